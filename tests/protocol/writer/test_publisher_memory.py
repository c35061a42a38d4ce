"""The trainer side holds one snapshot and nothing else of model size (issue 42, item 4):
what it reads or copies of an anchor goes through buffers of a fixed size, whatever the file's."""

from __future__ import annotations

import os
import tracemalloc
from pathlib import Path

from sparsesync.codec.digest import bytes_digest, file_digest
from sparsesync.store import open_store

FILE_MB = 24


def _big_file(tmp_path: Path) -> Path:
    path = tmp_path / "anchor.safetensors"
    path.write_bytes(os.urandom(FILE_MB << 20))
    return path


def _traced_peak(fn) -> int:  # type: ignore[no-untyped-def]
    tracemalloc.start()
    try:
        fn()
        return tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def test_file_digest_reads_through_a_fixed_buffer(tmp_path: Path) -> None:
    path = _big_file(tmp_path)
    out: list[str] = []
    peak = _traced_peak(lambda: out.append(file_digest(path)))
    assert out[0] == bytes_digest(path.read_bytes())
    assert peak < 6 << 20, f"file_digest of a {FILE_MB} MB file held {peak >> 20} MB at once"


def test_local_store_copies_a_file_through_a_fixed_buffer(tmp_path: Path) -> None:
    path = _big_file(tmp_path)
    store = open_store(str(tmp_path / "bucket"), create=True)
    peak = _traced_peak(lambda: store.put("anchors/a/model.safetensors", path))
    assert peak < 2 << 20, f"putting a {FILE_MB} MB file held {peak >> 20} MB at once"
    dest = tmp_path / "got.safetensors"
    peak = _traced_peak(lambda: store.get_file("anchors/a/model.safetensors", dest))
    assert peak < 2 << 20, f"getting a {FILE_MB} MB file held {peak >> 20} MB at once"
    assert dest.read_bytes() == path.read_bytes()


def test_a_committed_version_is_let_go(tmp_path: Path) -> None:
    """The uploader kept the last version it committed (its changes and patch: ~12 B per changed
    element) until the next one arrived: beside the next version's own, two at once."""
    import gc

    import torch

    from sparsesync.protocol.writer.publisher import Publisher
    from sparsesync.protocol.writer.uploads import PendingVersion

    state = {"w": torch.randn(64, 64).to(torch.bfloat16), "b": torch.randn(64).to(torch.bfloat16)}
    with Publisher(str(tmp_path / "run"), anchor_every=0) as pub:
        for v in range(3):
            state["w"][v] += 1
            pub.publish(state, v)
            pub.flush()
            gc.collect()
            held = [o.version for o in gc.get_objects() if type(o) is PendingVersion]
            assert held == [], f"after version {v} was committed, versions {held} are still held"


def _fp32_versions() -> list[dict]:  # type: ignore[type-arg]
    """Three versions of an fp32 master: sparse steps, a non-contiguous tensor (the phase-by-phase
    diff), an integer buffer (never cast) and values that round differently in bf16."""
    import torch

    g = torch.Generator().manual_seed(0)
    state = {f"layers.{i}.w": torch.randn(96, 80, generator=g) for i in range(6)}
    state["lm_head.t"] = torch.randn(80, 48, generator=g).t()  # non-contiguous
    state["pos"] = torch.arange(40, dtype=torch.int64)
    out = []
    for _ in range(3):
        out.append({n: t.clone() if t.is_contiguous() else t.clone().t().contiguous().t() for n, t in state.items()})
        for n, t in state.items():
            if t.is_floating_point():
                mask = torch.rand(t.shape, generator=g) < 0.05
                t[mask] += 1e-3 * torch.randn(int(mask.sum()), generator=g)
    return out


def _cast(state: dict) -> dict:  # type: ignore[type-arg]
    import torch

    return {n: t.to(torch.bfloat16) if t.is_floating_point() else t for n, t in state.items()}


def _objects(root: Path) -> list[object]:
    """The run's patch files (bytes) and anchors (header as parsed, tensor bytes): the order of an
    anchor header's metadata entries varies from one write to the next."""
    import json
    import struct

    store = open_store(str(root))
    out: list[object] = sorted(store.get(o.key) for o in store.list() if o.key.startswith("deltas/"))
    for o in store.list("anchors/"):
        data = store.get(o.key)
        n = struct.unpack("<Q", data[:8])[0]
        out.append((json.loads(data[8 : 8 + n]), data[8 + n :]))
    return out


def test_publishing_an_fp32_state_as_bf16_equals_publishing_the_cast_state(tmp_path: Path) -> None:
    """`Publisher(dtype=torch.bfloat16)` handed fp32 tensors publishes the same bytes and state
    digests as handing it the state cast first (whole deltas and deltas in parts, a resume)."""
    import torch

    from sparsesync.protocol.writer.publisher import Publisher

    versions = _fp32_versions()
    for part_bytes in (0, 20_000):
        digests = {}
        for how in ("cast-first", "dtype"):
            root = tmp_path / f"{how}-{part_bytes}"
            pub = Publisher(str(root), part_bytes=part_bytes, writer="w", anchor_every=0,
                            dtype=torch.bfloat16 if how == "dtype" else None)
            for v, s in enumerate(versions[:2]):
                pub.publish(s if how == "dtype" else _cast(s), v)
            pub.close()
            pub = Publisher(str(root), part_bytes=part_bytes, writer="w", anchor_every=0,
                            dtype=torch.bfloat16 if how == "dtype" else None)
            pub.resume(versions[1] if how == "dtype" else _cast(versions[1]))  # PatchMismatchError unless cast alike
            pub.publish(versions[2] if how == "dtype" else _cast(versions[2]), 2)
            pub.close()
            digests[how] = [m["version"] for m in pub.metrics], pub.state_digest, _objects(root)
        assert digests["dtype"] == digests["cast-first"], part_bytes
        assert len(digests["dtype"][2]) >= 1


_PEAK_SCRIPT = r"""
import resource, sys, torch
from sparsesync.protocol.writer.publisher import Publisher
cast_first = sys.argv[2] == "cast-first"
n, mb = 32, 4  # 32 tensors of 4 MB in bf16: 128 MB published, the fp32 master 256 MB
state = {f"t{i}": torch.randn(mb << 19) for i in range(n)}
pub = Publisher(sys.argv[1], part_bytes=0, anchor_every=0, dtype=None if cast_first else torch.bfloat16)
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss << 10
for v in range(3):
    for t in state.values():
        t[:: 1000] += 1e-2
    pub.publish({k: t.to(torch.bfloat16) for k, t in state.items()} if cast_first else state, v)
pub.close()
print((resource.getrusage(resource.RUSAGE_SELF).ru_maxrss << 10) - before, n * (mb << 20))
"""


def test_publishing_an_fp32_master_casts_no_whole_state(tmp_path: Path) -> None:
    """Beyond the caller's fp32 state, the publisher's peak is its bf16 snapshot and a few tensors
    in flight (cast one at a time), not a second whole bf16 copy (casting first: ~2 copies)."""
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", _PEAK_SCRIPT, str(tmp_path / "run"), "dtype"], check=True,
                         capture_output=True, text=True, env={**os.environ, "MALLOC_ARENA_MAX": "2"})
    grown, model = map(int, out.stdout.split())
    assert grown < 1.4 * model, f"publishing grew the peak by {grown / model:.2f} bf16 copies"
