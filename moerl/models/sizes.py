"""A model's size from its HF config alone: parameters (dense, routed experts) and KV cache
bytes per token, for every registered family. Pure arithmetic, no weights read; what the rollout
engine's memory fit (moerl.launch.layout) and `moerl bench project` use.

Counted: embeddings (and lm_head unless tied), attention (GQA: q, k, v, o; MLA: q_a/q_b or q,
kv_a, kv_b, o), dense MLPs (gate, up, down), per MoE layer the routed experts (3 x hidden x
width each), the router and any shared experts. Norms and biases are left out (well under 0.1 %).
DeepSeek-V3's multi-token-prediction layer is not counted (vLLM does not load it by default).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from moerl.models.families import family_of

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2, "fp8": 1}


@dataclass(frozen=True)
class ModelSizes:
    """What the engine memory fit needs of one model."""

    embed_params: int  # embeddings + lm_head
    dense_params: int  # attention, dense MLPs, routers, shared experts (not embeddings)
    expert_params: int  # routed experts, all MoE layers
    layers: int
    kv_heads: int  # KV heads per layer (GQA); 0 with MLA
    head_dim: int
    mla_kv_dim: int  # kv_lora_rank + qk_rope_head_dim per layer with MLA, else 0
    max_position_embeddings: int
    fp8: bool  # the checkpoint's linear layers are FP8 (quantization_config quant_method fp8)

    @property
    def total_params(self) -> int:
        return self.embed_params + self.dense_params + self.expert_params

    def kv_bytes_per_token(self, dtype_bytes: int, tp: int = 1) -> int:
        """KV cache bytes of one token on one GPU of a tensor-parallel group of `tp`: GQA shards
        the KV heads over TP (replicated when TP > heads); MLA's latent is on every rank."""
        if self.mla_kv_dim:
            return self.layers * self.mla_kv_dim * dtype_bytes
        heads = max(1, self.kv_heads // tp)
        return self.layers * 2 * heads * self.head_dim * dtype_bytes


def _int(hf: Mapping[str, Any], key: str, default: int = 0) -> int:
    v = hf.get(key)
    return int(v) if v is not None else default


def model_sizes(hf: Mapping[str, Any]) -> ModelSizes:
    """`ModelSizes` of an HF config.json (as a dict) of a registered family."""
    family = family_of(dict(hf))
    h, layers = _int(hf, "hidden_size"), _int(hf, "num_hidden_layers")
    vocab, heads = _int(hf, "vocab_size"), _int(hf, "num_attention_heads")
    kv_heads = _int(hf, "num_key_value_heads", heads)
    head_dim = _int(hf, "head_dim", h // heads if heads else 0)
    embed = vocab * h * (1 if hf.get("tie_word_embeddings") else 2)
    if family.uses_mla:
        q_lora, kv_lora = _int(hf, "q_lora_rank"), _int(hf, "kv_lora_rank")
        rope, nope = _int(hf, "qk_rope_head_dim"), _int(hf, "qk_nope_head_dim")
        v_dim = _int(hf, "v_head_dim", nope)
        q = (h * q_lora + q_lora * heads * (nope + rope)) if q_lora else h * heads * (nope + rope)
        attn = q + h * (kv_lora + rope) + kv_lora * heads * (nope + v_dim) + heads * v_dim * h
        mla_kv, kv_heads = kv_lora + rope, 0
    else:
        attn = 2 * h * heads * head_dim + 2 * h * kv_heads * head_dim
        mla_kv = 0
    experts = family.num_experts(hf)
    width = _int(hf, "moe_intermediate_size") or _int(hf, "intermediate_size")
    shared = _int(hf, "n_shared_experts") * width + _int(hf, "shared_expert_intermediate_size")
    moe_layers = len(family.moe_layer_ids(hf))
    dense_mlp = 3 * h * _int(hf, "intermediate_size")
    per_moe = h * experts + 3 * h * shared + (h if hf.get("shared_expert_intermediate_size") else 0)
    dense = layers * attn + (layers - moe_layers) * dense_mlp + moe_layers * per_moe
    quant = hf.get("quantization_config")
    fp8 = isinstance(quant, Mapping) and quant.get("quant_method") == "fp8"
    return ModelSizes(
        embed_params=embed,
        dense_params=dense,
        expert_params=moe_layers * experts * 3 * h * width,
        layers=layers,
        kv_heads=kv_heads,
        head_dim=head_dim,
        mla_kv_dim=mla_kv,
        max_position_embeddings=_int(hf, "max_position_embeddings", 4096),
        fp8=fp8,
    )


# The seed's models, the fields of their public config.json that model_sizes reads
# (huggingface.co/<name>/blob/main/config.json).
SEED_CONFIGS: dict[str, dict[str, Any]] = {
    "Qwen3-30B-A3B": {
        "model_type": "qwen3_moe",
        "hidden_size": 2048,
        "num_hidden_layers": 48,
        "num_attention_heads": 32,
        "num_key_value_heads": 4,
        "head_dim": 128,
        "vocab_size": 151936,
        "tie_word_embeddings": False,
        "num_experts": 128,
        "num_experts_per_tok": 8,
        "moe_intermediate_size": 768,
        "intermediate_size": 6144,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
        "max_position_embeddings": 40960,
    },
    "Qwen3-235B-A22B": {
        "model_type": "qwen3_moe",
        "hidden_size": 4096,
        "num_hidden_layers": 94,
        "num_attention_heads": 64,
        "num_key_value_heads": 4,
        "head_dim": 128,
        "vocab_size": 151936,
        "tie_word_embeddings": False,
        "num_experts": 128,
        "num_experts_per_tok": 8,
        "moe_intermediate_size": 1536,
        "intermediate_size": 12288,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
        "max_position_embeddings": 40960,
    },
    "DeepSeek-V3": {
        "model_type": "deepseek_v3",
        "hidden_size": 7168,
        "num_hidden_layers": 61,
        "num_attention_heads": 128,
        "num_key_value_heads": 128,
        "vocab_size": 129280,
        "tie_word_embeddings": False,
        "n_routed_experts": 256,
        "n_shared_experts": 1,
        "num_experts_per_tok": 8,
        "moe_intermediate_size": 2048,
        "intermediate_size": 18432,
        "first_k_dense_replace": 3,
        "moe_layer_freq": 1,
        "q_lora_rank": 1536,
        "kv_lora_rank": 512,
        "qk_rope_head_dim": 64,
        "qk_nope_head_dim": 128,
        "v_head_dim": 128,
        "max_position_embeddings": 163840,
        "quantization_config": {"quant_method": "fp8", "fmt": "e4m3"},
    },
}
