"""The store contract (sparsesync/store/base.py) on every backend, plus retries and failures.

Each contract test runs three times: a local folder, moto's S3 server on 127.0.0.1, and the HF
bucket backend (real huggingface_hub + hf_xet against tests/support/hub_server.py).
"""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from sparsesync.errors import ConfigError, ObjectNotFoundError, StoreAuthError, StoreError, StoreUnavailableError
from sparsesync.store import ObjectInfo, Store, open_store
from tests.conftest import HF_TEST_BUCKET, HF_TEST_TOKEN
from tests.support.hub_server import HubServer
from tests.support.store_faults import StoreFaults


@pytest.fixture
def store(store_url: str) -> Iterator[Store]:
    s = open_store(store_url, create=True)
    yield s
    s.close()


# -- contract -------------------------------------------------------------------------------
def test_put_get_exists_and_files(store: Store, tmp_path: Path) -> None:
    assert store.list() == []
    src = tmp_path / "src.bin"
    src.write_bytes(bytes(range(256)) * 40)
    store.put("a/bytes.bin", b"hello sparsesync")
    store.put("a/file.bin", src)
    store.put("empty", b"")
    assert store.get("a/bytes.bin") == b"hello sparsesync"
    assert store.get("a/file.bin") == src.read_bytes()
    assert store.get("empty") == b""
    assert store.exists("a/file.bin") and not store.exists("a/nope.bin") and not store.exists("a")
    dest = tmp_path / "out" / "copy.bin"
    store.get_file("a/file.bin", dest)
    assert dest.read_bytes() == src.read_bytes()
    assert [p.name for p in dest.parent.iterdir()] == ["copy.bin"]  # no temp files left behind
    assert store.object_url("a/file.bin").startswith(store.url.split("?")[0])


def test_get_range(store: Store) -> None:
    data = bytes(range(200))
    store.put("blob", data)
    assert store.get_range("blob", 0, 8) == data[:8]
    assert store.get_range("blob", 100, 50) == data[100:150]
    assert store.get_range("blob", 190, 50) == data[190:]  # fewer only at the end
    assert store.get_range("blob", 200, 10) == b""
    assert store.get_range("blob", 5, 0) == b""


def test_list_is_recursive_sorted_plain_prefix(store: Store) -> None:
    keys = {"logs-old": b"1", "logs.json": b"22", "logs/a": b"333", "logs/b/c": b"4444", "other/x": b"5"}
    store.put_many(list(keys.items()))
    assert store.list() == [ObjectInfo(k, len(v)) for k, v in sorted(keys.items())]
    assert [o.key for o in store.list("logs")] == ["logs-old", "logs.json", "logs/a", "logs/b/c"]
    assert [o.key for o in store.list("logs/")] == ["logs/a", "logs/b/c"]
    assert [o.key for o in store.list("logs/b")] == ["logs/b/c"]
    assert store.list("nope/") == [] and store.list("other/y") == []


def test_listing_pages(store: Store) -> None:
    items = [(f"many/k{i:04d}", b"x") for i in range(130)]  # hub_server pages tree answers by 100
    store.put_many(items)
    assert [o.key for o in store.list("many/")] == [k for k, _ in items]


def test_local_key_cannot_be_file_and_folder(tmp_path: Path) -> None:
    store = open_store(str(tmp_path / "s"), create=True)
    store.put("logs", b"1")
    with pytest.raises(StoreError) as err:
        store.put("logs/a", b"2")
    assert "'logs'" in str(err.value) and "folder" in str(err.value)


def test_delete_ignores_missing(store: Store) -> None:
    store.put_many([("d/1", b"1"), ("d/2", b"2"), ("keep", b"k")])
    store.delete(["d/1", "d/missing"])
    store.delete([])
    assert [o.key for o in store.list()] == ["d/2", "keep"]
    store.delete(["d/2"])
    assert [o.key for o in store.list()] == ["keep"]


def test_put_many_get_many(store: Store, tmp_path: Path) -> None:
    items = [(f"shards/part-{i}.safetensors", bytes([i]) * (1000 + i)) for i in range(6)]
    store.put_many(items)
    store.get_many([(k, tmp_path / "dl" / k) for k, _ in items])
    for k, v in items:
        assert (tmp_path / "dl" / k).read_bytes() == v


def test_put_new_is_create_only(store: Store, store_backend: str) -> None:
    assert store.has_create_only == (store_backend in ("local", "s3"))
    assert store.put_new("commits/v1.json", b"first") is True
    assert store.put_new("commits/v1.json", b"second") is False
    assert store.get("commits/v1.json") == b"first"


def test_put_new_race_has_one_winner(store: Store) -> None:
    if not store.has_create_only:
        pytest.skip("no create-only writes on this backend (check-then-put is racy by design)")
    wins: list[int] = []
    barrier = threading.Barrier(6)

    def contend(i: int) -> None:
        barrier.wait()
        if store.put_new("claim", f"writer {i}".encode()):
            wins.append(i)

    threads = [threading.Thread(target=contend, args=(i,)) for i in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(wins) == 1
    assert store.get("claim") == f"writer {wins[0]}".encode()


def test_missing_objects_raise_not_found(store: Store, tmp_path: Path) -> None:
    store.put("present", b"x")
    for call in (lambda: store.get("absent/key"), lambda: store.get_range("absent/key", 0, 4),
                 lambda: store.get_file("absent/key", tmp_path / "f"),
                 lambda: store.get_many([("present", tmp_path / "p"), ("absent/key", tmp_path / "g")])):
        with pytest.raises(ObjectNotFoundError) as err:
            call()
        assert "absent/key" in str(err.value) and err.value.url
    assert not (tmp_path / "f").exists()


@pytest.mark.parametrize("key", ["", "/abs", "a/../b", "..", "a//b", "a/./b", "dir/", "caf\u00e9", "a b", "a\\b",
                                 "tab\t", "x" * 1100])
def test_bad_keys_are_refused(store: Store, key: str) -> None:
    with pytest.raises(StoreError) as err:
        store.put(key, b"x")
    assert "invalid" in str(err.value) and err.value.hint
    with pytest.raises(StoreError):
        store.get(key)
    assert store.list() == []


def test_bad_prefixes_are_refused(store: Store) -> None:
    for prefix in ("../up", "/abs", "a//", "\u00fc/"):
        with pytest.raises(StoreError):
            store.list(prefix)


# -- faults: retries, unavailability, auth -------------------------------------------------
def test_transient_failures_are_retried(store: Store, store_faults: StoreFaults) -> None:
    store.put("k", b"v")
    store_faults.fail_requests(2)
    assert store.get("k") == b"v"
    store_faults.fail_requests(2)
    store.put("k2", b"v2")
    assert [o.key for o in store.list()] == ["k", "k2"]


def test_unavailable_for_a_while_then_recovers(store: Store, store_faults: StoreFaults) -> None:
    store.put("k", b"v")
    store_faults.unavailable(0.6)
    t0 = time.monotonic()
    assert store.get("k") == b"v"
    store.put("k2", b"v2")
    assert time.monotonic() - t0 < 15


def test_unavailable_past_the_budget_raises(store: Store, store_faults: StoreFaults,
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SPARSESYNC_STORE_RETRY_S", "0.5")
    store_faults.unavailable(30)
    t0 = time.monotonic()
    with pytest.raises(StoreUnavailableError) as err:
        store.list("commits/")
    assert store.url.split("?")[0] in str(err.value) and err.value.hint
    assert time.monotonic() - t0 < 15


def test_hf_auth_failure_names_fix_not_token(hub_server: HubServer, monkeypatch: pytest.MonkeyPatch) -> None:
    secret = "hf_SuperSecretTokenThatMustNotLeak42"
    _hf_env(hub_server, monkeypatch)
    monkeypatch.setenv("HF_TOKEN", secret)
    hub_server.tokens = {HF_TEST_TOKEN}
    try:
        store = open_store(f"hf://buckets/{HF_TEST_BUCKET}/auth")
        for call in (store.list, lambda: store.put("x", b"1"), lambda: store.get("x")):
            with pytest.raises(StoreAuthError) as err:
                call()
            text = f"{err.value} {err.value!r} {err.value.url} {store!r} {store.url}"
            assert secret not in text and "HF_TOKEN" in err.value.hint
        monkeypatch.setenv("HF_TOKEN", HF_TEST_TOKEN)
        store.put("x", b"1")
        assert store.get("x") == b"1"
    finally:
        hub_server.tokens = None


def test_hf_bucket_created_private_unless_asked(hub_server: HubServer, monkeypatch: pytest.MonkeyPatch) -> None:
    _hf_env(hub_server, monkeypatch)
    with pytest.raises(StoreError) as err:
        open_store("hf://buckets/someone/missing-bucket/run").list()
    assert "missing-bucket" in str(err.value) and "create" in err.value.hint

    open_store("hf://buckets/someone/priv-bucket/run", create=True)
    open_store("hf://buckets/someone/pub-bucket/run", create=True, private=False)
    creates = {r.path: r.body for r in hub_server.requests if r.method == "POST" and r.path.count("/") == 4}
    assert creates["/api/buckets/someone/priv-bucket"] == {"visibility": "private"}
    assert creates["/api/buckets/someone/pub-bucket"] == {"visibility": "public"}
    assert hub_server.buckets["someone/priv-bucket"].private
    assert not hub_server.buckets["someone/pub-bucket"].private
    n = len(hub_server.requests)
    open_store("hf://buckets/someone/priv-bucket/run", create=True)  # exists: no second create
    assert not any(r.method == "POST" for r in hub_server.requests[n:])


def _hf_env(hub: HubServer, monkeypatch: pytest.MonkeyPatch) -> str:
    """Point huggingface_hub at the test hub; returns a fresh prefix in the test bucket."""
    monkeypatch.setenv("HF_ENDPOINT", hub.endpoint)
    monkeypatch.setenv("HF_TOKEN", HF_TEST_TOKEN)
    return f"t-{uuid.uuid4().hex[:12]}"


def test_hf_batch_partial_failure_resends_only_failed(hub_server: HubServer,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    prefix = _hf_env(hub_server, monkeypatch)
    store = open_store(f"hf://buckets/{HF_TEST_BUCKET}/{prefix}")
    hub_server.fail_batch_path(f"{prefix}/b", times=1)
    try:
        store.put_many([("a", b"1"), ("b", b"2")])
        assert store.get("b") == b"2"
        hub_server.fail_batch_path(f"{prefix}/c", times=10)
        with pytest.raises(StoreError) as err:
            store.put_many([("c", b"3"), ("d", b"4")])
        assert f"{prefix}/c" in str(err.value) and "1 of 2" in str(err.value)
        assert store.exists("d")
    finally:
        hub_server.heal()


def test_hf_stale_listing(store: Store, store_faults: StoreFaults) -> None:
    store.put("commits/v1", b"1")
    store_faults.stale_listing()
    store.put("commits/v2", b"2")
    assert [o.key for o in store.list("commits/")] == ["commits/v1"]
    assert not store.exists("commits/v2")
    assert store.get("commits/v2") == b"2"  # resolve is not stale, only listings
    store_faults.fresh_listing()
    assert [o.key for o in store.list("commits/")] == ["commits/v1", "commits/v2"]


def test_s3_auth_errors_are_classified(s3_server, monkeypatch: pytest.MonkeyPatch) -> None:
    from botocore.exceptions import ClientError

    from tests.support.s3_server import CREDENTIALS

    for k, v in CREDENTIALS.items():
        monkeypatch.setenv(k, v)
    store = open_store(f"s3://sparsesync-test/auth?endpoint={s3_server.direct_url}")
    denied = ClientError({"Error": {"Code": "InvalidAccessKeyId", "Message": "The key you provided does not exist"},
                          "ResponseMetadata": {"HTTPStatusCode": 403}}, "GetObject")
    err = store._translate(denied, "download", store.object_url("k"))  # type: ignore[attr-defined]
    assert isinstance(err, StoreAuthError) and "AWS_ACCESS_KEY_ID" in err.hint
    assert CREDENTIALS["AWS_SECRET_ACCESS_KEY"] not in f"{err} {store!r} {vars(store)}"


# -- URLs ----------------------------------------------------------------------------------
def test_open_store_urls(tmp_path: Path) -> None:
    s = open_store(f"file://{tmp_path}/via-url", create=True)
    s.put("k", b"v")
    assert (tmp_path / "via-url" / "k").read_bytes() == b"v" and s.url == f"file://{tmp_path}/via-url"
    assert open_store(str(tmp_path / "via-url")).get("k") == b"v"
    assert open_store(str(tmp_path / "not-yet")).list() == []
    for bad in ("", "ftp://x/y", "hf://buckets/only-namespace", "hf://datasets/a/b", "file://host/x"):
        with pytest.raises(ConfigError):
            open_store(bad)


def test_s3_endpoint_in_url(s3_server, monkeypatch: pytest.MonkeyPatch) -> None:  # type: ignore[no-untyped-def]
    from tests.support.s3_server import CREDENTIALS

    for k, v in CREDENTIALS.items():
        monkeypatch.setenv(k, v)
    monkeypatch.delenv("SPARSESYNC_S3_ENDPOINT", raising=False)
    url = f"s3://url-endpoint-bucket/p?endpoint={s3_server.direct_url}"
    store = open_store(url, create=True)
    store.put("k", b"v")
    assert store.url == url and store.object_url("k") == f"s3://url-endpoint-bucket/p/k?endpoint={s3_server.direct_url}"
    assert s3_server.client().get_object(Bucket="url-endpoint-bucket", Key="p/k")["Body"].read() == b"v"


# -- the one wrapper -------------------------------------------------------------------------
def test_every_backend_runs_its_operations_through_the_one_wrapper(store: Store) -> None:
    """`Store._call` is written once: no backend keeps its own copy; on each, a failure that is not
    transient is tried once and leaves as the backend translates it (S3, HF: a StoreError naming the
    operation; a folder: only OS errors are a store's answer, anything else leaves unchanged)."""
    from sparsesync.store.hf_bucket import HfBucketStore
    from sparsesync.store.local import LocalStore
    from sparsesync.store.s3 import S3Store

    assert [c.__name__ for c in (LocalStore, S3Store, HfBucketStore) if "_call" in vars(c)] == []
    calls = []

    def bug() -> None:
        calls.append(1)
        raise ZeroDivisionError("a bug")

    with pytest.raises((ZeroDivisionError, StoreError)) as err:
        store._call("probe", store.url, bug)  # type: ignore[attr-defined]
    assert calls == [1]  # not retried: only a transient failure is
    if isinstance(err.value, StoreError):
        assert "probe of" in str(err.value) and isinstance(err.value.__cause__, ZeroDivisionError)
    else:
        assert store.url.startswith("file://") or "://" not in store.url
    with pytest.raises(ObjectNotFoundError):
        store.get("no/such/key")
