"""One key set for every run: `checkpoint_state` and the publisher that applies it."""

from __future__ import annotations

import pytest
import torch

from sparsesync.checkpoint import check_tied, checkpoint_state, shared_aliases, split_fused_experts
from sparsesync.errors import ConfigError
from sparsesync.protocol.follower.follower import Follower
from sparsesync.protocol.writer.publisher import Publisher


def _tied_state_dict() -> dict[str, torch.Tensor]:
    """What `model.state_dict()` of a tied model returns: the head is the embedding's storage."""
    g = torch.Generator().manual_seed(0)
    embed = torch.randn(32, 8, generator=g).to(torch.bfloat16)
    return {
        "model.embed_tokens.weight": embed,
        "model.layers.0.mlp.up_proj.weight": torch.randn(16, 8, generator=g).to(torch.bfloat16),
        "model.norm.weight": torch.ones(8, dtype=torch.bfloat16),
        "lm_head.weight": embed,
    }


def test_tied_alias_kept_once_under_the_checkpoint_name():
    out = checkpoint_state(_tied_state_dict())
    assert sorted(out) == ["model.embed_tokens.weight", "model.layers.0.mlp.up_proj.weight", "model.norm.weight"]


def test_a_run_that_holds_both_tied_names_gets_both_fresh_when_the_tie_comes_back():
    """A run whose key set has the head and the embedding as two tensors (its trainer cast them
    apart) continued from a state where they share one storage: both names carry the new values.
    Before, the head was dropped as an alias and then refilled from the previous version: a
    stale LM head."""
    old = {k: v.clone() for k, v in _tied_state_dict().items()}  # the run's previous version: two tensors
    new = _tied_state_dict()
    new["model.embed_tokens.weight"].add_(1)  # a step later, tied again (lm_head is the same storage)
    out = checkpoint_state(new, reference=old)
    assert sorted(out) == sorted(old)
    assert torch.equal(out["lm_head.weight"], new["model.embed_tokens.weight"])
    assert not torch.equal(out["lm_head.weight"], old["lm_head.weight"])


def test_runtime_fused_experts_are_split_per_expert():
    gate_up = torch.arange(2 * 6 * 4, dtype=torch.float32).view(2, 6, 4).to(torch.bfloat16)
    down = torch.arange(2 * 4 * 3, dtype=torch.float32).view(2, 4, 3).to(torch.bfloat16)
    out = checkpoint_state(
        {"model.layers.0.mlp.experts.gate_up_proj": gate_up, "model.layers.0.mlp.experts.down_proj": down}
    )
    assert torch.equal(out["model.layers.0.mlp.experts.1.gate_proj.weight"], gate_up[1, :3])
    assert torch.equal(out["model.layers.0.mlp.experts.1.up_proj.weight"], gate_up[1, 3:])
    assert torch.equal(out["model.layers.0.mlp.experts.0.down_proj.weight"], down[0])
    assert len(out) == 6


def test_tied_aliases_are_found_by_storage_and_checked_by_value():
    """What a sharded publisher keeps of a tie (`shared_aliases`, on local shards) and the check of
    every later version (`check_tied`): still the same storage or equal, else a clear error."""
    state = _tied_state_dict()
    assert shared_aliases(state) == {"lm_head.weight": "model.embed_tokens.weight"}
    assert shared_aliases({"a": torch.zeros(0), "b": torch.zeros(0)}) == {}  # empty shards say nothing
    aliases = shared_aliases(state)
    check_tied(state, aliases)
    check_tied({**state, "lm_head.weight": state["lm_head.weight"].clone()}, aliases)  # a copy, equal
    untied = state["lm_head.weight"].clone()
    untied[3, 1] += 1
    with pytest.raises(ConfigError, match="'lm_head.weight' was tied to 'model.embed_tokens.weight'"):
        check_tied({**state, "lm_head.weight": untied}, aliases)


def test_a_shard_of_fused_experts_is_named_from_its_first_expert():
    gate_up = torch.arange(2 * 6 * 4, dtype=torch.float32).view(2, 6, 4)  # experts 2 and 3 of 4
    out = split_fused_experts("model.layers.0.mlp.experts.gate_up_proj", gate_up, first=2)
    assert list(out) == [f"model.layers.0.mlp.experts.{e}.{p}_proj.weight" for e in (2, 3) for p in ("gate", "up")]
    assert torch.equal(out["model.layers.0.mlp.experts.3.up_proj.weight"], gate_up[1, 3:])
    assert split_fused_experts("model.layers.0.mlp.up_proj.weight", gate_up) is None


def test_frozen_tensors_come_from_the_previous_version_and_strangers_are_refused():
    ref = checkpoint_state(_tied_state_dict())
    trainable = {"model.layers.0.mlp.up_proj.weight": ref["model.layers.0.mlp.up_proj.weight"] + 1}
    out = checkpoint_state(trainable, ref)
    assert out.keys() == ref.keys() and out["model.norm.weight"] is ref["model.norm.weight"]
    cloned_alias = dict(ref, **{"lm_head.weight": ref["model.embed_tokens.weight"].clone()})  # a copy, not a view
    assert checkpoint_state(cloned_alias, ref).keys() == ref.keys()
    with pytest.raises(ConfigError, match="'model.extra.weight'"):
        checkpoint_state(dict(ref, **{"model.extra.weight": torch.zeros(2)}), ref)


def test_publisher_takes_a_tied_state_dict_and_trainable_only_updates(tmp_path):
    bucket = str(tmp_path / "bucket")
    sd = _tied_state_dict()
    follower = Follower(bucket)
    with Publisher(bucket, anchor_every=0) as pub:
        pub.publish(sd, 1)
        sd2 = {k: v.clone() for k, v in sd.items()}
        sd2["lm_head.weight"] = sd2["model.embed_tokens.weight"]  # still tied
        sd2["model.embed_tokens.weight"][0, 0] += 1
        pub.publish(sd2, 2)
        pub.publish({"model.layers.0.mlp.up_proj.weight": sd["model.layers.0.mlp.up_proj.weight"] * 2}, 3)
        with pytest.raises(ConfigError, match="key set"):
            pub.publish({"model.unknown.weight": torch.zeros(3)}, 4)
        pub.flush()
    assert follower.sync_once() == 3
    assert sorted(follower.mirror) == [
        "model.embed_tokens.weight",
        "model.layers.0.mlp.up_proj.weight",
        "model.norm.weight",
    ]
    assert torch.equal(follower.mirror["model.embed_tokens.weight"], sd2["model.embed_tokens.weight"])
    assert torch.equal(
        follower.mirror["model.layers.0.mlp.up_proj.weight"], sd["model.layers.0.mlp.up_proj.weight"] * 2
    )
