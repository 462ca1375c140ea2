"""Qwen2-MoE: softmax top-k router, one shared expert scaled by the sigmoid of its own gate."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from moerl.models.families.base import Family, softmax_weights

if TYPE_CHECKING:
    from moerl.config import TinyMoeConfig


def tiny_config(t: TinyMoeConfig, common: dict[str, Any]) -> Any:
    from transformers import Qwen2MoeConfig

    common = {k: v for k, v in common.items() if k != "head_dim"}  # hidden / heads
    return Qwen2MoeConfig(
        intermediate_size=t.moe_intermediate_size * 2,
        moe_intermediate_size=t.moe_intermediate_size,
        shared_expert_intermediate_size=t.moe_intermediate_size * 2,
        num_experts=t.num_experts,
        decoder_sparse_step=1,
        norm_topk_prob=True,
        **common,
    )


FAMILY = Family(
    model_type="qwen2_moe",
    name="Qwen2-MoE",
    config_class="Qwen2MoeConfig",
    model_class="Qwen2MoeForCausalLM",
    router_class="Qwen2MoeTopKRouter",
    router_weights=softmax_weights(norm_attr=True, cast=True),
    num_experts_fields=("num_experts",),
    tiny_config=tiny_config,
    shared_experts="shared_expert",
    shared_expert_gate="shared_expert_gate",
)
