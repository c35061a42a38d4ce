"""How the codec's C passes (`_native.c`) are compiled: the one definition of the extension.

`_native.c` is one translation unit that `#include`s its per-concept fragments from `native/`;
they are the extension's `depends` (read from those `#include` lines), so a changed fragment
rebuilds it and every sdist carries them.

`setup.py` builds it for every `pip install` of sparsesync. A source tree used without an
install (the inference Space's image copies the package folder) compiles it in place with
`python sparsesync/codec/_build.py`, which needs a C compiler and the Python headers. Run as a
script, this file imports nothing of sparsesync (whose codec cannot import without it).
"""

from __future__ import annotations

import os
import platform
import re
import sys

from setuptools import Distribution, Extension

SOURCE = "sparsesync/codec/_native.c"
_HERE = os.path.dirname(os.path.abspath(__file__))


def fragments() -> list[str]:
    """The files `_native.c` includes from `native/`, in its order, relative to the tree's root."""
    with open(os.path.join(_HERE, "_native.c"), encoding="utf-8") as f:
        names = re.findall(r'^#include "(native/[^"]+)"', f.read(), flags=re.M)
    return [f"sparsesync/codec/{n}" for n in names]


def extension() -> Extension:
    """The extension, with paths relative to the source tree's root."""
    # x86-64-v2 (2009 and later: SSE4.2, POPCNT) gives the popcount instruction; BMI2 is used only where the CPU has it
    arch = ["-march=x86-64-v2"] if platform.machine() in ("x86_64", "AMD64") else []
    return Extension(
        "sparsesync.codec._native", [SOURCE], depends=fragments(), extra_compile_args=["-O3", "-std=c11", *arch]
    )


def build_in_place(root: str) -> None:
    """Compile the extension next to its source inside the tree at `root`."""
    here = os.getcwd()
    os.chdir(root)
    try:
        dist = Distribution({"name": "sparsesync", "ext_modules": [extension()]})
        cmd = dist.get_command_obj("build_ext")
        cmd.inplace = True
        cmd.ensure_finalized()
        cmd.run()
    finally:
        os.chdir(here)


if __name__ == "__main__":
    build_in_place(
        sys.argv[1]
        if len(sys.argv) > 1
        else os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    )
