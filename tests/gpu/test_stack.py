"""The stack on CUDA: the embedded replica, one trainer step, FSDP2 on one NCCL rank.

Each test is parametrized over ["cpu", "cuda"]; the CUDA case is marked `gpu` (skipped, with
the reason, where no CUDA device is visible; scripts/gpu_check.sh runs it on a GPU machine).
- The embedded engine on the device follows 5 versions from a local bucket and, after each,
  generates what a fresh engine on the same device loaded from that version generates (token
  ids equal, logprobs within 1e-3), its weights at the trainer's digests.
- One GRPO step of the trainer's own pieces (trainer/train.py's precision, policy loading and
  publish cast; trainer/grpo.py's loss) on the device: bf16 master weights on CUDA. The version
  it publishes, and one published from the live device tensors, are applied bit-exactly by a CPU
  follower.
- FSDP2 `fully_shard` on one rank (NCCL for CUDA tensors plus gloo for CPU ones on CUDA, as
  trainer/distributed.py initializes; gloo on CPU): the distributed publisher publishes the
  sharded state dict before and after an AdamW step; the run reconstructs both bit for bit.
"""

from __future__ import annotations

import json
import os
import socket
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers", reason="the engine and trainer paths need transformers")

from inference_space.engines.embedded import EmbeddedEngine  # noqa: E402
from sparsesync.codec import tensor_digests  # noqa: E402
from sparsesync.protocol.follower.follower import Follower  # noqa: E402
from sparsesync.protocol.run import Run  # noqa: E402
from sparsesync.protocol.writer.publisher import Publisher  # noqa: E402
from tests.support.generation import greedy  # noqa: E402
from tests.support.model_steps import Trainer  # noqa: E402
from tests.support.weights import assert_bit_equal  # noqa: E402

HAS_CUDA = torch.cuda.is_available()
NO_CUDA = "needs a CUDA device (torch.cuda.is_available() is False); run scripts/gpu_check.sh on a GPU machine"
DEVICES = ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(not HAS_CUDA, reason=NO_CUDA)])]


@pytest.mark.parametrize("device", DEVICES)
def test_embedded_engine_on_the_device_follows_five_versions(device, tiny, tmp_path):
    bucket = str(tmp_path / "bucket")
    trainer = Trainer(tiny, seed=1)
    engine = EmbeddedEngine(tiny, device=device)
    assert all(p.device.type == device for p in engine.model.parameters())
    follower = Follower(bucket, hook=engine, poll_interval=0.05)
    seen = [greedy(engine)]
    with Publisher(bucket, anchor_every=3) as pub:
        for step in range(1, 6):
            state = trainer.step()
            version = pub.publish(state, step)
            pub.flush()
            assert follower.sync_once() == version
            assert engine.weight_version == version and engine.check_error is None
            assert tensor_digests(engine.state_dict()) == tensor_digests(state)
            fresh = EmbeddedEngine(trainer.save_version(tmp_path / f"v{version}"), device=device)
            got, want = greedy(engine), greedy(fresh)
            for (ids, lps), (ids_f, lps_f) in zip(got, want):
                assert ids == ids_f, f"version {version}: replica and fresh engine generate different tokens"
                assert max((abs(a - b) for a, b in zip(lps, lps_f)), default=0.0) <= 1e-3, (
                    f"version {version}: logprobs"
                )
            seen.append(got)
            del fresh
    assert engine.pauses.count == 5 and engine.pauses.max_ms is not None  # every version paused it once
    assert len({str([i for i, _ in s]) for s in seen}) > 1, (
        "the updates never changed a generation: the test proves nothing"
    )


@pytest.mark.parametrize("device", DEVICES)
def test_one_trainer_step_on_the_device_publishes_what_a_cpu_follower_applies(device, tiny, tmp_path):
    from trainer.config import TrainerConfig
    from trainer.grpo import Batch, grpo_loss, token_logprobs
    from trainer.train import load_policy, publish_state, resolve_precision

    cfg = TrainerConfig.from_dict({
        "model": {"path": str(tiny), "device": device},
        "rollout": {"replicas": ["http://127.0.0.1:1"], "env_url": "http://127.0.0.1:3"},
        "optim": {"steps": 1, "lr": 1e-3},
        "sync": {"bucket": str(tmp_path / "bucket")},
    })
    dev, master, publish = resolve_precision(cfg)
    assert dev.type == device and master == (torch.bfloat16 if device == "cuda" else torch.float32)
    torch.manual_seed(0)
    model = load_policy(cfg, dev, master)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=cfg.optim.lr)
    follower = Follower(cfg.sync.bucket, poll_interval=0.05)
    with Publisher(cfg.sync.bucket, anchor_every=0, anchor_fraction=1e9) as pub:
        first = publish_state(model, publish)
        pub.publish(first, 0)
        batch = Batch.build([[1, 2, 3], [4, 5]], [[6, 7, 8], [9, 10]], [[-1.0, -2.0, -1.5], [-0.5, -3.0]],
                            [1.0, -1.0], device=dev)
        loss, _ = grpo_loss(token_logprobs(model, batch), batch)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        second = publish_state(model, publish)  # the trainer's path: a cast copy on the host
        pub.publish(second, 1)
        with torch.no_grad():
            for p in model.parameters():
                p.add_(torch.randn_like(p) * 1e-2)
        live = {k: v.detach().to(publish) for k, v in model.state_dict().items()}  # on the device
        assert all(t.device.type == device for t in live.values())
        pub.publish(live, 2)
        pub.flush()
    assert follower.sync_once() == 2
    run = Run(cfg.sync.bucket)
    assert run.commit(1).has_delta and run.commit(2).has_delta
    n_changed = sum(
        int((a.view(torch.int16) != b.view(torch.int16)).sum()) for a, b in zip(first.values(), second.values())
    )
    assert n_changed > 0, "the step changed no bf16 element: the test proves nothing"
    assert_bit_equal(run.reconstruct(1)[1], second)
    assert_bit_equal(follower.mirror, {k: v.cpu() for k, v in live.items()})


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _fsdp_rank(rank: int, port: int, model_dir: str, url: str, out: str, device: str) -> None:
    """One rank (of one) of an FSDP2 job, initialized the way trainer/distributed.py does."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
    import torch.distributed as dist
    from safetensors.torch import save_file
    from torch.distributed.tensor import DTensor
    from transformers import AutoModelForCausalLM

    from trainer.distributed import full_state, init_distributed, shard_policy

    ctx = init_distributed(torch.device(device), 60)
    try:
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16).to(ctx.device)
        shard_policy(model)
        state = model.state_dict()
        assert all(isinstance(t, DTensor) and t.device.type == device for t in state.values())
        pub = Publisher(url, group=dist.group.WORLD, part_bytes=50_000, anchor_every=0, anchor_fraction=1e9)
        pub.publish(state, 1)
        saved = {1: {k: t.clone() for k, t in (full_state(state, 0) or {}).items()}}  # no aliasing of the live shards
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        ids = torch.tensor([[1, 2, 3, 4, 5]], device=ctx.device)
        model(input_ids=ids).logits.float().pow(2).mean().backward()
        opt.step()
        state = model.state_dict()
        pub.publish(state, 2)
        saved[2] = full_state(state, 0)
        pub.flush()
        pub.close()
        for v, s in saved.items():
            save_file({k: t.contiguous() for k, t in s.items()}, str(Path(out) / f"v{v}.safetensors"))
        (Path(out) / "ok.json").write_text(json.dumps({"backend": dist.get_backend(), "device": str(ctx.device)}))
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("device", DEVICES)
def test_fsdp2_on_one_rank_publishes_through_the_distributed_publisher(device, tiny, tmp_path):
    import torch.multiprocessing as mp
    from safetensors.torch import load_file

    url, out = str(tmp_path / "run"), tmp_path / "out"
    out.mkdir()
    mp.spawn(_fsdp_rank, args=(_free_port(), str(tiny), url, str(out), device), nprocs=1, join=True)
    info = json.loads((out / "ok.json").read_text())
    assert info["device"].startswith(device)
    run = Run(url)
    assert [c.version for c in run.commits()] == [1, 2] and run.commit(2).parts and not run.commit(2).has_anchor
    for v in (1, 2):
        assert_bit_equal(run.reconstruct(v)[1], load_file(str(out / f"v{v}.safetensors")))
    a, b = load_file(str(out / "v1.safetensors")), load_file(str(out / "v2.safetensors"))
    assert any(not torch.equal(a[k], b[k]) for k in a), "the step changed nothing: the test proves nothing"
