"""`verify_run`: check that every committed version of a run reconstructs bit-exactly.

Walks the versions oldest first, applying each delta to the state of its base (digests of
every touched tensor and of the whole state checked), and loading every anchor (each file's
bytes and each tensor's digest checked). Where a version has both, the two results must be
identical; every checkpoint file (config, tokenizer) must match its size and digest. Objects named like commit records
that are not commit records are reported (with the reason) and fail the run. Reads everything; writes nothing.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from sparsesync.errors import SparsesyncError
from sparsesync.protocol.run import Run, State


@dataclass
class VersionCheck:
    version: int
    how: str  # "anchor", "delta from N", "delta from N + anchor", "unreachable"
    ok: bool
    error: str | None = None


@dataclass
class VerifyReport:
    url: str
    versions: list[VersionCheck] = field(default_factory=list)
    rejected: dict[str, str] = field(default_factory=dict)  # commit-named objects that are not commits: reason

    @property
    def ok(self) -> bool:
        return bool(self.versions) and all(v.ok for v in self.versions) and not self.rejected

    def to_dict(self) -> dict:
        return {"url": self.url, "ok": self.ok, "versions": [asdict(v) for v in self.versions],
                "rejected": dict(self.rejected)}


def verify_run(url: str | Run) -> VerifyReport:
    """Check every committed version (see module docstring)."""
    run = url if isinstance(url, Run) else Run(url)
    report = VerifyReport(url=run.url)
    commits = run.commits()
    report.rejected = dict(run.rejected)
    state: State | None = None
    digests: dict[str, str] = {}
    held: int | None = None
    files_checked: dict[object, str | None] = {}
    for rec in commits:
        how: list[str] = []
        error = None
        if rec.has_delta and state is not None and held == rec.base_version:
            how.append(f"delta from {rec.base_version}" + (f" in {len(rec.parts)} parts" if rec.parts else ""))
            try:
                run.apply_delta(rec, state, digests)
                held = rec.version
            except SparsesyncError as e:
                error, state, held = f"delta: {e}", None, None
        if rec.has_anchor:
            how.append("anchor")
            try:
                anchor_state, anchor_digests = run.fetch_anchor(rec)
                if held == rec.version and anchor_digests != digests:
                    differ = sorted(k for k in anchor_digests.keys() | digests.keys()
                                    if anchor_digests.get(k) != digests.get(k))
                    error = f"anchor differs from the delta chain in {len(differ)} tensor(s), e.g. {differ[0]!r}"
                state, digests, held = anchor_state, anchor_digests, rec.version
            except SparsesyncError as e:
                error = (error + "; " if error else "") + f"anchor: {e}"
        for f in rec.files:  # the checkpoint files pull writes beside the weights (each object read once)
            if f not in files_checked:
                try:
                    run.fetch(f)
                    files_checked[f] = None
                except SparsesyncError as e:
                    files_checked[f] = f"file {f.name}: {e}"
            if files_checked[f]:
                error = (error + "; " if error else "") + str(files_checked[f])
        if not how:
            how.append("unreachable")
            error = error or f"no anchor and no delta from a reachable version (base {rec.base_version})"
        report.versions.append(VersionCheck(rec.version, " + ".join(how), error is None and held == rec.version, error))
    return report
