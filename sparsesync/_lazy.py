"""Names a package loads on first use (PEP 562): the one helper of the package front doors.

`lazy_names(__name__, homes)` returns the `__getattr__` and `__dir__` of the package `__name__`:
an attribute named in `homes` (name -> the module that defines it) is imported from its home on
first access and kept as a plain module attribute from then on; any other name raises
AttributeError as for any module. So `import sparsesync` imports neither torch nor a store client
until a name that needs one is used. Imports nothing of the library itself (it is in no layer).
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable, Mapping
from typing import Any


def lazy_names(package: str, homes: Mapping[str, str]) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """(`__getattr__`, `__dir__`) for `package`, loading each name of `homes` from its module."""
    namespace = sys.modules[package].__dict__

    def __getattr__(name: str) -> Any:
        home = homes.get(name)
        if home is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(home), name)
        namespace[name] = value  # once loaded, a plain module attribute
        return value

    def __dir__() -> list[str]:
        return sorted(set(namespace) | set(homes))

    return __getattr__, __dir__
