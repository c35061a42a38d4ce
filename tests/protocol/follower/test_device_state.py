"""A follower with no host mirror (`engine_held`): the embedded engine's own tensors are the verified
state, each delta applied straight into them on their device (`codec.device_apply`), anchors loaded
straight into them. Driven on the CPU (`EmbeddedEngine(device_state=True)` runs the device path on
CPU tensors) from a real local run: it reaches the bits the mirror follower reaches, an undone
delta leaves the engine's old bits, it recovers through an anchor, and every version it reports is
what the engine's tensors hold at that moment."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

from inference_space.engines.embedded import EmbeddedEngine  # noqa: E402
from sparsesync.codec import device_apply  # noqa: E402
from sparsesync.errors import DigestMismatchError, PatchMismatchError  # noqa: E402
from sparsesync.protocol.follower import anchor_into, engine_held  # noqa: E402
from sparsesync.protocol.follower.engine_held import HeldEngine  # noqa: E402
from sparsesync.protocol.follower.follower import Follower  # noqa: E402
from tests.protocol.follower.test_engine import A, Versions  # noqa: E402
from tests.support.weights import assert_bit_equal  # noqa: E402


def _checked_reports(f: Follower, engine: EmbeddedEngine, states: dict) -> list[int | None]:  # type: ignore[type-arg]
    """Every version the follower reports, checked against the engine's tensors the moment it is reported."""
    seen: list[int | None] = []
    assert isinstance(f._held, HeldEngine)
    report = f._held._served

    def served(rec):  # type: ignore[no-untyped-def]
        if rec is not None:
            assert engine.weight_version == rec.version
            assert_bit_equal(engine.state_dict(), states[rec.version])
        seen.append(None if rec is None else rec.version)
        report(rec)

    f._held._served = served
    return seen


@pytest.mark.parametrize("part_bytes", [0, 300_000], ids=["one-file", "parts"])
def test_a_mirrorless_follower_reaches_the_bits_of_the_mirror_follower(tiny, tmp_path, monkeypatch, part_bytes):
    url = str(tmp_path / "run")
    with_mirror, on_device = EmbeddedEngine(tiny), EmbeddedEngine(tiny, device_state=True)
    assert not with_mirror.holds_device_state and on_device.holds_device_state
    run = Versions(url, on_device.state_dict(), part_bytes=part_bytes)
    staged = []
    real = engine_held.apply_staged
    monkeypatch.setattr(engine_held, "apply_staged", lambda *a, **kw: staged.append(1) or real(*a, **kw))
    try:
        fm, fd = Follower(url, with_mirror, prefetch=False), Follower(url, on_device)
        assert isinstance(fd._held, HeldEngine) and not isinstance(fm._held, HeldEngine)
        reports = _checked_reports(fd, on_device, run.states)
        for v in (1, 2, 3, 4):
            run.publish(v)
            assert fm.sync_once() == v and fd.sync_once() == v
            assert on_device.weight_version == v and fd.status().state == "following"
            assert_bit_equal(on_device.state_dict(), with_mirror.state_dict())
            assert_bit_equal(on_device.state_dict(), run.states[v])
            assert fd.mirror == {} and fd.status().state_digest == run.pub.run.commit(v).state_digest
        # one anchor, then each delta: one file on the device path, parts through the parts reader
        assert reports == [1, 2, 3, 4] and len(staged) == (0 if part_bytes else 3)
        st = fd.status()
        assert (st.anchor_loads, st.versions_applied, st.current_version) == (1, 4, 4)
    finally:
        run.pub.close()


def test_a_delta_onto_weights_changed_behind_the_engine_is_undone_and_recovered_through_an_anchor(tiny, tmp_path):
    url = str(tmp_path / "run")
    engine = EmbeddedEngine(tiny, device_state=True)
    run = Versions(url, engine.state_dict())
    try:
        f = Follower(url, engine)
        reports = _checked_reports(f, engine, run.states)
        run.publish(1)
        assert f.sync_once() == 1
        run.publish(2)  # changes A at every 7th element
        with torch.no_grad():
            engine.device_tensors()[A].view(-1)[3] += 1  # not an element v2 writes: only the base digest sees it
        tampered = engine.state_dict()
        failures: list[BaseException] = []
        real = engine_held.apply_staged

        def watched(*a, **kw):  # type: ignore[no-untyped-def]
            try:
                return real(*a, **kw)
            except PatchMismatchError as e:  # the base check failed after the scatter: every bit came back
                failures.append(e)
                assert_bit_equal(engine.state_dict(), tampered)
                raise

        engine_held.apply_staged = watched
        try:
            assert f.sync_once() == 2  # the delta is undone, the anchor reloaded, the delta applied again
        finally:
            engine_held.apply_staged = real
        assert len(failures) == 1 and f"tensor '{A}'" in failures[0].message
        assert reports == [1, None, 1, 2]  # nothing reported between the failure and the anchor
        assert_bit_equal(engine.state_dict(), run.states[2])
        assert f.status().anchor_loads == 2 and engine.weight_version == 2
    finally:
        run.pub.close()


def test_a_failure_while_scattering_into_the_engine_restores_its_bits(tiny, tmp_path, monkeypatch):
    url = str(tmp_path / "run")
    engine = EmbeddedEngine(tiny, device_state=True)
    run = Versions(url, engine.state_dict())
    try:
        f = Follower(url, engine)
        reports = _checked_reports(f, engine, run.states)
        run.publish(1)
        assert f.sync_once() == 1
        run.publish(2)
        real, fired = device_apply.apply_staged, []

        def broken(staged, tensors, **kw):  # type: ignore[no-untyped-def]
            def written(t: torch.Tensor) -> None:
                if not fired:
                    fired.append(1)
                    raise RuntimeError("device lost mid-scatter")

            try:
                return real(staged, tensors, written=written, **kw)
            except RuntimeError:
                assert_bit_equal(engine.state_dict(), run.states[1])  # the engine's old bits, every one
                raise

        monkeypatch.setattr(engine_held, "apply_staged", broken)
        with pytest.raises(RuntimeError, match="mid-scatter"):  # not a store fault: raised (the follow loop logs it)
            f.sync_once()
        assert fired and reports[:2] == [1, None] and engine.weight_version is None and f.current_version is None
        assert f.status().state == "degraded"
        assert f.sync_once() == 2 and reports[-2:] == [1, 2]  # through the anchor
        assert_bit_equal(engine.state_dict(), run.states[2])
    finally:
        run.pub.close()


def test_an_anchor_loads_into_the_engine_through_a_bounded_buffer_each_tensor_hashed_there(tiny, tmp_path,
                                                                                            monkeypatch):
    url = str(tmp_path / "run")
    engine = EmbeddedEngine(tiny, device_state=True)
    run = Versions(url, engine.state_dict())
    try:
        monkeypatch.setattr(anchor_into, "CHUNK", 4096)  # every weight matrix crosses in several pieces
        sizes = []
        real = anchor_into._copy_in
        monkeypatch.setattr(anchor_into, "_copy_in", lambda f, s, n, d, buf, p: (sizes.append(buf.numel()),
                                                                                 real(f, s, n, d, buf, p))[1])
        f = Follower(url, engine)
        run.publish(1)
        assert f.sync_once() == 1
        assert_bit_equal(engine.state_dict(), run.states[1])
        assert sizes and set(sizes) == {4096}  # one buffer of CHUNK bytes, whatever the tensor
        # a shard whose bytes are not its recorded digests' (the file digest aside): refused, named
        rec = f.run.commit(1)
        files = f.run.download_anchor(rec, tmp_path)
        shard = next(p for p in files if p.suffix == ".safetensors")
        data = bytearray(shard.read_bytes())
        data[-3] ^= 0xFF  # inside the last tensor's bytes
        shard.write_bytes(bytes(data))
        with pytest.raises(DigestMismatchError, match="loaded into the engine: tensor '"):
            anchor_into.load_into(f.run, rec, files, engine.device_tensors())
    finally:
        run.pub.close()
