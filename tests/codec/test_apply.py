"""Applying a patch: checked against the tensors it is applied to (shape, dtype, presence, layout,
base and target digests), all or nothing, a Ctrl-C raised only after the undo; the codec's threads
(input order kept, the CPU affinity followed) and the fused write-and-digest pass."""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest
import torch

from sparsesync.codec import (
    apply_patch,
    decode_patch,
    read_patch,
    tensor_digest,
    tensor_digests,
    verify_digests,
)
from sparsesync.codec.diff import bits_view, to_np_bits
from sparsesync.errors import DigestMismatchError, PatchFormatError, PatchMismatchError
from tests.support.patches import (
    _case,
    _classed_case,
    _clone,
    _encode,
    _raw_patch,
    _rejects,
    _span,
    assert_bit_equal,
    bits,
)


def test_reject_wrong_shape():
    base, target = _case()
    work = _clone(base)
    work["x"] = work["x"].reshape(70, 60)
    err = _rejects(_encode(base, target), work, PatchMismatchError, "tensor 'x'", "shape [70, 60]", "expected [60, 70]")
    assert "'a'" not in err.message  # only the bad tensor is named


def test_reject_wrong_dtype():
    base, target = _case()
    work = _clone(base)
    work["x"] = work["x"].to(torch.float16)
    _rejects(_encode(base, target), work, PatchMismatchError, "tensor 'x'", "dtype F16", "expected BF16")


def test_reject_missing_tensor():
    base, target = _case()
    work = _clone(base)
    del work["x"]
    _rejects(_encode(base, target), work, PatchMismatchError, "tensor 'x'", "missing", "expected BF16 [60, 70]")


def test_reject_non_contiguous_tensor():
    base, target = _case()
    work = _clone(base)
    work["x"] = torch.empty(70, 60, dtype=torch.bfloat16).t().copy_(base["x"])
    _rejects(_encode(base, target), work, PatchMismatchError, "tensor 'x'", "not contiguous", "`.contiguous()`")


def test_reject_wrong_base():
    base, target = _case()
    work = _clone(base)
    bits(work["x"]).reshape(-1)[5] ^= 1  # one bit away from the base
    _rejects(
        _encode(base, target),
        work,
        PatchMismatchError,
        "tensor 'x'",
        f"digest {tensor_digest(work['x'])}",
        f"expected {tensor_digest(base['x'])}",
        "not at base version 3",
    )
    _rejects(_encode(base, target), _clone(target), PatchMismatchError, "tensor 'a'", "tensor 'x'")  # applied twice


def test_wrong_base_is_reported_as_such_even_where_the_patch_cannot_decode_against_it():
    """Class-coded positions decode from the base's magnitudes: against other weights they may
    not decode at all. apply_patch hashes the base in its write pass, so it decodes first; it
    must still say the weights are not at the base (the fix), not that the patch is corrupt."""
    base, target = _classed_case()
    data = _encode(base, target)
    assert read_patch(data).header.tensors["w"].position_params["thresholds"], "the case needs class-coded positions"
    work = _clone(base)
    work["w"].zero_()  # every element in the lowest class: the other classes' ranks run past their members
    with pytest.raises(PatchFormatError):
        decode_patch(read_patch(data), work, check_base_digest=False)
    _rejects(data, work, PatchMismatchError, "tensor 'w'", "not at base version 3", "load version 3")


def test_a_ctrl_c_during_apply_is_raised_after_the_undo_never_between_versions():
    """Ctrl-C (SIGINT) while the codec's threads write a patch whose base check then fails (one
    bit of one tensor is off): the KeyboardInterrupt comes once every write is undone. Before, the
    waiting thread stopped at once while the pool went on writing, and no undo ran."""
    import signal
    import threading
    import time

    from sparsesync.codec import _parallel

    if _parallel.workers() == 1:
        pytest.skip("needs the codec's thread pool (one CPU here)")
    g = torch.Generator().manual_seed(1)
    base = {f"t{i}": (torch.randn(256, 512, generator=g) * 0.02).to(torch.bfloat16) for i in range(6)}
    target = {k: (v.float() + torch.randn(v.shape, generator=g) * 1e-3).to(torch.bfloat16) for k, v in base.items()}
    data = _encode(base, target)

    class CtrlC(dict):  # a user's mapping; the first access from a codec thread sends SIGINT to the process
        fired = False

        def __getitem__(self, key):  # type: ignore[no-untyped-def]
            if not CtrlC.fired and threading.current_thread() is not threading.main_thread():
                CtrlC.fired = True
                signal.raise_signal(signal.SIGINT)
            return super().__getitem__(key)

    work = CtrlC(_clone(base))
    bits(work["t5"]).reshape(-1)[3] ^= 1  # not at the base: found in the write pass, after the writes
    before = _clone(dict(work))
    with pytest.raises(KeyboardInterrupt):
        apply_patch(read_patch(data), work)
    assert CtrlC.fired and signal.getsignal(signal.SIGINT) is signal.default_int_handler
    time.sleep(0.5)  # the pool's threads, had they gone on writing
    assert_bit_equal(dict(work), before)


def test_light_items_share_one_task_and_results_and_errors_keep_input_order():
    """The codec's pools: items lighter than SMALL_ITEM (small tensors, whose work is mostly
    Python) run one after another on one thread; results come back in input order either way,
    and map_ordered raises the first failing item's error in input order."""
    import threading

    from sparsesync.codec import _parallel

    if _parallel.workers() == 1:
        pytest.skip("needs the codec's thread pool (one CPU here)")
    heavy = _parallel.SMALL_ITEM
    weights = [heavy if x % 3 == 0 else 10 for x in range(12)]  # 0, 3, 6, 9 heavy
    thread_of: dict[int, int] = {}

    def fn(x: int) -> object:
        thread_of[x] = threading.get_ident()
        if x in (7, 9):
            raise ValueError(f"item {x}")
        return KeyError("a result, not an error") if x == 4 else x * x

    got = _parallel.map_settled(fn, list(range(12)), weights=weights)
    assert [str(r) if isinstance(r, Exception) else r for r in got] == [
        0,
        1,
        4,
        9,
        "'a result, not an error'",
        25,
        36,
        "item 7",
        64,
        "item 9",
        100,
        121,
    ]
    assert len({thread_of[x] for x in range(12) if weights[x] < heavy}) == 1
    with pytest.raises(ValueError, match="item 7"):  # 7 (light) comes before 9 (heavy) in input order
        _parallel.map_ordered(fn, list(range(12)), weights=weights)
    ok = _parallel.map_ordered(fn, [1, 2, 4], weights=[1, 1, 1])
    assert ok[:2] == [1, 4] and isinstance(ok[2], KeyError)  # a returned exception is a result
    # no weights: one task per item
    assert _parallel.map_ordered(lambda x: x + 1, list(range(50))) == list(range(1, 51))


def test_interrupts_deferred_holds_one_ctrl_c_to_the_end_and_a_second_stops_at_once():
    import signal

    from sparsesync.codec import interrupts_deferred

    reached = []
    with pytest.raises(KeyboardInterrupt):
        with interrupts_deferred():
            signal.raise_signal(signal.SIGINT)
            reached.append("after the first")
    assert reached == ["after the first"] and signal.getsignal(signal.SIGINT) is signal.default_int_handler
    with pytest.raises(KeyboardInterrupt):
        with interrupts_deferred():
            signal.raise_signal(signal.SIGINT)
            signal.raise_signal(signal.SIGINT)
            reached.append("after the second")
    assert reached == ["after the first"] and signal.getsignal(signal.SIGINT) is signal.default_int_handler
    with interrupts_deferred():  # no Ctrl-C: nothing raised
        reached.append("quiet")
    assert reached[-1] == "quiet"


def test_skipping_the_base_check_still_rejects_a_wrong_base():
    # a holder that vouches for its base (check_base_digest=False) gets the same guarantee from
    # the target digests: a drifted element is caught after writing and every bit is restored
    base, target = _case()
    data = _encode(base, target)
    work = _clone(base)
    same = np.flatnonzero(bits(base["x"]).reshape(-1).numpy() == bits(target["x"]).reshape(-1).numpy())
    bits(work["x"]).reshape(-1)[int(same[0])] ^= 1  # drifted where the patch writes nothing
    before = _clone(work)
    with pytest.raises(DigestMismatchError, match="tensor 'x'.*expected " + tensor_digest(target["x"])):
        apply_patch(read_patch(data), work, check_base_digest=False)
    assert_bit_equal(work, before)
    work = _clone(base)
    apply_patch(read_patch(data), work, check_base_digest=False)
    assert_bit_equal(work, target)
    with pytest.raises(ValueError, match="verify=True or check_base_digest=True"):
        apply_patch(read_patch(data), _clone(base), verify=False, check_base_digest=False)


def test_target_digest_is_verified_after_apply():
    base, target = _case()
    data = _raw_patch(base, target)
    s, _ = _span(data, "x::values")
    bad = data[:s] + bytes([data[s] ^ 1]) + data[s + 1 :]  # one value bit off: decodes, lands, wrong target
    work = _clone(base)
    err = _rejects(bad, work, DigestMismatchError, "tensor 'x'", f"expected {tensor_digest(target['x'])}", "(undone)")
    assert "'a'" not in err.message
    apply_patch(read_patch(bad), work, verify=False)  # without verification it lands ...
    assert torch.equal(bits(work["a"]), bits(target["a"])) and not torch.equal(bits(work["x"]), bits(target["x"]))
    with pytest.raises(
        DigestMismatchError, match="tensor 'x': digest xxh3b:[0-9a-f]{16}, expected " + tensor_digest(target["x"])
    ):
        # ... and a later check catches it
        verify_digests(work, {n: e.target_digest for n, e in read_patch(bad).header.tensors.items()})
    work = _clone(base)
    apply_patch(read_patch(data), work)
    assert_bit_equal(work, target)
    verify_digests(work, tensor_digests(target))


@pytest.mark.skipif(
    not hasattr(os, "sched_setaffinity") or (os.cpu_count() or 1) < 2, reason="needs CPU affinity and 2 CPUs"
)
def test_codec_threads_follow_the_cpu_affinity():
    """A process pinned to one core (taskset, a container's cpuset) runs the codec on one thread,
    not one per CPU of the machine fighting over that core."""
    code = ("import os; os.sched_setaffinity(0, {min(os.sched_getaffinity(0))}); "
            "from sparsesync.codec import _parallel; print(_parallel.workers())")
    env = {k: v for k, v in os.environ.items() if k != "SPARSESYNC_CODEC_THREADS"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.stdout.strip() == "1", out.stderr[-2000:]


@pytest.mark.parametrize("numel", [0, 1, 1000, (2 << 20) // 2, 3 * (1 << 20) + 17])
def test_put_and_digest_writes_like_put_bits_and_hashes_like_tensor_digest(numel):
    """The digest of the written tensor, hashed block by block in the same pass as the writes
    (blocks of 2 MiB: the larger sizes cross block edges), equals tensor_digest of the result;
    the overwritten bits are saved."""
    from sparsesync.codec.diff import put_bits
    from sparsesync.codec.digest import put_and_digest, put_and_digests

    rng = np.random.default_rng(numel)
    t = torch.empty(numel, dtype=torch.bfloat16)
    to_np_bits(bits_view(t))[:] = rng.integers(0, 1 << 16, numel, dtype=np.uint16)
    want = t.clone()
    idx = (
        np.sort(rng.choice(numel, min(numel, 5000), replace=False)).astype(np.int64) if numel else np.zeros(0, np.int64)
    )
    vals = rng.integers(0, 1 << 16, idx.size, dtype=np.uint16)
    put_bits(to_np_bits(bits_view(want)), idx, vals)
    old = np.empty(idx.size, np.uint16)
    before = to_np_bits(bits_view(t)).copy()
    digest = put_and_digest(to_np_bits(bits_view(t)), idx, vals, old)
    assert torch.equal(t.view(torch.int16), want.view(torch.int16))
    assert digest == tensor_digest(want)
    assert np.array_equal(old, before[idx])
    # and with the digest of the bytes before the writes, hashed in the same pass
    t1 = torch.empty(numel, dtype=torch.bfloat16)
    to_np_bits(bits_view(t1))[:] = before
    want_before = tensor_digest(t1)
    old1 = np.empty(idx.size, np.uint16)
    assert put_and_digests(to_np_bits(bits_view(t1)), idx, vals, old1) == (want_before, tensor_digest(want))
    assert torch.equal(t1.view(torch.int16), want.view(torch.int16)) and np.array_equal(old1, before[idx])
    if idx.size > 1:  # unsorted: every write still done once (the digest may not match; callers check it)
        t2 = torch.empty(numel, dtype=torch.bfloat16)
        to_np_bits(bits_view(t2))[:] = before
        put_and_digest(to_np_bits(bits_view(t2)), idx[::-1].copy(), vals[::-1].copy())
        assert torch.equal(t2.view(torch.int16), want.view(torch.int16))
    with pytest.raises(IndexError):
        put_and_digest(to_np_bits(bits_view(t)), np.array([numel], np.int64), np.zeros(1, np.uint16))
