"""`build_replica` opens the run's bucket once (issue 49): the adapter check at start and the
follower share one store, counted through the real folder store; the replica closes it."""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("transformers", reason="the embedded engine needs transformers")

from inference_space.replica import ReplicaConfig, build_replica  # noqa: E402
from sparsesync.protocol.writer.publisher import Publisher  # noqa: E402
from sparsesync.store.local import LocalStore  # noqa: E402
from tests.support.model_steps import Trainer  # noqa: E402


def test_build_replica_opens_the_bucket_once(tiny: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    bucket = tmp_path / "bucket"
    with Publisher(str(bucket)) as pub:
        pub.publish(Trainer(tiny).state, 0)
    opened: list[LocalStore] = []
    closed: list[LocalStore] = []
    init, close = LocalStore.__init__, LocalStore.close

    def counted_init(self: LocalStore, *args: object, **kwargs: object) -> None:
        init(self, *args, **kwargs)  # type: ignore[arg-type]
        opened.append(self)

    def counted_close(self: LocalStore) -> None:
        closed.append(self)
        close(self)

    monkeypatch.setattr(LocalStore, "__init__", counted_init)
    monkeypatch.setattr(LocalStore, "close", counted_close)
    replica = build_replica(ReplicaConfig(model=str(tiny), bucket=str(bucket), poll_interval=0.05))
    try:
        assert len(opened) == 1, f"{len(opened)} stores opened on {bucket}"
        assert replica.follower is not None and replica.follower.store is opened[0]
        replica.start()
        replica.follower.wait_for_version(0, timeout=60)
        assert replica.weight_version == 0 and len(opened) == 1
    finally:
        replica.close()
    assert opened[0] in closed
