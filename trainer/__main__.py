"""`python -m trainer --config trainer.toml`: run the asynchronous GRPO trainer.

Validates the config first (exit status 2 with one line naming the bad key), then trains and
prints the final version and state digest. Under torchrun (`torchrun --nproc-per-node N -m
trainer --config trainer.toml`) each process is one rank of a sharded run (trainer/distributed.py);
rank 0 prints the result, and a rank that fails prints `rank R: error: ...` and exits 1 at once.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys

from sparsesync.errors import ConfigError, SparsesyncError


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m trainer", description=__doc__.splitlines()[0])
    ap.add_argument("--config", required=True, help="TOML config file (see trainer/config.py)")
    ap.add_argument("--steps", type=int, help="override [optim] steps")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    from trainer.config import TrainerConfig

    try:
        cfg = TrainerConfig.load(args.config)
        if args.steps is not None:
            cfg.optim.steps = args.steps
            cfg.validate()
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    from trainer.distributed import launched_distributed
    from trainer.train import AsyncGRPOTrainer

    try:
        result = AsyncGRPOTrainer(cfg).run()
    except SparsesyncError as e:
        distributed = launched_distributed()
        if distributed:  # torchrun's SIGTERM (a peer died too) must not cut this line short
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
        rank = f"rank {os.environ['RANK']}: " if distributed else ""
        print(f"{rank}error: {e}", file=sys.stderr, flush=True)
        if distributed:  # a peer may be gone: do not wait in the process group's teardown
            sys.stdout.flush()
            os._exit(1)
        return 1
    if result.world > 1:
        import torch.distributed as dist

        dist.destroy_process_group()
        if result.rank != 0:  # rank 0 reports for the job
            return 0
    first, last = result.steps[0]["reward"], result.steps[-1]["reward"]
    print(f"trained {len(result.steps)} steps: reward {first:.3f} -> {last:.3f}; published version "
          f"{result.final_version} (state digest {result.state_digest}) to {cfg.sync.bucket}")
    if result.commit_digest != result.state_digest:  # sharded: the record's digest is over row units
        print(f"commit record of version {result.final_version}: state digest {result.commit_digest} "
              f"(over the {result.world} ranks' row shards)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
