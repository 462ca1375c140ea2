"""Qwen3-MoE: softmax top-k router, no shared expert; the embedded tiny policy's default."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from moerl.models.families.base import Family, softmax_weights

if TYPE_CHECKING:
    from moerl.config import TinyMoeConfig


def tiny_config(t: TinyMoeConfig, common: dict[str, Any]) -> Any:
    from transformers import Qwen3MoeConfig

    return Qwen3MoeConfig(
        intermediate_size=t.moe_intermediate_size * 2,
        moe_intermediate_size=t.moe_intermediate_size,
        num_experts=t.num_experts,
        decoder_sparse_step=1,
        norm_topk_prob=True,
        **common,
    )


FAMILY = Family(
    model_type="qwen3_moe",
    name="Qwen3-MoE",
    config_class="Qwen3MoeConfig",
    model_class="Qwen3MoeForCausalLM",
    router_class="Qwen3MoeTopKRouter",
    router_weights=softmax_weights(norm_attr=True, cast=True),
    # hub checkpoints write num_experts, transformers 5 writes num_local_experts
    num_experts_fields=("num_experts", "num_local_experts"),
    tiny_config=tiny_config,
)
