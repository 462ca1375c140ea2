"""The rollout engine layout of each seed model at the seed's node type, on paper: part of
`moerl bench project` (the "rollout engines" table).

For each model (Qwen3-30B-A3B, Qwen3-235B-A22B in bf16; DeepSeek-V3 in FP8 and in bf16), the
smallest tensor-parallel engine whose weights plus one max_model_len sequence of KV cache fit a
GPU, the smallest data-parallel x expert-parallel engine (TP 1) that does, the engines per node,
and the weights and KV per GPU; a model no single-node layout fits says so, with the nodes a
DP x EP engine over nodes needs (cluster.launch.rollout_nodes_per_worker). Formulas and what they leave
out: moerl/launch/layout.py; model sizes from the public config.json: moerl/models/sizes.py.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from moerl.launch.layout import EngineFit, LayoutChoice, choose_layouts
from moerl.models.sizes import SEED_CONFIGS, model_sizes


@dataclass(frozen=True)
class EngineInputs:
    gpus_per_node: int = 8  # p5en.48xlarge: 8 x H200
    gpu_gib: float = 140.0  # H200: 143,771 MiB as nvidia-smi reports it
    utilization: float = 0.9  # rollout.gpu_memory_utilization on cuda
    dtype: str = "bfloat16"  # rollout.dtype (FP8 checkpoints keep FP8 linear weights)
    max_model_len: int | None = None  # null: each model's own context


# (row label, config name, FP8 weights as published)
VARIANTS: tuple[tuple[str, str, bool], ...] = (
    ("Qwen3-30B-A3B", "Qwen3-30B-A3B", False),
    ("Qwen3-235B-A22B", "Qwen3-235B-A22B", False),
    ("DeepSeek-V3 FP8", "DeepSeek-V3", True),
    ("DeepSeek-V3 bf16", "DeepSeek-V3", False),
)


def _fit_row(choice: LayoutChoice, fit: EngineFit | None) -> dict[str, Any] | None:
    if fit is None:
        return None
    return {**asdict(fit), "engines_per_node": choice.engines_per_node(fit)}


def layout_rows(inp: EngineInputs) -> list[dict[str, Any]]:
    """One row per model variant: its size and the layouts `choose_layouts` picks."""
    rows = []
    for label, name, fp8 in VARIANTS:
        hf = dict(SEED_CONFIGS[name])
        if not fp8:
            hf.pop("quantization_config", None)
        sizes = model_sizes(hf)
        choice = choose_layouts(
            sizes, inp.gpus_per_node, inp.dtype, inp.gpu_gib, inp.utilization, inp.max_model_len
        )
        weight_bytes = sizes.embed_params * 2 + (sizes.dense_params + sizes.expert_params) * (
            1 if sizes.fp8 else 2
        )
        rows.append(
            {
                "model": label,
                "params": sizes.total_params,
                "weights_gb": weight_bytes / 1e9,
                "tp": _fit_row(choice, choice.tp),
                "dp_ep": _fit_row(choice, choice.dp_ep),
                "nodes_needed": choice.nodes_needed,
            }
        )
    return rows


def _cell(r: dict[str, Any] | None, axis: str) -> str:
    if r is None:
        return "-"
    n = r[axis]
    name = f"TP{n}" if axis == "tp" else f"DP{n}-EP{n}"
    return f"{r['engines_per_node']} x {name}: {r['weights_gib']:.1f} + KV {r['kv_gib']:.1f} GiB"


def format_layouts(rows: list[dict[str, Any]], inp: EngineInputs) -> str:
    from benchmarks import format_table

    head = (
        f"rollout engines per node: {inp.gpus_per_node} GPUs of {inp.gpu_gib:g} GiB "
        f"({inp.utilization:.0%} usable), serving {inp.dtype}; per GPU: weights + KV of one "
        f"{inp.max_model_len or 'max_position_embeddings'}-token sequence"
    )
    table = format_table(
        ["model", "weights GB", "smallest TP", "DP x EP", "fits one node"],
        [
            [
                r["model"],
                r["weights_gb"],
                _cell(r["tp"], "tp"),
                _cell(r["dp_ep"], "dp"),
                "yes"
                if r["nodes_needed"] == 1
                else f"no: DP{inp.gpus_per_node * r['nodes_needed']}-EP"
                f"{inp.gpus_per_node * r['nodes_needed']} over {r['nodes_needed']} nodes "
                "(rollout_nodes_per_worker)",
            ]
            for r in rows
        ],
    )
    return head + "\n" + table


def formulas() -> list[str]:
    from moerl.launch import layout

    doc = layout.__doc__ or ""
    return doc[doc.index("Per GPU, in the") : doc.index("Not counted")].rstrip().splitlines()
