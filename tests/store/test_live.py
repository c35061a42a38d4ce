"""Opt-in: the HF bucket store against the live Hugging Face Hub (runs only with HF_TOKEN set).

Creates a throwaway private bucket in the token owner's namespace, writes, lists, range-reads,
downloads, deletes, and removes the bucket. Only the live Hub can confirm auth and scopes,
the real CAS and CDN, error bodies and listing freshness; this test checks the first three.

    HF_TOKEN=hf_... .venv/bin/pytest tests/store/test_live.py -m live
"""

from __future__ import annotations

import os
import time
import uuid
from pathlib import Path

import pytest

from sparsesync.errors import ObjectNotFoundError
from sparsesync.store import open_store

pytestmark = [
    pytest.mark.live,
    pytest.mark.skipif(not os.environ.get("HF_TOKEN"), reason="set HF_TOKEN to run against the live Hub"),
]


def test_live_private_bucket_roundtrip(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from huggingface_hub import HfApi

    monkeypatch.delenv("HF_ENDPOINT", raising=False)
    api = HfApi()
    namespace = api.whoami()["name"]
    bucket_id = f"{namespace}/sparsesync-live-{uuid.uuid4().hex[:8]}"
    try:
        store = open_store(f"hf://buckets/{bucket_id}/run", create=True)
        assert api.bucket_info(bucket_id).private, "sparsesync must create private buckets"
        header = (1234).to_bytes(8, "little") + b"{}" + bytes(100)
        store.put_many([("deltas/a.safetensors", header), ("commits/v1.json", b'{"v": 1}')])
        assert store.put_new("commits/v1.json", b"again") is False

        listed: list[str] = []
        for _ in range(20):  # listings may lag a write; say how long if they do
            listed = [o.key for o in store.list("")]
            if len(listed) == 2:
                break
            time.sleep(0.5)
        assert listed == ["commits/v1.json", "deltas/a.safetensors"]
        assert store.get_range("deltas/a.safetensors", 0, 8) == header[:8]
        assert store.get_range("deltas/a.safetensors", 8, 2) == b"{}"
        assert store.get("commits/v1.json") == b'{"v": 1}'
        store.get_file("deltas/a.safetensors", tmp_path / "a.safetensors")
        assert (tmp_path / "a.safetensors").read_bytes() == header

        store.delete(["deltas/a.safetensors"])
        with pytest.raises(ObjectNotFoundError):
            store.get("deltas/a.safetensors")
    finally:
        api.delete_bucket(bucket_id, missing_ok=True)


def test_live_publish_and_follow(monkeypatch: pytest.MonkeyPatch) -> None:
    """The whole protocol against the live Hub: 3 versions published, followed bit-exactly."""
    import torch
    from huggingface_hub import HfApi

    from sparsesync.protocol.follower.follower import Follower
    from sparsesync.protocol.writer.publisher import Publisher
    from tests.protocol.test_end_to_end import RecordingHook
    from tests.support.weights import assert_bit_equal, make_state, train_step

    monkeypatch.delenv("HF_ENDPOINT", raising=False)
    api = HfApi()
    bucket_id = f"{api.whoami()['name']}/sparsesync-live-{uuid.uuid4().hex[:8]}"
    url = f"hf://buckets/{bucket_id}/run"
    try:
        g = torch.Generator().manual_seed(0)
        state = make_state(0)
        hook = RecordingHook()
        with Publisher(url) as pub:
            for v in range(1, 4):
                pub.publish(state, v)
                pub.flush()
                state = train_step(state, g) if v < 3 else state
        follower = Follower(url, hook, poll_interval=0.5)
        follower.start()
        try:
            follower.wait_for_version(3, timeout=120)  # listings may lag writes on the live Hub
        finally:
            follower.stop()
        assert_bit_equal(hook.weights, state)
        assert api.bucket_info(bucket_id).private
    finally:
        api.delete_bucket(bucket_id, missing_ok=True)
