"""`sparsesync status URL`: the newest committed version and what every replica serves, read
from the bucket alone (the replicas' heartbeats, `sparsesync.protocol.fleet`).

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
from typing import Annotated, Any

import typer
from rich import box
from rich.console import Group
from rich.markup import escape
from rich.table import Table
from rich.text import Text

from sparsesync.cli._console import CliConsole

console = CliConsole()
EXIT_UNHEALTHY = 3


def status(
    url: Annotated[str, typer.Argument(help="Run URL.")],
    as_json: Annotated[bool, typer.Option("--json/--no-json", help="Print the report as one JSON object.")] = False,
    watch: Annotated[bool, typer.Option("--watch/--no-watch", help="Refresh every --interval seconds until Ctrl-C.")] = False,
    interval: Annotated[float, typer.Option(help="Seconds between refreshes with --watch.")] = 2.0,
    min_replicas: Annotated[int, typer.Option(help="Exit 3 when fewer live replicas report.")] = 1,
    max_lag: Annotated[int, typer.Option(help="Exit 3 when a live replica is more versions behind the newest.")] = 2,
    show_all: Annotated[bool, typer.Option("--all/--live", help="Also list replicas that stopped or aged out.")] = False,
) -> None:
    """Show the run's newest version and every replica's version, lag, age and health."""
    from sparsesync.store import open_store

    store = open_store(url)
    if not watch:
        report = fleet_report(store, min_replicas=min_replicas, max_lag=max_lag)
        _print(report, as_json=as_json, show_all=show_all)
        if not report["ok"]:
            raise typer.Exit(EXIT_UNHEALTHY)
        return
    from rich.live import Live

    last: dict[str, Any] = {"ok": True}
    try:
        with Live(console=console, auto_refresh=False) as live:
            while True:
                last = fleet_report(store, min_replicas=min_replicas, max_lag=max_lag)
                if as_json:
                    print(json.dumps(last), flush=True)
                else:
                    live.update(Group(Text.from_markup(_title(last)), _table(last, show_all=show_all)), refresh=True)
                time.sleep(interval)
    except KeyboardInterrupt:
        pass
    if not last["ok"]:
        raise typer.Exit(EXIT_UNHEALTHY)


def fleet_report(store: Any, *, min_replicas: int = 1, max_lag: int = 2) -> dict[str, Any]:
    """The run's newest committed version, every heartbeat, and the thresholds crossed."""
    from sparsesync.protocol.fleet import read_fleet
    from sparsesync.protocol.lineage import Lineage

    newest, refused = _newest_commit(store)
    view = read_fleet(store)
    lineage = Lineage(store)  # a replica still on a version a rewind abandoned (reads only those records)
    rows, problems = [], []
    newest_version = None if newest is None else newest.version
    for seen in sorted(view.replicas, key=lambda s: s.record.replica):
        r = seen.record
        behind = None if r.version is None or newest is None else max(newest.version - r.version, 0)
        abandoned = lineage.judge(r.version, r.state_digest) == "abandoned"
        rows.append({**seen.to_dict(), "behind": behind, "abandoned": abandoned})
        if not seen.live:
            continue
        if abandoned:
            problems.append(f"{r.replica} serves version {r.version} of an abandoned attempt (state {r.state_digest}); "
                            f"the run was rewound, newest is {newest_version}")
        elif r.version is None or (behind is not None and behind > max_lag):
            problems.append(f"{r.replica} serves version {r.version}, newest is {newest_version} (max lag {max_lag})")
        if r.health == "degraded":
            retry = "" if r.retry_at is None else f" (next attempt in {max(r.retry_at - view.read_at, 0.0):.0f} s)"
            problems.append(f"{r.replica} is degraded: {r.last_error}{retry}")
    n_live = sum(1 for s in view.replicas if s.live)
    if n_live < min_replicas:
        problems.insert(0, f"{n_live} live replica(s), fewer than {min_replicas}")
    problems[:0] = [f"commit {key} is not a commit record, every reader refuses it: {why} (newest trusted version: "
                    f"{'none' if newest is None else newest.version})" for key, why in refused]
    return {
        "url": store.url, "newest_version": newest_version, "newest_committed_at": newest and newest.created_at,
        "refused": [{"key": k, "reason": why} for k, why in refused],
        "read_at": view.read_at, "live": n_live, "replicas": rows,
        "skipped": [{"key": k, "reason": why} for k, why in view.skipped],
        "thresholds": {"min_replicas": min_replicas, "max_lag": max_lag},
        "problems": problems, "ok": not problems,
    }


def _newest_commit(store: Any) -> tuple[Any, list[tuple[str, str]]]:
    """The newest trusted commit record (None when every name's object is refused), and the names
    newer than it whose object is not a commit record, with the reason, newest first. Reads records
    from the newest name down (not all of them); names whose object is gone or not a commit record are
    passed over, as every reader does."""
    from sparsesync.errors import RunNotFoundError
    from sparsesync.protocol.keys import COMMITS, valid_commits
    from sparsesync.protocol.run import Run

    run = Run(store)  # reads only the records fencing and the newest names need
    refused: list[tuple[str, str]] = []
    for _v, _e, key in reversed(valid_commits([o.key for o in store.list(COMMITS)], run.is_commit)):
        if (rec := run.record(key)) is not None:
            return rec, refused
        if key in run.rejected:
            refused.append((key, run.rejected[key]))
    if refused:
        return None, refused
    raise RunNotFoundError(f"no committed version under {store.url}",
                           hint="check the URL, or publish a first version with `sparsesync push`")


def _print(report: dict[str, Any], *, as_json: bool, show_all: bool) -> None:
    if as_json:
        print(json.dumps(report))
    else:
        console.print_table(_table(report, show_all=show_all), _title(report))


def _title(report: dict[str, Any]) -> str:
    """The line above the table (a line of its own: a long run URL is never broken)."""
    committed = report["newest_committed_at"]
    ago = "" if committed is None else f" (committed {report['read_at'] - committed:.0f} s ago)"
    return f"{_safe(report['url'])}: newest version {report['newest_version']}{ago}, {report['live']} live replica(s)"


def _table(report: dict[str, Any], *, show_all: bool) -> Table:
    t = Table(box=box.SIMPLE_HEAD, pad_edge=False, padding=(0, 1, 0, 0))
    for col in ("replica", "version", "behind", "age", "health", "staged", "engine", "where", "pause"):
        t.add_column(col, justify="right" if col in ("version", "behind", "age", "staged", "pause") else "left",
                     no_wrap=col != "where")
    for r in report["replicas"]:
        if not r["live"] and not show_all:
            continue
        health = r["health"] if r["live"] else ("stopped" if r["health"] == "stopped" else "gone (aged out)")
        if r.get("abandoned"):
            health += " (abandoned version)"
        if r["live"] and r.get("retry_at") is not None:
            health += f" (retry in {max(r['retry_at'] - report['read_at'], 0.0):.0f}s)"
        style = "" if r["live"] and r["health"] == "following" else ("red" if r["live"] else "dim")
        where = " ".join(v for k, v in sorted(r["where"].items()) if k != "host") or r["where"].get("host", "")
        t.add_row(
            _safe(r["replica"]), _str(r["version"]), _str(r["behind"]), f"{r['age_s']:.1f}s", _safe(health),
            _str(r["staged_version"]), _safe(r["engine"]), _safe(where),
            "" if r["last_apply_s"] is None else f"{r['last_apply_s'] * 1000:.0f}ms", style=style,
        )
    caption = [f"[red]{_safe(p)}[/]" for p in report["problems"]]
    if report["skipped"]:
        caption.append(f"{len(report['skipped'])} record(s) skipped: "
                       + "; ".join(f"{_safe(s['key'])}: {_safe(s['reason'])}" for s in report["skipped"][:3]))
    t.caption = "\n".join(caption) or None
    t.caption_justify = "left"
    return t


def _str(v: object) -> str:
    return "" if v is None else str(v)


def _safe(text: object) -> str:
    """A string from the bucket as table text: control characters replaced, markup escaped."""
    from sparsesync.protocol.records import clean_text

    return escape(clean_text(str(text)))
