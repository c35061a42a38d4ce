"""The device apply (`codec.device_apply`), run on CPU tensors: the same torch operations a GPU
runs, bit-equal to the C path over the edge cases, all or nothing (a base mismatch, a target
mismatch and a failure while scattering each restore every bit), one transfer of the updates
and one read of the digests per patch."""

from __future__ import annotations

import pytest
import torch

from sparsesync.codec import apply_patch, diff_state, encode_changes, read_patch, state_digest, tensor_digests
from sparsesync.codec import device_apply as D
from sparsesync.codec.blocks_digest import BLOCK, n_blocks
from sparsesync.errors import DigestMismatchError, PatchMismatchError
from tests.support.patches import _case, _clone, _raw_patch, _span, assert_bit_equal, bits, make_pair


def _patch(base: dict[str, torch.Tensor], target: dict[str, torch.Tensor], algo: str = "xxh3b") -> bytes:
    bd, td = tensor_digests(base, algo), tensor_digests(target, algo)
    return encode_changes(
        diff_state(base, target), base_version=3, target_version=4, base_digests=bd, target_digests=td,
        base_state_digest=state_digest(bd), target_state_digest=state_digest(td), base=base,
    )


def _edge_state() -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """bf16/fp16/fp32 with NaN payloads and -0.0, a one-element tensor, an empty one, small ones
    (coded as a group), and tensors whose changes sit on both sides of 64 KiB block boundaries."""
    base, target = {}, {}
    for i, (dt, shape, dens) in enumerate([
        (torch.bfloat16, (64, 48), 0.05), (torch.float16, (33, 65), 0.3), (torch.float32, (40, 41), 0.02),
        (torch.bfloat16, (1,), 1.0), (torch.float32, (7,), 0.5), (torch.float16, (9, 3), 0.4),
    ]):
        base[f"t{i}"], target[f"t{i}"] = make_pair(100 + i, dt, shape, dens, special=True)
    base["empty"] = torch.empty(0, dtype=torch.bfloat16)
    target["empty"] = base["empty"].clone()
    nan = torch.tensor([0x7FC00001, 0x7F800001, 0xFFC12345 - (1 << 32), 0, -(1 << 31)], dtype=torch.int32)
    base["f32nan"] = torch.zeros(5, dtype=torch.int32).view(torch.float32)
    target["f32nan"] = nan.view(torch.float32)  # NaN payloads, +0.0 -> -0.0
    per = BLOCK // 2  # bf16 elements per 64 KiB block
    b, t = make_pair(7, torch.bfloat16, (3 * per + 17,), 0.001)
    tb = bits(t).reshape(-1)
    for at in (0, per - 1, per, 2 * per - 1, 2 * per, 3 * per + 16):  # both sides of each boundary, the last
        tb[at] = bits(b).reshape(-1)[at] ^ 0x5A5A
    base["blocks"], target["blocks"] = b, t
    b4, t4 = make_pair(8, torch.float32, (BLOCK // 4 + 1,), 0.01)
    bits(t4).reshape(-1)[BLOCK // 4 - 1 :] ^= 1  # the last element of block 0 and the lone element of block 1
    base["f32blocks"], target["f32blocks"] = b4, t4
    return base, target


def test_device_path_on_cpu_tensors_is_bit_equal_to_the_c_path_over_edge_cases():
    base, target = _edge_state()
    data = _patch(base, target)
    assert {"t3", "f32nan", "blocks", "f32blocks"} <= set(read_patch(data).header.tensors)
    c_path, device_path = _clone(base), _clone(base)
    want = apply_patch(read_patch(data), c_path)  # CPU tensors: the C write-and-hash pass
    got = D.apply_on_device(read_patch(data), device_path)
    assert_bit_equal(device_path, c_path)
    assert_bit_equal(device_path, target)
    assert list(got) == list(want)
    for n in want:
        assert torch.equal(got[n].indices, want[n].indices) and torch.equal(bits(got[n].values), bits(want[n].values))
    names = list(base)  # the digests on the device path, the empty tensor's included, are the C codec's
    assert D._digest_all(device_path, names) == tensor_digests({n: device_path[n] for n in names})


@pytest.mark.parametrize("verify,check_base", [(True, False), (False, True)])
def test_each_digest_check_alone_still_applies(verify, check_base):
    base, target = _case()
    work = _clone(base)
    D.apply_on_device(read_patch(_patch(base, target)), work, verify=verify, check_base_digest=check_base)
    assert_bit_equal(work, target)
    with pytest.raises(ValueError, match="one digest must be checked"):
        D.apply_on_device(read_patch(_patch(base, target)), _clone(base), verify=False, check_base_digest=False)


def test_a_base_mismatch_restores_every_bit():
    # the scatter runs before the digests reach the host: a wrong base is found after writing and undone
    base, target = _case()
    work = _clone(base)
    same = (bits(base["x"]) == bits(target["x"])).reshape(-1).nonzero()
    bits(work["x"]).reshape(-1)[int(same[0])] ^= 1  # drifted where the patch writes nothing
    before = _clone(work)
    with pytest.raises(PatchMismatchError, match="tensor 'x'.*not at base version 3|not at base version 3.*tensor 'x'"):
        D.apply_on_device(read_patch(_patch(base, target)), work)
    assert_bit_equal(work, before)


def test_a_target_mismatch_restores_every_bit():
    # a valid container whose values are wrong: it decodes and lands; the target digest catches it
    base, target = _case()
    data = _raw_patch(base, target)
    s, _ = _span(data, "x::values")
    bad = data[:s] + bytes([data[s] ^ 1]) + data[s + 1 :]
    work = _clone(base)
    with pytest.raises(DigestMismatchError, match=r"did not produce the target bits \(undone\): tensor 'x'") as e:
        D.apply_on_device(read_patch(bad), work)
    assert "'a'" not in e.value.message and e.value.hint
    assert_bit_equal(work, base)


def test_a_failure_mid_scatter_restores_every_bit():
    base, target = _case()
    work = _clone(base)
    seen = []

    def written(t: torch.Tensor) -> None:
        seen.append(t)
        if len(seen) == 2:  # the first tensor is written, the second too: then the scatter fails
            raise RuntimeError("device lost")

    with pytest.raises(RuntimeError, match="device lost"):
        D.apply_on_device(read_patch(_patch(base, target)), work, written=written)
    assert len(seen) == 2
    assert_bit_equal(work, base)
    D.apply_on_device(read_patch(_patch(base, target)), work)  # the undo left it at the base exactly
    assert_bit_equal(work, target)


def test_one_transfer_of_the_updates_and_one_read_of_the_digests_per_patch(monkeypatch):
    base, target = _edge_state()
    packs, reads = [], []
    pack, collect = D._pack, D._collect
    monkeypatch.setattr(D, "_pack", lambda *a: packs.append(a) or pack(*a))

    def counting(jobs, *a, **kw):
        reads.append(sum(d.numel() for j in jobs for d in j.digests))
        return collect(jobs, *a, **kw)

    monkeypatch.setattr(D, "_collect", counting)
    work = _clone(base)
    names = list(read_patch(_patch(base, target)).header.tensors)
    blocks = sum(n_blocks(base[n].numel() * base[n].element_size()) for n in names)
    D.apply_on_device(read_patch(_patch(base, target)), work)
    assert len(packs) == 1 and set(packs[0][1]) == set(names)
    assert reads == [2 * blocks]  # base and target block digests of every touched tensor, read together
    assert_bit_equal(work, target)


def test_apply_patch_takes_the_device_path_for_tensors_off_the_cpu():
    from sparsesync.codec import apply as A

    assert A.DEVICE_PATH == [D._apply_on_device]  # registered when the codec is imported


def test_a_patch_of_an_older_run_keeps_the_host_path():
    base, target = _case()
    data = _patch(base, target, algo="xxh3")
    assert not D.device_apply_supported(read_patch(data))
    with pytest.raises(ValueError, match="'xxh3' digests: only 'xxh3b'"):
        D.apply_on_device(read_patch(data), _clone(base))
    work = _clone(base)
    apply_patch(read_patch(data), work)
    assert_bit_equal(work, target)
