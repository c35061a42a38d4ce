"""The members of a group section read in one native call (`_native.section_members`, issue 51):
the same names, shapes and errors as reading them field by field in Python (the reader it
replaced, kept here as the reference), for valid sections and for thousands of truncated and
damaged ones; and the members' element counts saturate instead of overflowing."""

from __future__ import annotations

import math

import numpy as np
import pytest

from sparsesync.codec import _groups, _native, _table
from sparsesync.errors import PatchFormatError


def _reference(raw: bytes, total: int) -> tuple[list[str], list[tuple[int, ...]], int]:
    """The names and shapes of `total` members at the start of `raw`, field by field (the Python
    reader `parse_section` had before the native call), and where they end."""
    rd = _table.Reader(raw, "patch group section", 5)
    names, prev = [], b""
    for i in range(total):
        shared = rd.varint(f"member {i}: shared prefix length", len(prev))
        nb = prev[:shared] + rd.take(rd.varint(f"member {i}: suffix length", _table.MAX_NAME_BYTES), f"member {i}")
        if not nb or len(nb) > _table.MAX_NAME_BYTES:
            raise rd.bad(f"member {i} has {len(nb)} bytes, expected 1..{_table.MAX_NAME_BYTES}")
        try:
            names.append(nb.decode("utf-8"))
        except UnicodeDecodeError:
            raise rd.bad(f"member {i} is not UTF-8") from None
        prev = nb
    shapes = []
    for name in names:
        nd = rd.byte(f"member '{name}': ndim")
        if nd > 16:
            raise rd.bad(f"member '{name}': {nd} dims, expected at most 16")
        shapes.append(tuple(rd.varints(f"member '{name}': dim", nd, 1 << 48)) if nd else ())
    return names, shapes, rd.pos


def _native_read(raw: bytes, total: int) -> tuple[list[str], list[tuple[int, ...]], int]:
    rd = _table.Reader(raw, "patch group section", 5)
    names, shapes, _ = _groups._members(rd, total)
    return names, shapes, rd.pos


def _outcome(fn, raw: bytes, total: int) -> object:
    try:
        return fn(raw, total)
    except PatchFormatError as e:
        return str(e)


def _blob(rng: np.random.Generator, total: int) -> bytes:
    """`total` members' names (sorted, with shared prefixes and non-ASCII) and shapes, as written."""
    stems = ["model.layers.", "model.layers.1", "lm_head", "é.x", "a"]
    names = sorted({rng.choice(stems) + "".join(rng.choice(list("ab.0ü"), size=rng.integers(1, 6)))
                    for _ in range(total)})
    out = bytearray()
    _groups._put_names(out, names)
    for _ in names:
        nd = int(rng.integers(0, 4))
        out.append(nd)
        for _ in range(nd):
            _table._varint(out, int(rng.choice([0, 1, 7, 127, 128, 300, 1 << 20])))
    return bytes(out), len(names)


def test_section_members_read_what_the_python_reader_read():
    rng = np.random.default_rng(0)
    for _ in range(200):
        raw, n = _blob(rng, int(rng.integers(1, 12)))
        assert _native_read(raw, n) == _reference(raw, n)
        assert _native_read(raw + b"\0\0", n) == _reference(raw + b"\0\0", n)  # stops after the last field


def test_section_members_refuse_damaged_sections_as_the_python_reader_did():
    rng = np.random.default_rng(1)
    seen = set()
    for _ in range(3000):
        raw, n = _blob(rng, int(rng.integers(1, 8)))
        bad = bytearray(raw[: int(rng.integers(0, len(raw) + 1))])  # truncated, then some bytes damaged
        for _ in range(int(rng.integers(0, 3))):
            if bad:
                bad[int(rng.integers(0, len(bad)))] = int(rng.choice([0x80, 0xFF, 0x00, 0xC3, 17, 200]))
        try:
            want = _outcome(_reference, bytes(bad), n)
        except ValueError:  # more varints asked than bytes left: parse_section's size check refuses it first
            continue
        assert _outcome(_native_read, bytes(bad), n) == want, bytes(bad)
        if isinstance(want, str):
            seen.add(want.split(":")[1].split("(")[0].strip()[:30])
    assert len(seen) > 10  # many kinds of damage were tried


@pytest.mark.parametrize("raw, needle", [
    (b"\x00\x04ab\xff\xfe", "member 0 is not UTF-8"),
    (b"\x00\x00", "member 0 has 0 bytes"),
    (b"\x00\x01a\x11", "member 'a': 17 dims, expected at most 16"),
    (b"\x00\x01a\x01\x80\x00", "member 'a': dim is 0 (overlong varint)"),
    (b"\x00\x01a\x01" + b"\xff" * 9, "member 'a': dim: varint longer than 9 bytes"),
    (b"\x00\x01a\x01\x80\x80\x80\x80\x80\x80\x80\x01", "member 'a': dim is over 281474976710656"),
    (b"\x02\x01a", "member 0: shared prefix length is over 0"),
    (b"\x00\x05ab", "ends inside member 0 (5 bytes needed at byte 2, 2 left)"),
])
def test_section_members_name_the_member_and_the_field(raw, needle):
    with pytest.raises(PatchFormatError, match=needle.replace("(", r"\(").replace(")", r"\)")):
        _native_read(raw, 1)
    assert _outcome(_reference, raw, 1) == _outcome(_native_read, raw, 1)


def test_section_members_saturate_huge_element_counts():
    out = bytearray(b"\x00\x01a\x04")
    for _ in range(4):
        _table._varint(out, 1 << 48)
    names, shapes, numels, *_ = _native.section_members(bytes(out), 0, 1, 64, 16, 1 << 48)
    assert shapes == [(1 << 48,) * 4] and numels == [1 << 62] and math.prod(shapes[0]) > 1 << 62
    _, _, numels, *_ = _native.section_members(b"\x00\x01a\x00", 0, 1, 64, 16, 1 << 48)
    assert numels == [1]  # no dims: one element
    _, _, numels, *_ = _native.section_members(b"\x00\x01a\x02\x00\x05", 0, 1, 64, 16, 1 << 48)
    assert numels == [0]
    with pytest.raises(ValueError, match="out of range"):
        _native.section_members(b"\x00", 2, 1, 64, 16, 1 << 48)
