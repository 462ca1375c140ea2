"""Mixtral: softmax top-k router (always renormalised), no shared expert; its checkpoints name
the block `block_sparse_moe` and the experts' projections w1 (gate), w3 (up), w2 (down)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from moerl.models.families.base import ExpertNames, Family, softmax_weights

if TYPE_CHECKING:
    from moerl.config import TinyMoeConfig


def tiny_config(t: TinyMoeConfig, common: dict[str, Any]) -> Any:
    from transformers import MixtralConfig

    return MixtralConfig(
        intermediate_size=t.moe_intermediate_size, num_local_experts=t.num_experts, **common
    )


FAMILY = Family(
    model_type="mixtral",
    name="Mixtral",
    config_class="MixtralConfig",
    model_class="MixtralForCausalLM",
    router_class="MixtralTopKRouter",
    router_weights=softmax_weights(norm_attr=False, cast=False),
    num_experts_fields=("num_local_experts",),
    tiny_config=tiny_config,
    checkpoint_block="block_sparse_moe",
    expert_names=ExpertNames("w1", "w3", "w2"),
)
