"""Where the repository's apps are found: `trainer/`, `inference_space/` and `env_space/`.

The apps are top-level folders of the repository, not parts of the wheel: the wheel's only
top-level name is `sparsesync`, so installing it shadows no other package's `trainer`. They run
from a checkout (`python -m trainer` in its root; the Space images copy their app's folder to
the image's working directory and run it there). The library's commands that start or render an
app (`sparsesync demo`, `sparsesync deploy`) load it with `import_app`.

Guarantee: `import_app(name)` returns the app of the checkout this `sparsesync` package was
loaded from (an editable install or a checkout on `sys.path`), putting that checkout on
`sys.path` when it is not yet there, and never a package of the same name from elsewhere; where
there is no such checkout, or another package of that name was imported first, it raises a
`ConfigError` naming the app and how to get it.
"""

from __future__ import annotations

import importlib
import sys
from pathlib import Path
from types import ModuleType

from sparsesync.errors import ConfigError

APPS = ("trainer", "inference_space", "env_space")
_CLONE_HINT = ("the apps ship with the repository, not the wheel: clone it and install that checkout "
               "(bash scripts/setup.sh, or pip install -e .), then run the command again")


def checkout_root(package_dir: Path | None = None) -> Path | None:
    """The checkout holding the apps beside `package_dir` (default: this `sparsesync` package's
    folder), or None where its parent folder holds no app (an installed wheel)."""
    pkg = package_dir if package_dir is not None else Path(__file__).resolve().parent
    root = pkg.parent
    return root if all((root / app / "__init__.py").is_file() for app in APPS) else None


def import_app(name: str, *, package_dir: Path | None = None) -> ModuleType:
    """The app `name` (one of `APPS`) of this package's checkout; see the module docstring."""
    if name not in APPS:
        raise ConfigError(f"{name!r} is not an app of the repository", hint=f"use one of: {', '.join(APPS)}")
    root = checkout_root(package_dir)
    if root is None:
        raise ConfigError(f"the app {name!r} is not beside the installed sparsesync package "
                          f"({(package_dir or Path(__file__).resolve().parent).parent})", hint=_CLONE_HINT)
    if name not in sys.modules and str(root) not in sys.path:
        sys.path.insert(0, str(root))
    mod = importlib.import_module(name)
    where = Path(mod.__file__ or "").resolve().parent
    if where != (root / name).resolve():
        raise ConfigError(f"the module {name!r} was loaded from {where}, not from the checkout's {root / name}",
                          hint=f"another package named {name!r} is installed or on sys.path: remove it, "
                               f"or run from the checkout {root}")
    return mod
