"""Tiny checkpoints of the MoE families beyond the embedded Qwen3-MoE, built from configs (no
hub download): shared by the mesh tests and the GPU checks."""

import torch


def family(arch: str, path):
    """A tiny checkpoint of a family with shared experts: Qwen2-MoE (one shared expert behind a
    sigmoid gate, softmax router) or DeepSeek-V3 (shared experts, sigmoid router with the bias
    correction, grouped top-k, MLA attention, a first dense layer)."""
    from transformers import AutoModelForCausalLM, DeepseekV3Config, OlmoeConfig, Qwen2MoeConfig

    common = dict(
        vocab_size=64,
        hidden_size=64,
        intermediate_size=96,
        moe_intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=64,
    )
    if arch == "qwen2_moe":
        cfg = Qwen2MoeConfig(
            **common, num_experts=8, num_experts_per_tok=2, shared_expert_intermediate_size=48
        )
    elif arch == "olmoe":  # no shared expert; q/k norms over the whole projection
        cfg = OlmoeConfig(
            **{k: v for k, v in common.items() if k != "moe_intermediate_size"},
            num_experts=8,
            num_experts_per_tok=2,
        )
    else:
        cfg = DeepseekV3Config(
            **common,
            n_routed_experts=8,
            num_experts_per_tok=2,
            n_shared_experts=1,
            n_group=2,
            topk_group=1,
            first_k_dense_replace=1,
            kv_lora_rank=16,
            q_lora_rank=24,
            qk_rope_head_dim=8,
            qk_nope_head_dim=8,
            v_head_dim=16,
        )
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    with torch.no_grad():
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(torch.linspace(-0.05, 0.05, b.numel()))  # a bias that changes the choice
    model.save_pretrained(path)
    return path
