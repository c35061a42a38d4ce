"""The device path (`codec.device_snapshot`) run on CPU tensors: the same torch code a GPU runs,
compared bit for bit with the C codec's path (a CPU `Snapshot`: its diff, its encoder given the
whole base, its groups of small tensors, its digests), and its device->host reads counted."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from sparsesync.codec import device_changes, read_patch
from sparsesync.codec._groups import SMALL_NUMEL
from sparsesync.codec.device_snapshot import DeviceSnapshot
from sparsesync.codec.diff import diff_state
from sparsesync.codec.digest import state_digest, tensor_digest
from sparsesync.codec.patch import assemble_patch, encode_tensors
from sparsesync.codec.prepared_base import PreparedBase
from sparsesync.codec.snapshot import Snapshot


def c_path_alone(base: dict[str, torch.Tensor], cur: dict[str, torch.Tensor], v0: int, v1: int,
                 effort: str = "size") -> bytes:
    """The patch the C codec makes with every tensor coded alone (no groups)."""
    changes = diff_state(base, cur)
    encoded = encode_tensors(changes, base=base, effort=effort)  # type: ignore[arg-type]
    bd = {n: tensor_digest(t) for n, t in base.items()}
    td = {n: tensor_digest(t) for n, t in cur.items()}
    return assemble_patch(encoded, base_version=v0, target_version=v1, base_digests=bd, target_digests=td,
                          base_state_digest=state_digest(bd), target_state_digest=state_digest(td))


def c_path(base: dict[str, torch.Tensor], cur: dict[str, torch.Tensor], v0: int, v1: int,
           effort: str = "size") -> tuple[bytes, dict[str, str]]:
    """The patch and target digests the C codec makes: a CPU `Snapshot` (host diff, encoder with
    the whole base, small tensors in groups)."""
    snap = Snapshot(base, v0, effort=effort)  # type: ignore[arg-type]
    enc = snap.diff_encode({k: v.contiguous() for k, v in cur.items()}, v1)  # contiguous: its grouping path
    return enc.data, enc.target_digests


def bits(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return t.view(dtype)


def edge_states() -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """A base and a target over the edge cases: NaN payloads, -0.0, subnormals, bf16/fp16/fp32,
    empty and one-element tensors, tensors ending at and just past a 64 KiB block, a change
    concentrated on large magnitudes (class thresholds), dense changes, a non-contiguous target."""
    g = torch.Generator().manual_seed(7)
    base = {
        "bf16": torch.randn(300, 700, generator=g).bfloat16(),
        "fp16": torch.randn(40000, generator=g).half(),
        "fp32": torch.randn(70001, generator=g),
        "block_exact": torch.randn(32768, generator=g).bfloat16(),  # exactly 64 KiB
        "block_past": torch.randn(32769, generator=g).bfloat16(),
        "one": torch.randn(1, generator=g).bfloat16(),
        "empty": torch.randn(0, generator=g),
        "dense": torch.randn(140000, generator=g).half(),  # not grouped: its full base is prepared
        "unchanged": torch.randn(9000, generator=g).bfloat16(),
        "classed": torch.randn(200000, generator=g).bfloat16(),
        "t": torch.randn(64, 96, generator=g).bfloat16(),
    }
    cur = {k: v.clone() for k, v in base.items()}
    b16 = cur["bf16"].view(-1).view(torch.int16)
    b16[::41] += 1
    b16[5] = 0x7FC1  # a NaN
    base["bf16"].view(-1).view(torch.int16)[6] = 0x7FC1
    b16[6] = 0x7FC2  # a NaN whose payload changed
    base["bf16"].view(-1).view(torch.int16)[7] = 0x7FC3
    b16[7] = 0x7FC3  # an unchanged NaN: no change
    base["fp16"][10] = 0.0
    cur["fp16"][10] = -0.0
    f32 = cur["fp32"].view(torch.int32)
    f32[::97] = 1  # subnormals
    f32[-1] ^= 1
    cur["block_exact"].view(torch.int16)[[0, 32767]] ^= 1
    cur["block_past"].view(torch.int16)[[32767, 32768]] ^= 1
    cur["one"].view(torch.int16)[0] ^= 0x10
    cur["dense"] += 1
    c = cur["classed"]
    big = base["classed"].float().abs() > 1.5
    c[big] = (c[big].float() * 1.01).bfloat16()
    tt = torch.randn(96, 64, generator=g).bfloat16()
    base["t"] = tt.t().contiguous()
    t2 = tt.clone()
    t2.view(torch.int16)[::5] ^= 1
    cur["t"] = t2.t()  # a non-contiguous view
    assert not cur["t"].is_contiguous()
    return base, cur


@pytest.mark.parametrize("grouped", [True, False])
@pytest.mark.parametrize("effort", ["size", "speed"])
def test_device_path_bytes_equal_the_c_path(effort, grouped, monkeypatch):
    """grouped=False: no tensor is kept on the host (`device_groups.MAX_BYTES`), so every edge
    case runs through the device code, against the C codec coding each tensor alone."""
    if not grouped:
        monkeypatch.setattr("sparsesync.codec.device_groups.MAX_BYTES", -1)
    base, cur = edge_states()
    snap = DeviceSnapshot(base, 0, effort=effort)
    assert snap.digests == {n: tensor_digest(t) for n, t in base.items()}
    assert bool(snap.small.names) == grouped
    ex = snap.extract(cur, 1)
    data, td = c_path(base, cur, 0, 1, effort)
    if not grouped:
        data = c_path_alone(base, cur, 0, 1, effort)
    assert ex.encode().data == data
    assert ex.target_digests == td
    assert "unchanged" not in ex.changes and "empty" not in ex.changes
    assert ex.changes["bf16"].indices.tolist().count(7) == 0  # an unchanged NaN is no change
    if effort == "size":  # the class-conditioned and the dense codings were prepared on the device
        assert ex.prepared["classed"].thresholds and ex.prepared["classed"].ranks is not None
        assert ex.prepared["dense"].full is not None
    for n in base:  # the snapshot advanced to the target, in place
        assert torch.equal(snap.state[n].view(torch.uint8), cur[n].contiguous().view(torch.uint8))
    # a second version from the advanced snapshot
    nxt = {k: v.contiguous().clone() for k, v in cur.items()}
    nxt["bf16"].view(-1).view(torch.int16)[1::53] -= 1
    ex2 = snap.extract(nxt, 2)
    cur_c = {k: v.contiguous() for k, v in cur.items()}
    assert ex2.encode().data == (c_path(cur_c, nxt, 1, 2, effort)[0] if grouped else
                                 c_path_alone(cur_c, nxt, 1, 2, effort))
    assert ex2.base_state_digest == ex.target_state_digest


@pytest.mark.parametrize("placement", ["device", "host"])
def test_reads_per_publish_do_not_grow_with_tensors(placement):
    g = torch.Generator().manual_seed(3)
    for n_tensors in (3, 40):
        # large tensors on the device path, as many small ones in groups (their bits ride in the first read)
        base = {f"w{i}": torch.randn(SMALL_NUMEL + 1 + 37 * i, generator=g).bfloat16() for i in range(n_tensors)}
        base.update({f"s{i}": torch.randn(500 + 37 * i, generator=g).bfloat16() for i in range(n_tensors)})
        cur = {k: v.clone() for k, v in base.items()}
        for v in cur.values():
            v.view(torch.int16)[::11] += 1
        snap = DeviceSnapshot(base, 0, placement=placement)
        before = device_changes.reads()
        ex = snap.extract(cur, 1)
        assert device_changes.reads() - before == 2, n_tensors  # counts and small bits, then the compact changes
        data = ex.encode().data
        assert data == c_path(base, cur, 0, 1)[0]
        assert sum(len(gr.members) for gr in read_patch(data).header.groups) == n_tensors


def versions_with_small_tensors() -> list[dict[str, torch.Tensor]]:
    """Five versions of a state with large bf16 tensors and groupable small ones of two dtypes
    (bf16, fp32: a LoRA adapter's shapes and norms), a lone small fp16 (no group: alone in its
    dtype), an empty one; each version touches them differently."""
    g = torch.Generator().manual_seed(11)
    s0 = {"big.a": torch.randn(SMALL_NUMEL + 5, generator=g).bfloat16(),
          "big.b": torch.randn(300, 500, generator=g).bfloat16(),
          "lone.fp16": torch.randn(77, generator=g).half(), "empty": torch.randn(0, generator=g).bfloat16()}
    for i in range(24):
        s0[f"layers.{i}.lora_A"] = torch.randn(16, 64 + i, generator=g).bfloat16()
        s0[f"layers.{i}.lora_B"] = torch.randn(96, 16, generator=g).bfloat16()
        s0[f"layers.{i}.norm"] = torch.randn(64 + 3 * i, generator=g)
    s0["layers.big_small"] = torch.randn(SMALL_NUMEL, generator=g).bfloat16()  # the largest grouped size
    out = [s0]

    def step(prev: dict[str, torch.Tensor], names: list[str], every: int) -> dict[str, torch.Tensor]:
        nxt = {k: v.clone() for k, v in prev.items()}
        for n in names:
            flat = nxt[n].view(-1)
            ints = flat.view(torch.int16 if flat.element_size() == 2 else torch.int32)
            ints[:: every] += 1
        return nxt

    small = [n for n in s0 if n.startswith("layers.")]
    out.append(step(out[-1], list(s0), 13))  # everything a little
    out.append(step(out[-1], ["layers.3.lora_B", "big.a"], 7))  # one member of a group: coded alone
    out.append(step(out[-1], ["big.b"], 5))  # no small tensor
    out.append(step(out[-1], small[::2] + ["lone.fp16"], 1))  # some members of each group, densely
    return out


@pytest.mark.parametrize("placement", ["device", "host"])
@pytest.mark.parametrize("effort", ["size", "speed"])
def test_grouped_small_tensors_bytes_equal_the_cpu_snapshot(placement, effort):
    """Over several versions the device path's patches are the CPU `Snapshot`'s byte for byte,
    groups of two dtypes included, and its snapshot and digests move as the CPU one's."""
    states = versions_with_small_tensors()
    dev = DeviceSnapshot(states[0], 0, placement=placement, effort=effort)
    cpu = Snapshot(states[0], 0, effort=effort)
    assert dev.digests == cpu.digests and dev.state_digest == cpu.state_digest
    grouped, dtypes = 0, set()
    for v, cur in enumerate(states[1:], start=1):
        ex = dev.extract(cur, v)
        enc = cpu.diff_encode(cur, v)
        data = ex.encode().data
        assert data == enc.data, v
        assert ex.target_digests == enc.target_digests and ex.target_state_digest == enc.target_state_digest
        assert {n: c.n_changed for n, c in ex.changes.items()} == {n: c.n_changed for n, c in enc.changes.items()}
        groups = read_patch(data).header.groups
        grouped += len(groups)
        dtypes |= {cur[gr.members[0]].dtype for gr in groups}
    assert grouped >= 4 and dtypes == {torch.bfloat16, torch.float32}  # both dtypes' groups, in two versions
    for n, t in states[-1].items():  # both halves of the snapshot hold the last version
        assert torch.equal(dev.state[n].reshape(-1).view(torch.uint8), t.reshape(-1).view(torch.uint8)), n


def test_a_failing_group_leaves_the_snapshot_as_it_was(monkeypatch):
    """All or nothing: a failure while the grouped tensors advance leaves both halves (device and
    host) and the digests as they were; the next version is then extracted from the old one."""
    from sparsesync.codec import device_groups

    states = versions_with_small_tensors()
    dev = DeviceSnapshot(states[0], 0)
    digests, sd = dict(dev.digests), dev.state_digest
    real = device_groups.diff_cpu_tensor
    calls = []

    def fails_late(base, target, **kw):  # the fault: the second group's (fp32) diff fails, the first (bf16) advanced
        calls.append(1)
        if len(calls) == 2:
            raise MemoryError("no memory for the diff")
        return real(base, target, **kw)

    monkeypatch.setattr(device_groups, "diff_cpu_tensor", fails_late)
    with pytest.raises(MemoryError):
        dev.extract(states[1], 1)
    monkeypatch.undo()
    assert dev.version == 0 and dev.digests == digests and dev.state_digest == sd
    for n, t in states[0].items():
        assert torch.equal(dev.state[n].reshape(-1).view(torch.uint8), t.reshape(-1).view(torch.uint8)), n
    ex = dev.extract(states[2], 2)
    assert ex.encode().data == c_path(states[0], states[2], 0, 2)[0]


def test_prepared_base_for_other_thresholds_is_refused():
    base, cur = edge_states()
    ex = DeviceSnapshot(base, 0).extract(cur, 1)
    p = ex.prepared["classed"]
    ex.prepared["classed"] = PreparedBase(p.numel, p.hist, [t + 1 for t in p.thresholds], p.ranks, p.full)
    with pytest.raises(ValueError, match="thresholds"):
        ex.encode()


def test_class_ranks_equal_the_c_pass():
    from sparsesync.codec._classes import class_ranks, class_sizes, key_counts

    g = torch.Generator().manual_seed(5)
    a = torch.randn(100003, generator=g).bfloat16()
    idx = torch.unique(torch.randint(0, a.numel(), (3000,), generator=g))
    thr = [60, 63, 64]
    host = a.view(torch.int16).numpy().view(np.uint16)
    sizes = class_sizes(key_counts(host[idx.numpy()]), thr)
    want = np.concatenate(class_ranks(host, thr, idx.numpy(), sizes))
    got = device_changes.class_ranks(a.view(torch.int16), thr, idx, sizes).numpy()
    assert np.array_equal(got, want)


def test_the_snapshot_goes_on_the_device_when_the_model_fits_twice():
    from sparsesync.codec.device_snapshot import placement_of

    gb = 1 << 30
    assert placement_of(14 * gb, 139 * gb) == "device"
    assert placement_of(14 * gb, 28 * gb) == "device"
    assert placement_of(14 * gb, 28 * gb - 1) == "host"
    assert placement_of(70 * gb, 100 * gb) == "host"


def test_batched_block_digests_equal_one_tensor_at_a_time():
    from sparsesync.codec.blocks_torch import block_digests_torch

    g = torch.Generator().manual_seed(9)
    ts = [torch.randn(n, generator=g).bfloat16() for n in (0, 1, 32768, 32769, 100000, 7, 300000)]
    ts.append(torch.randn(64, 96, generator=g).t())  # a non-contiguous view
    got = device_changes.block_digests_many(ts, batch_bytes=256 << 10)  # small batches: both branches run
    for t, d in zip(ts, got, strict=True):
        assert torch.equal(d, block_digests_torch(t)), t.shape
