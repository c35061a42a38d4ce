"""The sparse patch file: one safetensors file taking a model from version B to version B+k.

This module holds what a patch is (`TensorEntry`, `PatchHeader`, `Patch`, the format's names
and constants) and how one is written; reading a patch, the side that faces untrusted bytes,
is `sparsesync.codec.patch_reader` (both re-exported by `sparsesync.codec`). Spec: docs/format.md.

Guarantee: `encode_changes` output is deterministic (same changes, same bytes) and is a plain
safetensors file any safetensors reader loads; `assemble_patch` refuses a digest that is not 16
lowercase hex digits and a base that does not match the changes.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Literal, get_args

import numpy as np
import torch

from sparsesync.codec import _container, _encodings, _groups, _parallel, _table, blocks_digest
from sparsesync.codec._container import Stream
from sparsesync.codec.diff import TensorChange, bits_view, np_uint_dtype, to_np_bits
from sparsesync.codec.digest import BLOCKS_ALGO, algo_of, all_blocks, is_digest
from sparsesync.codec.prepared_base import PreparedBase
from sparsesync.errors import PatchFormatError, PatchMismatchError

FORMAT_NAME = "sparsesync.patch"
# what the encoder writes for "xxh3b" digests (legacy "xxh3" runs: 4 when it groups small tensors, else 3; `format_for`)
FORMAT_VERSION = 5
# 1 differs from 2 only in its entropy coder; 3 moves the entries into a binary table; 4 adds groups; 5 is 4 with
# "xxh3b" digests (docs/format.md)
READABLE_VERSIONS = (1, 2, 3, 4, 5)
DIGEST_RE = re.compile(r"^[0-9a-f]{16}$")

# What an encoder favors when it has the base. "size" (the default): the smallest patches, with
# positions and values coded per class of the base's magnitude, which costs the encoder and every
# reader one more pass over each changed tensor (finding each change's rank in its class).
# "speed": no class-conditioned codings: at 0.6B and 1.6% density, patches 26-29% larger,
# diff+encode about 30% and decode about 50% faster (benchmarks/codec_bench.py --effort);
# the better trade where the link moves a patch's extra bytes faster than the passes take
# (above about 50 Mbit/s at that size). Readers need nothing: a patch says how it is coded.
Effort = Literal["size", "speed"]


def check_effort(effort: str) -> Effort:
    """`effort` if it is one of `Effort`'s values, else ValueError naming them."""
    for value in get_args(Effort):
        if effort == value:
            return value
    raise ValueError(f"effort={effort!r}, expected one of {list(get_args(Effort))}")


TABLE_KEY, STREAMS_KEY = "table", "streams"  # format 3's two safetensors tensors
GROUPS_KEY = "groups"  # formats 4 and 5: the third, between them (optional in 5)
GROUPED = "group"  # positions and values of a member of a group (its changes are coded by the group)


@dataclass(frozen=True)
class TensorEntry:
    """The header's record of one tensor the patch touches."""

    name: str
    dtype: str  # safetensors dtype name of the tensor ("BF16", "F16", "F32", "F8_E4M3", ...)
    shape: tuple[int, ...]
    n_changed: int  # elements whose bits differ between base and target
    positions: str  # position encoding ("raw_i32", "dense", ...; docs/format.md)
    values: str  # value encoding ("raw", "delta", ...)
    base_digest: str  # xxh3_64 hex of the tensor's bytes at the base version
    target_digest: str  # same at the target version
    position_params: dict[str, object] = field(default_factory=dict)
    value_params: dict[str, object] = field(default_factory=dict)
    streams: dict[str, str] = field(default_factory=dict)  # role -> safetensors key
    stream_sizes: dict[str, int] = field(default_factory=dict)  # role -> bytes in the file

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def n_values(self) -> int:
        """How many values the value streams hold: every element for `dense`, else n_changed."""
        return self.numel if self.positions == "dense" else self.n_changed

    @property
    def nbytes(self) -> int:
        return sum(self.stream_sizes.values())


@dataclass(frozen=True)
class Group:
    """Formats 4 and 5: touched small tensors coded as one flat tensor, their concatenation in `members` order."""

    coding: TensorEntry  # the concatenation's encodings and streams (named by the first member, 1-D)
    members: tuple[str, ...]
    offsets: np.ndarray  # int64: each member's start in the concatenation, then the total
    n_changed: np.ndarray  # int64 per member


@dataclass(frozen=True)
class PatchHeader:
    """Everything a patch says about itself; readable from the file's header alone."""

    format_version: int
    base_version: int
    target_version: int
    base_state_digest: str
    target_state_digest: str
    tensors: dict[str, TensorEntry]
    # format 3: file offset of the `streams` tensor (each tensor's streams follow in table order)
    streams_start: int = 0
    # formats 4 and 5: members are in `tensors` too (positions GROUPED), coded by their group
    groups: tuple[Group, ...] = ()

    def byte_ranges(self, names: list[str] | None = None) -> dict[str, tuple[int, int]]:
        """Format 3: the file's [start, end) holding all streams of each tensor of `names`
        (default: every touched tensor), from the header alone: a part of a version is read by
        range. Formats 1 and 2 place streams by size, not by tensor: ValueError."""
        if self.format_version < 3:
            raise ValueError(
                f"patch format {self.format_version} does not place each tensor's streams together; read the whole file"
            )
        out, off = {}, self.streams_start
        for name, e in self.tensors.items():
            if e.positions != GROUPED:
                out[name] = (off, off + e.nbytes)
                off += e.nbytes
        for g in self.groups:  # after the table's tensors; a member's range is its group's
            for m in g.members:
                out[m] = (off, off + g.coding.nbytes)
            off += g.coding.nbytes
        return out if names is None else {n: out[n] for n in names}


@dataclass(frozen=True)
class Patch:
    """A structurally valid patch file held in memory."""

    header: PatchHeader
    data: bytes
    _streams: dict[str, Stream]

    @property
    def nbytes(self) -> int:
        return len(self.data)

    def stream(self, name: str, role: str, entry: TensorEntry | None = None) -> bytes:
        """The raw bytes of one of tensor `name`'s streams (`entry`: a group's coding)."""
        s = self._streams[(entry or self.header.tensors[name]).streams[role]]
        return self.data[s.start : s.end]


def stream_key(name: str, role: str) -> str:
    """The safetensors key of a tensor's stream: '<tensor name>::<role>'."""
    return f"{name}::{role}"


def format_for(algo: str, grouped: bool = False) -> int:
    """The format version a writer writes for digests of `algo`: 5 for "xxh3b" (groups or not);
    for legacy "xxh3" 4 when the patch groups small tensors, else 3 (a run written before
    "xxh3b" keeps formats 3 and 4, which followers of its release read)."""
    if algo == BLOCKS_ALGO:
        return FORMAT_VERSION
    return 4 if grouped else 3


def has_groups(format_version: int, keys: Collection[str]) -> bool:
    """Whether a patch of `format_version` whose tensors are `keys` has a group section: always
    in format 4, optional in 5 (present iff there is a `groups` tensor), never before."""
    return format_version == 4 or (format_version >= 5 and GROUPS_KEY in keys)


def digest_prefix(format_version: int) -> str:
    """What precedes the 16 hex digits of the table's digests in patches of `format_version`."""
    return blocks_digest.PREFIX if format_version >= 5 else ""


def bare_hex(digest: str) -> str:
    """The 16 hex digits of a digest (the table stores them as a u64, the algorithm is the format's)."""
    return digest.removeprefix(blocks_digest.PREFIX)


def ctx_for(entry: TensorEntry, base_bits: Callable[[np.ndarray | None], np.ndarray] | None = None,
            format_version: int = FORMAT_VERSION) -> _encodings.Ctx:
    dtype = _container.ST_DTYPES[entry.dtype][0]
    return _encodings.Ctx(
        entry.name, entry.dtype, np_uint_dtype(dtype), entry.numel, entry.n_changed, base_bits, format_version
    )


# ---------------------------------------------------------------------------- writing
def _choose(
    change: TensorChange, ctx: _encodings.Ctx, base: torch.Tensor | PreparedBase | None, classes: bool
) -> tuple[str, dict, dict, str, dict, dict]:
    """Smallest (positions, values) encoding pair for one tensor's change."""
    from sparsesync.codec import _select

    base_full: np.ndarray | PreparedBase | None = None
    if isinstance(base, PreparedBase):
        if base.numel != change.numel:
            raise PatchMismatchError(f"tensor '{ctx.name}': prepared base of {base.numel} elements, expected "
                                     f"{change.numel}", hint="pass the base the changes were diffed against")
        base_full = base
    elif base is not None:
        if tuple(base.shape) != tuple(change.shape) or base.dtype != change.dtype:
            raise PatchMismatchError(
                f"tensor '{ctx.name}': base is {base.dtype} {tuple(base.shape)}, expected {change.dtype} "
                f"{change.shape}",
                hint="pass the base the changes were diffed against",
            )
        base_full = to_np_bits(bits_view(base))
    return _select.choose(change, ctx, base_full, classes=classes)


@dataclass
class EncodedTensor:
    """One tensor's chosen encodings and streams, before digests and versions are attached."""

    dtype: str
    shape: tuple[int, ...]
    n_changed: int
    positions: str
    position_params: dict
    values: str
    value_params: dict
    streams: dict[str, tuple[str, tuple[int, ...], bytes]]  # role -> (dtype, shape, bytes)


def encode_tensor(
    name: str, change: TensorChange, base: torch.Tensor | PreparedBase | None = None, *, effort: Effort = "size"
) -> EncodedTensor:
    """Encode one non-empty change (the smallest encodings; see `encode_changes`); `base`: the
    tensor the change was diffed against, if the encoder has it (or what the encoder reads of
    it, prepared on a device: `prepared_base`, the same bytes). `effort` (`Effort`): "speed"
    leaves out the codings conditioned on the base's magnitude classes."""
    st = _container.st_dtype_name(change.dtype)
    ctx = _encodings.Ctx(name, st, np_uint_dtype(change.dtype), change.numel, change.n_changed, None)
    pos, pparams, pstreams, val, vparams, vstreams = _choose(change, ctx, base, check_effort(effort) == "size")
    return EncodedTensor(
        st, tuple(change.shape), change.n_changed, pos, pparams, val, vparams, {**pstreams, **vstreams}
    )


def encode_tensors(changes: Mapping[str, TensorChange], *,
                   base: Mapping[str, torch.Tensor] | Mapping[str, PreparedBase] | None = None,
                   effort: Effort = "size") -> dict[str, EncodedTensor]:
    """Encode every non-empty change (`encode_tensor`). Tensors are encoded on the codec's
    thread pool; the result does not depend on it."""
    # biggest first keeps both threads busy to the end; the result is keyed by name (order-free)
    names = sorted((n for n in changes if changes[n].indices.size), key=lambda n: (-changes[n].numel, n))
    encoded = dict(
        zip(
            names,
            _parallel.map_ordered(
                lambda n: encode_tensor(n, changes[n], base.get(n) if base is not None else None, effort=effort),
                names,
                weights=[changes[n].numel for n in names],
            ),
        )
    )
    return {n: encoded[n] for n in sorted(encoded)}


def assemble_patch(
    encoded: Mapping[str, EncodedTensor],
    *,
    base_version: int,
    target_version: int,
    base_digests: Mapping[str, str],
    target_digests: Mapping[str, str],
    base_state_digest: str,
    target_state_digest: str,
    groups: Sequence[tuple[EncodedTensor, _groups.Members]] = (),
) -> bytes:
    """The patch file from encoded tensors plus versions and digests; `groups`: the encoded
    concatenation of each group's touched members and who they are. The version follows the
    digests (`format_for`): "xxh3b" digests give format 5, groups or not; "xxh3" ones give
    format 4 with groups, else format 3, which older readers read."""
    if not (type(base_version) is int and type(target_version) is int and 0 <= base_version < target_version):
        raise PatchFormatError(
            f"versions {base_version} -> {target_version}, expected 0 <= base < target",
            hint="pass the published version numbers",
        )
    member_names = [n for _, m in groups for n in m.names]
    touched = [*encoded, *member_names]
    need = set(touched)
    missing = sorted((need - base_digests.keys()) | (need - target_digests.keys()))
    if missing:
        raise PatchFormatError(
            f"no base/target digest for tensors {missing}", hint="pass digests for every tensor in changes"
        )
    # all "xxh3b" (checked in one pass, no Python per tensor), else each checked and named
    every = [base_state_digest, target_state_digest, *[base_digests[n] for n in touched],
             *[target_digests[n] for n in touched]]
    algos = {BLOCKS_ALGO} if all_blocks(every) else set()
    named = [] if algos else [
        ("base_state_digest", base_state_digest), ("target_state_digest", target_state_digest),
        *[(f"digest of '{n}'", dg) for n in touched for dg in (base_digests[n], target_digests[n])],
    ]
    for what, d in named:
        if not is_digest(d):
            raise PatchFormatError(f"{what} {d!r:.40}, expected 16 lowercase hex digits, optionally after 'xxh3b:'",
                                   hint="use codec.tensor_digest / codec.state_digest")
        algos.add(algo_of(d))
    if len(algos) > 1:
        raise PatchFormatError(
            f"the digests mix the algorithms {sorted(algos)}", hint="compute every digest of a patch with one algorithm"
        )
    fv = format_for(algos.pop(), bool(groups))
    if len(set(member_names)) != len(member_names) or set(member_names) & set(encoded):
        raise PatchFormatError("a tensor is in two groups, or in a group and coded alone", hint="code each tensor once")
    blobs: list[bytes] = []
    rows = [
        _row(name, encoded[name], bare_hex(base_digests[name]), bare_hex(target_digests[name]), blobs)
        for name in sorted(encoded)
    ]
    grows = [_row(m.names[0], e, _ZERO, _ZERO, blobs) for e, m in groups]
    meta = {
        "format": FORMAT_NAME,
        "format_version": str(fv),
        "base_version": str(base_version),
        "target_version": str(target_version),
        "base_state_digest": base_state_digest,
        "target_state_digest": target_state_digest,
    }
    table = _table.build_table(rows)
    tensors = [(TABLE_KEY, "U8", (len(table),), table)]
    if groups:  # digests as the table's (the format says the algorithm)
        section = _groups.build_section(grows, [m for _, m in groups], base_digests, target_digests)
        tensors.append((GROUPS_KEY, "U8", (len(section),), section))
    return _container.write_container(meta, [*tensors, (STREAMS_KEY, "U8", (sum(len(b) for b in blobs),), blobs)])


_ZERO = "0" * 16  # a group's own digests (unused: its members carry theirs)


def _row(name: str, e: EncodedTensor, base_digest: str, target_digest: str, blobs: list[bytes]) -> _table.Row:
    """The table record of one encoded tensor (models quantized as the coder does); its streams
    are appended to `blobs` in the data section's order."""
    pp, vp = e.position_params, e.value_params
    if e.positions == "gaps":  # the table carries the coder's quantized frequencies (format 3)
        pp = {
            "thresholds": pp["thresholds"],
            "classes": [{**c, "counts": _table.quantize(c["counts"])} for c in pp["classes"]],
        }
    if e.values == "delta":
        vp = {"thresholds": vp["thresholds"], "counts": [_table.quantize(c) for c in vp["counts"]]}
    explicit = _table.explicit_roles(e.positions, pp, e.values, vp)
    blobs += [e.streams[role][2] for role in _table.ROLE_ORDER if role in e.streams]
    return _table.Row(
        name,
        e.dtype,
        tuple(e.shape),
        e.n_changed,
        e.positions,
        pp,
        e.values,
        vp,
        base_digest,
        target_digest,
        {role: len(e.streams[role][2]) for role in explicit},
    )


def encode_changes(
    changes: Mapping[str, TensorChange],
    *,
    base_version: int,
    target_version: int,
    base_digests: Mapping[str, str],
    target_digests: Mapping[str, str],
    base_state_digest: str,
    target_state_digest: str,
    base: Mapping[str, torch.Tensor] | None = None,
) -> bytes:
    """The patch file's bytes for `changes` (from `diff_state` or `compose_changes`).

    `base_digests`/`target_digests` must name every tensor in `changes` (other names are
    ignored). Per tensor the smallest of the available encodings is chosen. With `base` (the
    state the changes were diffed against) positions and values can be coded conditioned on
    the base values, which is much smaller; without it only base-independent encodings are
    used (e.g. for changes coalesced with `compose_changes`).
    """
    return assemble_patch(
        encode_tensors(changes, base=base),
        base_version=base_version,
        target_version=target_version,
        base_digests=base_digests,
        target_digests=target_digests,
        base_state_digest=base_state_digest,
        target_state_digest=target_state_digest,
    )
