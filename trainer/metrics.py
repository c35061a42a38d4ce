"""Per-step metrics: console (a rich progress bar plus a line per step), a JSONL file, trackio.

One record per optimizer step, flat `{key: number}` plus `step`:
`reward` (mean reward of the samples trained on), `reward_generated` (of the groups the
workers produced since the last step), `staleness_mean` / `staleness_max` (versions),
`sync_bytes` / `density` / `n_changed` (the newest committed version's patch), `version`,
`lag/<replica>` and `pause_s/<replica>` (the replicas' follower status), `samples_per_s`,
`tokens_per_s`, `loss`, `clip_frac`, `step_s`. Extra event records (`{"event": "commit", ...}`
for each committed weight version) go to the JSONL file only.

Guarantees: every record is strict JSON (NaN and infinities become null), written and flushed to the JSONL file before
`log_step` returns (a crashed run keeps every step it logged); trackio is used only when it is installed and a
project is configured, and a trackio failure never stops training (it is logged once and
trackio is switched off).
"""

from __future__ import annotations

import json
import logging
import math
import time
from pathlib import Path
from typing import Any, TextIO

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

log = logging.getLogger(__name__)


def read_jsonl(path: str | Path) -> list[dict[str, Any]]:
    """All records of a metrics file (step records and events)."""
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def step_records(path: str | Path) -> list[dict[str, Any]]:
    """Only the per-step records of a metrics file, in step order."""
    return [r for r in read_jsonl(path) if "step" in r and "event" not in r]


class MetricsLogger:
    """Writes step records to the console, a JSONL file and trackio (see module docstring)."""

    def __init__(
        self,
        *,
        total_steps: int,
        jsonl: str | Path | None = None,
        progress: bool = True,
        trackio_project: str = "",
        log_every: int = 1,
        config: dict[str, Any] | None = None,
        console: Console | None = None,
    ) -> None:
        self.total_steps = total_steps
        self.log_every = log_every
        self.console = console or Console(stderr=True, highlight=False)
        self._file: TextIO | None = None
        if jsonl:
            p = Path(jsonl)
            p.parent.mkdir(parents=True, exist_ok=True)
            self._file = p.open("a")
        self._trackio: Any = None
        if trackio_project:
            self._trackio = _init_trackio(trackio_project, config or {})
        self._progress: Progress | None = None
        self._task: Any = None
        if progress:
            self._progress = Progress(
                TextColumn("[bold]train"), BarColumn(), MofNCompleteColumn(), TextColumn("{task.description}"),
                TimeElapsedColumn(), TimeRemainingColumn(), console=self.console, transient=False,
            )
            self._progress.start()
            self._task = self._progress.add_task("waiting for rollouts", total=total_steps)
        self._t0 = time.time()

    def log_step(self, record: dict[str, Any]) -> None:
        """Record one optimizer step (`record["step"]` required)."""
        step = int(record["step"])
        rec = {"step": step, "time": time.time() - self._t0, **{k: v for k, v in record.items() if k != "step"}}
        self._write(rec)
        if self._trackio is not None:
            try:
                self._trackio.log({k: v for k, v in rec.items() if isinstance(v, (int, float))}, step=step)
            except Exception as e:  # noqa: BLE001 - metrics must never stop training
                log.warning("trackio.log failed (%s); trackio logging switched off", e)
                self._trackio = None
        summary = _summary(rec)
        if self._progress is not None:
            self._progress.update(self._task, completed=step, description=summary)
        if step % self.log_every == 0 or step == self.total_steps:
            self.console.print(f"step {step:>4}  {summary}")

    def log_event(self, event: str, record: dict[str, Any]) -> None:
        """An extra record for the JSONL file only (e.g. one per committed weight version)."""
        self._write({"event": event, "time": time.time() - self._t0, **record})

    def close(self) -> None:
        if self._progress is not None:
            self._progress.stop()
            self._progress = None
        if self._file is not None:
            self._file.close()
            self._file = None
        if self._trackio is not None:
            try:
                self._trackio.finish()
            except Exception:  # noqa: BLE001
                pass
            self._trackio = None

    def __enter__(self) -> MetricsLogger:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _write(self, rec: dict[str, Any]) -> None:
        if self._file is not None:
            clean = {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in rec.items()}
            self._file.write(json.dumps(clean, default=_jsonable, allow_nan=False) + "\n")
            self._file.flush()


def _summary(rec: dict[str, Any]) -> str:
    parts = []
    if "reward" in rec:
        parts.append(f"reward {rec['reward']:.3f}")
    if "staleness_max" in rec:
        parts.append(f"stale {rec['staleness_max']:.0f}")
    if rec.get("sync_bytes") is not None:
        parts.append(f"sync {_fmt_bytes(rec['sync_bytes'])} ({rec.get('density', 0.0):.1%} of elements changed)")
    lags = [v for k, v in rec.items() if k.startswith("lag/") and v is not None]
    if lags:
        parts.append(f"lag {max(lags):.0f}")
    if "samples_per_s" in rec:
        parts.append(f"{rec['samples_per_s']:.0f} smp/s")
    return "  ".join(parts)


def _fmt_bytes(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if abs(n) < 1000 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n:.1f} GB"


def _jsonable(v: Any) -> Any:
    if hasattr(v, "item"):
        return v.item()
    return str(v)


def _init_trackio(project: str, config: dict[str, Any]) -> Any:
    try:
        import trackio  # type: ignore[import-not-found]
    except ImportError:
        log.info("trackio is not installed; metrics go to the console and JSONL only")
        return None
    try:
        trackio.init(project=project, config=config)
    except Exception as e:  # noqa: BLE001
        log.warning("trackio.init failed (%s); trackio logging switched off", e)
        return None
    return trackio
