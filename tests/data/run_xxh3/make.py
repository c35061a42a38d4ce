"""Writes the runs in this folder: `whole` (deltas as one file each) and `parts` (deltas in
parts), three versions each (an anchor, then two deltas), with the tensor digest of sparsesync
before "xxh3b" (XXH3-64 of each tensor's whole byte stream; patch format 3). They were written
by sparsesync at commit d1f4da3 (`PYTHONPATH=<that checkout> python tests/data/run_xxh3/make.py`);
tests/protocol/test_digest_upgrade.py reads them with today's code (pull, verify, follow,
resume). Running it with a newer sparsesync writes "xxh3b" runs instead: do not, keep the files."""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import torch

from sparsesync import Publisher


def states() -> list[dict[str, torch.Tensor]]:
    """Versions 0, 1, 2: `a` spans two 64 KiB blocks (bf16), `b` and `c` are small; NaN payloads,
    -0.0 and subnormals among the values."""
    g = torch.Generator().manual_seed(0)
    a = torch.randn(40000, generator=g).to(torch.bfloat16)
    # NaN payload, -0.0, subnormal, -NaN
    a.view(torch.int16)[:4] = torch.tensor([0x7FC1, -32768, 0x0001, -0x7F81 - 1], dtype=torch.int16)
    b = torch.tensor([[0.0, -0.0, 1e-45, float("inf"), 1.0]] * 3, dtype=torch.float32)
    c = torch.randn(257, generator=g).to(torch.float16)
    out = [{"a": a, "b": b, "c": c}]
    for v in (1, 2):
        s = {k: t.clone() for k, t in out[-1].items()}
        s["a"].view(torch.int16)[torch.arange(v, 40000, 97)] += 1
        s["a"].view(torch.int16)[32768 + v] += 3  # the second block
        s["c"].view(torch.int16)[v * 7] ^= 1
        if v == 2:
            s["b"][1, 1] = 2.5
        out.append(s)
    return out


def main(root: Path) -> None:
    for name, part_bytes in (("whole", 1 << 30), ("parts", 1 << 10)):
        url = root / name
        shutil.rmtree(url, ignore_errors=True)
        with Publisher(str(url), anchor_every=50, part_bytes=part_bytes) as pub:
            for v, s in enumerate(states()):
                pub.publish(s, v)


if __name__ == "__main__":
    main(Path(sys.argv[1]) if len(sys.argv) > 1 else Path(__file__).parent)
