"""The groups of small tensors (format 4 under "xxh3" digests, 5 under "xxh3b"): bit-exact
against coding each tensor alone, hostile group sections refused with nothing applied, older
formats still read, anchors of a grouped snapshot."""

from __future__ import annotations

import json

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from safetensors.torch import load_file

from sparsesync.codec import (
    Snapshot,
    _container,
    _groups,
    _table,
    apply_patch,
    decode_patch,
    diff_state,
    encode_changes,
    read_patch,
    state_digest,
    tensor_digests,
)
from sparsesync.codec._flat_group import FlatGroup
from sparsesync.codec.anchor import write_anchor
from sparsesync.codec.patch import (
    FORMAT_NAME,
    GROUPS_KEY,
    STREAMS_KEY,
    TABLE_KEY,
    _row,
    assemble_patch,
    bare_hex,
    format_for,
)
from sparsesync.codec.patch_reader import fetch_header
from sparsesync.errors import DigestMismatchError, PatchFormatError, PatchMismatchError
from tests.support.patches import DTYPES, _clone, _rejects, assert_bit_equal, make_pair

SHAPES = [(0,), (1,), (3, 5), (64,), (16, 40), (2, 3, 4), (700,)]
ALGOS = ["xxh3", "xxh3b"]  # groups under both digests: formats 4 and 5


def _state(
    seed: int, spec: list[tuple[int, int, float, bool]]
) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """(base, target): tensor i of shape SHAPES[s], dtype DTYPES[d], `density` changed, with bf16/fp16 specials (NaN
    payloads, -0.0, inf)."""
    base, target = {}, {}
    for i, (s, d, density, special) in enumerate(spec):
        base[f"m.{i:02d}.w"], target[f"m.{i:02d}.w"] = make_pair(seed + i, DTYPES[d], SHAPES[s], density, special)
    return base, target


def _per_tensor(base: dict[str, torch.Tensor], target: dict[str, torch.Tensor], algo: str) -> bytes:
    """The patch each tensor coded alone (format 3, or 5 under "xxh3b"), the path groups must agree with."""
    changes = diff_state(base, target)
    bd, td = tensor_digests(base, algo), tensor_digests(target, algo)
    return encode_changes(changes, base_version=0, target_version=1, base_digests=bd, target_digests=td,
                          base_state_digest=state_digest(bd), target_state_digest=state_digest(td), base=base)


spec = st.lists(
    st.tuples(
        st.integers(0, len(SHAPES) - 1), st.integers(0, 2), st.sampled_from([0.0, 0.01, 0.3, 1.0]), st.booleans()
    ),
    min_size=1,
    max_size=12,
)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(spec=spec, seed=st.integers(0, 1000), effort=st.sampled_from(["size", "speed"]), algo=st.sampled_from(ALGOS))
def test_grouped_patch_applies_the_same_bits_as_coding_each_tensor_alone(spec, seed, effort, algo):
    base, target = _state(seed, spec)
    snap = Snapshot(base, 0, effort=effort, algo=algo)
    enc = snap.diff_encode(target, 1)
    patch = read_patch(enc.data)
    assert patch.header.format_version == ((4 if patch.header.groups else 3) if algo == "xxh3" else 5)
    alone = read_patch(_per_tensor(base, target, algo))
    assert patch.header.tensors.keys() == alone.header.tensors.keys()  # the same tensors touched, the same digests
    for n, e in alone.header.tensors.items():
        g = patch.header.tensors[n]
        assert (g.n_changed, g.base_digest, g.target_digest, g.shape, g.dtype) == (
            e.n_changed,
            e.base_digest,
            e.target_digest,
            e.shape,
            e.dtype,
        )
    ours, theirs = decode_patch(patch, _clone(base)), decode_patch(alone, _clone(base))
    for n in theirs:
        assert torch.equal(ours[n].indices, theirs[n].indices), n
        assert torch.equal(ours[n].values.view(torch.uint8), theirs[n].values.view(torch.uint8)), n
    work = _clone(base)
    apply_patch(patch, work)
    assert_bit_equal(work, target)
    assert_bit_equal(snap.state, target)
    assert snap.digests == tensor_digests(target, algo) and enc.target_state_digest == state_digest(
        tensor_digests(target, algo)
    )
    for n, ch in enc.changes.items():  # per tensor, in its own indices (what coalescing composes)
        assert ch.shape == tuple(target[n].shape) and torch.equal(torch.from_numpy(ch.indices), theirs[n].indices)


@pytest.mark.parametrize("algo", ALGOS)
def test_some_members_touched_and_one_member_touched(algo):
    base = {f"s{i}": make_pair(i, torch.bfloat16, (32, 48), 0.0)[0] for i in range(6)}
    some = {k: (make_pair(7, torch.bfloat16, (32, 48), 0.2)[1] if k in ("s1", "s4") else v) for k, v in base.items()}
    some["s1"] = base["s1"].clone()
    some["s1"].view(-1)[::7] = 0.5
    snap = Snapshot(base, 0, algo=algo)
    p = read_patch(snap.diff_encode(some, 1).data)
    assert [g.members for g in p.header.groups] == [("s1", "s4")] and p.header.format_version == format_for(algo, True)
    # members carry their algorithm
    assert all(e.base_digest.startswith("xxh3b:") == (algo == "xxh3b") for e in p.header.tensors.values())
    work = _clone(base)
    apply_patch(p, work)
    assert_bit_equal(work, some)
    one = dict(some)
    one["s2"] = some["s2"].clone()
    one["s2"].view(-1)[5] = 1.0
    p = read_patch(snap.diff_encode(one, 2).data)
    # one touched member: coded alone (xxh3: format 3, readable by older followers)
    assert p.header.format_version == format_for(algo) and not p.header.groups and list(p.header.tensors) == ["s2"]
    apply_patch(p, work)
    assert_bit_equal(work, one)


def test_plan_groups_is_deterministic_and_by_dtype_and_size():
    layouts = {
        "a": (torch.bfloat16, 10),
        "b": (torch.float32, 10),
        "c": (torch.bfloat16, _groups.SMALL_NUMEL + 1),
        "d": (torch.bfloat16, 0),
        "e": (torch.bfloat16, 5),
        "f": (torch.float32, 3),
        "g": (torch.float16, 4),
    }
    assert _groups.plan_groups(layouts) == [["a", "e"], ["b", "f"]]
    per = _groups.GROUP_NUMEL // _groups.SMALL_NUMEL
    many = {f"t{i:03d}": (torch.bfloat16, _groups.SMALL_NUMEL) for i in range(2 * per + 1)}
    assert [len(g) for g in _groups.plan_groups(many)] == [per, per]  # the last would be a group of one


def test_anchor_of_a_grouped_snapshot(tmp_path):
    base = {f"s{i}": make_pair(i, torch.bfloat16, (8, 8), 0.0)[0] for i in range(3)}
    snap = Snapshot(base, 0)
    # views of one flat tensor
    assert snap.state["s0"].untyped_storage().data_ptr() == snap.state["s1"].untyped_storage().data_ptr()
    files = write_anchor(snap.state, tmp_path, version=0)
    assert_bit_equal(load_file(str(files[0])), base)


# ---------------------------------------------------------------------------- hostile group sections
def _group_parts(algo: str = "xxh3") -> tuple[dict, dict, object, _groups.Members, dict, dict]:
    base = {f"s{i}": make_pair(i, torch.bfloat16, (16, 24), 0.0)[0] for i in range(4)}
    target = {k: make_pair(20 + i, torch.bfloat16, (16, 24), 0.0)[0] for i, k in enumerate(base)}
    for i, k in enumerate(base):
        target[k] = base[k].clone()
        target[k].view(-1)[i :: 5 + i] = -0.0
    fg = FlatGroup(sorted(base), [base[n].clone() for n in sorted(base)])
    done = fg.diff_encode(target, "size", 1 << 20, algo=algo)
    return base, target, done.group[0], done.group[1], tensor_digests(base, algo), tensor_digests(target, algo)


def _bare(digests: dict[str, str]) -> dict[str, str]:
    """The 16 hex digits of each digest, as the group section stores them."""
    return {n: bare_hex(d) for n, d in digests.items()}


def _forge(
    enc, members: _groups.Members, bd: dict, td: dict, *, section: bytes | None = None, table_rows: list | None = None
) -> bytes:
    """A file of one group, format 4 or 5 by the digests' algorithm (`section`: the compressed
    group section as given)."""
    blobs: list[bytes] = []
    rows = []
    for name, e in (table_rows or []):
        rows.append(_row(name, e, bare_hex(bd[name]), bare_hex(td[name]), blobs))
    grow = _row(members.names[0], enc, "0" * 16, "0" * 16, blobs)
    section = _groups.build_section([grow], [members], _bare(bd), _bare(td)) if section is None else section
    table = _table.build_table(rows)
    fv = format_for("xxh3b" if next(iter(bd.values())).startswith("xxh3b:") else "xxh3", True)
    meta = {"format": FORMAT_NAME, "format_version": str(fv), "base_version": "0", "target_version": "1",
            "base_state_digest": state_digest(bd), "target_state_digest": state_digest(td)}
    return _container.write_container(
        meta,
        [
            (TABLE_KEY, "U8", (len(table),), table),
            (GROUPS_KEY, "U8", (len(section),), section),
            (STREAMS_KEY, "U8", (sum(len(b) for b in blobs),), blobs),
        ],
    )


@pytest.mark.parametrize("algo", ALGOS)
def test_forged_group_file_is_the_writers_file(algo):
    base, target, enc, m, bd, td = _group_parts(algo)
    data = _forge(enc, m, bd, td)
    assert data == assemble_patch(
        {},
        base_version=0,
        target_version=1,
        base_digests=bd,
        target_digests=td,
        base_state_digest=state_digest(bd),
        target_state_digest=state_digest(td),
        groups=[(enc, m)],
    )
    work = _clone(base)
    apply_patch(read_patch(data), work)
    assert_bit_equal(work, target)


@pytest.mark.parametrize("algo", ALGOS)
def test_reject_group_member_counts_that_do_not_match_the_decoded_changes(algo):
    base, _, enc, m, bd, td = _group_parts(algo)
    moved = _groups.Members(m.names, m.shapes, [m.n_changed[0] + 1, m.n_changed[1] - 1, *m.n_changed[2:]])  # same sum
    _rejects(
        _forge(enc, moved, bd, td),
        _clone(base),
        PatchFormatError,
        "group 's0': member 's0' decodes to",
        "the group section says",
    )


@pytest.mark.parametrize("algo", ALGOS)
def test_reject_group_members_whose_sizes_do_not_add_up(algo):
    base, _, enc, m, bd, td = _group_parts(algo)
    for shapes, needle in (([(16, 25), *m.shapes[1:]], "members hold 1552 elements, the group's coding 1536"),
                           # same sum, wrong shape: the tensors say so
                           ([(24, 16), *m.shapes[1:]], "tensor 's0': shape [16, 24], expected [24, 16]")):
        exc = PatchFormatError if "members hold" in needle else PatchMismatchError
        _rejects(_forge(enc, _groups.Members(m.names, shapes, m.n_changed), bd, td), _clone(base), exc, needle)
    _rejects(
        _forge(enc, _groups.Members(m.names, m.shapes, [0, *m.n_changed[1:]]), bd, td),
        _clone(base),
        PatchFormatError,
        "members' n_changed",
    )


@pytest.mark.parametrize("algo", ALGOS)
def test_reject_group_members_twice(algo):
    base, _, enc, m, bd, td = _group_parts(algo)
    twice = _groups.Members(["s0", "s1", "s1", "s3"], m.shapes, m.n_changed)
    _rejects(_forge(enc, twice, bd, td), _clone(base), PatchFormatError, "members ['s1'] appear twice")


@pytest.mark.parametrize("algo", ALGOS)
def test_reject_group_members_unsorted_or_also_in_the_table(algo):
    base, _, enc, m, bd, td = _group_parts(algo)
    swapped = _groups.Members(["s0", "s2", "s1", "s3"], m.shapes, m.n_changed)
    _rejects(_forge(enc, swapped, bd, td), _clone(base), PatchFormatError, "members not sorted")
    # a member also coded alone in the table
    alone = diff_state({"s3": base["s3"]}, {"s3": torch.zeros_like(base["s3"])})
    from sparsesync.codec.patch import encode_tensor
    e3 = encode_tensor("s3", alone["s3"], base["s3"])
    _rejects(
        _forge(enc, m, bd, {**td, "s3": td["s3"]}, table_rows=[("s3", e3)]),
        _clone(base),
        PatchFormatError,
        "members ['s3'] appear twice",
    )


@pytest.mark.parametrize("algo", ALGOS)
def test_reject_truncated_or_damaged_group_section(algo):
    base, _, enc, m, bd, td = _group_parts(algo)
    grow = _row(m.names[0], enc, "0" * 16, "0" * 16, [])
    raw = _table.inflate(_groups.build_section([grow], [m], _bare(bd), _bare(td)))
    for cut, needle in (
        (len(raw) - 3, "ends inside member target digests"),
        (len(_table.table_bytes([grow])) + 2, "declares 4 members, but"),
    ):
        _rejects(
            _forge(enc, m, bd, td, section=_table.compress(raw[:cut])),
            _clone(base),
            PatchFormatError,
            "patch group section",
            needle,
        )
    _rejects(
        _forge(enc, m, bd, td, section=_table.compress(raw + b"\0")),
        _clone(base),
        PatchFormatError,
        "1 bytes left after the last field",
    )
    _rejects(_forge(enc, m, bd, td, section=b"not zstd"), _clone(base), PatchFormatError, "not a zstd frame")


@pytest.mark.parametrize("algo", ALGOS)
def test_reject_group_of_the_wrong_dtype_or_with_damaged_streams(algo):
    base, _, enc, m, bd, td = _group_parts(algo)
    data = _forge(enc, m, bd, td)
    half = {k: v.to(torch.float16) for k, v in base.items()}
    _rejects(data, half, PatchMismatchError, "tensor 's0': dtype F16, expected BF16")
    p = read_patch(data)
    s = next(iter(p._streams.values()))
    bad = bytearray(data)
    bad[s.start + 40] ^= 0xFF  # inside the group's first stream (gaps or raw positions)
    _rejects(bytes(bad), _clone(base), (PatchFormatError, DigestMismatchError, PatchMismatchError))
    wrong = _clone(base)
    wrong["s2"].view(-1)[3] = 7.0  # one member is not at the base: its digest says so, nothing written
    _rejects(data, wrong, (PatchMismatchError, DigestMismatchError))


@pytest.mark.parametrize("algo", ALGOS)
def test_group_stream_ranges_and_header_by_range(algo):
    base, target, enc, m, bd, td = _group_parts(algo)
    data = _forge(enc, m, bd, td)
    h = fetch_header(lambda start, length: data[start : start + length])
    assert [g.members for g in h.groups] == [tuple(m.names)] and h.tensors["s1"].positions == "group"
    assert set(h.byte_ranges().values()) == {(h.streams_start, len(data))}
    meta = json.loads(data[8 : 8 + int.from_bytes(data[:8], "little")])
    assert list(k for k in meta if k != "__metadata__") == [TABLE_KEY, GROUPS_KEY, STREAMS_KEY]


def _golden_grouped(algo: str) -> bytes:
    base = {
        "a": torch.tensor([1.0, -2.0, 0.5, 0.0, 3.0, -0.0, 8.0, 0.25], dtype=torch.bfloat16),
        "b": torch.tensor([[0.5, 1.5], [2.5, -4.0]], dtype=torch.bfloat16),
    }
    target = {
        "a": torch.tensor([1.0, -2.0, 0.75, -0.0, 3.0, -0.0, 8.0, 0.25], dtype=torch.bfloat16),
        "b": torch.tensor([[0.5, 1.5], [2.5, 4.0]], dtype=torch.bfloat16),
    }
    return Snapshot(base, 7, algo=algo).diff_encode(target, 8).data


@pytest.mark.parametrize(
    ("algo", "version", "golden"), [("xxh3", 4, "24601af05b6d3258"), ("xxh3b", 5, "5bfd953113cd2579")]
)
def test_golden_bytes_pin_formats_4_and_5(algo, version, golden):
    import xxhash

    data = _golden_grouped(algo)
    assert read_patch(data).header.format_version == version
    # docs/format.md, "Groups": a change of these bytes is a format change
    assert xxhash.xxh3_64_hexdigest(data) == golden, xxhash.xxh3_64_hexdigest(data)


def test_format_5_differs_from_format_4_only_in_its_digests():
    v4, v5 = (read_patch(_golden_grouped(a)) for a in ALGOS)
    assert v4.header.groups and len(v4.header.groups) == len(v5.header.groups)
    for a, b in zip(v4.header.groups, v5.header.groups):
        assert (a.members, a.n_changed.tolist()) == (b.members, b.n_changed.tolist())
    assert {k: (s.end - s.start) for k, s in v4._streams.items()} == {
        k: (s.end - s.start) for k, s in v5._streams.items()
    }
    for n, e in v5.header.tensors.items():
        assert e.base_digest.startswith("xxh3b:") and not v4.header.tensors[n].base_digest.startswith("xxh3b:")


@pytest.mark.parametrize("bad", ["0123456789abcdef", "xxh3b:0123456789ABCDEF", "xxh3b:0123"])
def test_assemble_patch_checks_every_members_digest(bad):
    """A group member's digest of another algorithm, or no digest at all, is refused and named,
    though the state digests pass (the members' digests are checked in one pass with them)."""
    _, _, enc, m, bd, td = _group_parts("xxh3b")
    with pytest.raises(PatchFormatError, match="mix the algorithms" if bad[:1] == "0" else f"digest of '{m.names[1]}'"):
        assemble_patch({}, base_version=0, target_version=1, base_digests=bd, target_digests={**td, m.names[1]: bad},
                       base_state_digest=state_digest(bd), target_state_digest=state_digest(td), groups=[(enc, m)])
