"""The bucket protocol end to end, on every store backend: publisher -> store -> followers.

Every test runs against the local folder, a real S3 server on 127.0.0.1 (moto) and the HF
bucket backend (real huggingface_hub + hf_xet against tests/support/hub_server.py).
"""

from __future__ import annotations

import pytest
import torch

from sparsesync.codec import state_digest, tensor_digests
from sparsesync.errors import FencedWriterError
from sparsesync.protocol.follower.follower import Follower
from sparsesync.protocol.follower.hooks import ApplyHook
from sparsesync.protocol.keys import COMMITS, DELTAS
from sparsesync.protocol.run import Run
from sparsesync.protocol.verify import verify_run
from sparsesync.protocol.writer.commits import CommitWriter
from sparsesync.protocol.writer.publisher import Publisher
from sparsesync.store import open_store
from tests.support.weights import assert_bit_equal, make_state, train_step


class RecordingHook(ApplyHook):
    """An engine stand-in that keeps its own copy of the weights, as a real replica does."""

    def __init__(self) -> None:
        self.weights: dict[str, torch.Tensor] = {}
        self.version: int | None = None
        self.calls: list[tuple[str, int]] = []

    def load_full(self, version, tensors):  # type: ignore[no-untyped-def]
        self.weights = {k: v.clone() for k, v in tensors.items()}
        self.version = version
        self.calls.append(("full", version))

    def apply_sparse(self, version, updates, full):  # type: ignore[no-untyped-def]
        for name, upd in updates.items():
            self.weights[name].view(-1)[upd.indices] = upd.values
        self.version = version
        self.calls.append(("sparse", version))


def test_followers_stay_bit_exact_over_20_versions(store_url):
    g = torch.Generator().manual_seed(1)
    state = make_state(0)
    hooks = [RecordingHook(), RecordingHook()]
    with Publisher(store_url, anchor_every=8) as pub:
        pub.publish(state, 1)
        pub.flush()
        followers = [Follower(store_url, h, poll_interval=0.05) for h in hooks]
        for f in followers:
            assert f.sync_once() == 1
        for version in range(2, 23):
            state = train_step(state, g)
            pub.publish(state, version)
            pub.flush()
            for f, h in zip(followers, hooks, strict=True):
                assert f.sync_once() == version
                assert_bit_equal(h.weights, state)
                assert_bit_equal(f.mirror, state)
                assert f.status().lag == 0 and f.status().state == "following"
    # after the first load every version arrived as a sparse patch, not a reload
    assert hooks[0].calls[0] == ("full", 1)
    assert all(kind == "sparse" for kind, _ in hooks[0].calls[1:])
    assert len(hooks[0].calls) == 22
    run = Run(store_url)
    assert [c.version for c in run.commits()] == list(range(1, 23))
    assert sum(c.has_anchor for c in run.commits()) >= 3  # v1, then every 8 versions
    assert verify_run(store_url).ok


def test_cold_follower_and_restart_catch_up(store_url):
    g = torch.Generator().manual_seed(2)
    state = make_state(1)
    with Publisher(store_url, anchor_every=4) as pub:
        for v in range(1, 7):
            pub.publish(state, v)
            pub.flush()  # one upload at a time: no coalescing, so anchors land where planned
            state = train_step(state, g) if v < 6 else state
        pub.flush()
        f1 = Follower(store_url)
        assert f1.sync_once() == 6
        del f1  # "killed": nothing persists on the reader side
        for v in range(7, 11):
            state = train_step(state, g)
            pub.publish(state, v)
            pub.flush()
    hook = RecordingHook()
    f2 = Follower(store_url, hook)
    assert f2.sync_once() == 10
    assert_bit_equal(hook.weights, state)
    # cold start used the newest anchor (v9: every 4 versions from v1) and then deltas
    assert hook.calls == [("full", 9), ("sparse", 10)]


def test_deleted_delta_falls_back_to_anchor(store_url):
    g = torch.Generator().manual_seed(3)
    state = make_state(2)
    store = open_store(store_url)
    hook = RecordingHook()
    with Publisher(store_url, anchor_every=5) as pub:
        pub.publish(state, 1)
        pub.flush()
        follower = Follower(store_url, hook)
        assert follower.sync_once() == 1
        for v in range(2, 9):
            state = train_step(state, g)
            pub.publish(state, v)
            pub.flush()  # one upload at a time: no coalescing, so the anchor lands at v6
    delta_3 = [o.key for o in store.list(DELTAS) if "-v0000000003-" in o.key]
    store.delete(delta_3)
    assert follower.sync_once() == 8
    assert_bit_equal(hook.weights, state)
    kinds = [(m["version"], m["kind"]) for m in pub.metrics]
    assert ("full", 6) in hook.calls, kinds  # the anchor at v6 (1 + 5) bridged the gap


def test_flipped_byte_is_detected_not_applied_and_recovered(store_url):
    g = torch.Generator().manual_seed(4)
    state = make_state(3)
    store = open_store(store_url)
    hook = RecordingHook()
    with Publisher(store_url, anchor_every=100, anchor_fraction=1e9) as pub:
        pub.publish(state, 1)
        pub.flush()
        follower = Follower(store_url, hook)
        follower.sync_once()
        good = {k: v.clone() for k, v in state.items()}
        state = train_step(state, g)
        pub.publish(state, 2)
        pub.flush()
        key = next(o.key for o in store.list(DELTAS) if "-v0000000002-" in o.key)
        data = bytearray(store.get(key))
        data[len(data) // 2] ^= 0x01
        store.delete([key])
        store.put(key, bytes(data))
        # detected: the replica keeps serving version 1, untouched, and says it is degraded
        assert follower.sync_once() == 1
        assert_bit_equal(hook.weights, good)
        assert_bit_equal(follower.mirror, good)
        st = follower.status()
        assert st.state == "degraded" and "anchor" in (st.last_error or "")
        assert st.newest_version == 2 and st.lag == 1
        # recovered: the trainer's next anchor gives a way around the corrupt object
        pub.config.anchor_every = 1
        state = train_step(state, g)
        pub.publish(state, 3)
        pub.flush()
    assert follower.sync_once() == 3
    assert_bit_equal(hook.weights, state)
    assert follower.status().state == "following"


def test_drifted_mirror_is_caught_and_reloaded(store_url):
    # the follower does not re-hash its mirror before a delta (it was verified when written);
    # if its bytes drift anyway (an engine writing into tensors it was lent), the target digests
    # catch it and the follower reloads from the anchor instead of serving wrong weights
    g = torch.Generator().manual_seed(5)
    state = make_state(4)
    hook = RecordingHook()
    with Publisher(store_url, anchor_every=100, anchor_fraction=1e9) as pub:
        pub.publish(state, 1)
        pub.flush()
        follower = Follower(store_url, hook)
        assert follower.sync_once() == 1
        new = train_step(state, g)
        pub.publish(new, 2)
        pub.flush()
    name = next(iter(state))
    same = torch.nonzero(state[name].view(-1).view(torch.int16) == new[name].view(-1).view(torch.int16))
    follower.mirror[name].view(-1).view(torch.int16)[int(same[0])] ^= 1  # drift where v2 writes nothing
    assert follower.sync_once() == 2
    assert_bit_equal(follower.mirror, new)
    assert_bit_equal(hook.weights, new)
    assert ("full", 1) in hook.calls[1:], hook.calls  # reloaded from the anchor, then the delta


def test_second_writer_fences_the_first(store_url):
    from sparsesync.errors import FencedWriterError

    g = torch.Generator().manual_seed(5)
    state = make_state(4)
    p1 = Publisher(store_url, writer="trainer-a")
    p1.publish(state, 1)
    p1.flush()
    p2 = Publisher(store_url, writer="trainer-b")
    assert p2.epoch > p1.epoch
    state2 = train_step(state, g)
    p2.publish(state2, 2)
    p2.flush()
    p1.publish(train_step(state, g), 3)  # returns: the upload fails in the background
    try:
        p1.flush()
        raise AssertionError("the fenced writer's flush must raise")
    except FencedWriterError as e:
        assert "trainer-b" in e.message
    try:
        p1.publish(state, 4)
        raise AssertionError("publish after being fenced must raise")
    except FencedWriterError:
        pass
    p1.close()
    p2.close()
    f = Follower(store_url)
    assert f.sync_once() == 2
    assert_bit_equal(f.mirror, state2)


def test_publishers_starting_together_never_share_an_epoch(store_url):
    """Eight publishers claim the run in the same instant. Where the store has create-only
    writes each gets its own epoch; without them (HF buckets) equal epochs are ordered by
    writer id, so exactly one of them is not fenced."""
    import threading

    store = open_store(store_url, create=True)
    barrier = threading.Barrier(8)
    pubs: list[Publisher] = []

    def start(i: int) -> None:
        barrier.wait()
        pubs.append(Publisher(store_url, writer=f"trainer-{i}"))

    threads = [threading.Thread(target=start, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    claims = sorted((p.epoch, p.writer) for p in pubs)
    if store.has_create_only:
        assert len({e for e, _ in claims}) == 8, claims
    top = max(claims)
    for p in pubs:
        try:
            CommitWriter(store, p.writer, p.epoch).check_fence()  # the check before every commit
            assert (p.epoch, p.writer) == top, "only the newest claim may commit"
        except FencedWriterError:
            assert (p.epoch, p.writer) != top
        p.close()


def test_an_epoch_reserved_but_not_yet_claimed_is_skipped(store_url):
    """A writer that reserved epoch 1 with its create-only lock and died before writing its
    claim: the next writer takes epoch 2, and never waits on the dead one."""
    from sparsesync.protocol.keys import epoch_lock_key

    store = open_store(store_url, create=True)
    if not store.has_create_only:
        pytest.skip("no create-only writes on this backend: epochs are not reserved")
    assert store.put_new(epoch_lock_key(1), b"dead-writer")
    with Publisher(store_url, writer="next") as p:
        assert p.epoch == 2
        p.publish(make_state(3), 1)


def test_writers_sharing_an_epoch_are_ordered_by_id(store_url):
    """Without create-only writes two writers may claim the same epoch: the one with the
    smaller id stops at its next commit, loudly."""
    from sparsesync.protocol.keys import writer_key
    from sparsesync.protocol.records import WriterClaim

    store = open_store(store_url, create=True)
    p = Publisher(store_url, writer="trainer-a")
    # the same epoch, claimed in the same instant (a claim record: a stray file fences nothing)
    store.put(writer_key(p.epoch, "trainer-b"), WriterClaim(p.epoch, "trainer-b").to_json())
    p.publish(make_state(6), 1)
    with pytest.raises(FencedWriterError, match="trainer-b"):
        p.flush()
    p.close()
    assert Run(store).commits() == []


def test_a_writer_claim_is_a_record_of_the_schema(tmp_path):
    """The claim a publisher writes parses as `records.WriterClaim`, whose `to_json` gives the
    same bytes back (one schema module serves every record of a run)."""
    from sparsesync.protocol.keys import WRITERS, parse_writer_key
    from sparsesync.protocol.records import WriterClaim

    url = str(tmp_path / "run")
    with Publisher(url, writer="trainer-a") as p:
        p.publish(make_state(3), 1)
    store = open_store(url)
    [key] = [o.key for o in store.list(WRITERS) if parse_writer_key(o.key)]
    data = store.get(key)
    claim = WriterClaim.from_json(data, key)
    assert (claim.epoch, claim.writer) == (p.epoch, "trainer-a") and claim.to_json() == data
    with pytest.raises(ValueError, match="does not match the claim's name"):
        WriterClaim.from_json(data, key.replace("trainer-a", "trainer-b"))


def test_fenced_commit_written_anyway_is_ignored(store_url):
    """Without compare-and-swap a fenced writer may still land a commit; readers ignore it."""
    from sparsesync.protocol.keys import commit_key
    from sparsesync.protocol.records import CommitRecord

    g = torch.Generator().manual_seed(6)
    state = make_state(5)
    with Publisher(store_url, writer="old") as p1:
        p1.publish(state, 1)
    with Publisher(store_url, writer="new") as p2:
        s2 = train_step(state, g)
        p2.publish(s2, 2)
    store = open_store(store_url)
    run = Run(store)
    rec2 = run.commits()[-1]
    # the old writer (epoch 1) lands a commit for version 3 after epoch 2 committed version 2
    forged = CommitRecord.from_json(rec2.to_json(), commit_key(2, rec2.epoch))
    forged.version, forged.epoch = 3, 1
    store.put(commit_key(3, 1), forged.to_json())
    assert [(c.version, c.epoch) for c in Run(store).commits()] == [(1, 1), (2, 2)]


def test_resume_continues_with_a_delta(store_url):
    g = torch.Generator().manual_seed(7)
    state = make_state(6)
    with Publisher(store_url) as p1:
        p1.publish(state, 1)
    _rec, pulled, _d = Run(store_url).reconstruct()
    with Publisher(store_url) as p2:
        p2.resume(pulled)
        state = train_step(state, g)
        p2.publish(state, 2)
    rec = Run(store_url).commits()[-1]
    assert rec.has_delta and not rec.has_anchor and rec.base_version == 1
    _rec, got, digests = Run(store_url).reconstruct(2)
    assert_bit_equal(got, state)
    assert state_digest(digests) == state_digest(tensor_digests(state))


def test_commit_records_are_written_last(store_url):
    """Every object a commit names exists, and each version has exactly one commit."""
    g = torch.Generator().manual_seed(8)
    state = make_state(7)
    with Publisher(store_url, anchor_every=3) as pub:
        for v in range(1, 6):
            pub.publish(state, v)
            state = train_step(state, g)
    store = open_store(store_url)
    keys = {o.key for o in store.list("")}
    commits = Run(store).commits()
    assert len([k for k in keys if k.startswith(COMMITS)]) == 5
    for c in commits:
        for ref in c.objects():
            assert ref.key in keys


_STALLING_WRITER = r'''
import sys, time, torch
from sparsesync.protocol.writer.publisher import Publisher
from sparsesync.store import open_store
from tests.support.weights import make_state, train_step

store = open_store(sys.argv[1])
real_put = store.put
def put(key, data):
    if key.startswith("commits/v0000000003"):
        print("STALLED", flush=True)  # every object of version 3 is uploaded; the commit is next
        time.sleep(600)
    real_put(key, data)
store.put = put
g = torch.Generator().manual_seed(9)
state = make_state(8)
pub = Publisher(store, anchor_every=2)
for v in (1, 2, 3):
    pub.publish(state, v)
    pub.flush() if v < 3 else None
    state = train_step(state, g)
time.sleep(600)
'''


def test_writer_killed_mid_upload_leaves_no_torn_version(store_url, store_backend):
    import signal

    import pytest

    if store_backend == "hf":
        pytest.skip("hf_xet's file-backed test CAS can be opened by one process only; the writer runs in its own")
    import subprocess
    import sys

    proc = subprocess.Popen([sys.executable, "-c", _STALLING_WRITER, store_url], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        assert proc.stdout.readline().strip() == "STALLED"
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    store = open_store(store_url)
    # version 3's objects are in the store (delta and anchor), but it is not committed
    assert any("-v0000000003-" in o.key for o in store.list(DELTAS))
    assert [c.version for c in Run(store).commits()] == [1, 2]
    follower = Follower(store_url)
    assert follower.sync_once() == 2
    # the next writer continues from the newest committed version
    g = torch.Generator().manual_seed(10)
    with Publisher(store_url) as pub:
        pub.resume(follower.mirror)
        state = train_step(follower.mirror, g)
        pub.publish(state, 3)
    assert follower.sync_once() == 3
    assert_bit_equal(follower.mirror, state)
    from sparsesync.protocol.gc import plan_gc

    assert any("-v0000000003-e000001-" in k for k in plan_gc(store).objects)  # the dead writer's garbage
