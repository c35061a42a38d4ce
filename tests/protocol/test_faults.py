"""Faults a real deployment meets, on every store backend where the fault is real.

- the store is unreachable for a while: the publisher keeps accepting versions (coalescing
  what cannot be uploaded), the follower keeps serving its last good version, and both
  recover by themselves;
- the bucket listing answers stale results (HF): followers see fewer versions, never a wrong one;
- garbage collection never removes what a follower needs to reach the newest version.
"""

from __future__ import annotations

import time

import torch

from sparsesync.protocol.follower.follower import Follower
from sparsesync.protocol.gc import apply_gc, plan_gc
from sparsesync.protocol.keys import ANCHORS, DELTAS, object_version
from sparsesync.protocol.run import Run
from sparsesync.protocol.verify import verify_run
from sparsesync.protocol.writer.publisher import Publisher
from sparsesync.store import open_store
from tests.protocol.test_end_to_end import RecordingHook
from tests.support.weights import assert_bit_equal, make_state, train_step


def test_store_outage_training_and_serving_continue_then_recover(store_url, store_faults, monkeypatch):
    monkeypatch.setenv("SPARSESYNC_STORE_RETRY_S", "0.3")  # each store call gives up fast
    monkeypatch.setenv("SPARSESYNC_STORE_RETRY_TRIES", "2")
    g = torch.Generator().manual_seed(11)
    state = make_state(3)
    hook = RecordingHook()
    with Publisher(store_url, anchor_every=1000, queue_size=2, retry_backoff_s=0.1) as pub:
        pub.publish(state, 1)
        pub.flush()
        follower = Follower(store_url, hook)
        assert follower.sync_once() == 1
        v1 = {k: v.clone() for k, v in state.items()}

        store_faults.unavailable(4.0)
        for v in range(2, 9):  # "training" goes on: publish never raises, never waits for the store
            state = train_step(state, g)
            pub.publish(state, v)
            assert pub.pending <= 2 + 1  # queue_size waiting + the one being retried
        assert follower.sync_once() == 1  # unreachable store: keep serving the last good version
        st = follower.status()
        assert st.state == "degraded" and st.current_version == 1 and st.last_error
        assert_bit_equal(hook.weights, v1)

        pub.flush(timeout=120)  # the outage ends by itself; the uploader catches up
    committed = [c.version for c in Run(store_url).commits()]
    assert committed[0] == 1 and committed[-1] == 8
    assert len(committed) < 8, "with the store down and a queue of 2, versions must have been coalesced"
    assert any(m.get("coalesced") for m in pub.metrics)

    assert follower.sync_once() == 8
    assert follower.status().state == "following"
    assert_bit_equal(hook.weights, state)
    assert verify_run(store_url).ok


def test_stale_listing_shows_fewer_versions_never_wrong_ones(store_url, store_faults):
    g = torch.Generator().manual_seed(12)
    state = make_state(4)
    hook = RecordingHook()
    with Publisher(store_url, anchor_every=1000) as pub:
        for v in range(1, 4):
            pub.publish(state, v)
            pub.flush()
            state = train_step(state, g) if v < 3 else state
        v3 = {k: t.clone() for k, t in state.items()}
        follower = Follower(store_url, hook)
        assert follower.sync_once() == 3

        store_faults.stale_listing()  # listings now answer from this moment (skips where impossible)
        for v in range(4, 7):
            state = train_step(state, g)
            pub.publish(state, v)
        pub.flush()
        assert follower.sync_once() == 3  # the commits of 4..6 are not listed yet
        assert follower.status().state == "following"
        assert_bit_equal(hook.weights, v3)

        store_faults.fresh_listing()
        assert follower.sync_once() == 6
        assert_bit_equal(hook.weights, state)


def test_gc_keeps_what_followers_need(store_url):
    g = torch.Generator().manual_seed(13)
    state = make_state(5)
    behind = RecordingHook()  # a replica that stopped at v5 and comes back after gc
    with Publisher(store_url, anchor_every=4) as pub:
        for v in range(1, 13):
            pub.publish(state, v)
            pub.flush()
            if v == 5:
                assert Follower(store_url, behind).sync_once() == 5
            state = train_step(state, g) if v < 12 else state
    store = open_store(store_url)
    anchors_before = {o.key.split("/")[1] for o in store.list(ANCHORS)}
    assert len(anchors_before) == 3  # v1, v5, v9

    plan = plan_gc(store, keep_anchors=1)
    assert plan.objects and plan.old_commits and plan.bytes_freed > 0
    apply_gc(store, plan)

    assert [c.version for c in Run(store_url).commits()] == [9, 10, 11, 12]
    assert len({o.key.split("/")[1] for o in store.list(ANCHORS)}) == 1
    deltas = [o.key for o in store.list(DELTAS)]
    assert all(object_version(k) >= 9 for k in deltas), deltas  # only deltas into v9..v12
    assert verify_run(store_url).ok
    for hook in (RecordingHook(), behind):  # a cold replica and one from before the kept anchor
        assert Follower(store_url, hook).sync_once() == 12
        assert_bit_equal(hook.weights, state)
    assert behind.calls[1] == ("full", 9)  # its chain was collected: it re-anchored at v9
    assert plan_gc(store, keep_anchors=1).empty  # nothing more to delete: gc is idempotent


def test_gc_dry_run_plan_deletes_nothing(tmp_path):
    url = str(tmp_path / "run")
    g = torch.Generator().manual_seed(14)
    state = make_state(6)
    with Publisher(url, anchor_every=3) as pub:
        for v in range(1, 8):
            pub.publish(state, v)
            pub.flush()
            state = train_step(state, g)
    store = open_store(url)
    before = [(o.key, o.size) for o in store.list("")]
    plan = plan_gc(store, keep_anchors=1)
    assert not plan.empty
    assert [(o.key, o.size) for o in store.list("")] == before


def test_hf_events_feed_wakes_followers_polling_is_the_fallback(hub_server, monkeypatch):
    """With the bucket events feed served, a follower that polls only every 60 s still picks up
    a new version at once; without the feed (501, the default here) it falls back to polling."""
    from tests.conftest import HF_TEST_BUCKET, HF_TEST_TOKEN

    monkeypatch.setenv("HF_ENDPOINT", hub_server.endpoint)
    monkeypatch.setenv("HF_TOKEN", HF_TEST_TOKEN)
    url = f"hf://buckets/{HF_TEST_BUCKET}/events-{time.time_ns()}"
    g = torch.Generator().manual_seed(15)
    state = make_state(7)
    hub_server.events_enabled = True
    try:
        with Publisher(url) as pub:
            pub.publish(state, 1)
            pub.flush()
            hook = RecordingHook()
            follower = Follower(url, hook, poll_interval=60, max_poll_interval=60)
            follower.start()
            try:
                follower.wait_for_version(1, timeout=30)
                deadline = time.monotonic() + 15
                while not follower.store.events_active and time.monotonic() < deadline:
                    time.sleep(0.05)
                assert follower.store.events_active
                state = train_step(state, g)
                pub.publish(state, 2)
                pub.flush()
                follower.wait_for_version(2, timeout=20)  # far sooner than the 60 s poll interval
                assert_bit_equal(hook.weights, state)
            finally:
                follower.stop()
    finally:
        hub_server.events_enabled = False

    polling = Follower(url, RecordingHook(), poll_interval=0.05)
    polling.start()
    try:
        polling.wait_for_version(2, timeout=30)
        assert not polling.store.events_active  # the feed is gone (501): polling found it
    finally:
        polling.stop()


def test_hf_events_feed_ignores_heartbeats(hub_server, monkeypatch):
    """Replicas rewrite `fleet/<id>.json` every few seconds: on the events feed those writes must
    not wake followers (each wake costs a listing of `commits/`), while a new object elsewhere
    under the run still does."""
    import threading

    from tests.conftest import HF_TEST_BUCKET, HF_TEST_TOKEN

    monkeypatch.setenv("HF_ENDPOINT", hub_server.endpoint)
    monkeypatch.setenv("HF_TOKEN", HF_TEST_TOKEN)
    url = f"hf://buckets/{HF_TEST_BUCKET}/feed-{time.time_ns()}"
    writer, watcher, stop = open_store(url), open_store(url), threading.Event()
    hub_server.events_enabled = True
    try:
        writer.put("commits/.keep", b"")
        watcher.wait_for_change(0.01, stop)  # starts the feed
        deadline = time.monotonic() + 15
        while not watcher.events_active and time.monotonic() < deadline:
            time.sleep(0.05)
        assert watcher.events_active
        watcher.wait_for_change(1.0, stop)  # drain the wake-up of the feed's first reconcile
        writer.put("fleet/replica-a.json", b"{}")
        t0 = time.monotonic()
        watcher.wait_for_change(2.0, stop)
        assert time.monotonic() - t0 >= 1.9, "a heartbeat woke the follower"
        writer.put("switches/v0000000001.json", b"{}")
        t0 = time.monotonic()
        watcher.wait_for_change(20.0, stop)
        assert time.monotonic() - t0 < 15, "a switch record did not wake the follower"
    finally:
        hub_server.events_enabled = False
        watcher.close()
        writer.close()
