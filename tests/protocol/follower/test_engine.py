"""The engine holds exactly the version a replica reports, whatever fails between mirror and engine.

A follower drives the embedded engine (transformers, the tiny Qwen3) from a real local run. An
exception is injected once at one step of a sync (fetch, decode, the mirror's write, the
coordinated gate, the engine's write, the engine's read-back, after the apply), then the follower
goes on to later versions, each changing other tensors; after every sync every tensor the engine
holds must equal the version it reports, and the follower must report what the engine reports.
Also: the coordinated-mode case of issue 43 (a fleet record no reader could parse while a version
staged), and a failing engine retried with backoff, not in a reload storm (issue 35).
"""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import Callable

import pytest
import torch
from typer.testing import CliRunner

pytest.importorskip("transformers")

from inference_space.engines.embedded import EmbeddedEngine  # noqa: E402
from sparsesync.cli import app  # noqa: E402
from sparsesync.errors import EngineCheckError  # noqa: E402
from sparsesync.protocol import parts_reader as parts_mod  # noqa: E402
from sparsesync.protocol import run as run_mod  # noqa: E402
from sparsesync.protocol.fleet import read_fleet  # noqa: E402
from sparsesync.protocol.follower.fleet_member import FleetOptions  # noqa: E402
from sparsesync.protocol.follower.follower import Follower  # noqa: E402
from sparsesync.protocol.follower.hooks import ApplyHook
from sparsesync.protocol.keys import heartbeat_key, switch_key  # noqa: E402
from sparsesync.protocol.writer.publisher import Publisher  # noqa: E402
from sparsesync.store import open_store  # noqa: E402
from tests.support.weights import assert_bit_equal  # noqa: E402

A = "model.layers.0.self_attn.q_proj.weight"
B = "model.layers.1.mlp.down_proj.weight"
C = "model.embed_tokens.weight"
CHANGES = {1: [C], 2: [A], 3: [B], 4: [A, B]}  # version -> the tensors it changes


class Versions:
    """A run whose version v changes only the tensors CHANGES[v]; `states[v]` is what v holds."""

    def __init__(self, url: str, base: dict[str, torch.Tensor], **publisher: object) -> None:
        self.pub = Publisher(url, anchor_every=0, anchor_fraction=1e9, **publisher)
        self.states: dict[int, dict[str, torch.Tensor]] = {}
        self._last = base
        self._g = torch.Generator().manual_seed(5)

    def publish(self, v: int) -> None:
        state = {k: t.clone() for k, t in self._last.items()}
        for name in CHANGES[v]:
            flat = state[name].view(-1)
            flat[::7] = torch.randn(flat[::7].numel(), generator=self._g).to(flat.dtype)
        self.pub.publish(state, v)
        self.pub.flush()
        self.states[v], self._last = state, state


def _sync(f: Follower) -> None:
    """One round of the follow loop: an unexpected error is logged there, not raised."""
    with contextlib.suppress(Exception):
        f.sync_once()


def _assert_engine_holds_what_is_reported(f: Follower, engine: EmbeddedEngine, states: dict, what: str) -> None:
    assert f.current_version == engine.weight_version, (what, f.current_version, engine.weight_version)
    if engine.weight_version is not None:  # every tensor, not only those the last patch touched
        assert_bit_equal(engine.state_dict(), states[engine.weight_version])


def _once(exc: BaseException, before: Callable | None = None) -> Callable:  # type: ignore[type-arg]
    """A wrapper factory: the first call runs `before` (if any), then raises `exc`; later calls pass through."""
    fired = []

    def wrap(real: Callable) -> Callable:  # type: ignore[type-arg]
        def inner(*a, **kw):  # type: ignore[no-untyped-def]
            if not fired:
                fired.append(1)
                if before is not None:
                    before(real, *a, **kw)
                raise exc
            return real(*a, **kw)
        return inner
    return wrap


def _half_write(real, self, version, updates, full):  # type: ignore[no-untyped-def]
    """The engine writes half of the first tensor's changes, then fails."""
    name, upd = next(iter(updates.items()))
    n = max(len(upd.indices) // 2, 1)
    with torch.no_grad():
        self._sd[name].view(-1)[upd.indices[:n]] = upd.values[:n]


STEPS = [
    "fetch",
    "decode",
    "mirror",
    "gate",
    "engine-apply",
    "engine-readback",
    "engine-apply-and-reload",
    "after-apply",
]


def _inject(step: str, monkeypatch: pytest.MonkeyPatch, f: Follower, engine: EmbeddedEngine) -> None:
    bug = RuntimeError(f"injected at {step}")
    if step == "fetch":
        monkeypatch.setattr(run_mod.Run, "fetch", _once(bug)(run_mod.Run.fetch))
    elif step == "decode":
        monkeypatch.setattr(run_mod, "read_patch", _once(bug)(run_mod.read_patch))
        monkeypatch.setattr(parts_mod, "read_patch", _once(bug)(parts_mod.read_patch))
    elif step == "mirror":  # after the mirror's bits were written
        monkeypatch.setattr(
            run_mod, "apply_patch", _once(bug, before=lambda real, *a, **kw: real(*a, **kw))(run_mod.apply_patch)
        )
        monkeypatch.setattr(parts_mod, "verify_digests", _once(bug)(parts_mod.verify_digests))
    elif step == "gate":  # what a fleet record with written_at = 10**400 did
        monkeypatch.setattr(
            Follower, "_gate", _once(OverflowError("int too large to convert to float"))(Follower._gate)
        )
    elif step == "engine-apply":
        monkeypatch.setattr(
            EmbeddedEngine, "_apply_sparse", _once(bug, before=_half_write)(EmbeddedEngine._apply_sparse)
        )
    elif step == "engine-readback":
        monkeypatch.setattr(engine, "_check", _once(EngineCheckError("injected read-back mismatch"))(engine._check))
    elif step == "engine-apply-and-reload":  # the engine fails the update and the reload after it
        monkeypatch.setattr(
            EmbeddedEngine, "_apply_sparse", _once(bug, before=_half_write)(EmbeddedEngine._apply_sparse)
        )
        monkeypatch.setattr(
            EmbeddedEngine, "_load_full", _once(RuntimeError("reload failed"))(EmbeddedEngine._load_full)
        )
    elif step == "after-apply":
        monkeypatch.setattr(Follower, "_advance", _once(bug)(Follower._advance))


@pytest.mark.parametrize("part_bytes", [0, 300_000], ids=["one-file", "parts"])
@pytest.mark.parametrize("step", STEPS)
def test_an_exception_at_any_step_never_leaves_the_engine_off_the_version_it_reports(
        tiny, tmp_path, monkeypatch, step, part_bytes):
    url = str(tmp_path / "run")
    engine = EmbeddedEngine(tiny)
    run = Versions(url, engine.state_dict(), part_bytes=part_bytes)
    try:
        f = Follower(url, engine, prefetch=False)
        run.publish(1)
        _sync(f)
        assert f.current_version == 1
        _assert_engine_holds_what_is_reported(f, engine, run.states, "v1")
        run.publish(2)  # changes A only
        with monkeypatch.context() as mp:
            _inject(step, mp, f, engine)
            _sync(f)
            _assert_engine_holds_what_is_reported(f, engine, run.states, f"{step} at v2")
        for v in (3, 4):  # B only, then A and B
            run.publish(v)
            _sync(f)
            _assert_engine_holds_what_is_reported(f, engine, run.states, f"{step}, then v{v}")
        _sync(f)  # whatever was pending has been retried by now
        assert f.current_version == 4 and f.status().state == "following", f.status()
        _assert_engine_holds_what_is_reported(f, engine, run.states, f"{step}, end")
    finally:
        run.pub.close()
        engine.close()


@pytest.mark.parametrize("record", ["heartbeat", "switch"])
def test_coordinated_replica_with_an_unparsable_fleet_record_serves_exactly_its_version(tiny, tmp_path, record):
    """Issue 43, case 1: v2 changes A and stages while the bucket holds a fleet record with a number
    of 400 digits; the record goes away; v3 changes B. The engine must hold v3 in full when it says 3."""
    url = str(tmp_path / "run")
    engine = EmbeddedEngine(tiny)
    run = Versions(url, engine.state_dict())
    store = open_store(url)
    fleet = FleetOptions(replica_id="r0", coordinated=True, heartbeat=False, switch_deadline_s=2.0)
    f = Follower(url, engine, poll_interval=0.05, fleet=fleet, prefetch=False)
    try:
        run.publish(1)
        _sync(f)
        assert f.current_version == 1
        if record == "heartbeat":
            key, body = heartbeat_key("x"), ('{"format": "sparsesync-heartbeat/1", "replica": "x", "written_at": '
                                             + str(10**400) + ', "interval_s": 1, "health": "following"}')
        else:
            key, body = switch_key(2), ('{"format": "sparsesync-switch/1", "version": 2, "apply_at": '
                                        + str(10**400) + ', "written_at": 1, "by": "x"}')
        store.put(key, body.encode())
        run.publish(2)
        _sync(f)
        _assert_engine_holds_what_is_reported(f, engine, run.states, "v2 staged beside the record")
        store.delete([key])
        run.publish(3)
        _sync(f)
        _sync(f)
        assert f.current_version == 3
        _assert_engine_holds_what_is_reported(f, engine, run.states, "v3")
    finally:
        run.pub.close()
        engine.close()


class FailingHook(ApplyHook):
    """An engine whose every load fails (as vLLM's MoE loader did on a run of other weights)."""

    def __init__(self) -> None:
        self.calls: list[float] = []
        self.fail = True
        self.version: int | None = None

    def load_full(self, version, tensors):  # type: ignore[no-untyped-def]
        self.calls.append(time.monotonic())
        if self.fail:
            raise RuntimeError("torch.cat(): expected a non-empty list of Tensors")
        self.version = version

    def apply_sparse(self, version, updates, full):  # type: ignore[no-untyped-def]
        self.load_full(version, full)


def test_a_failing_engine_is_retried_with_backoff_and_reported_degraded(tmp_path):
    url = str(tmp_path / "run")
    with Publisher(url) as pub:
        pub.publish({"w": torch.arange(64, dtype=torch.float32)}, 1)
        pub.flush()
    hook = FailingHook()
    f = Follower(url, hook, poll_interval=0.05, max_poll_interval=0.2,
                 fleet=FleetOptions(replica_id="r0", interval_s=0.1, engine="test"))
    f.start()
    try:
        time.sleep(8.0)
        attempts = len(hook.calls) // 2  # each attempt: the load, then the reload after it
        assert 1 <= attempts <= 4, f"{attempts} attempts in 8 s (a reload storm): {hook.calls}"
        st = f.status()
        assert st.state == "degraded" and st.current_version is None
        assert "torch.cat()" in st.last_error and st.failures == attempts
        assert st.retry_at is not None and 0 <= st.retry_in_s <= 60
        time.sleep(0.3)  # the heartbeat carries it too
        (seen,) = read_fleet(open_store(url)).replicas
        assert seen.record.health == "degraded" and seen.record.retry_at == pytest.approx(st.retry_at)
        res = CliRunner().invoke(app, ["status", url, "--json"])
        report = json.loads(res.stdout)
        assert res.exit_code == 3 and any("r0 is degraded" in p and "torch.cat()" in p and "next attempt in" in p
                                          for p in report["problems"]), report
        res = CliRunner().invoke(app, ["status", url])
        assert res.exit_code == 3 and "retry in" in res.stdout, res.stdout
        hook.fail = False
        assert f.sync_once() == 1  # a direct call tries at once; success clears the backoff
        st = f.status()
        assert st.state == "following" and st.retry_at is None and st.failures == 0 and hook.version == 1
    finally:
        f.stop()
