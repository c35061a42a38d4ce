"""`sparsesync log`, `inspect`, `verify` and `gc`: looking at a run and keeping it tidy."""

from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import Annotated, Any

import typer
from rich import box
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from sparsesync.cli._console import CliConsole
from sparsesync.cli._errors import fail

console = CliConsole()


def _fmt_count(n: float) -> str:
    return f"{n / 1e6:.2f}M" if n >= 1e6 else f"{n / 1e3:.1f}k" if n >= 1e4 else str(n)


def _fmt_bytes(n: float | None) -> str:
    if n is None:
        return ""
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if abs(n) < 1000 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return ""


def _secs(x: Any) -> str:
    return f"{x:.3f}" if isinstance(x, int | float) else ""


def log(
    url: Annotated[str, typer.Argument(help="Run URL.")],
    as_json: Annotated[bool, typer.Option("--json/--no-json", help="Print one JSON object per version.")] = False,
) -> None:
    """List the committed versions of a run: kind, density, bytes and timings."""
    from sparsesync.protocol.history import log_rows, rewind_line
    from sparsesync.protocol.run import Run

    run = Run(url)
    rows = log_rows(run)
    _warn_rejected(run.rejected)
    if as_json:
        for r in rows:
            print(json.dumps(r.to_dict()))
        return
    if not rows:
        fail(f"no committed version under {url}", "check the URL, or publish with `sparsesync push`")
    for a in run.abandoned():  # one line per rewind: the versions of the older epoch it abandoned
        console.print(rewind_line(a), soft_wrap=True)
    title = escape(f"{url}: {len(rows)} committed version(s); diff, enc(ode), up(load) in seconds")
    t = Table(box=box.SIMPLE_HEAD, pad_edge=False, padding=(0, 1, 0, 0))  # compact: fits 80 columns
    for col in ("version", "base", "kind", "changed", "density", "patch", "anchor", "diff", "enc", "up"):
        t.add_column(col, justify="right" if col not in ("kind",) else "left", no_wrap=True)
    for r in rows:
        m = r.metrics
        t.add_row(
            str(r.version), "" if r.base_version is None else str(r.base_version), escape(m.kind_text or ""),
            "" if m.n_changed is None else _fmt_count(m.n_changed),
            "" if m.density is None else f"{m.density:.3%}",
            _fmt_bytes(r.patch_bytes), _fmt_bytes(r.anchor_bytes),
            _secs(m.diff_s), _secs(m.encode_s), _secs(m.upload_s),
        )
    console.print_table(t, title)


def _warn_rejected(rejected: dict[str, str]) -> None:
    """One stderr line per commit-named object that is not a commit record (readers skip it)."""
    for key, reason in sorted(rejected.items()):
        Console(stderr=True, highlight=False).print(f"skipped {key}: not a commit record: {reason}",
                                                    markup=False, soft_wrap=True)


def inspect(
    target: Annotated[
        str, typer.Argument(help="A local patch file, the URL of one in a store, or a run URL with --version.")
    ],
    version: Annotated[
        int | None,
        typer.Option(
            help="TARGET is a run URL: show the delta of this committed version (the number `push --step` gave it)."
        ),
    ] = None,
    as_json: Annotated[bool, typer.Option("--json/--no-json", help="Print the header as JSON.")] = False,
) -> None:
    """Show a patch's header (versions, digests, per-tensor encodings) without reading its body."""
    from sparsesync.codec import fetch_header
    from sparsesync.store import open_store

    if version is not None:
        from sparsesync.protocol.run import Run

        run = Run(target)
        refs = run.commit(version).delta_objects()
        if not refs:
            fail(f"version {version} of {run.url} is an anchor alone: it has no delta to inspect",
                 f"`sparsesync log {target}` lists the versions with a delta")
        for ref in refs:  # a version in parts: one header per part
            _show_header(fetch_header(functools.partial(run.store.get_range, ref.key)), as_json)
        return
    if Path(target).exists():
        if not Path(target).is_file():  # a FIFO or a device would hang or never end
            fail(f"{target} is not a regular file", "name a patch file (.safetensors)")
        with open(target, "rb") as f:
            header = fetch_header(lambda start, length: (f.seek(start), f.read(length))[1])
    else:
        root, _, key = target.rpartition("/")
        store = open_store(root)
        header = fetch_header(lambda start, length: store.get_range(key, start, length))
    _show_header(header, as_json)


def _show_header(header: Any, as_json: bool) -> None:
    if as_json:
        from dataclasses import asdict

        console.print_json(json.dumps(asdict(header), default=str))
        return
    title = (f"patch format {header.format_version}: version {header.base_version} -> {header.target_version}\n"
             f"base state {header.base_state_digest}  target state {header.target_state_digest}")
    t = Table()
    for col in ("tensor", "dtype", "shape", "changed", "positions", "values", "base digest", "target digest"):
        t.add_column(col)
    for name, e in header.tensors.items():
        t.add_row(escape(name), str(e.dtype), "x".join(map(str, e.shape)), f"{e.n_changed:,}", e.positions,
                  e.values, e.base_digest, e.target_digest)
    console.print_table(t, title)


def verify(
    url: Annotated[str, typer.Argument(help="Run URL.")],
    as_json: Annotated[bool, typer.Option("--json/--no-json", help="Print the result as JSON.")] = False,
) -> None:
    """Check that every committed version reconstructs and matches its digests."""
    from sparsesync.protocol.verify import verify_run

    report = verify_run(url)
    if as_json:
        console.print_json(json.dumps(report.to_dict()))
    else:
        for key, reason in sorted(report.rejected.items()):
            console.print(f"[red]NOT A COMMIT[/] {escape(key)}: {escape(reason)}")
        for v in report.versions:
            mark = "[green]ok[/]" if v.ok else f"[red]FAILED[/] {escape(v.error or '')}"
            console.print(f"version {v.version} ({v.how}): {mark}")
        console.print(f"{sum(v.ok for v in report.versions)}/{len(report.versions)} versions verified")
    if not report.ok:
        raise typer.Exit(1)


def gc(
    url: Annotated[str, typer.Argument(help="Run URL.")],
    keep_anchors: Annotated[int, typer.Option(help="How many of the newest usable anchors to keep.")] = 1,
    dry_run: Annotated[
        bool, typer.Option("--dry-run/--no-dry-run", help="Print what would be deleted; delete nothing.")
    ] = False,
    as_json: Annotated[bool, typer.Option("--json/--no-json", help="Print the plan as JSON.")] = False,
) -> None:
    """Delete old versions and garbage, never what the newest version's chain needs.

    Kept: the newest committed version and every version from the oldest kept anchor on (the
    newest --keep-anchors anchors from which a chain of deltas reaches the newest version), with
    their deltas and checkpoint files, and any object newer than the newest commit (a writer may
    be uploading it). Deleted: commit records of fenced writers, older versions' commits, and
    objects no kept commit references. Nothing is deleted when the newest version could not be
    rebuilt from what would be kept."""
    from dataclasses import asdict

    from sparsesync.protocol.gc import apply_gc, plan_gc
    from sparsesync.store import open_store

    store = open_store(url)
    plan = plan_gc(store, keep_anchors=keep_anchors)
    if as_json:
        console.print_json(json.dumps({**asdict(plan), "dry_run": dry_run}))
    else:
        n = len(plan.invalid_commits) + len(plan.old_commits) + len(plan.objects)
        console.print(
            f"{'would delete' if dry_run else 'deleting'} {n} object(s), {_fmt_bytes(plan.bytes_freed)}; "
            f"keeping versions {plan.oldest_kept_version}..{plan.newest_version}"
        )
        for key in plan.invalid_commits + plan.old_commits + plan.objects:
            console.print(f"  {key}")
    if not dry_run and not plan.empty:
        apply_gc(store, plan)
