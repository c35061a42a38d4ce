"""The follower's mirror lives in a file map on local disk, not in anonymous memory (issue 42).

A real run (Publisher into a local folder) is followed by a real Follower. Checked: the mirror's
tensors are views of a shared file map in the configured folder (nothing left in the folder),
bit-exact with every version; following a model much larger than a bound grows the process's
anonymous memory by less than the bound; a failed apply leaves the mapped mirror at its previous
version's bits; memory a hook frees is handed back to the OS after each version; anchors load
straight into the map.
"""

from __future__ import annotations

import ctypes
from pathlib import Path

import pytest
import torch

from sparsesync.codec import tensor_digests, write_anchor
from sparsesync.codec.anchor import load_anchor
from sparsesync.errors import DigestMismatchError
from sparsesync.protocol import parts_reader as parts_mod
from sparsesync.protocol.follower.follower import Follower
from sparsesync.protocol.follower.hooks import ApplyHook
from sparsesync.protocol.follower.mirror import ENV_DIR, MirrorDir, is_file_backed
from sparsesync.protocol.run import Run
from sparsesync.protocol.writer.publisher import Publisher
from tests.support.weights import assert_bit_equal


def _status(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise AssertionError(field)


def _mapped(t: torch.Tensor) -> int:
    """Bytes of the map holding `t` that are mapped in this process (its VMA's Rss in /proc/self/smaps)."""
    addr, inside = t.data_ptr(), False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split(maxsplit=1)[0]
        if "-" in head and ":" not in head:
            lo, hi = (int(x, 16) for x in head.split("-"))
            inside = lo <= addr < hi
        elif inside and head == "Rss:":
            return int(line.split()[1]) * 1024
    raise AssertionError("no map holds the tensor")


def _state(n_tensors: int, numel: int, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {f"layer{i}.weight": torch.randn(numel, generator=g).to(torch.bfloat16) for i in range(n_tensors)}


def _step(state: dict[str, torch.Tensor], g: torch.Generator, density: float = 0.01) -> dict[str, torch.Tensor]:
    out = {}
    for name, t in state.items():
        t = t.clone()
        idx = torch.randint(0, t.numel(), (max(1, int(t.numel() * density)),), generator=g)
        t[idx] = torch.randn(idx.numel(), generator=g).to(t.dtype)
        out[name] = t
    return out


def _published(
    url: str, n_tensors: int, numel: int, seed: int, **publisher: object
) -> tuple[list[dict[str, str]], int]:
    """Versions 0..3 of an `n_tensors` x `numel` bf16 model (each delta touching every page of
    every tensor) published to `url`; (each version's tensor digests, model bytes). The states
    are freed, with what the publisher freed, before this returns."""
    g = torch.Generator().manual_seed(seed)
    states = [_state(n_tensors, numel)]
    for _ in range(3):
        states.append(_step(states[-1], g))
    with Publisher(url, anchor_every=0, **publisher) as pub:  # type: ignore[arg-type]
        for v, s in enumerate(states):
            pub.publish(s, v)
        pub.flush()
    out = ([tensor_digests(s) for s in states], n_tensors * numel * 2)
    del states, s
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    return out


def test_mirror_is_a_shared_file_map_in_the_mirror_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    mdir = tmp_path / "mirror"
    monkeypatch.setenv(ENV_DIR, str(mdir))  # the replica's setting (SPARSESYNC_MIRROR_DIR / --mirror-dir)
    url = str(tmp_path / "run")
    g = torch.Generator().manual_seed(1)
    state = _state(4, 1 << 14)
    f = Follower(url, prefetch=False)
    with Publisher(url, anchor_every=0) as pub:
        for v in range(3):
            pub.publish(state, v)
            pub.flush()
            assert f.sync_once() == v
            f.wait_for_version(v, timeout=1)  # (version 0 included: it was taken for "none" before)
            assert_bit_equal(f.mirror, state)
            state = _step(state, g)
    assert all(is_file_backed(t) for t in f.mirror.values())
    maps = Path("/proc/self/maps").read_text()
    assert str(mdir) in maps  # mapped from the configured folder ...
    assert list(mdir.iterdir()) == []  # ... and unlinked at once: nothing is left behind


def test_following_a_large_model_keeps_anonymous_memory_bounded(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """48 MB of weights followed through an anchor and 3 deltas (each touching every page of
    every tensor): the anonymous memory grows by less than a quarter of the model."""
    monkeypatch.setenv(ENV_DIR, str(tmp_path / "mirror"))
    url = str(tmp_path / "run")
    digests, model_bytes = _published(url, 6, 4 << 20, seed=2)  # 6 x 4M bf16 = 48 MB
    final = digests[-1]
    before = _status("RssAnon")
    f = Follower(url, prefetch=False)
    assert f.sync_once() == 3
    grown = _status("RssAnon") - before
    assert tensor_digests(f.mirror) == final
    assert grown < model_bytes // 4, (
        f"anonymous memory grew by {grown >> 20} MiB following a {model_bytes >> 20} MiB model"
    )


def test_a_failed_apply_leaves_the_mapped_mirror_at_its_version(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """All or nothing on the file map: a version whose digests fail after its writes is undone in place."""
    monkeypatch.setenv(ENV_DIR, str(tmp_path / "mirror"))
    url = str(tmp_path / "run")
    g = torch.Generator().manual_seed(3)
    v0 = _state(3, 1 << 12)
    v1 = _step(v0, g)
    f = Follower(url, prefetch=False)
    with Publisher(url, anchor_every=0, part_bytes=8192) as pub:  # a version in parts, one tensor each
        pub.publish(v0, 0)
        pub.flush()
        assert f.sync_once() == 0
        pub.publish(v1, 1)
        pub.flush()
    real = parts_mod.verify_digests
    calls = []

    def fail(*a, **kw):  # type: ignore[no-untyped-def]
        calls.append(1)
        raise DigestMismatchError("injected: a target digest after the writes")

    monkeypatch.setattr(parts_mod, "verify_digests", fail)
    assert f.sync_once() == 0 and f.status().state == "degraded" and calls
    assert all(is_file_backed(t) for t in f.mirror.values())
    assert_bit_equal(f.mirror, v0)
    monkeypatch.setattr(parts_mod, "verify_digests", real)
    g2 = Follower(url, prefetch=False)  # (f now plans around the parts that failed twice)
    assert g2.sync_once() == 1
    assert_bit_equal(g2.mirror, v1)


def test_memory_a_hook_frees_goes_back_to_the_os(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """An engine's reload frees model-sized memory in many blocks between blocks it keeps (what
    vLLM's layerwise reload does); after the version, that memory is returned to the OS."""
    monkeypatch.setenv(ENV_DIR, str(tmp_path / "mirror"))
    kept: list[torch.Tensor] = []

    class FragmentingHook(ApplyHook):
        def load_full(self, version, tensors):  # type: ignore[no-untyped-def]
            self._churn()

        def apply_sparse(self, version, updates, full):  # type: ignore[no-untyped-def]
            self._churn()

        @staticmethod
        def _churn() -> None:
            blocks = []
            for _ in range(1024):  # 64 MiB in 64 KiB blocks (heap, not mmap), a small block kept after each
                blocks.append(torch.empty(1 << 16, dtype=torch.uint8).fill_(1))
                kept.append(torch.empty(64, dtype=torch.uint8))
            del blocks

    url = str(tmp_path / "run")
    with Publisher(url, anchor_every=0) as pub:
        pub.publish(_state(2, 1 << 10), 0)
        pub.flush()
    f = Follower(url, FragmentingHook(), prefetch=False)  # type: ignore[arg-type]
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    before = _status("RssAnon")
    assert f.sync_once() == 0
    grown = _status("RssAnon") - before
    assert grown < 16 << 20, f"{grown >> 20} MiB freed by the hook stayed with the process"


def test_anchor_loads_straight_into_the_allocated_tensors(tmp_path: Path) -> None:
    state = _state(3, 1000)
    files = write_anchor(state, tmp_path / "a", version=4, max_shard_bytes=3000)
    mirror = MirrorDir(tmp_path / "m")
    got, info = load_anchor(files, alloc=mirror.allocate)
    assert_bit_equal(got, state)
    assert info.version == 4 and all(is_file_backed(t) for t in got.values())
    storages = {t.untyped_storage().data_ptr() for t in got.values()}
    assert len(storages) == 1  # one map for the whole state
    assert all(t.data_ptr() % 64 == 0 for t in got.values())


def test_mirror_dir_memory_keeps_the_mirror_in_anonymous_memory(tmp_path: Path) -> None:
    """The opt-out (no disk writeback): SPARSESYNC_MIRROR_DIR=memory / --mirror-dir memory."""
    got = MirrorDir("memory").allocate({"w": (torch.bfloat16, (64, 64))})
    assert not is_file_backed(got["w"]) and not (Path.cwd() / "memory").exists()


class _PagingEngine(ApplyHook):  # a hook that asks for the mirror out of RSS (as the vLLM hooks do)
    pages_out_mirror = True

    def load_full(self, version, tensors):  # type: ignore[no-untyped-def]
        pass

    def apply_sparse(self, version, updates, full):  # type: ignore[no-untyped-def]
        pass


@pytest.mark.parametrize("part_bytes", [None, 8 << 20], ids=["one-file", "parts"])
@pytest.mark.parametrize("pages_out", [True, False], ids=["paged-out", "mapped"])
def test_the_mirror_leaves_the_process_rss_tensor_by_tensor_and_keeps_its_bits(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, part_bytes: int | None, pages_out: bool) -> None:
    """48 MB followed through an anchor and 3 deltas (each writing every page of every tensor).
    For a hook that sets `pages_out_mirror`: while the engine takes a version, at most a third of
    the mirror is mapped in the process (each tensor is unmapped once a patch is written into
    it); after each version, almost none of it. For one that does not (the embedded engine, whose
    updates would pay for the faults), the mirror stays mapped. Either way, what the engine gets
    and what the mirror holds stay bit-exact (the bits live on in the file's page cache)."""
    monkeypatch.setenv(ENV_DIR, str(tmp_path / "mirror"))
    url = str(tmp_path / "run")
    expected, model_bytes = _published(url, 6, 4 << 20, seed=4, **({"part_bytes": part_bytes} if part_bytes else {}))
    assert all(bool(c.parts) == bool(part_bytes) for c in Run(url).commits()[1:])
    mapped_in_hook: list[int] = []

    class Engine(ApplyHook):  # what an engine sees of the mirror when it is called, and its own copy of it
        pages_out_mirror = pages_out

        def __init__(self) -> None:
            self.weights: dict[str, torch.Tensor] = {}

        def load_full(self, version, tensors):  # type: ignore[no-untyped-def]
            mapped_in_hook.append(_mapped(next(iter(tensors.values()))))
            self.weights = {k: t.clone() for k, t in tensors.items()}

        def apply_sparse(self, version, updates, full):  # type: ignore[no-untyped-def]
            mapped_in_hook.append(_mapped(next(iter(full.values()))))
            for name, u in updates.items():
                self.weights[name].view(-1)[u.indices] = u.values

    engine = Engine()
    f = Follower(url, engine, prefetch=False)  # type: ignore[arg-type]
    assert f.sync_once() == 3  # the anchor, then the 3 deltas, each into the mirror and then the engine
    after = _mapped(next(iter(f.mirror.values())))
    assert tensor_digests(engine.weights) == expected[3] and tensor_digests(f.mirror) == expected[3]
    assert all(is_file_backed(t) for t in f.mirror.values())
    if not pages_out:
        assert after > model_bytes * 0.9, (
            f"{after >> 20} MiB of the {model_bytes >> 20} MiB mirror mapped after the sync"
        )
        return
    assert after < model_bytes // 8, (
        f"{after >> 20} MiB of the {model_bytes >> 20} MiB mirror stayed mapped after the sync"
    )
    assert mapped_in_hook and max(mapped_in_hook) < model_bytes // 3, [m >> 20 for m in mapped_in_hook]


def test_reading_an_anchor_and_its_deltas_never_maps_the_whole_mirror(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The process's peak RSS while a follower (for a hook that sets `pages_out_mirror`) reads a
    48 MB anchor and 3 deltas into its mirror grows by less than half the model (measured:
    14-16 MiB; 53 MiB when the anchor's tensors stay mapped): each tensor leaves RSS once read
    (or written) and checked."""
    monkeypatch.setenv(ENV_DIR, str(tmp_path / "mirror"))
    url = str(tmp_path / "run")
    digests, model_bytes = _published(url, 24, 1 << 20, seed=6)  # 24 x 1M bf16 = 48 MB
    final = digests[-1]
    f = Follower(url, _PagingEngine(), prefetch=False)  # type: ignore[arg-type]
    Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS
    before = _status("VmHWM")
    assert f.sync_once() == 3
    grown = _status("VmHWM") - before
    assert tensor_digests(f.mirror) == final
    assert grown < model_bytes // 2, f"peak RSS grew by {grown >> 20} MiB following a {model_bytes >> 20} MiB model"


def test_dropping_pages_keeps_every_bit_and_never_touches_anonymous_memory(tmp_path: Path) -> None:
    """Unmapping a mirror's pages keeps its bits (they come back from the page cache); the same
    call on anonymous memory (an engine's weights, the `memory` mirror), where unmapping would
    zero it, does nothing."""
    from sparsesync.protocol.follower.mirror import drop_resident, pager

    state = _state(3, 3 << 20, seed=5)
    mapped = MirrorDir(tmp_path / "m").allocate({k: (t.dtype, tuple(t.shape)) for k, t in state.items()})
    anon = MirrorDir("memory").allocate({k: (t.dtype, tuple(t.shape)) for k, t in state.items()})
    for k, t in state.items():
        mapped[k].copy_(t)
        anon[k].copy_(t)
    before = _status("RssFile")
    assert pager(mapped.values())(mapped["layer1.weight"][1000:]) > 0  # a view of one tensor
    assert drop_resident(mapped.values()) >= 2 * (6 << 20) and _status("RssFile") < before - (12 << 20)
    assert drop_resident(anon.values()) == 0 and pager(mapped.values())(anon["layer0.weight"]) == 0
    assert drop_resident(state.values()) == 0
    assert_bit_equal(mapped, state)
    assert_bit_equal(anon, state)
