"""Repo-wide layout rules. The wheel's only top-level name is `sparsesync` (issue 49: the apps stay
top-level folders of the repository and are found from the checkout, `sparsesync.apps`). Issue 41: no module of the
shipped packages (`sparsesync/`, `trainer/`,
`inference_space/`, `env_space/`) is over `MAX_LINES` lines unless its docstring says why, in a
line that starts with `Length:` followed by the reason (e.g. "Length: one state machine whose
states share every field; split, each half would reach into the other's"). docs/architecture.md
states the rule; this test holds it in CI.

"""

from __future__ import annotations

import ast
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from sparsesync.apps import APPS, checkout_root, import_app
from sparsesync.errors import ConfigError

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("sparsesync", "trainer", "inference_space", "env_space")
MAX_LINES = 450
MARKER = "Length:"
MIN_REASON_CHARS = 20  # "Length: long" is not a reason

def _modules() -> list[Path]:
    return sorted(p for pkg in PACKAGES for p in (ROOT / pkg).rglob("*.py") if "__pycache__" not in p.parts)


def _reason(path: Path) -> str | None:
    """The text after `Length:` on a line of the module's docstring, or None."""
    doc = ast.get_docstring(ast.parse(path.read_text(encoding="utf-8"), filename=str(path))) or ""
    for line in doc.splitlines():
        if line.strip().startswith(MARKER):
            return line.strip().removeprefix(MARKER).strip()
    return None


def _too_long(path: Path) -> str | None:
    """Why `path` breaks the rule, or None."""
    n = len(path.read_text(encoding="utf-8").splitlines())
    if n <= MAX_LINES:
        return None
    reason = _reason(path)
    if reason is None:
        return f"{n} lines, no `{MARKER}` line in its docstring"
    if len(reason) < MIN_REASON_CHARS:
        return f"{n} lines, and `{MARKER} {reason}` states no reason"
    return None


def test_modules_are_short_or_say_why() -> None:
    bad = {}
    for path in _modules():
        rel = path.relative_to(ROOT).as_posix()
        if (why := _too_long(path)) is not None:
            bad[rel] = why
    assert not bad, (
        f"modules over {MAX_LINES} lines (split them along a concept seam, or state the reason in the module "
        f"docstring on a line starting `{MARKER}`; docs/architecture.md):\n"
        + "\n".join(f"  {k}: {v}" for k, v in sorted(bad.items()))
    )


def test_the_rule_sees_a_long_module_and_its_reason(tmp_path: Path) -> None:
    body = "x = 1\n" * MAX_LINES
    plain = tmp_path / "plain.py"
    plain.write_text('"""A module."""\n' + body)
    assert _too_long(plain) is not None
    vague = tmp_path / "vague.py"
    vague.write_text('"""A module.\n\nLength: long\n"""\n' + body)
    assert _too_long(vague) is not None
    stated = tmp_path / "stated.py"
    stated.write_text('"""A module.\n\nLength: one state machine; each half would reach into the other.\n"""\n' + body)
    assert _too_long(stated) is None
    short = tmp_path / "short.py"
    short.write_text('"""A module."""\n' + "x = 1\n" * (MAX_LINES - 1))
    assert _too_long(short) is None


@pytest.mark.slow
def test_the_wheel_installs_only_sparsesync(tmp_path: Path) -> None:
    """No generic top-level name (`trainer`, `inference_space`, `env_space`) that would shadow another package's."""
    src = tmp_path / "src"  # a clean copy: setuptools would pack whatever an earlier build left in build/lib
    shutil.copytree(
        ROOT,
        src,
        ignore=shutil.ignore_patterns(
            ".git",
            ".venv",
            "build",
            "dist",
            "*.egg-info",
            "__pycache__",
            "*.so",
            ".*_cache",
            ".hypothesis",
            "runs",
            "out",
        ),
    )
    res = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w",
                          str(tmp_path), str(src)], capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stdout + res.stderr
    (wheel,) = tmp_path.glob("sparsesync-*.whl")
    with zipfile.ZipFile(wheel) as z:
        names = z.namelist()
    top = {n.split("/")[0] for n in names}
    assert top == {"sparsesync", next(t for t in top if t.endswith(".dist-info"))}, sorted(top)
    assert any(n.startswith("sparsesync/codec/_native") for n in names)  # the codec's C passes are in it


def test_the_apps_are_found_in_this_checkout() -> None:
    assert checkout_root() == ROOT
    for app in APPS:
        assert Path(import_app(app).__file__ or "").resolve().parent == ROOT / app


def test_without_a_checkout_an_app_is_a_clear_error(tmp_path: Path) -> None:
    pkg = tmp_path / "site-packages" / "sparsesync"  # an installed wheel: no app beside the package
    pkg.mkdir(parents=True)
    assert checkout_root(pkg) is None
    with pytest.raises(ConfigError, match="not beside the installed sparsesync") as err:
        import_app("trainer", package_dir=pkg)
    assert "clone" in err.value.hint and "'trainer'" in err.value.message
    with pytest.raises(ConfigError, match="not an app"):
        import_app("tests")


def test_another_package_of_an_apps_name_is_refused(tmp_path: Path) -> None:
    """A foreign `trainer` found first on sys.path is never taken for the app."""
    (tmp_path / "trainer").mkdir()
    (tmp_path / "trainer" / "__init__.py").write_text("")
    code = ("from sparsesync.apps import import_app\n"
            "from sparsesync.errors import ConfigError\n"
            "try:\n    import_app('trainer')\nexcept ConfigError as e:\n    print('refused:', e)\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), str(ROOT)])}
    res = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env, cwd=tmp_path
    )
    assert res.returncode == 0, res.stderr
    assert res.stdout.startswith("refused:") and "another package named 'trainer'" in res.stdout, res.stdout
