"""The hook's contract (`ApplyHook`): its capability fields are declared on the protocol, default
False, and the follower passes a keyword (state_digest=, digests=, base_version=) only to a hook
whose field says it takes it, with the values of the version it hands over."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from sparsesync.codec import tensor_digests
from sparsesync.codec.apply import SparseUpdate
from sparsesync.protocol.follower.follower import Follower
from sparsesync.protocol.follower.hooks import ApplyHook
from sparsesync.protocol.run import Run
from sparsesync.protocol.writer.publisher import Publisher
from tests.support.weights import make_state, train_step


class _Plain(ApplyHook):
    """Takes nothing beyond the weights: any keyword would be a TypeError."""

    def __init__(self) -> None:
        self.calls: list[str] = []

    def load_full(self, version, tensors):  # type: ignore[no-untyped-def]
        self.calls.append(f"full {version}")

    def apply_sparse(self, version, updates, full):  # type: ignore[no-untyped-def]
        self.calls.append(f"sparse {version}")


class _Labelled(ApplyHook):
    takes_state_digest = True
    takes_digests = True
    takes_base_version = True

    def __init__(self) -> None:
        self.calls: list[tuple[str, int, dict[str, Any]]] = []

    def load_full(self, version: int, tensors: Mapping[str, torch.Tensor], **kw: Any) -> None:
        self.calls.append(("full", version, kw))

    def apply_sparse(self, version: int, updates: Mapping[str, SparseUpdate], full: Mapping[str, torch.Tensor],
                     **kw: Any) -> None:
        self.calls.append(("sparse", version, kw))


def test_capability_fields_are_declared_and_default_false() -> None:
    for field in ("takes_state_digest", "takes_digests", "takes_base_version", "pages_out_mirror"):
        assert ApplyHook.__annotations__[field] == "bool"
        assert getattr(_Plain(), field) is False


def test_follower_passes_only_what_a_hook_takes(tmp_path: Path) -> None:
    url = str(tmp_path / "run")
    g = torch.Generator().manual_seed(0)
    states = [make_state(0)]
    states.append(train_step(states[0], g))
    plain, labelled = _Plain(), _Labelled()
    followers = [Follower(url, plain, mirror_dir=tmp_path / "m1"), Follower(url, labelled, mirror_dir=tmp_path / "m2")]
    with Publisher(url, anchor_every=0) as pub:
        pub.publish(states[0], 0)
        pub.flush()
        assert [f.sync_once() for f in followers] == [0, 0]
        pub.publish(states[1], 1)
        pub.flush()
        assert [f.sync_once() for f in followers] == [1, 1]
    assert plain.calls == ["full 0", "sparse 1"]
    commits = {c.version: c for c in Run(url).commits()}
    assert [(kind, v) for kind, v, _ in labelled.calls] == [("full", 0), ("sparse", 1)]
    (_, _, full_kw), (_, _, sparse_kw) = labelled.calls
    assert full_kw == {"state_digest": commits[0].state_digest, "digests": tensor_digests(states[0])}
    assert sparse_kw == {
        "state_digest": commits[1].state_digest,
        "digests": tensor_digests(states[1]),
        "base_version": 0,
    }
    for f in followers:
        f.stop()
