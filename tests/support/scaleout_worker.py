"""One rank of a distributed trainer for tests/protocol/test_scaleout.py: FSDP2 on CPU (gloo), tiny Qwen3.

    python -m tests.support.scaleout_worker '<json args>'   # with RANK, WORLD_SIZE, MASTER_PORT set

Trains the tiny model (same seed on every rank; `arch`: one of `tiny_model.ARCHS` at hidden 64;
`freeze`: with a frozen embedding; `trainable_only`: publishing the trainable tensors alone after
the first version) with AdamW, publishes `model.state_dict()` (DTensor shards) through `Publisher(url)` after every
step, flushes, and has rank 0 save the gathered full state of each version to `<out>/v<version>.safetensors` (what
followers must reproduce). With
`resume`, every rank first loads the run's newest committed version into the model and calls
`pub.resume(model.state_dict())` (with `perturb`, after changing one element of the last tensor, or of
the tensor it names; with `resume_version`, that older version instead: a rewind). With `kill_rank`/`kill_version`,
that rank dies (os._exit) when it starts storing its part of that version. With `slow_puts` (seconds), every rank's
part uploads take that long and versions are published without waiting for them (flushed after the last one;
`queue_size` as given). With `fence_version`, rank 0 starts another writer on the
run (a single-process Publisher in a new process, which claims a newer epoch) before that version.
Exit codes: 0 done, 3 the publisher raised (its message on stderr, one line), 17 killed.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist


def main() -> None:
    args = json.loads(sys.argv[1])
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{os.environ['MASTER_PORT']}", rank=rank, world_size=world
    )
    from safetensors.torch import save_file
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
    from torch.distributed.fsdp import fully_shard
    from transformers import AutoModelForCausalLM

    if args.get("ddp"):
        return _ddp(args, rank)
    from sparsesync.checkpoint import checkpoint_state
    from sparsesync.errors import SparsesyncError
    from sparsesync.protocol.run import Run
    from sparsesync.protocol.writer.publisher import Publisher
    from sparsesync.store import open_store
    from sparsesync.tiny_model import arch_config, tiny_config

    torch.manual_seed(0)
    cfg = arch_config(args["arch"], hidden=64) if args.get("arch") else tiny_config(
        hidden_size=64, intermediate_size=128, num_attention_heads=2, num_key_value_heads=1)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in sorted(model.named_parameters()):
            p.copy_(torch.ones_like(p) if name.endswith("norm.weight") else torch.randn(p.shape, generator=g) * 0.05)
    model = model.to(torch.bfloat16)
    if args.get("resume"):
        _rec, state, _d = Run(args["url"]).reconstruct(args.get("resume_version"))
        if args.get("perturb"):  # weights one ulp away from the run's newest version (in tensor `perturb`, or the last)
            name = args["perturb"] if isinstance(args["perturb"], str) else sorted(state)[-1]
            state[name].view(-1)[:1].view(torch.int16).add_(1)
        # the run is in the checkpoint's key set: copied into its views of the model's tensors (a tied
        # head once, as the embedding; fused MoE experts per expert)
        views = checkpoint_state(model.state_dict())
        if set(views) != set(state):
            raise AssertionError(f"rank {rank}: the run's newest version does not fit the model: "
                                 f"{sorted(set(views) ^ set(state))[:5]}")
        with torch.no_grad():
            for name, t in views.items():
                t.copy_(state[name])
    if args.get("freeze"):  # a frozen embedding (requires_grad False): AdamW leaves it as it is
        model.model.embed_tokens.weight.requires_grad_(False)
    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=args.get("lr", 2e-3))

    store = open_store(args["url"], create=True)
    current = {"version": None}
    if args.get("kill_rank") == rank:
        put = store.put

        def dying_put(key, data):  # type: ignore[no-untyped-def]
            if key.startswith("deltas/") and current["version"] == args["kill_version"]:
                os._exit(17)  # killed before this rank's part is stored
            return put(key, data)

        store.put = dying_put  # type: ignore[method-assign]
    if args.get("slow_puts"):  # every part upload takes this long: uploads lag behind training
        import time

        slow = store.put

        def slow_put(key, data):  # type: ignore[no-untyped-def]
            if key.startswith("deltas/"):
                time.sleep(args["slow_puts"])
            return slow(key, data)

        store.put = slow_put  # type: ignore[method-assign]
    out = Path(args["out"])
    pub = Publisher(store, anchor_every=args.get("anchor_every", 0), anchor_fraction=1e9,
                    part_bytes=args.get("part_bytes", 16 << 10), dist_timeout_s=args.get("dist_timeout", 60),
                    effort=args.get("effort", "size"), queue_size=args.get("queue_size", 4))
    assert type(pub) is Publisher and (pub.rank, pub.world) == (rank, world)  # one rank of a distributed publisher
    try:
        if args.get("resume"):
            pub.resume(model.state_dict(), version=args.get("resume_version"))
        for v in range(args["first"], args["last"] + 1):
            tokens = torch.randint(0, 512, (2, 16), generator=torch.Generator().manual_seed(1000 * v + rank))
            loss = model(input_ids=tokens, labels=tokens).loss
            loss.backward()
            opt.step()
            opt.zero_grad()
            current["version"] = v
            if v == args.get("fence_version") and rank == 0:
                import subprocess

                code = "from sparsesync.protocol.writer.publisher import Publisher; Publisher(%r).close()" % args["url"]
                env = {k: val for k, val in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_PORT")}
                subprocess.run([sys.executable, "-c", code], check=True, env=env, timeout=120)
            state = model.state_dict()
            # as callbacks that send what changes do: no frozen tensors
            if args.get("trainable_only") and v > args["first"]:
                trainable = {n for n, p in model.named_parameters() if p.requires_grad}
                state = {k: t for k, t in state.items() if k in trainable}
            pub.publish(state, v)
            if not args.get("slow_puts") or v == args["last"]:  # with slow uploads: no waiting, versions coalesce
                pub.flush()
                if pub.state_digest != Run(store).commit(v).state_digest:  # the global digest, on every rank
                    raise AssertionError(f"rank {rank}: state_digest {pub.state_digest} is not version {v}'s")
            full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
            if rank == 0:
                save_file({k: t.contiguous() for k, t in full.items()}, str(out / f"v{v}.safetensors"))
        pub.close()
    except SparsesyncError as e:
        print(f"rank {rank}: {type(e).__name__}: {e}", file=sys.stderr, flush=True)
        os._exit(3)  # a peer is gone: do not wait in process-group teardown
    dist.destroy_process_group()


def _ddp(args: dict, rank: int) -> None:
    """Replicated weights (DDP): a Publisher on rank 0 only ("rank0") or on every rank ("all")."""
    from sparsesync.protocol.writer.publisher import Publisher
    from tests.support.weights import make_state, train_step

    g = torch.Generator().manual_seed(7)
    state = make_state(0)
    pub = Publisher(args["url"], part_bytes=20_000) if args["ddp"] == "all" or rank == 0 else None
    for v in range(1, 4):
        if v > 1:
            state = train_step(state, g)
        if pub is not None:
            pub.publish(state, v)
            pub.flush()
    if pub is not None:
        pub.close()
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
