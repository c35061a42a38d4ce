"""Adapter runs as the protocol sees them: what a commit's `adapter` field (`AdapterMeta`) means
to a publisher, a follower and a pull, checked against a run's commits (docs/protocol.md,
"Adapter runs").

Only what needs a run lives here. The adapter itself (the PEFT bridge, the config bounds,
`AdapterMeta`, the adapter state a publisher publishes) is `sparsesync.lora`, below the
protocol: this module calls down into it, never the reverse.

Guarantees:
- An adapter run and a full-weight run are never confused: a publisher refuses to add adapter
  versions to a full-weight run and the reverse, and to change the base, the configuration or
  the dtype of an adapter run (`check_publish`); a follower built for one kind refuses the
  other, and an adapter follower refuses versions of another base or configuration
  (`check_follow`); a pull refuses a run whose commits mix the two kinds or two adapters
  before anything is fetched (`check_one_kind`).
- `read_run_adapter` never raises on an unreadable run: None (a follower then refuses adapter
  versions by name).
"""

from __future__ import annotations

import json
from typing import Any

from sparsesync.errors import RunKindError, SparsesyncError
from sparsesync.lora.meta import AdapterMeta
from sparsesync.protocol.records import CommitRecord
from sparsesync.protocol.run import Run
from sparsesync.store import Store


# -- the writer side --------------------------------------------------------------------------
def check_publish(newest: CommitRecord | None, meta: AdapterMeta | None, url: str) -> None:
    """Refuse to publish `meta`'s kind of version into a run whose newest commit is of another
    kind, base or adapter configuration."""
    if newest is None:
        return
    have = newest.adapter
    if (have is None) != (meta is None):
        raise RunKindError(
            f"{url} is a {_kind(have)} run (version {newest.version}); this publisher writes a {_kind(meta)} run",
            hint="publish to a new run URL",
        )
    if have is not None and meta is not None and _identity(have) != _identity(meta):
        raise RunKindError(
            f"{url} carries an adapter of another {_what_differs(have, meta)} (version {newest.version})",
            hint="publish this adapter to a new run URL",
        )


def check_follow(rec: CommitRecord, expected: AdapterMeta | None, url: str) -> None:
    """Refuse a version of another kind (adapter vs full weights), base or adapter configuration
    than the engine following `url` was built for."""
    have = rec.adapter
    if (have is None) != (expected is None):
        fix = ("start the replica on the run's base model with the adapter engine (it reads the run's adapter config)"
               if have is not None else "follow it with a full-weight engine, not an adapter engine")
        raise RunKindError(
            f"version {rec.version} of {url} is a {_kind(have)} version; this replica serves a {_kind(expected)} run",
            hint=fix,
        )
    if have is not None and expected is not None and _identity(have) != _identity(expected):
        raise RunKindError(
            f"version {rec.version} of {url} carries an adapter of another {_what_differs(have, expected)}",
            hint="restart the replica: it builds its adapter from the run's newest version",
        )


def _identity(meta: AdapterMeta) -> tuple[str, dict[str, Any], str]:
    return meta.base_digest, meta.config, meta.dtype


def _kind(meta: AdapterMeta | None) -> str:
    return "full-weight" if meta is None else f"LoRA adapter (r={meta.rank})"


def _what_differs(a: AdapterMeta, b: AdapterMeta) -> str:
    """What `a` (the run's, the version's) has that `b` (the writer's, the replica's) has not, in a few words."""
    if a.base_digest != b.base_digest:
        return "base model"
    if a.config == b.config:
        return f"dtype ({a.dtype}, not {b.dtype})"
    diff = sorted(k for k in a.config.keys() | b.config.keys() if a.config.get(k) != b.config.get(k))
    shown = "; ".join(f"{k}={_json(a.config.get(k))}, not {_json(b.config.get(k))}" for k in diff[:3])
    return f"configuration (adapter_config.json: {shown}{'; ...' if len(diff) > 3 else ''})"


def _json(value: Any, limit: int = 80) -> str:
    text = json.dumps(value, sort_keys=True)  # control characters escaped: safe in one line
    return text if len(text) <= limit else text[:limit] + "..."



# -- the reader side --------------------------------------------------------------------------
def run_adapter(commits: list[CommitRecord]) -> AdapterMeta | None:
    """The adapter the newest of `commits` carries (None: a full-weight run, or no version yet)."""
    return commits[-1].adapter if commits else None


def read_run_adapter(url: str | Store) -> AdapterMeta | None:
    """The adapter of the run at `url` (a URL, or its open store) as its newest commit says; None
    for a full-weight run, and when no version can be read yet (a follower then refuses adapter
    versions by name)."""
    try:
        return run_adapter(Run(url).commits())
    except SparsesyncError:
        return None


# -- pull --------------------------------------------------------------------------------------
def check_one_kind(commits: list[CommitRecord], url: str) -> None:
    """RunKindError unless every commit of a run is of one kind (adapter or full weights) and,
    in an adapter run, of one adapter (base, configuration, dtype): a version rebuilt across
    kinds is neither a model nor an adapter."""
    adapter = [c.version for c in commits if c.adapter is not None]
    full = [c.version for c in commits if c.adapter is None]
    if adapter and full:
        raise RunKindError(f"{url} mixes adapter versions ({_versions(adapter)}) and full-weight versions "
                           f"({_versions(full)})",
                           hint="two publishers wrote this run: pull from a run of one kind, or delete the other "
                                "kind's commits")
    ids = {json.dumps(c.adapter.to_dict(), sort_keys=True): c.version for c in commits if c.adapter is not None}
    if len(ids) > 1:
        raise RunKindError(
            f"{url} holds versions of {len(ids)} different adapters (versions {_versions(list(ids.values()))} "
            "differ in base, adapter_config.json or dtype)",
            hint="two publishers wrote this run: pull from a run of one adapter",
        )


def _versions(vs: list[int]) -> str:
    return ", ".join(map(str, vs[:5])) + (f", ... {len(vs)} in all" if len(vs) > 5 else "")
