"""A Publisher whose snapshot sits beside the weights (`snapshot="device"`/`"host"`, the path of
GPU weights, here on CPU tensors): a real Follower on a local folder reaches the same bits,
`publish` returns before the entropy coding is done, and a failure of that coding surfaces as an
upload failure does."""

from __future__ import annotations

import time

import pytest
import torch

from sparsesync.codec import state_digest, tensor_digests
from sparsesync.errors import ConfigError, SparsesyncError
from sparsesync.protocol.follower.follower import Follower
from sparsesync.protocol.run import Run
from sparsesync.protocol.verify import verify_run
from sparsesync.protocol.writer.publisher import Publisher
from tests.support.weights import assert_bit_equal, make_state, train_step


@pytest.mark.parametrize("place", ["device", "host"])
def test_follower_reaches_the_published_bits(tmp_path, place):
    url = str(tmp_path / "run")
    g = torch.Generator().manual_seed(1)
    state = make_state(0)
    with Publisher(url, snapshot=place, anchor_every=5) as pub:
        pub.publish(state, 0)
        assert pub.snapshot_device == ("device:cpu" if place == "device" else "host")
        pub.flush()
        f = Follower(url, poll_interval=0.05)
        assert f.sync_once() == 0
        for v in range(1, 8):
            state = train_step(state, g)
            pub.publish(state, v)
            pub.flush()
            assert f.sync_once() == v
            assert_bit_equal(f.mirror, state)
            assert pub.state_digest == state_digest(tensor_digests(state))
    commits = Run(url).commits()
    assert [c.version for c in commits] == list(range(8))
    deltas = [c for c in commits if c.has_delta]
    assert deltas and all(c.metrics["snapshot_device"] == pub.snapshot_device for c in deltas)
    assert all(c.metrics["encode_s"] > 0 and c.metrics["patch_bytes"] > 0 for c in deltas)
    assert verify_run(url).ok


def lora_state(seed: int) -> dict[str, torch.Tensor]:
    """A LoRA adapter's shapes (small bf16 A/B matrices, not named as PEFT names them) with fp32
    norms beside them: groups of two dtypes."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for i in range(12):
        out[f"layers.{i}.adapter_a.weight"] = (torch.randn(8, 64, generator=g) * 0.02).bfloat16()
        out[f"layers.{i}.adapter_b.weight"] = (torch.randn(64, 8, generator=g) * 0.02).bfloat16()
        out[f"layers.{i}.norm.weight"] = torch.randn(64, generator=g)
    return out


def test_grouped_small_tensors_reach_the_follower_with_the_cpu_path_bytes(tmp_path):
    """Small tensors of two dtypes published from the device path (kept and grouped on the host):
    a real Follower reaches the bits, and every delta file is the CPU publisher's, byte for byte."""
    g = torch.Generator().manual_seed(5)
    states = [lora_state(0)]
    for _ in range(5):
        states.append(train_step(states[-1], g, density=0.05))
    urls = {place: str(tmp_path / place) for place in ("device", "cpu")}
    for place, url in urls.items():
        with Publisher(url, snapshot=place, anchor_every=100) as pub:
            for v, s in enumerate(states):
                pub.publish(s, v)
                pub.flush()
    f = Follower(urls["device"], poll_interval=0.05)
    assert f.sync_once() == len(states) - 1
    assert_bit_equal(f.mirror, states[-1])
    assert verify_run(urls["device"]).ok
    deltas = {}
    for place, url in urls.items():
        run = Run(url)
        deltas[place] = [run.fetch(c.delta) for c in run.commits() if c.delta is not None]
    assert len(deltas["device"]) == len(states) - 1 and deltas["device"] == deltas["cpu"]
    from sparsesync.codec import read_patch

    assert all(read_patch(d).header.groups for d in deltas["device"])  # grouped, both halves


def test_cpu_weights_keep_the_cpu_snapshot(tmp_path):
    with Publisher(str(tmp_path / "run")) as pub:
        pub.publish(make_state(0), 0)
        assert pub.snapshot_device == "cpu"
    with pytest.raises(ConfigError, match="snapshot="):
        Publisher(str(tmp_path / "run2"), snapshot="gpu")


def test_publish_returns_before_the_encoding_is_done(tmp_path):
    url = str(tmp_path / "run")
    g = torch.Generator().manual_seed(2)
    state = make_state(0)
    with Publisher(url, snapshot="device") as pub:
        pub.publish(state, 0)
        for v in range(1, 4):
            state = train_step(state, g)
            t0 = time.perf_counter()
            pub.publish(state, v)
            stall = time.perf_counter() - t0
            assert pub.pending >= 1  # handed over, not yet committed
            pub.flush()
            m = pub.metrics[-1]
            # the coding began after publish() returned (measured on one clock), and took no part of its stall
            assert m["encode_wait_s"] >= 0 and m["encode_s"] > 0
            assert m["diff_s"] <= stall


def test_a_background_encoding_failure_surfaces(tmp_path, monkeypatch):
    url = str(tmp_path / "run")
    g = torch.Generator().manual_seed(4)
    state = make_state(0)
    pub = Publisher(url, snapshot="device")
    pub.publish(state, 0)
    pub.flush()

    def fails(*args, **kwargs):  # the fault: the entropy coder runs out of memory
        raise MemoryError("no memory for the coder")

    monkeypatch.setattr("sparsesync.codec.device_snapshot.encode_tensors", fails)
    pub.publish(train_step(state, g), 1)  # returns: the coding happens later
    with pytest.raises(SparsesyncError, match="encoding version 1 .* failed in the background"):
        pub.flush()
    with pytest.raises(SparsesyncError, match="encoding version 1"):
        pub.publish(train_step(state, g), 2)
    pub.close()
    assert [c.version for c in Run(url).commits()] == [0]  # nothing of version 1 committed


def test_versions_published_back_to_back_reach_the_same_bits(tmp_path):
    """Versions published without a flush between them (queue_size=1: one waiting unencoded
    version is merged from its changes when the uploader lags); the follower lands on the bits."""
    url = str(tmp_path / "run")
    g = torch.Generator().manual_seed(6)
    state = make_state(0)
    with Publisher(url, snapshot="device", queue_size=1) as pub:
        for v in range(0, 8):
            pub.publish(state, v)
            state = train_step(state, g) if v < 7 else state
        pub.flush()
    f = Follower(url, poll_interval=0.05)
    assert f.sync_once() == 7
    assert_bit_equal(f.mirror, state)
    assert verify_run(url).ok


def test_two_unencoded_versions_coalesce_into_one_delta():
    """The queue merges waiting versions that were never encoded (`coalesce`, from their changes):
    the merged delta takes the first base to the second target, checked by its digests."""
    from sparsesync.codec import apply_patch, read_patch
    from sparsesync.codec.device_snapshot import DeviceSnapshot
    from sparsesync.protocol.writer.uploads import PendingVersion, coalesce

    g = torch.Generator().manual_seed(8)
    s0 = make_state(0)
    s1 = train_step(s0, g)
    s2 = train_step(s1, g)
    snap = DeviceSnapshot(s0, 0)
    items = []
    for v, s in ((1, s1), (2, s2)):
        ex = snap.extract(s, v)
        items.append(PendingVersion(version=v, base_version=ex.base_version, state_digest=ex.target_state_digest,
                                    base_state_digest=ex.base_state_digest, digests=ex.target_digests,
                                    base_digests=ex.base_digests, changes=ex.changes, delta=None, anchor_dir=None,
                                    metrics={}, unencoded=ex))
    merged = coalesce(items[0], items[1])
    assert merged.unencoded is None and merged.delta is not None and merged.base_version == 0
    work = {k: v.clone() for k, v in s0.items()}
    apply_patch(read_patch(merged.delta), work)
    assert_bit_equal(work, s2)
