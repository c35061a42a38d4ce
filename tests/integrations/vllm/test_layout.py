"""Checkpoint names -> vLLM layers (no vLLM needed): complete groups, and nothing more."""

from __future__ import annotations

from sparsesync.integrations.vllm.layout import Layout

SHAPES = {
    "model.embed_tokens.weight": (512, 128),
    "model.layers.0.self_attn.q_proj.weight": (128, 128),
    "model.layers.0.self_attn.k_proj.weight": (64, 128),
    "model.layers.0.self_attn.v_proj.weight": (64, 128),
    "model.layers.0.self_attn.o_proj.weight": (128, 128),
    "model.layers.0.mlp.gate.weight": (4, 128),
    "model.layers.0.input_layernorm.weight": (128,),
    **{
        f"model.layers.0.mlp.experts.{e}.{p}.weight": (64, 128) if p != "down_proj" else (128, 64)
        for e in range(4)
        for p in ("gate_proj", "up_proj", "down_proj")
    },
    "model.layers.1.mlp.gate_proj.weight": (256, 128),
    "model.layers.1.mlp.up_proj.weight": (256, 128),
    "model.layers.1.mlp.down_proj.weight": (128, 256),
}


def test_reload_groups_are_whole_vllm_layers_and_only_those_touched():
    layout = Layout(SHAPES, {"qkv_proj": ["q_proj", "k_proj", "v_proj"]})
    assert layout.complete_groups(["model.layers.0.self_attn.q_proj.weight"]) == [
        "model.layers.0.self_attn.k_proj.weight",
        "model.layers.0.self_attn.q_proj.weight",
        "model.layers.0.self_attn.v_proj.weight",
    ]
    experts = layout.complete_groups(["model.layers.0.mlp.experts.2.up_proj.weight"])
    assert len(experts) == 12 and all(".mlp.experts." in n for n in experts)  # every expert of the layer, nothing else
    assert layout.complete_groups(["model.layers.1.mlp.up_proj.weight"]) == [
        "model.layers.1.mlp.gate_proj.weight",
        "model.layers.1.mlp.up_proj.weight",
    ]
    assert layout.complete_groups(["model.layers.0.input_layernorm.weight"]) == [
        "model.layers.0.input_layernorm.weight"
    ]
    # the router is not an expert
    assert layout.complete_groups(["model.layers.0.mlp.gate.weight"]) == ["model.layers.0.mlp.gate.weight"]


def test_locations_in_fused_layers():
    layout = Layout(SHAPES)
    v = layout.locate("model.layers.0.self_attn.v_proj.weight")
    assert (v.module, v.param, v.kind, v.part, v.row0) == (
        "model.layers.0.self_attn.qkv_proj",
        "weight",
        "fused",
        2,
        192,
    )
    up = layout.locate("model.layers.0.mlp.experts.3.up_proj.weight")
    assert (up.module, up.param, up.kind, up.expert, up.part) == (
        "model.layers.0.mlp.experts",
        "w13_weight",
        "expert_w13",
        3,
        1,
    )
    down = layout.locate("model.layers.0.mlp.experts.1.down_proj.weight")
    assert (down.param, down.kind, down.expert) == ("w2_weight", "expert_w2", 1)
    assert layout.locate("model.embed_tokens.weight").kind == "vocab"


def test_auto_picks_the_reload_path_on_gpu_too_and_sparse_is_an_opt_in():
    """The sparse in-place path has never run on a GPU here: `auto` must not pick it anywhere."""
    import pytest

    from inference_space.engines.vllm_engine import apply_mode
    from sparsesync.errors import EngineError

    assert apply_mode("auto", on_cpu=False) == "reload"
    assert apply_mode("auto", on_cpu=True) == "reload"
    assert apply_mode("reload", on_cpu=False) == "reload"
    assert apply_mode("sparse", on_cpu=False) == "sparse"  # asked for by name only
    with pytest.raises(EngineError, match="needs a GPU"):
        apply_mode("sparse", on_cpu=True)
    with pytest.raises(EngineError, match="expected one of"):
        apply_mode("inplace", on_cpu=False)


def test_vllm_apply_flag_reaches_the_replica_config():
    import pytest

    from inference_space.__main__ import parse_config
    from sparsesync.errors import SparsesyncError

    assert parse_config(["--model", "m"], environ={})[0].vllm_apply == "auto"
    assert parse_config(["--model", "m", "--vllm-apply", "sparse"], environ={})[0].vllm_apply == "sparse"
    assert parse_config(["--model", "m"], environ={"SPARSESYNC_VLLM_APPLY": "reload"})[0].vllm_apply == "reload"
    with pytest.raises(SparsesyncError, match="expected auto, reload or sparse"):
        parse_config(["--model", "m", "--vllm-apply", "fast"], environ={})
