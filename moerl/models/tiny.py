"""The embedded default policy: a tiny random-init MoE of any registered family, built from
`model.tiny` and a seed and saved in HF format, with a character-level tokenizer over the
shipped tasks' alphabet (other characters map to `<unk>`), so no hub download is ever needed.
moerl/models/README.md.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from moerl.config import TinyMoeConfig
from moerl.models.families import family_of

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


def tiny_hf_config(t: TinyMoeConfig, vocab_size: int, pad_id: int, eos_id: int, bos_id: int) -> Any:
    """The HF config of the tiny model: the fields every family shares, and the family's own
    (`Family.tiny_config`)."""
    common: dict[str, Any] = dict(
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
    return family_of(t.architecture).tiny_config(t, common)


def build_tiny_skeleton(t: TinyMoeConfig, out_dir: str | Path) -> Path:
    """The tiny model's files without its weights (config, generation config, tokenizer), the
    same files `build_tiny_model` writes beside them: what an engine started on dummy weights
    needs, without initializing and saving a model (about 1 s on the rollout's critical path)."""
    import torch
    from transformers import GenerationConfig
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer()
    cfg = tiny_hf_config(
        t, len(tokenizer), tokenizer.pad_token_id, tokenizer.eos_token_id, tokenizer.bos_token_id
    )
    # what saving the model adds to its config: the class that loads it, and its dtype
    cfg.architectures = [MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[cfg.model_type]]
    cfg.dtype = torch.float32
    cfg.save_pretrained(out)
    GenerationConfig(
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
    ).save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


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
