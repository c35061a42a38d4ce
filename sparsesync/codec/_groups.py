"""Small tensors coded together (the group section of formats 4 and 5; spec: docs/format.md, "Groups").

A LoRA adapter is hundreds of small tensors; coding each on its own costs more (a table row,
entropy models, Python calls on both sides) than its changed elements. Formats 4 and 5 code the
touched tensors of a group, each of at most SMALL_NUMEL elements and all of one dtype, as ONE
flat tensor, their concatenation in name order: one positions/values coding (a format-3 table
record, named by the group's first member), one run of streams. The group section lists every
member with its shape, its count of changed elements and its base and target digests, so each
member is still checked on its own.

Guarantees: `plan_groups` is deterministic (the same names, dtypes and sizes give the same
groups). `parse_groups` either returns groups whose members are unique, sorted inside their
group, in none of the table's rows, whose element counts sum to their group's, and whose changed
counts are each at least 1 and sum to their group's, or raises PatchFormatError naming the
field; it allocates nothing beyond the section's inflated size (capped) and a few objects per
member.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from itertools import chain

import numpy as np

from sparsesync.codec import _native, _table, blocks_digest
from sparsesync.errors import PatchFormatError  # noqa: F401 - what parse_section raises (through _table.Reader)

SMALL_NUMEL = 1 << 17  # tensors of at most this many elements are grouped (256 KiB of bf16)
# a group holds at most this many elements (2 MiB of bf16): groups encode in parallel, and this bounds a
# task's temporaries; each group costs its own coding, tables and Python calls (2^18 gave a 10M-parameter
# adapter 40 groups and twice the encode and apply time of 2^20's ten; 2^21's five were no faster and
# took 30 MB more at 50% changed)
GROUP_NUMEL = 1 << 20
MAX_MEMBERS = 1 << 20  # members a reader accepts in one patch


def plan_groups(layouts: Mapping[str, tuple[object, int]]) -> list[list[str]]:
    """The groups of `layouts` ({name: (dtype, numel)}): the names of each dtype's tensors of
    1..SMALL_NUMEL elements in sorted order, cut greedily before a group would pass GROUP_NUMEL.
    Groups of one tensor are left out (nothing to share). Ordered by first member."""
    by_dtype: dict[object, list[str]] = {}
    for name in sorted(layouts):
        dtype, numel = layouts[name]
        if 0 < numel <= SMALL_NUMEL:
            by_dtype.setdefault(dtype, []).append(name)
    groups = []
    for names in by_dtype.values():
        cur: list[str] = []
        size = 0
        for n in names:
            numel = layouts[n][1]
            if cur and size + numel > GROUP_NUMEL:
                groups.append(cur)
                cur, size = [], 0
            cur.append(n)
            size += numel
        groups.append(cur)
    return sorted((g for g in groups if len(g) > 1), key=lambda g: g[0])


@dataclass
class Members:
    """The writer's record of one group's touched members (in concatenation order)."""

    names: list[str]
    shapes: list[tuple[int, ...]]
    n_changed: list[int]


def _shared_prefix(a: bytes, b: bytes) -> int:
    """The length of the longest common prefix of `a` and `b` (a binary search over slice
    comparisons: a few C compares, not a Python step per byte)."""
    lo, hi = 0, min(len(a), len(b))
    if a[:hi] == b[:hi]:
        return hi
    while hi - lo > 1:  # a[:lo] == b[:lo], a[:hi] != b[:hi]
        mid = (lo + hi) // 2
        if a[:mid] == b[:mid]:
            lo = mid
        else:
            hi = mid
    return lo


def _put_names(out: bytearray, names: Sequence[str]) -> None:
    prev = b""
    for name in names:
        nb = name.encode("utf-8")
        shared = _shared_prefix(nb, prev)
        _table._varint(out, shared)
        _table._varint(out, len(nb) - shared)
        out += nb[shared:]
        prev = nb


def build_section(
    rows: list[_table.Row], members: list[Members], base_digests: Mapping[str, str], target_digests: Mapping[str, str]
) -> bytes:
    """The zstd-compressed group section: the groups' coding records (a format-3 table of
    `rows`, each named by its first member), then the members of every group (`*_digests`: 16
    hex digits each, the table's; a "xxh3b:" prefix is left out, as the format version says the
    algorithm). A version's hundreds of members cost no Python each: the names and shapes of the
    same members come from a cache, counts and digests are written in bulk."""
    out = bytearray(_table.table_bytes(rows))
    _native.varints_put(out, [len(m.names) for m in members], len(members))
    names = list(chain.from_iterable(m.names for m in members))
    out += _layout_bytes(tuple(names), tuple(chain.from_iterable(m.shapes for m in members)))
    counts = list(chain.from_iterable(m.n_changed for m in members))
    _native.varints_put(out, counts, len(counts))
    for digests in (base_digests, target_digests):
        hexes = "".join([digests[n] for n in names]).replace(blocks_digest.PREFIX, "")
        if len(hexes) != 16 * len(names):
            raise ValueError(f"member digests hold {len(hexes)} hex digits, expected 16 for each of {len(names)}")
        out += np.frombuffer(bytes.fromhex(hexes), dtype=">u8").astype("<u8").tobytes()  # each stored little-endian
    return _table.compress(bytes(out))


@functools.lru_cache(maxsize=16)
def _layout_bytes(names: tuple[str, ...], shapes: tuple[tuple[int, ...], ...]) -> bytes:
    """The section's member names (each sharing a prefix with the one before) and shapes (ndim
    as a byte, then the dims): the same for every version that touches the same members."""
    out = bytearray()
    _put_names(out, names)
    if all(len(s) < 0x80 for s in shapes):  # an ndim below 0x80 is its own varint: one call for all
        flat = [x for s in shapes for x in (len(s), *s)]
        _native.varints_put(out, flat, len(flat))
        return bytes(out)
    for shape in shapes:
        out.append(len(shape))
        for d in shape:
            _table._varint(out, d)
    return bytes(out)


@dataclass(frozen=True)
class ParsedGroup:
    """One group as the section states it (checked against itself and the table's names)."""

    row: _table.Row  # the coding of the concatenation, named by the first member
    names: tuple[str, ...]
    shapes: tuple[tuple[int, ...], ...]
    offsets: np.ndarray  # int64: where each member starts in the concatenation, then the total
    n_changed: np.ndarray  # int64 per member
    base_digests: tuple[str, ...]
    target_digests: tuple[str, ...]


def _hex(digests: bytes) -> tuple[str, ...]:
    """Each stored digest (8 bytes, little-endian) as its 16 hex digits."""
    return tuple([f"{x:016x}" for x in np.frombuffer(digests, dtype="<u8").tolist()])


def parse_section(raw: bytes, table_names: set[str], fmt: int = 4) -> list[ParsedGroup]:
    """The groups of an inflated group section of a patch of format `fmt` (see the module
    docstring for the checks; digests come back as the section stores them, bare hex)."""
    rd = _table.Reader(raw, "patch group section", fmt)
    _bad = rd.bad
    rows = _table.read_rows(rd)
    counts = [rd.varint(f"group '{r.name}': member count", MAX_MEMBERS) for r in rows]
    total = sum(counts)
    # each member takes at least 18 bytes (name 2, ndim 1, count 1, digests 16)
    if total > MAX_MEMBERS or total * 18 > len(raw):
        raise _bad(f"declares {total} members, but {len(raw)} bytes hold at most {len(raw) // 18}")
    names, shapes, numels = _members(rd, total)
    changed = rd.varints("member n_changed", total, 1 << 48) if total else []
    base = _hex(rd.take(8 * total, "member base digests"))
    target = _hex(rd.take(8 * total, "member target digests"))
    if rd.pos != len(raw):
        raise _bad(f"{len(raw) - rd.pos} bytes left after the last field")
    if len(set(names)) != total or table_names.intersection(names):
        dup = sorted(set(n for n in names if names.count(n) > 1) | table_names.intersection(names))[:3]
        raise _bad(
            f"members {dup} appear twice (in two groups, or in a group and the table); each tensor must be coded once"
        )
    out, start = [], 0
    for r, m in zip(rows, counts):
        where = f"group '{r.name}'"
        gn = names[start : start + m]
        if not m or gn[0] != r.name:
            raise _bad(
                f"{where}: first member {gn[0] if m else None!r:.80}, expected the group's name (a group has at least "
                "one member)"
            )
        if not all(map(str.__lt__, gn, gn[1:])):  # code point order is UTF-8 byte order
            raise _bad(f"{where}: members not sorted by name")
        if len(r.shape) != 1:
            raise _bad(f"{where}: shape {list(r.shape)}, expected one dimension (the members' concatenation)")
        gnumel = np.asarray(numels[start : start + m], dtype=np.int64)  # saturated at 2^62: fails below
        if int(gnumel.max()) > 1 << 48 or int(gnumel.sum()) != r.shape[0]:
            exact = sum(math.prod(s) for s in shapes[start : start + m])
            raise _bad(f"{where}: members hold {exact} elements, the group's coding {r.shape[0]}")
        ch = np.asarray(changed[start : start + m], dtype=np.int64)
        if int(ch.min()) < 1 or bool((ch > gnumel).any()) or int(ch.sum()) != r.n_changed:
            raise _bad(
                f"{where}: members' n_changed {ch[:8].tolist()}... (sum {int(ch.sum())}), expected each in [1, its "
                f"elements], summing to the group's {r.n_changed}"
            )
        offs = np.zeros(m + 1, dtype=np.int64)
        np.cumsum(gnumel, out=offs[1:])
        out.append(ParsedGroup(r, tuple(gn), tuple(shapes[start : start + m]), offs, ch,
                               base[start : start + m], target[start : start + m]))
        start += m
    return out


_FIELDS = ("shared prefix length", "suffix length", "name", "ndim", "dim")


def _members(rd: _table.Reader, total: int) -> tuple[list[str], list[tuple[int, ...]], list[int]]:
    """The names, shapes and element counts (saturated at 2^62) of the section's `total` members
    from `rd`'s position on (one native call); PatchFormatError naming the member and field."""
    names, shapes, numels, pos, status, i, field, v = _native.section_members(
        rd.data, rd.pos, total, _table.MAX_NAME_BYTES, 16, 1 << 48
    )
    if status:
        assert names is not None
        who = f"member '{names[i]}'" if field >= 3 else f"member {i}"
        what = who if field == 2 else f"{who}: {_FIELDS[field]}"
        # the bound of the field: the previous name's length, a name's, a dim's
        hi = [len(names[-1].encode()) if names else 0, _table.MAX_NAME_BYTES, 0, 0, 1 << 48][field]
        raise rd.bad({
            1: f"ends inside {what} (at byte {pos})" if field != 2 else f"ends inside {what} ({v} bytes needed at "
               f"byte {pos}, {len(rd.data) - pos} left)",
            2: f"{what} is {v} (overlong varint), expected at most {hi}",
            3: f"{what} is over {hi}, expected at most {hi}",
            4: f"{what}: varint longer than 9 bytes",
            5: f"member {i} has {v} bytes, expected 1..{_table.MAX_NAME_BYTES}",
            6: f"member {i} is not UTF-8",
            7: f"{who}: {v} dims, expected at most 16",
        }[status])
    assert names is not None and shapes is not None and numels is not None
    rd.pos = pos
    return names, shapes, numels
