"""Build of the codec's C passes; everything else is in pyproject.toml. The extension is defined
once, in sparsesync/codec/_build.py (loaded by path: the package itself needs the extension)."""

import importlib.util
from pathlib import Path

from setuptools import setup

_spec = importlib.util.spec_from_file_location(
    "_sparsesync_build", Path(__file__).parent / "sparsesync" / "codec" / "_build.py"
)
_build = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_build)

setup(ext_modules=[_build.extension()])
