"""`sparsesync status URL`: the newest committed version and what every replica serves, read
from the bucket alone (the replicas' heartbeats). The health rules and the report are the
library's (`sparsesync.protocol.fleet.fleet_report`, a `FleetReport`); this module prints it.

Exit status: 0 when the fleet is healthy; 3 when a threshold is crossed: fewer than
`--min-replicas` live replicas, a live replica more than `--max-lag` versions behind the newest
committed version or serving a version a rewind abandoned (`abandoned`), a live replica
"degraded" (its heartbeat's error says why: a refused commit names its key and reason), or a commit
name newer than the newest trusted version whose object is not a commit record (`refused`); 1 on
an error (no run, store unreachable).
With `--watch` the table refreshes until Ctrl-C, and the exit status is that of the last look.

Records are data: every string from the bucket (replica names, health, errors, engine, where,
skipped keys and reasons) is printed with its rich markup escaped and its control characters
replaced, so no record can change the table or send escape sequences to the terminal.
"""

from __future__ import annotations

import json
import time
from typing import TYPE_CHECKING, Annotated

import typer
from rich import box
from rich.console import Group
from rich.markup import escape
from rich.table import Table
from rich.text import Text

from sparsesync.cli._console import CliConsole

if TYPE_CHECKING:
    from sparsesync.protocol.fleet import FleetReport

console = CliConsole()
EXIT_UNHEALTHY = 3


def status(
    url: Annotated[str, typer.Argument(help="Run URL.")],
    as_json: Annotated[bool, typer.Option("--json/--no-json", help="Print the report as one JSON object.")] = False,
    watch: Annotated[
        bool, typer.Option("--watch/--no-watch", help="Refresh every --interval seconds until Ctrl-C.")
    ] = False,
    interval: Annotated[float, typer.Option(help="Seconds between refreshes with --watch.")] = 2.0,
    min_replicas: Annotated[int, typer.Option(help="Exit 3 when fewer live replicas report.")] = 1,
    max_lag: Annotated[int, typer.Option(help="Exit 3 when a live replica is more versions behind the newest.")] = 2,
    show_all: Annotated[
        bool, typer.Option("--all/--live", help="Also list replicas that stopped or aged out.")
    ] = False,
) -> None:
    """Show the run's newest version and every replica's version, lag, age and health."""
    from sparsesync.protocol.fleet import fleet_report
    from sparsesync.store import open_store

    store = open_store(url)
    if not watch:
        report = fleet_report(store, min_replicas=min_replicas, max_lag=max_lag)
        if as_json:
            print(json.dumps(report.to_dict()))
        else:
            console.print_table(_table(report, show_all=show_all), _title(report))
        if not report.ok:
            raise typer.Exit(EXIT_UNHEALTHY)
        return
    from rich.live import Live

    ok = True
    try:
        with Live(console=console, auto_refresh=False) as live:
            while True:
                last = fleet_report(store, min_replicas=min_replicas, max_lag=max_lag)
                ok = last.ok
                if as_json:
                    print(json.dumps(last.to_dict()), flush=True)
                else:
                    live.update(Group(Text.from_markup(_title(last)), _table(last, show_all=show_all)), refresh=True)
                time.sleep(interval)
    except KeyboardInterrupt:
        pass
    if not ok:
        raise typer.Exit(EXIT_UNHEALTHY)


def _title(report: FleetReport) -> str:
    """The line above the table (a line of its own: a long run URL is never broken)."""
    committed = report.newest_committed_at
    ago = "" if committed is None else f" (committed {report.read_at - committed:.0f} s ago)"
    return f"{_safe(report.url)}: newest version {report.newest_version}{ago}, {report.live} live replica(s)"


def _table(report: FleetReport, *, show_all: bool) -> Table:
    t = Table(box=box.SIMPLE_HEAD, pad_edge=False, padding=(0, 1, 0, 0))
    for col in ("replica", "version", "behind", "age", "health", "staged", "engine", "where", "pause"):
        t.add_column(col, justify="right" if col in ("version", "behind", "age", "staged", "pause") else "left",
                     no_wrap=col != "where")
    for row in report.replicas:
        live, r = row.seen.live, row.seen.record
        if not live and not show_all:
            continue
        health = r.health if live else ("stopped" if r.health == "stopped" else "gone (aged out)")
        if row.abandoned:
            health += " (abandoned version)"
        if live and r.retry_at is not None:
            health += f" (retry in {max(r.retry_at - report.read_at, 0.0):.0f}s)"
        style = "" if live and r.health == "following" else ("red" if live else "dim")
        where = " ".join(v for k, v in sorted(r.where.items()) if k != "host") or r.where.get("host", "")
        t.add_row(
            _safe(r.replica), _str(r.version), _str(row.behind), f"{row.seen.age_s:.1f}s", _safe(health),
            _str(r.staged_version), _safe(r.engine), _safe(where),
            "" if r.last_apply_s is None else f"{r.last_apply_s * 1000:.0f}ms", style=style,
        )
    caption = [f"[red]{_safe(p)}[/]" for p in report.problems]
    if report.skipped:
        caption.append(f"{len(report.skipped)} record(s) skipped: "
                       + "; ".join(f"{_safe(key)}: {_safe(why)}" for key, why in report.skipped[:3]))
    t.caption = "\n".join(caption) or None
    t.caption_justify = "left"
    return t


def _str(v: object) -> str:
    return "" if v is None else str(v)


def _safe(text: object) -> str:
    """A string from the bucket as table text: control characters replaced, markup escaped."""
    from sparsesync.protocol.records import clean_text

    return escape(clean_text(str(text)))
