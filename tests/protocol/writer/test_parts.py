"""Versions in parts (sparsesync.protocol.writer.parts, commit format 2): a streaming publisher on one
process, followers that fetch parts concurrently and apply all or nothing, partial holders."""

from __future__ import annotations

import json
import threading
from pathlib import Path

import pytest
import torch

from sparsesync.codec import tensor_digest
from sparsesync.errors import ConfigError, DigestMismatchError, MalformedCommitError, PatchMismatchError
from sparsesync.protocol.follower.follower import Follower
from sparsesync.protocol.parts_reader import apply_parts, set_unit_digests
from sparsesync.protocol.records import COMMIT_FORMAT, COMMIT_FORMAT_PARTS, CommitRecord, Unit
from sparsesync.protocol.run import Run
from sparsesync.protocol.verify import verify_run
from sparsesync.protocol.writer.parts import group_by_bytes
from sparsesync.protocol.writer.publisher import Publisher
from sparsesync.store import open_store
from tests.support.weights import assert_bit_equal, make_state, train_step

PART_BYTES = 20_000  # the test model (~120 KB) in 4 parts


def _held_store(url: str, hold):  # type: ignore[no-untyped-def]
    """A real local store whose puts of keys `hold(key)` wait until the returned event is set."""
    import threading

    store = open_store(url, create=True)
    gate = threading.Event()
    put = store.put

    def held_put(key, data):  # type: ignore[no-untyped-def]
        if hold(key):
            gate.wait(30)
        return put(key, data)

    store.put = held_put  # type: ignore[method-assign]
    return store, gate


def _publish(url: str, n: int, **kw) -> list[dict[str, torch.Tensor]]:  # type: ignore[no-untyped-def]
    g = torch.Generator().manual_seed(3)
    states = [make_state(0)]
    with Publisher(url, anchor_every=0, anchor_fraction=1e9, **kw) as pub:
        pub.publish(states[0], 1)
        for v in range(2, n + 1):
            states.append(train_step(states[-1], g))
            pub.publish(states[-1], v)
            pub.flush()  # every version committed (a slow store would coalesce waiting ones)
    return states


def test_versions_in_parts_stay_bit_exact(store_url):
    states = _publish(store_url, 12, part_bytes=PART_BYTES)
    run = Run(store_url)
    commits = run.commits()
    assert [c.version for c in commits] == list(range(1, 13))
    for c in commits[1:]:
        assert c.format == COMMIT_FORMAT_PARTS and c.delta is None
        assert [[u.name for u in p.units] for p in c.parts] == group_by_bytes(states[0], PART_BYTES)
        assert sorted(u.name for p in c.parts for u in p.units) == sorted(states[0])
    # a follower that joins at the anchor and steps through every parted version
    f = Follower(store_url)
    f.sync_once()
    assert_bit_equal(f.mirror, states[-1])
    _rec, got, _ = run.reconstruct(7)
    assert_bit_equal(got, states[6])
    assert verify_run(store_url).ok


def test_publisher_effort_speed_streams_parts_a_follower_applies_bit_exact(tmp_path):
    url = str(tmp_path / "run")
    states = _publish(url, 4, part_bytes=PART_BYTES, effort="speed")
    f = Follower(url)
    f.sync_once()
    assert_bit_equal(f.mirror, states[-1])
    with pytest.raises(ConfigError, match="effort='fast'"):
        Publisher(str(tmp_path / "other"), effort="fast")


def test_group_by_bytes_is_deterministic_and_bounded():
    state = make_state(0)
    groups = group_by_bytes(state, PART_BYTES)
    assert [n for g in groups for n in g] == sorted(state)
    nbytes = {n: state[n].numel() * state[n].element_size() for n in state}
    for g in groups:
        assert len(g) == 1 or sum(nbytes[n] for n in g) <= PART_BYTES
    # the last part is small (all that is left to fetch and decode once the encoder is done):
    # the last tensors that fit in part_bytes // 8, unless the very last tensor alone does not
    for part_bytes in (PART_BYTES, 4 * PART_BYTES, 16 * PART_BYTES):
        g = group_by_bytes(state, part_bytes)
        tail = sum(nbytes[n] for n in g[-1])
        if nbytes[sorted(state)[-1]] > part_bytes // 8:
            assert len(g[-1]) == 1 or tail > part_bytes // 8  # an ordinary last group
        else:
            assert tail <= part_bytes // 8 < tail + nbytes[g[-2][-1]]
    assert group_by_bytes(make_state(1), PART_BYTES) == groups


def test_parts_and_one_file_upload_the_same_bytes_within_2_percent(tmp_path):
    one = _publish(str(tmp_path / "one"), 6, part_bytes=0)
    _publish(str(tmp_path / "parts"), 6, part_bytes=PART_BYTES)
    c1, c2 = Run(str(tmp_path / "one")).commits(), Run(str(tmp_path / "parts")).commits()
    assert all(c.format == COMMIT_FORMAT and c.delta is not None for c in c1[1:])  # format 1 still written on request
    b1 = sum(c.delta.size for c in c1[1:])  # type: ignore[union-attr]
    b2 = sum(p.size for c in c2[1:] for p in c.parts)
    # each extra part costs its own file header (a few hundred bytes), nothing per changed element;
    # on a 0.6B model that is far below 2% (benchmarks/protocol_lag.py --parts)
    n_parts = len(c2[-1].parts)
    assert n_parts > 1 and b1 < b2 <= b1 + 5 * (n_parts - 1) * 600, (b1, b2)
    f = Follower(str(tmp_path / "one"))
    f.sync_once()
    assert_bit_equal(f.mirror, one[-1])


def test_follower_fails_whole_when_one_part_is_damaged(tmp_path):
    url = str(tmp_path / "run")
    states = _publish(url, 3, part_bytes=PART_BYTES)
    run = Run(url)
    rec2 = run.commit(2)
    _r, mirror, digests = run.reconstruct(2)
    before = {k: v.clone() for k, v in mirror.items()}
    rec3 = run.commit(3)
    # damage the last part in the bucket: flip one byte of its streams
    victim = Path(url) / rec3.parts[-1].key
    data = bytearray(victim.read_bytes())
    data[-3] ^= 0xFF
    victim.write_bytes(bytes(data))
    saved = dict(digests)
    with pytest.raises(DigestMismatchError) as e:
        apply_parts(run.fetch, rec3, mirror, digests)
    assert e.value.key == rec3.parts[-1].key and not e.value.written  # refused before any write
    assert_bit_equal(mirror, before)  # no part applied, not even the ones that verified
    assert digests == saved
    # a follower reaches version 2, refuses 3 whole, keeps serving 2 and says why
    f = Follower(url)
    assert f.sync_once() == 2
    st = f.status()
    assert st.state == "degraded" and st.current_version == 2, st
    # names the damaged part
    assert "version 3" in (st.last_error or "") and rec3.parts[-1].key in (st.last_error or ""), st.last_error
    assert_bit_equal(f.mirror, states[1])
    assert rec2.version == 2


def test_parts_written_then_a_later_part_fails_are_all_undone(tmp_path):
    url = str(tmp_path / "run")
    _publish(url, 3, part_bytes=PART_BYTES)
    run = Run(url)
    _r, mirror, digests = run.reconstruct(2)
    rec3 = run.commit(3)
    # the mirror drifted in the last part's tensor (its recorded digest still says version 2):
    # every part decodes, all are written, the last one's target digest fails -> all undone
    last = rec3.parts[-1].units[-1].name
    mirror[last].view(-1).view(torch.uint8)[0] ^= 1
    before = {k: v.clone() for k, v in mirror.items()}
    with pytest.raises(DigestMismatchError) as e:
        apply_parts(run.fetch, rec3, mirror, digests)
    assert e.value.written and e.value.key == rec3.parts[-1].key
    assert_bit_equal(mirror, before)


def test_a_holder_of_some_tensors_fetches_only_their_parts(tmp_path):
    url = str(tmp_path / "run")
    states = _publish(url, 4, part_bytes=PART_BYTES)
    run = Run(url)
    rec = run.commit(4)
    want = [rec.parts[0].units[0].name]
    fetched: list[str] = []

    def fetch(ref):  # type: ignore[no-untyped-def]
        fetched.append(ref.key)
        return run.fetch(ref)

    _r, full3, _d = run.reconstruct(3)
    stage = {n: full3[n].clone() for n in want}  # this holder serves one tensor only
    digests: dict[str, str] = {}
    updates = apply_parts(fetch, rec, stage, digests, names=want)
    assert fetched == [rec.parts[0].key]
    assert_bit_equal(stage, {n: states[3][n] for n in want})
    assert set(updates) <= set(want)
    with pytest.raises(PatchMismatchError, match="lacks"):
        apply_parts(run.fetch, rec, {n: full3[n].clone() for n in want}, {})


def test_shard_units_apply_into_row_ranges_and_digests_stay_a_partition():
    d: dict[str, str] = {"w": "a" * 16, "v": "b" * 16}
    set_unit_digests(d, [(Unit("w", (0, 4)), "1" * 16)])
    set_unit_digests(d, [(Unit("w", (4, 8)), "2" * 16)])
    assert d == {"v": "b" * 16, "w[0:4]": "1" * 16, "w[4:8]": "2" * 16}
    set_unit_digests(d, [(Unit("w", (2, 6)), "3" * 16)])  # overlaps both: both go
    assert d == {"v": "b" * 16, "w[2:6]": "3" * 16}
    set_unit_digests(d, [(Unit("w"), "4" * 16)])
    assert d == {"v": "b" * 16, "w": "4" * 16}


def test_commit_format_2_schema_is_strict(tmp_path):
    url = str(tmp_path / "run")
    _publish(url, 2, part_bytes=PART_BYTES)
    store = open_store(url)
    key = Run(url).commit(2)
    ckey = f"commits/v{2:010d}-e{key.epoch:06d}.json"
    raw = json.loads(store.get(ckey))
    assert raw["format"] == COMMIT_FORMAT_PARTS and "delta" in raw and raw["delta"] is None
    assert CommitRecord.from_json(json.dumps(raw).encode(), ckey).parts == key.parts
    bad = [
        {**raw, "parts": []},
        {**raw, "parts": [{**raw["parts"][0], "units": [["x", 4, 2]]}]},
        {**raw, "parts": [raw["parts"][0], {**raw["parts"][1], "units": raw["parts"][0]["units"]}]},
        {**raw, "parts": [{**raw["parts"][0], "key": raw["parts"][0]["key"].replace("-p00000", "")}]},
        {**raw, "parts": [{**raw["parts"][0], "extra": 1}]},
        {**raw, "format": COMMIT_FORMAT},  # format 1 has no parts: names neither delta nor anchor
    ]
    for b in bad:
        with pytest.raises(MalformedCommitError):
            CommitRecord.from_json(json.dumps(b).encode(), ckey)


def test_lagging_uploads_coalesce_parted_versions(tmp_path):
    """With the uploader held back, waiting parted versions merge part by part into one delta."""
    url = str(tmp_path / "run")
    store, gate = _held_store(url, lambda key: key.startswith("deltas/"))
    g = torch.Generator().manual_seed(5)
    state = make_state(0)
    with Publisher(store, anchor_every=0, anchor_fraction=1e9, queue_size=1, part_bytes=PART_BYTES) as pub:
        pub.publish(state, 1)
        pub.flush()
        for v in range(2, 6):
            state = train_step(state, g)
            pub.publish(state, v)
        gate.set()
        pub.flush()
    commits = Run(url).commits()
    assert commits[-1].version == 5 and len(commits) < 5  # 3->5 or so: some versions were merged
    f = Follower(url)
    f.sync_once()
    assert_bit_equal(f.mirror, state)


def test_parts_upload_while_later_parts_are_still_encoded(tmp_path):
    """The uploader stores part 0 before publish() has finished encoding the last part."""
    import threading

    url = str(tmp_path / "run")
    store = open_store(url, create=True)
    returned = threading.Event()
    first_part_stored_early: list[bool] = []
    put = store.put

    def watch_put(key, data):  # type: ignore[no-untyped-def]
        if key.endswith("-p00000.safetensors"):
            first_part_stored_early.append(not returned.is_set())
        return put(key, data)

    store.put = watch_put  # type: ignore[method-assign]
    g = torch.Generator().manual_seed(0)
    state = {f"w{i}": (torch.randn(1024, 2048, generator=g) * 0.02).to(torch.bfloat16) for i in range(6)}
    with Publisher(store, anchor_every=0, anchor_fraction=1e9, part_bytes=4 << 20) as pub:
        pub.publish(state, 1)
        pub.flush()
        state = train_step(state, g)
        pub.publish(state, 2)
        returned.set()
        pub.flush()
    assert first_part_stored_early == [True]
    assert len(Run(url).commit(2).parts) == 6


def test_a_run_written_in_format_1_continues_in_parts(tmp_path):
    """A run written before parts existed (format 1: one delta file per version) is resumed by a
    publisher that writes parts; followers cross from one format to the other."""
    url = str(tmp_path / "run")
    states = _publish(url, 3, part_bytes=0)
    f = Follower(url)
    assert f.sync_once() == 3
    g = torch.Generator().manual_seed(11)
    with Publisher(url, part_bytes=PART_BYTES, anchor_every=0, anchor_fraction=1e9) as pub:
        pub.resume(states[-1])
        for v in (4, 5):
            states.append(train_step(states[-1], g))
            pub.publish(states[-1], v)
            pub.flush()
    formats = [c.format for c in Run(url).commits()]
    assert formats == [COMMIT_FORMAT] * 3 + [COMMIT_FORMAT_PARTS] * 2
    assert f.sync_once() == 5
    assert_bit_equal(f.mirror, states[-1])
    assert verify_run(url).ok


def test_follower_prefetches_stored_parts_before_the_commit_and_trusts_only_the_commit(tmp_path):
    url = str(tmp_path / "run")
    # version 3's parts are stored, its commit is not (yet)
    store, gate = _held_store(url, lambda key: key.startswith("commits/") and "v0000000003" in key)
    g = torch.Generator().manual_seed(2)
    states = [make_state(0)]
    with Publisher(store, anchor_every=0, anchor_fraction=1e9, part_bytes=PART_BYTES) as pub:
        pub.publish(states[0], 1)
        states.append(train_step(states[-1], g))
        pub.publish(states[-1], 2)
        pub.flush()
        f = Follower(url)
        assert f.sync_once() == 2
        states.append(train_step(states[-1], g))
        pub.publish(states[-1], 3)
        keys: list[str] = []
        for _ in range(200):  # wait until every part of version 3 is stored
            keys = [o.key for o in open_store(url).list("deltas/v0000000002-")]
            if len(keys) == len(group_by_bytes(states[0], PART_BYTES)):
                break
            threading.Event().wait(0.05)
        # one part is damaged while the follower prefetches, then repaired before the commit lands:
        # the prefetched copy does not match the commit's digest, so it is fetched again
        victim = Path(url) / keys[0]
        good = victim.read_bytes()
        victim.write_bytes(good[:-1] + bytes([good[-1] ^ 1]))
        assert f.sync_once() == 2  # nothing committed: prefetches version 3's parts
        assert f._prefetch is not None and len(f._prefetch._done) == len(keys)
        assert sum(d is not None and d.predicted is not None for d in f._prefetch._done.values()) <= 1  # one per poll
        for _ in keys:
            assert f.sync_once() == 2  # nothing new: each poll hashes one more decoded part's outcome
        victim.write_bytes(good)
        gate.set()
        pub.flush()
    fetched: list[str] = []
    fetch = f.run.fetch

    def counting_fetch(ref):  # type: ignore[no-untyped-def]
        fetched.append(ref.key)
        return fetch(ref)

    f.run.fetch = counting_fetch  # type: ignore[method-assign]
    assert all(d is None or d.predicted for d in f._prefetch._done.values())  # hashed ahead: only writes are left
    assert f.sync_once() == 3
    assert fetched == [keys[0]]  # the others were used as prefetched and decoded
    assert_bit_equal(f.mirror, states[-1])
    assert f.digests == {k: tensor_digest(v) for k, v in f.mirror.items()}


def test_the_poll_loop_backs_off_while_quiet_and_polls_fast_again_once_parts_arrive(tmp_path):
    """`Follower.start`: the wait between polls grows while nothing is new (idle listings cost
    the store and the CPU); once new parts are prefetched it is `poll_interval` until their
    version is applied, so the commit that follows them is seen soon, not after a long wait."""
    import time

    url = str(tmp_path / "run")
    store, gate = _held_store(url, lambda key: key.startswith("commits/") and "v0000000002" in key)
    reader = open_store(url)
    calls: list[tuple[float, str, int]] = []  # (when, prefix, objects listed)
    real_list = reader.list

    def listing(prefix):  # type: ignore[no-untyped-def]
        out = real_list(prefix)
        calls.append((time.monotonic(), prefix, len(out)))
        return out

    reader.list = listing  # type: ignore[method-assign]
    states = [make_state(0)]
    with Publisher(store, anchor_every=0, anchor_fraction=1e9, part_bytes=PART_BYTES) as pub:
        pub.publish(states[0], 1)
        pub.flush()
        f = Follower(reader, poll_interval=0.05, max_poll_interval=5.0)
        f.start()
        try:
            f.wait_for_version(1, 30)
            threading.Event().wait(2.0)  # quiet: 0.05, 0.075, ... s between polls
            polls = [t for t, p, _ in calls if p.startswith("commits/")]
            assert polls[-1] - polls[-2] > 0.4, "the waits did not grow while nothing was new"
            states.append(train_step(states[-1], torch.Generator().manual_seed(7)))
            pub.publish(states[-1], 2)  # its parts are stored, its commit held
            for _ in range(400):
                found = [t for t, p, n in calls if p.startswith("deltas/") and n]
                if found:
                    break
                threading.Event().wait(0.05)
            assert found, "the follower never listed version 2's parts"
            threading.Event().wait(1.6)  # the commit is held: backing off would have waited 0.38 s by now
            nxt = [found[0]] + [t for t, p, _ in calls if p.startswith("commits/") and t > found[0]]
            gaps = [b - a for a, b in zip(nxt, nxt[1:])]
            assert len(gaps) >= 5 and max(gaps) < 0.3, f"polls after the parts arrived came {gaps} s apart"
            gate.set()
            pub.flush()
            f.wait_for_version(2, 30)
            assert_bit_equal(f.mirror, states[-1])
        finally:
            gate.set()
            f.stop()


def test_a_prefetched_part_whose_predicted_digest_is_wrong_fails_whole_then_is_fetched_again(tmp_path, monkeypatch):
    """The digests hashed ahead stand in for hashing after the writes: one that does not match
    the commit undoes every write, and the retry fetches, decodes and hashes afresh."""
    import sparsesync.protocol.parts_reader as parts_module

    url = str(tmp_path / "run")
    store, gate = _held_store(url, lambda key: key.startswith("commits/") and "v0000000002" in key)
    states = [make_state(0)]
    with Publisher(store, anchor_every=0, anchor_fraction=1e9, part_bytes=PART_BYTES) as pub:
        pub.publish(states[0], 1)
        pub.flush()
        f = Follower(url)
        assert f.sync_once() == 1
        states.append(train_step(states[-1], torch.Generator().manual_seed(5)))
        pub.publish(states[-1], 2)
        n_parts = len(group_by_bytes(states[0], PART_BYTES))
        for _ in range(200):
            if len(open_store(url).list("deltas/v0000000001-")) == n_parts:
                break
            threading.Event().wait(0.05)
        real = parts_module.digest_after_put
        monkeypatch.setattr(parts_module, "digest_after_put", lambda *a: "xxh3b:" + "0" * 16)  # a prediction gone wrong
        for _ in range(n_parts + 1):
            assert f.sync_once() == 1  # prefetches version 2's parts, then hashes them ahead, one per poll
        assert f._prefetch is not None and all(d is not None and d.predicted for d in f._prefetch._done.values())
        monkeypatch.setattr(parts_module, "digest_after_put", real)
        gate.set()
        pub.flush()
    before = {k: v.clone() for k, v in f.mirror.items()}
    fail = f.run.apply_delta
    seen: list[BaseException] = []

    def first_attempt(*a, **k):  # type: ignore[no-untyped-def]
        try:
            return fail(*a, **k)
        except DigestMismatchError as e:
            seen.append(e)
            assert_bit_equal(f.mirror, before)  # every write undone
            raise

    f.run.apply_delta = first_attempt  # type: ignore[method-assign]
    assert f.sync_once() == 2
    assert len(seen) == 1 and "0000000000000000" in str(seen[0])
    assert_bit_equal(f.mirror, states[-1])


def test_an_anchor_beside_row_range_parts_is_not_a_commit(tmp_path):
    """docs/protocol.md: a record may carry an anchor beside parts only when every unit is a whole tensor."""
    url = str(tmp_path / "run")
    _publish(url, 2, part_bytes=PART_BYTES)
    rec = Run(url).commit(2)
    ckey = f"commits/v{2:010d}-e{rec.epoch:06d}.json"
    raw = json.loads(open_store(url).get(ckey))
    anchor = [{"key": f"anchors/v{2:010d}-e{rec.epoch:06d}-0123abcd/model.safetensors", "size": 8, "xxh3": "0" * 16}]
    # whole tensors: allowed
    assert CommitRecord.from_json(json.dumps({**raw, "anchor": anchor}).encode(), ckey).has_anchor
    first = raw["parts"][0]
    name = first["units"][0][0]
    parts = [{**first, "units": [[name, 0, 1], *first["units"][1:]]}, *raw["parts"][1:]]
    CommitRecord.from_json(json.dumps({**raw, "parts": parts}).encode(), ckey)  # rows without an anchor: fine
    with pytest.raises(MalformedCommitError, match="anchor beside parts with row ranges"):
        CommitRecord.from_json(json.dumps({**raw, "anchor": anchor, "parts": parts}).encode(), ckey)


def _parts_record(n_units: int, *, one_tensor: bool, n_parts: int = 100) -> bytes:
    per = n_units // n_parts
    parts = [{"key": f"deltas/v{1:010d}-v{2:010d}-e000000-abc-p{p:05d}.safetensors", "size": 10, "xxh3": "0" * 16,
              "base_state_digest": "0" * 16, "state_digest": "0" * 16,
              "units": [["t", i, i + 1] if one_tensor else [f"t{i}"] for i in range(p * per, (p + 1) * per)]}
             for p in range(n_parts)]
    return json.dumps({"format": COMMIT_FORMAT_PARTS, "version": 2, "epoch": 0, "writer": "w", "state_digest": "0" * 16,
                       "created_at": 1.0, "base_version": 1, "base_state_digest": "0" * 16, "delta": None,
                       "parts": parts}).encode()


@pytest.mark.parametrize("one_tensor", [False, True], ids=["tensors", "rows-of-one-tensor"])
def test_a_parts_list_parses_in_linear_time(one_tensor):
    """200,000 units (the schema allows 1,000,000): parsed in seconds, not the hours a pairwise overlap check takes."""
    import time

    from tests.protocol.test_hostile import _time_bound

    key = f"commits/v{2:010d}-e000000.json"
    data = _parts_record(200_000, one_tensor=one_tensor)
    t0 = time.perf_counter()
    with _time_bound(60, "parsing 200,000 units"):  # about 1-2 s on an idle core; a quadratic check takes > 10 min
        rec = CommitRecord.from_json(data, key)
    assert sum(len(p.units) for p in rec.parts) == 200_000, time.perf_counter() - t0
    overlapping = json.loads(_parts_record(20_000, one_tensor=True))
    overlapping["parts"][-1]["units"].append(["t", 5, 7])  # rows 5 and 6 are another part's already
    with pytest.raises(MalformedCommitError, match=r"parts\[\d+\] covers tensor 't' rows that another unit covers too"):
        CommitRecord.from_json(json.dumps(overlapping).encode(), key)
