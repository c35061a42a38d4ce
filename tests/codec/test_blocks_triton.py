"""The Triton kernel of the "xxh3b" digest (`codec/blocks_triton.py`), bit-equal to the C codec.

The kernel runs under Triton's CPU interpreter in a child process (tests/support/triton_cases.py):
TRITON_INTERPRET=1 must be set before triton's `jit` decorates it, and only there, so vLLM and
torch in this process never see it. The cases: NaN payloads, -0.0, subnormals, empty and
one-element tensors, non-contiguous views, bf16/fp16/fp32, 65535/65536/65537 bytes, several
blocks, partial first and last stripes, random data, other steps per round and a cut into several
launches. The same kernel is compiled for an H100 (sm_90) without a GPU, so a construct the
interpreter accepts but the GPU compiler refuses fails here too. Tensors over 2^31 elements are
not hashed (the interpreter takes about 0.1 s per 64 KiB block: 2 GiB would take an hour); the
index arithmetic is checked by construction instead (see test_offsets_inside_one_launch_fit_32_bits).
Skipped, saying so, where triton is not installed (CI installs it: requirements/lock.txt).
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from sparsesync.codec.digest import tensor_digest
from tests.support.triton_cases import VARIANTS, cases

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("triton") is None,
    reason="triton is not installed here (requirements/lock.txt pins it; scripts/setup.sh installs it)",
)


def _child(code_or_module: list[str], interpret: bool, tmp: Path) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), *filter(None, [env.get("PYTHONPATH")])])
    env["TRITON_CACHE_DIR"] = str(tmp / "triton-cache")
    if interpret:
        env["TRITON_INTERPRET"] = "1"
    return subprocess.run([sys.executable, *code_or_module], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=600)


@pytest.fixture(scope="module")
def interpreted(tmp_path_factory) -> dict:
    """The kernel's digests of every case, from the child under the interpreter."""
    r = _child(["-m", "tests.support.triton_cases"], True, tmp_path_factory.mktemp("triton"))
    assert r.returncode == 0, r.stderr[-4000:]
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out["interpret"] is True
    return out["digests"]


@pytest.mark.slow
@pytest.mark.parametrize("name", list(cases()))
def test_triton_equals_c(name, interpreted):
    t = cases()[name]
    want = tensor_digest(t, "xxh3b")  # the C codec (a CPU tensor)
    assert want == tensor_digest(t.contiguous(), "xxh3b")  # a view's bytes are read in C order
    got = interpreted[name]
    assert set(got) == {"default", *(",".join(f"{k}={v}" for k, v in kw.items()) for kw in VARIANTS.get(name, []))}
    assert got == dict.fromkeys(got, want), name


def test_this_process_never_saw_the_interpreter_flag(interpreted):
    assert "TRITON_INTERPRET" not in os.environ  # set for the child only


@pytest.mark.slow
def test_kernel_compiles_for_an_h100_without_spilling(tmp_path):
    """The GPU compiler (triton's bundled ptxas, no GPU needed) accepts the kernel for sm_90, and
    the compiled kernel keeps everything in registers: no stack, no local memory (a spill would
    cost the kernel its memory speed)."""
    code = """
import pathlib, re, subprocess, tempfile, triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from sparsesync.codec.blocks_triton import ROUNDS, WARPS, _xxh3b_blocks_kernel as k
sig = {"words_ptr": "*i64", "table_ptr": "*i64", "out_ptr": "*i64", "R": "constexpr"}
c = triton.compile(ASTSource(fn=k, signature=sig, constexprs={"R": ROUNDS}), target=GPUTarget("cuda", 90, 32),
                   options={"num_warps": WARPS})
cubin = pathlib.Path(tempfile.mkdtemp()) / "k.cubin"
cubin.write_bytes(c.asm["cubin"])
tool = pathlib.Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
print(subprocess.run([str(tool), "-res-usage", str(cubin)], capture_output=True, text=True, check=True).stdout)
"""
    r = _child(["-c", code], False, tmp_path)
    assert r.returncode == 0, r.stderr[-4000:]
    usage = dict(re.findall(r"\b(REG|STACK|LOCAL):(\d+)", r.stdout))
    assert set(usage) == {"REG", "STACK", "LOCAL"}, r.stdout
    assert usage["STACK"] == "0" and usage["LOCAL"] == "0" and int(usage["REG"]) <= 128, usage


def test_offsets_inside_one_launch_fit_32_bits():
    """A launch covers at most 2^17 blocks, so the largest word offset inside the kernel is below
    2^31 even if the compiler kept it in 32 bits; tensors beyond are cut into launches by torch
    slicing (64-bit), which the 'launch_blocks' variants above exercise on small tensors."""
    from sparsesync.codec import blocks_triton as bt

    assert bt._MAX_LAUNCH_BLOCKS * bt.WORDS <= 2**31 - 1
    assert bt._MAX_LAUNCH_BLOCKS * bt.WORDS * 8 >= 8 << 30  # and a launch still covers 8 GiB
    for bad in ({"rounds": 3}, {"warps": 3}, {"launch_blocks": 0}, {"launch_blocks": bt._MAX_LAUNCH_BLOCKS + 1}):
        with pytest.raises(ValueError):
            bt.block_digests_triton(torch.zeros(8, dtype=torch.uint8), **bad)


def test_the_cpu_path_never_imports_triton_and_cuda_picks_the_kernel(tmp_path):
    code = """
import sys, torch
from sparsesync.codec import device_blocks, device_changes, digest
digest.tensor_digest(torch.arange(100000, dtype=torch.float32), "xxh3b")
digest.tensor_digest(torch.arange(100000, dtype=torch.float32), "xxh3")
device_changes.block_digests_many([torch.arange(10.0)])  # the device publish path, on CPU tensors
print("triton" in sys.modules, device_blocks.cuda_impl().__module__)
for name in [m for m in sys.modules if m == "triton" or m.startswith(("triton.", "sparsesync.codec.blocks_triton"))]:
    del sys.modules[name]
sys.modules["triton"] = None  # triton not installed: the torch implementation
device_blocks._cuda_impl = None
print(device_blocks.cuda_impl().__module__)
"""
    r = _child(["-c", code], False, tmp_path)
    assert r.returncode == 0, r.stderr[-4000:]
    assert r.stdout.split() == ["False", "sparsesync.codec.blocks_triton", "sparsesync.codec.blocks_torch"]
