"""The trainer's core: config validation, group advantages, the GRPO loss, the versioned buffer."""

from __future__ import annotations

import dataclasses
import math
import threading
import time
from pathlib import Path

import pytest
import torch

from sparsesync.errors import ConfigError
from sparsesync.store import open_store
from trainer.buffer import BufferClosed, Group, RolloutBuffer, Sample
from trainer.config import TrainerConfig
from trainer.grpo import Batch, group_advantages, grpo_loss

# ------------------------------------------------------------------------------ config
GOOD = {
    "model": {"path": "/tmp/model"},
    "rollout": {"replicas": ["http://127.0.0.1:1", "http://127.0.0.1:2"], "env_url": "http://127.0.0.1:3"},
    "optim": {"steps": 3, "lr": 1e-3, "betas": [0.9, 0.99]},
    "sync": {"bucket": "/tmp/bucket"},
}


def _with(section: str, **kv: object) -> dict:
    d = {k: dict(v) for k, v in GOOD.items()}
    d.setdefault(section, {}).update(kv)
    return d


def test_config_loads_toml_and_round_trips(tmp_path: Path) -> None:
    cfg = TrainerConfig.from_dict(GOOD)
    assert cfg.optim.betas == (0.9, 0.99) and cfg.optim.lr == 1e-3 and cfg.rollout.group_size == 8
    p = tmp_path / "t.toml"
    p.write_text(cfg.to_toml())
    assert TrainerConfig.load(p) == cfg


@pytest.mark.parametrize(
    ("section", "kv", "needle"),
    [
        ("optim", {"lr": 0.0}, "[optim] lr"),
        ("optim", {"lr": "fast"}, "expected a number"),
        ("optim", {"steps": 2.5}, "expected an integer"),
        ("optim", {"stale_policy": "ignore"}, "expected one of ['drop', 'correct']"),
        ("optim", {"buffer_groups": 1, "groups_per_step": 4}, "[optim] buffer_groups"),
        ("optim", {"lrr": 1e-3}, "unknown key(s) ['lrr']"),
        ("rollout", {"group_size": 1}, "[rollout] group_size"),
        ("rollout", {"replicas": []}, "[rollout] replicas"),
        ("rollout", {"replicas": ["127.0.0.1:8000"]}, "an http(s):// URL"),
        ("rollout", {"temperature": 0}, "[rollout] temperature"),
        ("sync", {"bucket": ""}, "[sync] bucket"),
        ("sync", {"publish_every": 0}, "[sync] publish_every"),
        ("sync", {"effort": "fast"}, "[sync] effort = 'fast': expected one of ['size', 'speed']"),
        ("model", {"master_dtype": "fp8"}, "expected one of"),
        ("extra", {"x": 1}, "unknown section(s) ['extra']"),
        ("distributed", {"timeout_s": 0}, "[distributed] timeout_s"),
        ("distributed", {"rank": 1}, "unknown key(s) ['rank']"),
    ],
)
def test_config_rejects_bad_values_naming_the_key(section: str, kv: dict, needle: str) -> None:
    with pytest.raises(ConfigError) as e:
        TrainerConfig.from_dict(_with(section, **kv))
    assert needle in str(e.value)


def test_config_file_errors(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="does not exist"):
        TrainerConfig.load(tmp_path / "missing.toml")
    bad = tmp_path / "bad.toml"
    bad.write_text("[optim\nlr = 1")
    with pytest.raises(ConfigError, match="not valid TOML"):
        TrainerConfig.load(bad)


# ------------------------------------------------------------------------------ advantages and loss
def test_group_advantages_normalise_within_the_group() -> None:
    a = group_advantages([0.0, 0.5, 1.0, 0.5])
    assert a.dtype == torch.float32
    assert abs(float(a.sum())) < 1e-5
    std = math.sqrt(((0.5**2) * 2) / 4)
    assert torch.allclose(a, torch.tensor([-0.5, 0.0, 0.5, 0.0]) / (std + 1e-4), atol=1e-5)
    assert a[2] > a[1] > a[0]
    assert torch.equal(group_advantages([0.3, 0.3, 0.3]), torch.zeros(3))  # no signal, no update
    assert torch.allclose(group_advantages([1.0, 0.0], scale=False), torch.tensor([0.5, -0.5]))
    with pytest.raises(ValueError):
        group_advantages([])


def _batch(adv: list[float], stale: list[bool] | None = None, lp: float = -1.0) -> Batch:
    return Batch.build([[5, 6, 7], [5, 6]], [[1, 2], [3, 4, 9]], [[lp, lp], [lp, lp, lp]], adv, stale)


def test_batch_aligns_logprobs_with_completion_tokens() -> None:
    b = _batch([1.0, -1.0], lp=-0.5)
    # sample 0: prompt of 3 -> completion tokens predicted at positions 2, 3
    assert b.completion_mask[0].tolist() == [0, 0, 1, 1]
    assert b.completion_mask[1].tolist() == [0, 1, 1, 1]
    assert b.behaviour_logprobs[0].tolist() == [0, 0, -0.5, -0.5]
    assert b.input_ids[1].tolist() == [5, 6, 3, 4, 9]
    with pytest.raises(ValueError, match="log-probs"):
        Batch.build([[1]], [[2, 3]], [[-1.0]], [0.0])


def test_loss_at_ratio_one_is_reinforce_and_clips_outside_the_trust_region() -> None:
    b = _batch([1.0, -1.0])
    logp = b.behaviour_logprobs.clone().requires_grad_(True)  # learner == sampler: ratio 1
    loss, st = grpo_loss(logp, b)
    loss.backward()
    assert st.ratio_mean == pytest.approx(1.0) and st.clip_frac == 0.0 and st.tokens == 5
    # d loss / d logp_t = -A / n_tokens on completion tokens, 0 elsewhere
    expected = -(b.advantages.unsqueeze(1) * b.completion_mask) / 5
    assert torch.allclose(logp.grad, expected)
    # ratio far above 1 + clip_high for a positive advantage: clipped, no gradient
    logp2 = (b.behaviour_logprobs + 1.0 * b.completion_mask).requires_grad_(True)
    loss2, st2 = grpo_loss(logp2, _batch([1.0, 1.0]), clip_high=0.28)
    loss2.backward()
    assert st2.clip_frac == pytest.approx(1.0)
    assert torch.count_nonzero(logp2.grad) == 0


def test_stale_samples_get_a_capped_importance_weight() -> None:
    b = _batch([1.0, 1.0], stale=[True, False])
    logp = (b.behaviour_logprobs + 0.05 * b.completion_mask).requires_grad_(True)
    _loss, st = grpo_loss(logp, b, is_cap=1.05)
    assert st.stale_weight_mean == pytest.approx(min(math.exp(0.1), 1.05))


# ------------------------------------------------------------------------------ buffer
def _group(gid: int, versions: list[int], rewards: list[float] | None = None) -> Group:
    rewards = rewards or [float(i) for i in range(len(versions))]
    adv = group_advantages(rewards).tolist()
    return Group(
        gid, "p", [Sample((1,), (2,), (-1.0,), r, a, v) for v, r, a in zip(versions, rewards, adv, strict=True)]
    )


def test_buffer_keeps_versions_and_drops_stale_samples() -> None:
    buf = RolloutBuffer(8, max_staleness=2, policy="drop")
    buf.put(_group(0, [3, 3]))
    buf.put(_group(1, [1, 4]))  # one sample 4 versions behind at take time (5)
    buf.put(_group(2, [0, 0]))  # all stale: skipped, does not count
    buf.put(_group(3, [5, 5]))
    out = buf.take(3, current_version=5, timeout=1)
    assert [g.group_id for g in out] == [0, 1, 3]
    assert [s.version for s in out[1].samples] == [4]  # the version each sample was generated by
    assert all(5 - s.version <= 2 for g in out for s in g.samples)
    assert buf.stats.dropped_stale == 3 and buf.stats.samples_out == 5 and buf.stats.max_staleness_seen == 2


def _rewound_run(url: str) -> tuple[list[dict[str, torch.Tensor]], dict[int, str], str]:
    """A run of versions 1..3, rewound to 2 by a second writer that then published another 3:
    (states, the first attempt's digests by version, the new 3's digest)."""
    from sparsesync.protocol.writer.publisher import Publisher
    from tests.support.weights import make_state, train_step

    g = torch.Generator().manual_seed(0)
    states = [make_state(1)]
    for _ in range(3):
        states.append(train_step(states[-1], g))
    digests = {}
    with Publisher(url, anchor_every=0) as pub:  # the first attempt: 1..3, then a crash
        for v in (1, 2, 3):
            pub.publish(states[v], v)
            pub.flush()
            digests[v] = pub.state_digest
    with Publisher(url, anchor_every=0) as pub:  # resumed from checkpoint 2: rewind, then another 3
        pub.resume(states[2], version=2)
        pub.publish(train_step(states[2], torch.Generator().manual_seed(7)), 3)
        pub.flush()
        new3 = pub.state_digest
    assert new3 != digests[3]
    return states, digests, new3


def _with_digests(group: Group, digests: list[str | None]) -> Group:
    group.samples = [dataclasses.replace(s, state_digest=d) for s, d in zip(group.samples, digests, strict=True)]
    return group


def test_buffer_drops_samples_of_a_version_a_rewind_abandoned(tmp_path: Path) -> None:
    """After a rewind to 2 and a new version 3, a sample of the abandoned 3 (its state digest) is
    dropped, and so is one that names no digest (before: judged by its version alone, and
    trained on as the new 3); the new 3's and 2's are kept."""
    from trainer.trust import SampleJudge

    url = str(tmp_path / "run")
    _states, digests, new3 = _rewound_run(url)
    buf = RolloutBuffer(8, max_staleness=4, policy="drop")
    buf.put(_with_digests(_group(0, [3, 3, 2, 3]), [digests[3], new3, digests[2], None]))
    (out,) = buf.take(1, current_version=3, timeout=1, judge=SampleJudge(open_store(url)).for_take())
    assert [s.state_digest for s in out.samples] == [new3, digests[2]]
    assert buf.stats.dropped_abandoned == 1 and buf.stats.dropped_unverified == 1


def test_a_listing_cached_before_a_rewind_does_not_trust_an_abandoned_version(tmp_path: Path) -> None:
    """Before: a listing cached before the rewind trusted the abandoned 3 for up to 10 s. The
    trainer's judge lists once at each take; TRL's cache is dropped as soon as a batch holds a
    pair it does not trust (the new 3), and the whole batch is judged on the fresh listing."""
    from sparsesync.protocol.lineage import TrustedCommits
    from sparsesync.protocol.writer.publisher import Publisher
    from tests.support.weights import make_state, train_step
    from trainer.trust import SampleJudge

    url = str(tmp_path / "run")
    g = torch.Generator().manual_seed(0)
    first = [make_state(1)]
    for _ in range(3):
        first.append(train_step(first[-1], g))
    with Publisher(url, anchor_every=0) as pub:
        for v in (1, 2, 3):
            pub.publish(first[v], v)
            pub.flush()
        old3 = pub.state_digest
    judge, cached = SampleJudge(open_store(url)), TrustedCommits(open_store(url))
    assert judge.for_take()({(3, old3)}) == set() and cached.trusts(3, old3)  # 3 trusted, and cached
    with Publisher(url, anchor_every=0) as pub:  # the rewind to 2, and another 3
        pub.resume(first[2], version=2)
        pub.publish(train_step(first[2], torch.Generator().manual_seed(7)), 3)
        pub.flush()
        new3 = pub.state_digest
    assert judge.for_take()({(3, old3)}) == {(3, old3)}  # each take lists afresh: no window after a rewind
    assert judge.for_take()({(3, old3), (3, new3)}) == {(3, old3)}
    assert cached.untrusted({(3, old3), (3, new3)}) == {(3, old3)}  # before: old3 trusted from the cache


def test_a_failed_listing_keeps_the_samples_and_the_run_goes_on(tmp_path: Path) -> None:
    """Before: the StoreError of a failed `commits/` listing escaped `take` (the groups it had
    taken lost) and ended the run. Now the groups go back to the head of the buffer, the take
    raises TrustCheckUnavailable, and a later take returns them; the learner gives up only
    after `patience_s` of failures."""
    from sparsesync.errors import StoreUnavailableError
    from sparsesync.store.local import LocalStore
    from trainer.buffer import TrustCheckUnavailable
    from trainer.errors import TrainerError
    from trainer.trust import SampleJudge

    url = str(tmp_path / "run")
    _states, digests, new3 = _rewound_run(url)

    class Flaky(LocalStore):
        failing = True

        def list(self, prefix: str = ""):  # type: ignore[no-untyped-def]
            if self.failing and prefix.startswith("commits"):
                raise StoreUnavailableError(f"listing {prefix} failed", url=self.url)
            return super().list(prefix)

    store = Flaky(Path(url))
    judge = SampleJudge(store, patience_s=0.2)
    buf = RolloutBuffer(8, max_staleness=4)
    for i in range(3):
        buf.put(_with_digests(_group(i, [3, 2]), [new3, digests[2]]))
    with pytest.raises(TrustCheckUnavailable, match="listing commits/ failed") as e:
        buf.take(2, current_version=3, timeout=1, judge=judge.for_take())
    assert len(buf) == 3 and buf.stats.samples_out == 0  # nothing lost, nothing counted out
    judge.failed(e.value)  # the first failure: logged, the learner retries
    time.sleep(0.25)
    with pytest.raises(TrainerError, match="could not list the commits"):
        judge.failed(e.value)  # failing for longer than patience_s: the run stops, saying why
    store.failing = False
    out = buf.take(3, current_version=3, timeout=1, judge=judge.for_take())
    assert [g.group_id for g in out] == [0, 1, 2] and all(len(g.samples) == 2 for g in out)


def test_a_take_lists_the_commits_once_and_outside_the_buffer_lock(tmp_path: Path) -> None:
    """Before: every sample the cached listing did not explain made a listing of `commits/`,
    each under the buffer's lock (producers blocked). Now one listing judges the take, and a
    producer can put while it runs."""
    from sparsesync.store.local import LocalStore
    from trainer.trust import SampleJudge

    url = str(tmp_path / "run")
    _states, digests, new3 = _rewound_run(url)
    buf = RolloutBuffer(16, max_staleness=4)
    listed = threading.Event()
    put_during_listing: list[bool] = []

    class Watched(LocalStore):
        lists = 0

        def list(self, prefix: str = ""):  # type: ignore[no-untyped-def]
            if prefix.startswith("commits"):
                Watched.lists += 1
                if not listed.is_set():
                    listed.set()
                    t = threading.Thread(target=lambda: buf.put(_group(99, [3])))
                    t.start()
                    t.join(timeout=5)
                    put_during_listing.append(not t.is_alive())
            return super().list(prefix)

    judge = SampleJudge(Watched(Path(url)))
    for i in range(4):  # 8 samples, each of a digest no commit has (and one good sample per group)
        buf.put(_with_digests(_group(i, [3, 3, 2]), [f"{i:016x}", f"{i + 8:016x}", digests[2]]))
    out = buf.take(4, current_version=3, timeout=5, judge=judge.for_take())
    assert [g.group_id for g in out] == [0, 1, 2, 3] and buf.stats.dropped_abandoned == 8
    assert Watched.lists == 1 and put_during_listing == [True] and len(buf) == 1


def test_buffer_correct_policy_keeps_and_flags_stale_samples() -> None:
    buf = RolloutBuffer(4, max_staleness=1, policy="correct")
    buf.put(_group(0, [0, 2]))
    (g,) = buf.take(1, current_version=3, timeout=1)
    assert [(s.version, s.stale) for s in g.samples] == [(0, True), (2, False)]
    assert buf.stats.kept_stale == 1 and buf.stats.dropped_stale == 0 and buf.stats.max_staleness_seen == 3


def test_buffer_is_bounded_and_blocks_producers() -> None:
    buf = RolloutBuffer(2, max_staleness=0)
    buf.put(_group(0, [0, 0]))
    buf.put(_group(1, [0, 0]))
    with pytest.raises(TimeoutError):
        buf.put(_group(2, [0, 0]), timeout=0.1)
    done = threading.Event()

    def producer() -> None:
        buf.put(_group(2, [0, 0]))
        done.set()

    threading.Thread(target=producer, daemon=True).start()
    time.sleep(0.1)
    assert not done.is_set() and len(buf) == 2
    assert [g.group_id for g in buf.take(1, current_version=0, timeout=1)] == [0]
    assert done.wait(2) and len(buf) == 2
    with pytest.raises(TimeoutError):
        buf.take(3, current_version=0, timeout=0.1)
    assert len(buf) == 2  # a timed-out take gives its groups back, in order
    assert [g.group_id for g in buf.take(2, current_version=0, timeout=1)] == [1, 2]
    buf.stop()
    with pytest.raises(BufferClosed):
        buf.put(_group(3, [0, 0]))
    with pytest.raises(BufferClosed):
        buf.take(1, current_version=0, timeout=1)


# ------------------------------------------------------------------------------ entry point and metrics
def test_cli_refuses_a_bad_config_before_starting_anything(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from trainer.__main__ import main

    p = tmp_path / "t.toml"
    p.write_text(TrainerConfig.from_dict(GOOD).to_toml().replace("lr = 0.001", "lr = -1.0"))
    assert main(["--config", str(p)]) == 2
    err = capsys.readouterr().err
    assert "[optim] lr = -1.0" in err and not (tmp_path / "bucket").exists()


def test_auth_token_comes_from_the_environment_only(monkeypatch: pytest.MonkeyPatch) -> None:
    from trainer.train import auth_headers

    cfg = TrainerConfig.from_dict(_with("rollout", auth_token_env="SPARSESYNC_TEST_TOKEN"))
    monkeypatch.delenv("SPARSESYNC_TEST_TOKEN", raising=False)
    with pytest.raises(ConfigError, match="SPARSESYNC_TEST_TOKEN is not set"):
        auth_headers(cfg)
    monkeypatch.setenv("SPARSESYNC_TEST_TOKEN", "hf_x")
    assert auth_headers(cfg) == {"Authorization": "Bearer hf_x"}
    assert auth_headers(TrainerConfig.from_dict(GOOD)) is None


def test_metrics_logger_writes_every_step_to_jsonl(tmp_path: Path) -> None:
    from trainer.metrics import MetricsLogger, read_jsonl, step_records

    path = tmp_path / "m" / "metrics.jsonl"
    with MetricsLogger(total_steps=3, jsonl=path, progress=False, trackio_project="") as m:
        m.log_event("commit", {"version": 0, "patch_bytes": 10})
        for step in (1, 2, 3):
            m.log_step({"step": step, "reward": step / 10, "sync_bytes": 100, "density": 0.01, "lag/0": 0,
                        "nan": float("nan")})
            assert len(step_records(path)) == step  # flushed before log_step returns
    assert [r["reward"] for r in step_records(path)] == [0.1, 0.2, 0.3]
    assert read_jsonl(path)[0]["event"] == "commit" and step_records(path)[0]["nan"] is None


def test_a_rollout_worker_stopped_by_a_bug_is_reported_at_once(monkeypatch):
    """A worker that raises something other than a rollout failure (a bug) used to die silently,
    and the learner waited forever on the buffer; now `check()` raises it at once."""
    import trainer.rollout as rollout
    from trainer.errors import TrainerError
    from trainer.replicas import ReplicaPool

    def buggy(*args, **kwargs):  # the fault: a programming error inside a rollout
        raise KeyError("completion")

    monkeypatch.setattr(rollout, "play_group", buggy)
    workers = rollout.RolloutWorkers(
        RolloutBuffer(4, max_staleness=1),
        ReplicaPool(["http://127.0.0.1:9"]),
        "http://127.0.0.1:9",
        task="t",
        params=rollout.SamplingParams(),
        workers=2,
    )
    workers.start()
    try:
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            try:
                workers.check()
            except TrainerError as e:
                assert "crashed" in str(e) and "KeyError" in str(e)
                break
            time.sleep(0.05)
        else:
            pytest.fail("check() never reported the crashed worker")
    finally:
        workers.stop(timeout=5)


def test_publish_state_keeps_a_tied_head_one_tensor_when_it_casts():
    """fp32 master weights cast to bf16 for the replicas: the tied head and embedding stay one
    tensor, which the publisher sends once (the embedding is a quarter of Qwen3-0.6B)."""
    pytest.importorskip("transformers")
    from transformers import Qwen3ForCausalLM

    from sparsesync.checkpoint import checkpoint_state
    from sparsesync.tiny_model import tiny_config
    from trainer.train import publish_state

    model = Qwen3ForCausalLM(tiny_config(vocab_size=64, tie_word_embeddings=True)).float()
    state = publish_state(model, torch.bfloat16)
    assert state["lm_head.weight"].dtype == torch.bfloat16
    assert state["lm_head.weight"].data_ptr() == state["model.embed_tokens.weight"].data_ptr()
    assert "lm_head.weight" not in checkpoint_state(state)


def test_an_fp32_master_is_published_by_a_casting_publisher_as_its_cast(tmp_path: Path) -> None:
    """An fp32 master on CPU: the trainer hands the publisher the model's own tensors and
    `Publisher(dtype=bf16)` casts them one at a time; the run gets the same bytes and state
    digests as publishing `publish_state`'s cast (the tied head still sent once)."""
    pytest.importorskip("transformers")
    from transformers import Qwen3ForCausalLM

    from sparsesync.protocol.writer.publisher import Publisher
    from sparsesync.tiny_model import tiny_config
    from trainer.policy import publish_state, publisher_casts

    torch.manual_seed(0)
    model = Qwen3ForCausalLM(tiny_config(vocab_size=64, tie_word_embeddings=True)).float()
    assert publisher_casts(model, torch.bfloat16) and not publisher_casts(model, torch.float32)
    runs = {}
    for lazy in (False, True):
        m = Qwen3ForCausalLM(tiny_config(vocab_size=64, tie_word_embeddings=True)).float()
        m.load_state_dict(model.state_dict())
        root = tmp_path / f"lazy{lazy}"
        with Publisher(str(root), dtype=torch.bfloat16 if lazy else None, writer="w") as pub:
            for v in range(3):
                with torch.no_grad():
                    for p in m.parameters():
                        p.add_(1e-3 * torch.randn(p.shape, generator=torch.Generator().manual_seed(v)))
                pub.publish(publish_state(m, torch.bfloat16, cast=not lazy), v)
            pub.flush()
            digest = pub.state_digest
        store = open_store(str(root))
        runs[lazy] = digest, sorted(store.get(o.key) for o in store.list("deltas/"))
    assert runs[True] == runs[False] and len(runs[True][1]) == 2
