"""`sparsesync demo`: the whole disaggregated RL job on this machine, in one command.

A thin wrapper over `trainer.demo.run_demo` (imported lazily so `sparsesync --help` stays fast), from
the checkout the library was installed from (`sparsesync.apps`: the wheel ships no app).
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer


def demo(
    steps: Annotated[int, typer.Option(help="Optimizer steps (one published weight version each).")] = 200,
    engine: Annotated[
        str, typer.Option(help="Replica engine: embedded (default) or vllm (when installed).")
    ] = "embedded",
    replicas: Annotated[int, typer.Option(help="Inference replicas to start.")] = 2,
    lr: Annotated[float, typer.Option(help="Learning rate.")] = 2e-3,
    seed: Annotated[int, typer.Option(help="Seed of the tiny model and the rollouts.")] = 0,
    workdir: Annotated[
        Path | None, typer.Option(help="Work folder (bucket, logs, metrics); default a temporary one.")
    ] = None,
    keep: Annotated[bool, typer.Option("--keep/--no-keep", help="Keep the temporary work folder.")] = False,
    min_reward_gain: Annotated[
        float, typer.Option(help="Fail unless the mean reward rises by at least this much.")
    ] = 0.25,
    progress: Annotated[bool, typer.Option("--progress/--no-progress", help="Show a progress bar.")] = True,
    json_out: Annotated[Path | None, typer.Option("--json", help="Also write the report as JSON to this file.")] = None,
    lora: Annotated[
        bool,
        typer.Option(
            "--lora/--no-lora",
            help="Train a LoRA adapter (r=8, every linear layer and the LM head) and ship adapter versions; default lr "
                 "2e-2.",
        ),
    ] = False,
) -> None:
    """Run a local async RL job: env server, inference replicas and trainer sharing weights only through a bucket
    folder."""
    from sparsesync.apps import import_app

    import_app("trainer")  # the checkout's trainer/ (the wheel ships no app): sparsesync.apps
    from trainer.demo import DemoOptions, run_demo

    if engine not in ("embedded", "vllm"):
        raise typer.BadParameter(f"engine {engine!r}: expected embedded or vllm", param_hint="--engine")
    if lora and lr == 2e-3:  # the full-weight default is too small for an adapter
        lr = 2e-2
    opts = DemoOptions(steps=steps, engine=engine, replicas=replicas, lr=lr, seed=seed, workdir=workdir, keep=keep,
                       min_reward_gain=min_reward_gain, progress=progress, lora=lora)
    report = run_demo(opts)
    if json_out is not None:
        json_out.write_text(report.to_json())
