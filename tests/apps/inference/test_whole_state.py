"""Issue 48, section 1, embedded engine: a replica labels a completion N only when every tensor
its forward pass reads holds version N's bits, however they changed.

A replica follows version 1 of a run; then something in the process changes one parameter that
version 2 leaves as it is (an in-place edit, a replaced Parameter, a new Parameter at the old
address); version 2 arrives as a delta. The replica must end at version 2 bit-exact (read from
the engine's live parameters, and greedy output equal to a fresh engine of version 2), reloading
on the way, or refuse loudly; never report version 2 over the edited bits.
"""

from __future__ import annotations

import pytest

pytest.importorskip("transformers", reason="the embedded engine needs transformers (pip install -e '.[embedded]')")

import torch  # noqa: E402

from inference_space.engines.embedded import EmbeddedEngine  # noqa: E402
from sparsesync.codec import tensor_digests  # noqa: E402
from sparsesync.protocol.follower.follower import Follower  # noqa: E402
from sparsesync.protocol.writer.publisher import Publisher  # noqa: E402
from tests.support.generation import greedy  # noqa: E402
from tests.support.model_steps import Trainer  # noqa: E402

NORM = "model.norm.weight"  # what the hostile edit changes; version 2 leaves it as version 1 had it


def follow_edit_follow(engine, model_dir, bucket: str, edit):  # type: ignore[no-untyped-def]
    """Version 1, then `edit()`, then version 2 (a delta that does not touch NORM). Returns the
    follower and version 2's state."""
    trainer = Trainer(model_dir, seed=4)
    follower = Follower(bucket, hook=engine, poll_interval=0.05)
    with Publisher(bucket, anchor_every=0) as pub:
        v1 = trainer.step()
        pub.publish(v1, 1)
        pub.flush()
        assert follower.sync_once() == 1 and engine.weight_version == 1
        edit()
        v2 = dict(trainer.step())
        v2[NORM] = v1[NORM]
        trainer.state = v2
        pub.publish(v2, 2)
        pub.flush()
        follower.sync_once()
    rec = follower.run.newest()
    assert rec is not None and rec.version == 2 and (rec.delta is not None or rec.parts), (
        "version 2 must arrive as a delta"
    )
    return follower, trainer


def assert_bit_exact_at_2(engine, follower, trainer, tmp_path, caplog) -> None:  # type: ignore[no-untyped-def]
    # refusing loudly (no version, degraded) would also keep the promise; these engines recover
    assert engine.check_error is None, f"refused instead of reloading: {engine.check_error}"
    live = engine.state_dict()  # read from the engine's live parameters (views of the model's module tree)
    assert not torch.equal(live[NORM], torch.zeros_like(live[NORM])), "labels v2 over the zeroed norm"
    assert engine.weight_version == 2 and follower.status().current_version == 2
    assert tensor_digests(live) == tensor_digests(trainer.state), "the replica labels v2 but holds other bits"
    assert greedy(engine) == greedy(EmbeddedEngine(trainer.save_version(tmp_path / "v2"))), (
        "labels v2, computes otherwise"
    )
    assert any("reloading all weights" in r.getMessage() for r in caplog.records), "the edit went unseen"


def _norm(engine):  # type: ignore[no-untyped-def]
    return engine.model.model.norm


def test_an_in_place_edit_of_a_parameter_no_version_touched_is_caught(tiny, tmp_path, caplog):
    engine = EmbeddedEngine(tiny)
    with caplog.at_level("ERROR"):
        follower, trainer = follow_edit_follow(
            engine, tiny, str(tmp_path / "b"), lambda: _norm(engine).weight.data.zero_()
        )
    assert_bit_exact_at_2(engine, follower, trainer, tmp_path, caplog)


def test_a_replaced_parameter_object_is_caught(tiny, tmp_path, caplog):
    engine = EmbeddedEngine(tiny)

    def replace() -> None:
        _norm(engine).weight = torch.nn.Parameter(torch.zeros_like(_norm(engine).weight), requires_grad=False)

    with caplog.at_level("ERROR"):
        follower, trainer = follow_edit_follow(engine, tiny, str(tmp_path / "b"), replace)
    assert_bit_exact_at_2(engine, follower, trainer, tmp_path, caplog)


def test_a_new_parameter_at_the_old_address_is_caught(tiny, tmp_path, caplog):
    """A new Parameter object whose storage lands where the old one was: the address alone (what
    the engine compared before) cannot tell them apart; object and storage identity, and the
    content digest, do."""
    engine = EmbeddedEngine(tiny)
    addr: list[int] = []

    def same_address() -> None:
        old = _norm(engine).weight
        addr.append(old.data_ptr())
        new = torch.empty(0, dtype=old.dtype).set_(old.untyped_storage(), old.storage_offset(), old.shape, old.stride())
        _norm(engine).weight = torch.nn.Parameter(new, requires_grad=False)
        _norm(engine).weight.data.fill_(0.5)

    with caplog.at_level("ERROR"):
        follower, trainer = follow_edit_follow(engine, tiny, str(tmp_path / "b"), same_address)
    assert addr and _norm(engine).weight.data_ptr() == addr[0], "the new tensor must sit at the old address"
    assert_bit_exact_at_2(engine, follower, trainer, tmp_path, caplog)


def test_a_sparse_update_without_the_follower_still_checks_the_untouched_tensors(tiny):
    """Without `digests=` (a caller other than the follower) the engine checks every untouched
    tensor against the digests it recorded at its last passing check."""
    from sparsesync.codec.apply import SparseUpdate
    from sparsesync.errors import EngineCheckError

    engine = EmbeddedEngine(tiny)
    trainer = Trainer(tiny, seed=5)
    engine.load_full(1, trainer.step())
    _norm(engine).weight.data[0] = 7.0
    name = "model.layers.1.self_attn.o_proj.weight"
    new = trainer.state[name].clone()
    new.view(-1)[:4] += 1
    with pytest.raises(EngineCheckError, match=f"{NORM} \\(not in this update"):
        engine.apply_sparse(2, {name: SparseUpdate(torch.arange(4), new.view(-1)[:4].clone())}, {name: new})
    assert engine.weight_version is None
