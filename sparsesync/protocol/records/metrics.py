"""A commit's `metrics` field, typed: what kind of version it is and what publishing it measured.

The record keeps `metrics` as the JSON object it carries on the wire (`CommitRecord.metrics`, and
`Publisher.metrics` the same dicts), so every byte written and every key a caller reads stay as
they were. Readers that need a field read it through `CommitMetrics.of(metrics)` instead of
`.get("kind")`, so the kinds are one `Literal` a type checker knows.

Guarantees: `CommitMetrics.of` never raises and never guesses. `kind` is one of `KINDS` or
None (absent, or a text this release does not write: docs/protocol.md says only that `kind` is
a string, so `kind_text` keeps the text as written, for display). A field is its value from the
record when it has the field's type (numbers: the record parser already checked them finite,
`CommitRecord.from_json`), else None: a hostile record's odd value reads as absent, never as
another type.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal, get_args

CommitKind = Literal["anchor", "delta", "delta+anchor", "rewind"]
"""anchor: a whole-state anchor alone; delta: a patch from `base_version`; delta+anchor: both;
rewind: the commit that rewinds the run to its version (docs/protocol.md, "Rewinds")."""
KINDS: tuple[CommitKind, ...] = get_args(CommitKind)


def _number(m: Mapping[str, Any], key: str) -> float | None:
    v = m.get(key)
    return v if isinstance(v, int | float) and not isinstance(v, bool) else None


def _ints(m: Mapping[str, Any], key: str) -> list[int] | None:
    v = m.get(key)
    return list(v) if isinstance(v, list) and all(type(x) is int for x in v) else None


@dataclass(frozen=True)
class CommitMetrics:
    """The typed view of one commit's `metrics` (see module docstring); None: absent or ill-typed."""

    kind: CommitKind | None
    kind_text: str | None
    """The `kind` text as the record has it (None: absent); equals `kind` for every kind in `KINDS`."""
    n_changed: float | None = None
    n_params: float | None = None
    density: float | None = None
    patch_bytes: float | None = None
    anchor_bytes: float | None = None
    diff_s: float | None = None
    encode_s: float | None = None
    upload_s: float | None = None
    coalesced: list[int] | None = None
    """The versions one delta stands for when uploads lagged (`writer.uploads`)."""
    rewind_from: int | None = None
    """A rewind: the newest version it abandoned."""
    rewind_from_epoch: int | None = None
    abandoned: list[int] | None = None
    """A rewind: the versions it abandoned, as its writer listed them."""

    @property
    def is_rewind(self) -> bool:
        return self.kind == "rewind"

    @classmethod
    def of(cls, metrics: Mapping[str, Any]) -> CommitMetrics:
        """The typed view of a `metrics` dict (a record's, or `Publisher.metrics[i]`); never raises."""
        text = metrics.get("kind")
        text = text if isinstance(text, str) else None
        kind: CommitKind | None = next((k for k in KINDS if k == text), None)
        rewind_from, from_epoch = metrics.get("rewind_from"), metrics.get("rewind_from_epoch")
        return cls(
            kind=kind, kind_text=text,
            n_changed=_number(metrics, "n_changed"), n_params=_number(metrics, "n_params"),
            density=_number(metrics, "density"), patch_bytes=_number(metrics, "patch_bytes"),
            anchor_bytes=_number(metrics, "anchor_bytes"), diff_s=_number(metrics, "diff_s"),
            encode_s=_number(metrics, "encode_s"), upload_s=_number(metrics, "upload_s"),
            coalesced=_ints(metrics, "coalesced"),
            rewind_from=rewind_from if type(rewind_from) is int else None,
            rewind_from_epoch=from_epoch if type(from_epoch) is int else None,
            abandoned=_ints(metrics, "abandoned"),
        )
