"""The model families moerl trains and serves, one module each, and the registry that answers
for them: `family_of(config or model_type)`. Nothing outside `moerl/models/` tests `model_type`
strings; it asks the family. How to add one: moerl/models/README.md.
"""

from __future__ import annotations

from typing import Any

from moerl.errors import ConfigError
from moerl.models.families import deepseek_v3, mixtral, olmoe, qwen2_moe, qwen3_moe
from moerl.models.families.base import ExpertNames, Family, config_get

__all__ = [
    "FAMILIES",
    "SUPPORTED_MODEL_TYPES",
    "ExpertNames",
    "Family",
    "UnsupportedModelType",
    "family_of",
    "replay_problem",
    "router_bias_names",
    "router_classes",
]

# In the order messages list them
FAMILIES: tuple[Family, ...] = (
    qwen3_moe.FAMILY,
    mixtral.FAMILY,
    qwen2_moe.FAMILY,
    olmoe.FAMILY,
    deepseek_v3.FAMILY,
)
_BY_TYPE: dict[str, Family] = {f.model_type: f for f in FAMILIES}
SUPPORTED_MODEL_TYPES: tuple[str, ...] = tuple(_BY_TYPE)


class UnsupportedModelType(ConfigError):
    """A model_type no registered family answers for."""


def family_of(config_or_model_type: Any) -> Family:
    """The family of an HF config (object or config.json dict), a model, or a model_type."""
    if isinstance(config_or_model_type, str):
        model_type: Any = config_or_model_type
    else:
        config = getattr(config_or_model_type, "config", config_or_model_type)
        model_type = config_get(config, "model_type")
    family = _BY_TYPE.get(model_type) if isinstance(model_type, str) else None
    if family is None:
        raise UnsupportedModelType(
            f"model_type {model_type!r} is not a supported MoE family; supported: "
            f"{', '.join(SUPPORTED_MODEL_TYPES)}"
        )
    return family


def source_tags(config: Any) -> dict[str, str]:
    """The run tags naming a model's family, from its HF config (`moerl.model.family`, and
    `moerl.model.model_type` as HF spells it)."""
    family = family_of(config)
    return {"moerl.model.family": family.name, "moerl.model.model_type": family.model_type}


def moe_disclosure(cfg: dict[str, Any]) -> dict[str, Any]:
    """Experts per token and in total, layers, vocabulary, from a config.json, as its model
    family reads them; a model of no registered MoE family discloses its layers and vocabulary
    only (None: absent). A multimodal config is read through its `text_config`."""
    text = cfg.get("text_config") or cfg
    try:
        family = family_of(text)
        shape, kind = family.shape(text), family.model_type
    except (UnsupportedModelType, ValueError):
        shape, kind = {}, None
    return {
        "model_type": kind,  # the report's field: the family's name for it
        "experts_per_token": shape.get("experts_per_token"),
        "experts": shape.get("num_experts"),
        "layers": text.get("num_hidden_layers"),
        "hidden_size": text.get("hidden_size"),
        "vocab_size": text.get("vocab_size"),
    }


def router_classes() -> dict[str, Family]:
    """Router class name -> its family, over every registered family."""
    return {f.router_class: f for f in FAMILIES}


def router_bias_names() -> tuple[str, ...]:
    """The bias-correction buffers of the families whose router has one."""
    return tuple(f.router_bias for f in FAMILIES if f.router_bias is not None)


def replay_problem(family: Family) -> str | None:
    """Why routing replay and routed-expert capture cannot run on `family` (None: they can)."""
    if family.router_replay:
        return None
    known = ", ".join(f.model_type for f in FAMILIES if f.router_replay)
    return f"routing replay and routed-expert capture know the routers of {known}; model.path is a {family.model_type!r}"
