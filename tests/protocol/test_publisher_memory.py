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

    from sparsesync.protocol.publisher import Publisher
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
