"""The trainer's memory per GPU at the seed's scale, on paper: does a model fit the mesh moerl's
trainer would lay it on, and how many tokens fit in one micro-batch.

Part of `moerl bench project` (the "memory fit" table). Every input and formula is in the
report; a reader can check it by hand. Symbols:

    W   trainer GPUs (nodes x GPUs per node)     G  GPUs per node
    ep  expert-parallel size: the largest divisor of E that is <= G (EP inside a node, on
        NVLink: the trainer lays EP groups on consecutive ranks); dp = W / ep
    Pd  dense parameters (attention, embeddings, lm_head, norms, routers, shared experts)
    Pe  routed-expert parameters, all layers      L  MoE layers   h hidden   I expert width
    k   experts per token   E  experts   V  vocabulary

Static (FSDP2 + EP over all W GPUs, sharded; bf16 compute with float32 master weights):
    static = (Pd + Pe) / W * 16 bytes            fp32 weights 4 + fp32 grads 4 + Adam 8
Transient (FSDP2 all-gathers one layer ahead, and reduce-scatters one layer's gradients):
    layer_bf16 = (Pd / L + Pe / L / ep) * 2      one layer unsharded in bf16 (its experts: E/ep)
    transient = 2 * layer_bf16 + layer_bf16 * 2  two layers gathered (prefetch) + one layer's fp32 grads
Activations per token (bf16):
    per_layer = 2 * (8 h + k * (2 h + 3 I))      residual, norms, attention in/out (~8 h); per
                                                 routed copy: dispatched and combined hidden
                                                 (2 h) and the expert's gate, up, act (3 I)
    no checkpointing:   act = L * per_layer
    with checkpointing: act = L * 2 h + per_layer   each layer's input kept, one layer recomputed
    logits = 4 * V * 2  (float32 logits and log-softmax) per token of the micro-batch; with the
                        chunked logprob (trainer.parallelism.logprob_chunk_tokens = C) only C positions'
                        exist at once: logits per token 0, and C * 4 * V * 3 (logits, log-softmax,
                        their gradient) added to the transient
Fit:
    free = HBM * usable - static - transient
    micro_batch_tokens_max = free / (act + logits)   (0 when the static part alone does not fit)

Limitations: activation bytes are an estimate of the dominant tensors (no attention scores:
flash attention keeps none; no allocator fragmentation); the dense-layer count of DeepSeek-V3
(its first 3 layers are dense MLPs) is folded into Pd; pipeline and tensor parallelism are not
considered (moerl has neither).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

# Vocabulary sizes from the public configs (Qwen3: 151,936; DeepSeek-V3: 129,280).
VOCAB = {"Qwen3-30B-A3B": 151936, "Qwen3-235B-A22B": 151936, "DeepSeek-V3": 129280}


@dataclass(frozen=True)
class FitInputs:
    nodes: int = 16
    gpus_per_node: int = 8
    hbm_gb: float = 141.0  # H200
    usable: float = 0.9  # what the allocator can hand out after the CUDA context and NCCL buffers
    activation_checkpointing: bool = True
    micro_batch_tokens: int = 8192  # trainer.parallelism.micro_batch_tokens, the default
    logprob_chunk_tokens: int = (
        1024  # trainer.parallelism.logprob_chunk_tokens; 0 = the whole micro-batch at once
    )


def choose_ep(experts: int, gpus_per_node: int) -> int:
    """The largest divisor of `experts` that fits in one node."""
    return max(d for d in range(1, min(experts, gpus_per_node) + 1) if experts % d == 0)


def fit(shape, inp: FitInputs) -> dict[str, Any]:
    """The memory-fit row of one model (a `project.ModelShape`) at `inp`."""
    world = inp.nodes * inp.gpus_per_node
    ep = choose_ep(shape.experts, inp.gpus_per_node)
    dense = shape.total_params - shape.expert_params
    width = shape.expert_params / (shape.moe_layers * shape.experts * 3 * shape.hidden)
    gb = 1e9
    static = (dense + shape.expert_params) / world * 16
    layer_bf16 = (dense / shape.moe_layers + shape.expert_params / shape.moe_layers / ep) * 2
    transient = 2 * layer_bf16 + 2 * layer_bf16
    per_layer = 2 * (8 * shape.hidden + shape.topk * (2 * shape.hidden + 3 * width))
    act = (
        (shape.moe_layers * 2 * shape.hidden + per_layer)
        if inp.activation_checkpointing
        else shape.moe_layers * per_layer
    )
    vocab = VOCAB.get(shape.name, 151936)
    logits = 4 * vocab * 2
    if inp.logprob_chunk_tokens > 0:
        transient += inp.logprob_chunk_tokens * 4 * vocab * 3
        logits = 0
    free = inp.hbm_gb * gb * inp.usable - static - transient
    max_tokens = max(0, int(free // (act + logits)))
    at_default = static + transient + inp.micro_batch_tokens * (act + logits)
    return {
        "model": shape.name,
        "gpus": world,
        "mesh": {"dp": world // ep, "ep": ep},
        "dense_params": dense,
        "expert_params": shape.expert_params,
        "expert_width": width,
        "static_gb": static / gb,
        "transient_gb": transient / gb,
        "activation_kb_per_token": act / 1e3,
        "logits_kb_per_token": logits / 1e3,
        "fits_static": free > 0,
        "micro_batch_tokens_max": max_tokens,
        "gb_at_micro_batch_tokens": at_default / gb,
        "fits_at_micro_batch_tokens": at_default <= inp.hbm_gb * gb * inp.usable,
        # the layout before the mesh: dense weights replicated, EP = ep inside one node
        "static_gb_replicated_dense": (dense + shape.expert_params / ep) * 16 / gb,
    }


def fit_table(models, inp: FitInputs) -> list[dict[str, Any]]:
    return [fit(shape, inp) for shape in models]


def formulas() -> list[str]:
    doc = __doc__ or ""
    return doc[doc.index("Static (FSDP2") : doc.index("Limitations:")].rstrip().splitlines()


def format_fit(rows: list[dict[str, Any]], inp: FitInputs) -> str:
    from benchmarks import format_table

    head = (
        f"memory fit per GPU: {inp.nodes} x {inp.gpus_per_node} GPUs of {inp.hbm_gb:g} GB "
        f"({inp.usable:.0%} usable), activation checkpointing {'on' if inp.activation_checkpointing else 'off'}, "
        f"logprob chunks {inp.logprob_chunk_tokens or 'off'}"
    )
    table = format_table(
        [
            "model",
            "mesh dp x ep",
            "static GB",
            "transient GB",
            "act+logits KB/token",
            "max micro-batch tokens",
            f"GB at {inp.micro_batch_tokens} tokens",
            "static GB, dense replicated",
        ],
        [
            [
                r["model"],
                f"{r['mesh']['dp']} x {r['mesh']['ep']}",
                r["static_gb"],
                r["transient_gb"],
                r["activation_kb_per_token"] + r["logits_kb_per_token"],
                r["micro_batch_tokens_max"],
                r["gb_at_micro_batch_tokens"],
                r["static_gb_replicated_dense"],
            ]
            for r in rows
        ],
    )
    return head + "\n" + table
