"""The model-family registry (`moerl.models.families`): every family answers every question the
trainer, the engine and preflight ask, on a tiny model of its own built from a config."""

import json

import pytest
import torch
from safetensors import safe_open

from moerl.config import TinyMoeConfig
from moerl.errors import ConfigError
from moerl.models.families import (
    FAMILIES,
    SUPPORTED_MODEL_TYPES,
    Family,
    UnsupportedModelType,
    family_of,
    router_bias_names,
    router_classes,
)
from moerl.models.tiny import tiny_hf_config

ARCHS = [f.model_type for f in FAMILIES]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """arch -> (model, checkpoint dir, config.json): each family's tiny model from `model.tiny`,
    saved as transformers saves it."""
    from transformers import AutoModelForCausalLM

    root = tmp_path_factory.mktemp("families")
    out = {}
    for arch in ARCHS:
        t = TinyMoeConfig(
            architecture=arch, hidden_size=32, num_layers=2, num_heads=2, num_kv_heads=1
        )
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(tiny_hf_config(t, 16, 0, 1, 2))
        model.save_pretrained(root / arch)
        out[arch] = (model, root / arch, json.loads((root / arch / "config.json").read_text()))
    return out


def _disk_keys(path) -> set[str]:
    with safe_open(str(path / "model.safetensors"), framework="pt") as f:
        return set(f.keys())


def test_the_registry_lists_every_family_once_in_message_order():
    assert SUPPORTED_MODEL_TYPES == ("qwen3_moe", "mixtral", "qwen2_moe", "olmoe", "deepseek_v3")
    assert all(isinstance(f, Family) for f in FAMILIES)
    assert len({f.router_class for f in FAMILIES}) == len(FAMILIES)
    assert set(router_classes()) == {f.router_class for f in FAMILIES}
    assert router_bias_names() == ("e_score_correction_bias",)


@pytest.mark.parametrize("asked", ["llama", None, 3, {"model_type": "gpt2"}, {}])
def test_an_unknown_model_type_is_refused_naming_the_supported_ones(asked):
    with pytest.raises(UnsupportedModelType) as err:
        family_of(asked)
    assert isinstance(err.value, ConfigError)
    msg = str(err.value)
    assert "is not a supported MoE family" in msg
    assert all(t in msg for t in SUPPORTED_MODEL_TYPES)
    if asked == "llama":
        assert "'llama'" in msg


@pytest.mark.parametrize("arch", ARCHS)
def test_the_family_is_found_from_a_type_a_config_a_dict_and_a_model(tiny, arch):
    model, _, hf = tiny[arch]
    f = family_of(arch)
    assert f.model_type == arch
    assert family_of(hf) is f and family_of(model.config) is f and family_of(model) is f
    assert type(model.config).__name__ == f.config_class
    assert type(model).__name__ == f.model_class


@pytest.mark.parametrize("arch", ARCHS)
def test_every_family_answers_about_its_model(tiny, arch):
    model, _, hf = tiny[arch]
    f = family_of(arch)
    assert f.num_experts(model.config) == f.num_experts(hf) == 8
    moe = f.moe_layer_ids(model.config)
    assert moe == f.moe_layer_ids(hf)
    layers = model.model.layers
    for i, layer in enumerate(layers):  # a layer is sparse exactly where the family says
        block = getattr(layer, f.moe_block)
        assert hasattr(block, "experts") == (i in moe)
    block = getattr(layers[moe[0]], f.moe_block)
    assert {n for n, _ in block.named_children()} == set(f.block_parts)
    router = block.gate
    assert type(router).__name__ == f.router_class
    assert hasattr(router, "e_score_correction_bias") == (f.router_bias is not None)
    for name in ("shared_experts", "shared_expert", "shared_expert_gate"):
        assert hasattr(block, name) == (name in (f.shared_experts, f.shared_expert_gate))
    assert f.uses_mla == (hf.get("kv_lora_rank") is not None)
    assert f.config_limits(hf) is None  # the tiny checkpoint is one moerl accepts
    assert f.router_replay


@pytest.mark.parametrize("arch", ARCHS)
def test_router_weights_at_the_routers_own_ids_equal_its_forward(tiny, arch):
    """What routing replay recomputes at forced ids is what the router computed itself."""
    model, _, _ = tiny[arch]
    f = family_of(arch)
    block = getattr(model.model.layers[f.moe_layer_ids(model.config)[0]], f.moe_block)
    x = torch.randn(7, model.config.hidden_size, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        logits, w, ids = block.gate(x)
        again = f.router_weights(block.gate, logits, ids)
    assert torch.allclose(again.to(w.dtype), w, atol=1e-6)


@pytest.mark.parametrize("arch", ARCHS)
def test_checkpoint_keys_round_trip_to_the_model_and_back(tiny, arch):
    """Every key `save_pretrained` wrote maps to a model tensor, and every model tensor to the
    keys on disk: non-expert tensors by name, a layer's fused experts to one tensor per expert."""
    model, path, _ = tiny[arch]
    f = family_of(arch)
    disk = _disk_keys(path)
    names = set(model.state_dict())
    assert {f.model_name(k) for k in disk} == names
    covered: set[str] = set()
    for name in names:
        if name.endswith((".experts.gate_up_proj", ".experts.down_proj")):
            continue
        hits = [k for k in f.checkpoint_names(name) if k in disk]
        assert len(hits) == 1, name
        assert f.model_name(hits[0]) == name
        covered.add(hits[0])
    for i in f.moe_layer_ids(model.config):
        block = f"model.layers.{i}.{f.moe_block}"
        templates = [t for t in f.expert_templates(block) if t[0].format(e=0) in disk]
        assert len(templates) == 1
        for e in range(f.num_experts(model.config)):
            keys = [t.format(e=e) for t in templates[0]]
            assert set(keys) <= disk
            assert [f.model_name(k) for k in keys] == [
                f"{block}.experts.gate_up_proj",
                f"{block}.experts.gate_up_proj",
                f"{block}.experts.down_proj",
            ]
            covered |= set(keys)
        fused = f.fused_expert_keys(block)[0]
        assert [f.model_name(k) for k in fused] == [
            f"{block}.experts.gate_up_proj",
            f"{block}.experts.down_proj",
        ]
    assert covered == disk  # nothing on disk left without a place


def test_mixtral_checkpoints_name_the_block_and_experts_their_own_way():
    f = family_of("mixtral")
    assert f.checkpoint_names("model.layers.0.mlp.gate.weight") == [
        "model.layers.0.mlp.gate.weight",
        "model.layers.0.block_sparse_moe.gate.weight",
    ]
    assert f.expert_templates("model.layers.0.mlp")[1] == tuple(
        f"model.layers.0.block_sparse_moe.experts.{{e}}.{w}.weight" for w in ("w1", "w3", "w2")
    )
    assert f.model_name("model.layers.0.block_sparse_moe.experts.3.w2.weight") == (
        "model.layers.0.mlp.experts.down_proj"
    )
    assert family_of("qwen3_moe").checkpoint_names("model.layers.0.mlp.gate.weight") == [
        "model.layers.0.mlp.gate.weight"
    ]


def test_dense_layers_come_from_the_familys_own_fields():
    ds, qwen = family_of("deepseek_v3"), family_of("qwen2_moe")
    assert ds.moe_layer_ids({"num_hidden_layers": 5, "first_k_dense_replace": 2}) == [2, 3, 4]
    assert ds.moe_layer_ids(
        {"num_hidden_layers": 6, "first_k_dense_replace": 1, "moe_layer_freq": 2}
    ) == [2, 4]
    assert qwen.moe_layer_ids(
        {"num_hidden_layers": 4, "decoder_sparse_step": 2, "mlp_only_layers": [3]}
    ) == [1]
    assert family_of("mixtral").moe_layer_ids({"num_hidden_layers": 3}) == [0, 1, 2]


def test_the_limits_name_what_vllm_would_serve_differently():
    assert "norm_topk_prob true" in (
        family_of("olmoe").config_limits({"norm_topk_prob": True}) or ""
    )
    ds = family_of("deepseek_v3")
    assert 'needs topk_method "noaux_tc"' in (ds.config_limits({"topk_method": "greedy"}) or "")
    assert ds.config_limits({"topk_method": "noaux_tc"}) is None
    assert ds.vllm_cpu_problem and all(f.vllm_cpu_problem is None for f in FAMILIES if f is not ds)


def test_a_config_without_the_experts_field_is_refused():
    with pytest.raises(ValueError, match="n_routed_experts"):
        family_of("deepseek_v3").num_experts({"model_type": "deepseek_v3"})
