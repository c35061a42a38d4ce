"""The embedded (transformers) replica follows a real run of the tiny model, bit-exact.

Publisher -> local bucket -> Follower -> EmbeddedEngine; after each version the replica's
weights match the trainer's digests, and its greedy generations equal those of a fresh engine
loaded from that version's weights. A request sent while a version is being staged completes.
"""

from __future__ import annotations

import threading
import time

import pytest

pytest.importorskip("transformers", reason="the embedded engine needs transformers (pip install -e '.[embedded]')")

from inference_space.engines import SamplingParams  # noqa: E402
from inference_space.engines.embedded import EmbeddedEngine  # noqa: E402
from sparsesync.codec import tensor_digests  # noqa: E402
from sparsesync.errors import WeightUpdateError  # noqa: E402
from sparsesync.protocol.follower.follower import Follower  # noqa: E402
from sparsesync.protocol.writer.publisher import Publisher  # noqa: E402
from sparsesync.tiny_model import build_tiny_model  # noqa: E402
from tests.support.generation import GREEDY, greedy  # noqa: E402
from tests.support.model_steps import PROMPTS, Trainer  # noqa: E402


def test_embedded_replica_follows_six_versions(tiny, tmp_path):
    bucket = str(tmp_path / "bucket")
    trainer = Trainer(tiny, seed=1)
    engine = EmbeddedEngine(tiny)
    follower = Follower(bucket, hook=engine, poll_interval=0.05)
    assert engine.weight_version is None
    first = greedy(engine)
    assert all(c.weight_version is None for c in engine.generate(PROMPTS[0], GREEDY))
    seen = [first]
    with Publisher(bucket, anchor_every=4) as pub:
        for step in range(1, 7):
            state = trainer.step()
            version = pub.publish(state, step)
            pub.flush()
            assert follower.sync_once() == version
            assert engine.weight_version == version
            assert tensor_digests(engine.state_dict()) == tensor_digests(state)
            fresh = EmbeddedEngine(trainer.save_version(tmp_path / f"v{version}"))
            got = greedy(engine)
            assert got == greedy(fresh), f"version {version}: replica and fresh engine disagree"
            assert {c.weight_version for c in engine.generate(PROMPTS[1], GREEDY)} == {version}
            seen.append(got)
    st = follower.status()
    assert st.versions_applied == 6 and st.anchor_loads == 1 and st.state == "following"
    assert engine.pauses.count == 6 and engine.pauses.max_ms is not None
    assert len({str(s) for s in seen}) > 1, "the updates never changed a generation: the test proves nothing"


def test_request_during_staging_completes_and_pause_is_measured(tiny, tmp_path):
    bucket = str(tmp_path / "bucket")
    trainer = Trainer(tiny, seed=2)
    engine = EmbeddedEngine(tiny)
    follower = Follower(bucket, hook=engine, poll_interval=0.02, prefetch=False)  # the delta is fetched while staging
    staging, release = threading.Event(), threading.Event()
    fetch = follower.run.fetch

    def slow_fetch(*a, **kw):  # type: ignore[no-untyped-def]  # a slow download of the patch (one file or its parts)
        staging.set()
        assert release.wait(30)
        return fetch(*a, **kw)

    with Publisher(bucket, anchor_every=0) as pub:
        pub.publish(trainer.step(), 1)
        pub.flush()
        assert follower.sync_once() == 1
        follower.run.fetch = slow_fetch  # type: ignore[method-assign]
        follower.start()
        try:
            pub.publish(trainer.step(), 2)
            pub.flush()
            assert staging.wait(30)
            t0 = time.perf_counter()
            outs = engine.generate(PROMPTS[0], SamplingParams(max_tokens=4, temperature=0.0))
            assert time.perf_counter() - t0 < 10 and outs[0].weight_version == 1  # served while staging
            release.set()
            follower.wait_for_version(2, timeout=30)
        finally:
            release.set()
            follower.stop()
    assert engine.generate(PROMPTS[0], GREEDY)[0].weight_version == 2
    assert engine.pauses.count == 2 and 0 < engine.pauses.last_ms < 1000
    assert follower.status().last_apply_s is not None


def test_generation_and_update_never_overlap(tiny, tmp_path):
    """An update waits for the running batch, then blocks new batches until it is written."""
    engine = EmbeddedEngine(tiny)
    trainer = Trainer(tiny, seed=3)
    state = trainer.step()
    versions: list[int | None] = []
    stop = threading.Event()

    def client() -> None:
        while not stop.is_set():
            versions.extend(
                c.weight_version for c in engine.generate(PROMPTS[0], SamplingParams(max_tokens=16, temperature=0.0))
            )

    threads = [threading.Thread(target=client) for _ in range(2)]
    for t in threads:
        t.start()
    time.sleep(0.2)
    engine.load_full(1, state)
    time.sleep(0.2)
    stop.set()
    for t in threads:
        t.join()
    assert versions[0] is None and versions[-1] == 1 and set(versions) == {None, 1}
    assert versions == sorted(versions, key=lambda v: -1 if v is None else v)  # never back
    assert engine.pauses.last_wait_ms is not None


def test_updates_are_validated_before_the_engine_sees_them(tiny):
    import torch

    from sparsesync.codec.apply import SparseUpdate

    engine = EmbeddedEngine(tiny)
    before = tensor_digests(engine.state_dict())
    name = "model.layers.0.self_attn.q_proj.weight"
    full = {name: engine.state_dict()[name]}
    bad = {
        "unknown": SparseUpdate(torch.tensor([0]), torch.tensor([1.0], dtype=torch.bfloat16)),
        name: SparseUpdate(torch.tensor([10**9]), torch.tensor([1.0], dtype=torch.bfloat16)),
    }
    with pytest.raises(WeightUpdateError, match="unknown"):
        engine.apply_sparse(5, bad, full)
    with pytest.raises(WeightUpdateError, match="index outside"):
        engine.apply_sparse(5, {name: bad[name]}, full)
    nan = SparseUpdate(torch.tensor([0]), torch.tensor([float("nan")], dtype=torch.bfloat16))
    with pytest.raises(WeightUpdateError, match="non-finite"):
        engine.apply_sparse(5, {name: nan}, full)
    assert engine.weight_version is None and tensor_digests(engine.state_dict()) == before


def test_sampling_with_seed_is_reproducible_and_stops(tiny):
    engine = EmbeddedEngine(tiny)
    p = SamplingParams(max_tokens=6, temperature=1.0, top_p=0.9, n=3, seed=7)
    a, b = engine.generate(PROMPTS[0], p), engine.generate(PROMPTS[0], p)
    assert [c.token_ids for c in a] == [c.token_ids for c in b] and len(a) == 3
    assert all(len(c.logprobs) == len(c.token_ids) and all(lp <= 0 for lp in c.logprobs) for c in a)
    greedy = engine.generate(PROMPTS[0], GREEDY)[0]
    stop = greedy.text[2:4]
    cut = engine.generate(PROMPTS[0], SamplingParams(max_tokens=8, temperature=0.0, stop=[stop]))[0]
    assert cut.finish_reason == "stop" and stop not in cut.text and greedy.text.startswith(cut.text)


def test_a_stale_tied_head_is_caught_by_the_read_back(tmp_path):
    """A model whose head stopped sharing the embedding's storage fails the check: version null,
    /sync degraded, and the follower never reports the version as followed."""
    import torch

    from tests.support.model_steps import follow_then_break

    engine = EmbeddedEngine(build_tiny_model(tmp_path / "tied", seed=0, arch="qwen3-tied"))

    def untie() -> None:  # the head goes stale
        head = engine.model.get_output_embeddings()
        head.weight = torch.nn.Parameter(head.weight.detach().clone())

    replica = follow_then_break(engine, engine.model_dir, str(tmp_path / "bucket"), untie)
    st = replica.status()
    # the apply and the reload both failed the check: the engine holds no version it can vouch
    # for, so the replica reports none (not the last version, whose bits were overwritten)
    assert st["current_version"] is None and st["state"] == "degraded" and "lm_head.weight" in st["last_error"]
    assert engine.weight_version is None and engine.generate(PROMPTS[0], GREEDY)[0].weight_version is None
    engine.model.tie_weights()  # fixed: the next sync reloads from an anchor and passes the check
    assert replica.follower.sync_once() == 2 and replica.status()["state"] == "following" and engine.weight_version == 2


def test_tied_model_takes_the_lm_head_alias_only_when_it_equals_the_embedding(tmp_path):
    """A run published from state_dict() may carry `lm_head.weight` for a tied model: accepted
    when equal to the embedding, refused (nothing written) when not."""
    import torch

    from sparsesync.codec.apply import SparseUpdate

    engine = EmbeddedEngine(build_tiny_model(tmp_path / "tied", seed=0, arch="qwen3-tied"))
    emb = "model.embed_tokens.weight"
    assert "lm_head.weight" not in engine.state_dict()
    new = engine.state_dict()[emb].clone()
    new.view(-1)[:3] += 1
    upd = SparseUpdate(torch.arange(3), new.view(-1)[:3].clone())
    engine.apply_sparse(1, {emb: upd, "lm_head.weight": upd}, {emb: new, "lm_head.weight": new})
    assert engine.weight_version == 1 and torch.equal(engine.model.get_output_embeddings().weight, new)
    with pytest.raises(WeightUpdateError, match="ties them"):
        engine.apply_sparse(2, {emb: upd, "lm_head.weight": upd}, {emb: new, "lm_head.weight": new + 1})
    assert engine.weight_version == 1


def _replace_down_proj(engine) -> None:  # type: ignore[no-untyped-def]
    """What user code (or a library hook) may do: swap a parameter of the live model for a copy."""
    import torch

    mlp = engine.model.model.layers[0].mlp
    mlp.down_proj.weight = torch.nn.Parameter(mlp.down_proj.weight.detach().clone(), requires_grad=False)


def test_a_replaced_parameter_fails_the_check_until_a_full_load(tiny):
    """The read-back reads the parameters the forward pass uses at check time: a sparse update
    after a parameter was replaced raises EngineCheckError (version null), even when the
    update does not touch it; a full load writes into the live parameters and recovers."""
    import torch

    from sparsesync.codec.apply import SparseUpdate
    from sparsesync.errors import EngineCheckError

    engine = EmbeddedEngine(tiny)
    trainer = Trainer(tiny, seed=5)
    engine.load_full(1, trainer.step())
    _replace_down_proj(engine)
    name = "model.layers.1.self_attn.o_proj.weight"  # not the replaced one
    new = trainer.state[name].clone()
    new.view(-1)[:4] += 1
    with pytest.raises(EngineCheckError, match="model.layers.0.mlp.down_proj.weight"):
        engine.apply_sparse(2, {name: SparseUpdate(torch.arange(4), new.view(-1)[:4].clone())}, {name: new})
    assert (
        engine.weight_version is None
        and engine.check_error
        and engine.generate(PROMPTS[0], GREEDY)[0].weight_version is None
    )
    state = trainer.step()
    engine.load_full(3, state)
    assert engine.weight_version == 3 and tensor_digests(engine.state_dict()) == tensor_digests(state)
    assert greedy(engine) == greedy(EmbeddedEngine(trainer.save_version(tiny.parent / "v3")))


def test_a_replica_whose_parameter_was_replaced_never_serves_stale_weights(tiny, tmp_path, caplog):
    """The issue's case: a replica follows v1, a parameter of the live model is replaced by a
    copy, v2 arrives. Today's main wrote v2 into the orphaned tensor, checked that tensor, and
    served v2's label with v1's down_proj. Now the sparse apply fails its check and the
    follower's full reload writes into the live parameters: v2, equal to a fresh engine."""
    from tests.support.model_steps import follow_then_break

    engine = EmbeddedEngine(tiny)
    with caplog.at_level("ERROR"):
        replica = follow_then_break(engine, tiny, str(tmp_path / "bucket"), lambda: _replace_down_proj(engine))
    assert replica.status()["state"] == "following" and engine.weight_version == 2
    trainer = Trainer(tiny, seed=4)  # the run follow_then_break published
    trainer.step(), trainer.step()
    fresh = EmbeddedEngine(trainer.save_version(tmp_path / "v2"))
    assert greedy(engine) == greedy(fresh), "the replica labels v2 but computes with other weights"
    assert any("replaced since the engine mapped it" in r.getMessage() for r in caplog.records)


def test_sparse_updates_the_engine_cannot_vouch_for_are_refused(tiny):
    """Issue 43, engine half: after a failed check every tensor is stale, so a sparse update
    that brings only its touched tensors is refused; so is a delta from another version than
    the one held. Both leave version null until a full load."""
    import torch

    from sparsesync.codec.apply import SparseUpdate
    from sparsesync.errors import EngineCheckError

    engine = EmbeddedEngine(tiny)
    trainer = Trainer(tiny, seed=6)
    engine.load_full(1, trainer.step())
    name = "model.layers.0.self_attn.q_proj.weight"
    new = trainer.state[name].clone()
    new.view(-1)[:2] += 1
    upd = {name: SparseUpdate(torch.arange(2), new.view(-1)[:2].clone())}
    with pytest.raises(EngineCheckError, match="delta from version 7, but the engine holds version 1"):
        engine.apply_sparse(2, upd, {name: new}, base_version=7)
    assert engine.weight_version is None
    with pytest.raises(EngineCheckError, match="unverified since a failed update"):
        engine.apply_sparse(2, upd, {name: new})
    assert engine.weight_version is None
    state = dict(trainer.state)
    engine.load_full(1, state)
    engine.apply_sparse(2, upd, {name: new}, base_version=1)
    assert engine.weight_version == 2 and torch.equal(engine.state_dict()[name], new)


def test_device_flag_defaults_to_cuda_when_there_is_one_and_reaches_the_engine(tiny, monkeypatch):
    """Issue 42 item 3: `--device` (SPARSESYNC_DEVICE), default cuda when available, else cpu,
    passed through the replica config to the embedded engine."""
    import torch

    from inference_space.__main__ import parse_config
    from inference_space.replica import ReplicaConfig, build_replica
    from sparsesync.errors import SparsesyncError

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert parse_config(["--model", "m"], environ={})[0].device == "cuda"
    assert parse_config(["--model", "m", "--device", "cuda:1"], environ={})[0].device == "cuda:1"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert parse_config(["--model", "m"], environ={})[0].device == "cpu"
    assert parse_config(["--model", "m"], environ={"SPARSESYNC_DEVICE": "cpu"})[0].device == "cpu"
    with pytest.raises(SparsesyncError, match="no CUDA device"):
        parse_config(["--model", "m", "--device", "cuda"], environ={})
    with pytest.raises(SparsesyncError, match="not a torch device"):
        parse_config(["--model", "m", "--device", "gpu0"], environ={})
    monkeypatch.undo()
    replica = build_replica(ReplicaConfig(model=str(tiny), device="cpu:0"))  # "cpu:0": not the engine's default
    assert isinstance(replica.engine, EmbeddedEngine) and replica.engine.device == torch.device("cpu", 0)
    assert replica.engine.generate(PROMPTS[0], GREEDY)[0].token_ids
