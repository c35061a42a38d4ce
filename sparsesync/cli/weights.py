"""`sparsesync push` and `sparsesync pull`: weight versions in and out of a run.

Each command is `sparsesync.transfer.push` / `pull` (the library functions: what they guarantee,
the atomic write of DEST, the version numbering and rewinds, is documented there) plus a spinner
on stderr and the one line (or JSON) it prints. A push that would rewind the run goes ahead only
with `--rewind` (or when confirmed at a prompt, on a terminal), after a line on stderr naming the
versions it abandons.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console
from rich.progress import Progress, SpinnerColumn, TaskID, TextColumn, TimeElapsedColumn

from sparsesync.cli._console import CliConsole

console = CliConsole()


class _Spinner:
    """The transient progress line on stderr, in a terminal only: appears at the first phase the library reports."""

    def __init__(self) -> None:
        self._progress: Progress | None = None
        self._task: TaskID | None = None

    def __call__(self, description: str) -> None:
        if self._progress is None:
            stderr = Console(stderr=True)
            if not stderr.is_terminal:  # a file or a pipe gets no progress lines (nor the newline a spinner leaves)
                return
            self._progress = Progress(SpinnerColumn(), TextColumn("{task.description}"), TimeElapsedColumn(),
                                      console=stderr, transient=True)
            self._progress.start()
            self._task = self._progress.add_task(description)
        else:
            assert self._task is not None
            self._progress.update(self._task, description=description)

    def __enter__(self) -> _Spinner:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop()

    def stop(self) -> None:
        """Take the line away (before a prompt or a printed line); the next phase brings it back."""
        if self._progress is not None:
            self._progress.stop()
            self._progress = None


def _rewind_gate(allowed: bool, spinner: _Spinner) -> Any:
    """`transfer.push`'s `rewind`: says on stderr what the rewind abandons before it is done; with
    `--rewind` goes ahead, on a terminal asks, else refuses (the library then fails naming the fix)."""

    def gate(plan: Any) -> bool:
        spinner.stop()
        if allowed:
            CliConsole(stderr=True).print(f"rewinding: {plan.describe()}", markup=False, soft_wrap=True)
            return True
        if sys.stdin.isatty():
            return typer.confirm(f"{plan.describe()}. Rewind?", default=False, err=True)
        return False

    return gate


def push(
    source: Annotated[
        Path, typer.Argument(help="A .safetensors file, a folder of safetensors shards, or a PEFT adapter folder.")
    ],
    url: Annotated[
        str, typer.Argument(help="Run URL: a folder, file://..., s3://bucket/prefix or hf://buckets/ns/name/prefix.")
    ],
    step: Annotated[
        int | None,
        typer.Option(
            help="Version number to publish, the number `pull --version` and `log` show "
            "(default: the checkpoint's step, from trainer_state.json's global_step or a "
            "checkpoint-N folder name; else newest + 1, 0 in a new run)."
        ),
    ] = None,
    anchor_every: Annotated[int, typer.Option(help="Write a full anchor every N versions.")] = 50,
    public: Annotated[
        bool, typer.Option("--public/--private", help="Create the bucket public (default private).")
    ] = False,
    as_json: Annotated[bool, typer.Option("--json/--no-json", help="Print the result as JSON.")] = False,
    base_model: Annotated[
        Path | None,
        typer.Option("--base", help="PEFT adapter SOURCE: the base model's folder (its digest is recorded)."),
    ] = None,
    effort: Annotated[
        str, typer.Option(help="size: the smallest patch; speed: about 27% larger, encoded and decoded faster.")
    ] = "size",
    rewind: Annotated[
        bool,
        typer.Option(
            "--rewind",
            help="Allow a version at or below the run's newest: the run rewinds and "
            "its newer versions are abandoned (named first). Without it a terminal asks; else refused.",
        ),
    ] = False,
) -> None:
    """Publish SOURCE as the next version of the run at URL (a delta, or an anchor when due).

    The version is the checkpoint's optimizer step (see --step). The folder's config, generation
    config and tokenizer files travel with it, so `pull` writes a folder that loads as is. A PEFT
    adapter folder (adapter_config.json + adapter_model.safetensors) makes an adapter run.
    Nothing outside SOURCE is read: a file linking out of it, or a FIFO, is refused.

    A version at or below the run's newest rewinds the run, abandoning the newer versions: only
    with --rewind (or confirmed at the prompt, on a terminal)."""
    from sparsesync import transfer
    from sparsesync.protocol.records import CommitMetrics

    with _Spinner() as spinner:
        result = transfer.push(source, url, step=step, step_source="--step", anchor_every=anchor_every, public=public,
                               base_model=base_model, effort=effort, progress=spinner,
                               rewind=_rewind_gate(rewind, spinner), rewind_source="--rewind")
    if result.held:
        console.print(
            f"version {result.version} of {result.url} already holds these weights (the newest); nothing pushed",
            soft_wrap=True,
        )
        return
    m = {**result.metrics, "step_from": result.step_from}
    if result.abandoned is not None:
        m["abandoned"] = result.abandoned
    if as_json:
        console.print_json(json.dumps({**m, "files": result.files}))
        return
    msg = (
        f"pushed version {result.version} ({CommitMetrics.of(m).kind}; version from {result.step_from}) to {result.url}"
    )
    if "n_changed" in m:
        msg += (
            f": {m['n_changed']:,} of {m['n_params']:,} elements changed ({m['density']:.3%}), {m['patch_bytes']:,} "
            "bytes"
        )
    if "anchor_bytes" in m:
        msg += f"; anchor {m['anchor_bytes']:,} bytes"
    if result.files:
        msg += f"; with {', '.join(result.files)}"
    if m.get("abandoned"):
        # each once (PushResult.abandoned)
        msg += f"; rewound: versions {m['abandoned']} of the older attempt abandoned"
    console.print(msg, soft_wrap=True)


def pull(
    url: Annotated[str, typer.Argument(help="Run URL.")],
    dest: Annotated[Path, typer.Argument(help="Output: a folder, or a path ending in .safetensors for one file.")],
    version: Annotated[
        int | None,
        typer.Option(
            help="Version to materialize: the number `push --step` gave it, as `log` "
            "lists them (default: the newest committed)."
        ),
    ] = None,
    as_json: Annotated[bool, typer.Option("--json/--no-json", help="Print the result as JSON.")] = False,
) -> None:
    """Materialize a committed version of the run at URL into DEST as safetensors, bit-exact
    (an adapter run: as a PEFT adapter folder), with the config and tokenizer files the run
    carries: `from_pretrained(DEST)` loads it.

    DEST is replaced atomically; in an existing folder, other *.safetensors files and indexes are removed."""
    from sparsesync import transfer
    from sparsesync.cli.run_info import _warn_rejected

    with _Spinner() as spinner:
        result = transfer.pull(url, dest, version=version, progress=spinner, on_rejected=_warn_rejected)
    if as_json:
        console.print_json(json.dumps({"version": result.version, "state_digest": result.state_digest,
                                       "files": [str(f) for f in result.files]}))
    else:
        extra = result.extra_files
        with_files = f", with {', '.join(extra)}" if extra and dest.suffix != ".safetensors" else ""
        console.print(
            f"pulled version {result.version} (state {result.state_digest}) into {dest}{with_files}", soft_wrap=True
        )
