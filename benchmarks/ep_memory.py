"""Trainer memory benchmark: what each rank holds, and its peak RSS, at several meshes side by side.

    moerl bench ep-memory [--world-sizes 1,2,4 | --meshes 1x4,2x2,4x1] [--layers 4] [--experts 64] [--hidden 512]

A mesh is DPxEP: `trainer.parallelism.data_parallel_shard` x `trainer.parallelism.expert_parallel_size` ranks;
`--world-sizes W,...` means the meshes 1xW.

Methodology: a Qwen3-MoE whose experts dominate its size (default 64 experts, hidden 512,
expert intermediate 256, 4 layers: ~403 MB of float32 experts, ~16 MB of everything else) is
built from a seed into a temporary directory (no hub) and saved by transformers. For each
EP mesh, dp x ep ranks are spawned (gloo over loopback, a file store, one thread per rank) and run
the real trainer path: `ep_train.setup` (load, then FSDP2 on the mesh), one `train_ep`
optimizer step (AdamW: grads and both moments appear here), then `ep_train.save_ep` (the
optimizer state through Distributed Checkpoint; rank 0 receives each tensor whole, one at a
time, and writes the HF checkpoint). Each rank counts the bytes it holds after the step
(its shards of the weights, gradients and both Adam moments) against the model's total x 4 /
(dp x ep): the sharding's ratio, 1.0 when nothing is replicated (padding of uneven shards
adds a little). Each rank records its peak RSS (VmHWM from
/proc/self/status: the `ru_maxrss` high-water mark without the spawning parent's peak, which
Linux carries over fork + exec; each value includes the ones before it) after its imports
(the base), after load, after the step and after the save, and the expert bytes its
parameters actually hold. EP = 1 runs the same code with one rank.

The expected expert bytes per rank are total expert bytes / (dp x ep); the "x EP1" columns
divide each rank's RSS growth over its base by the one-rank run's, which falls towards
1 / (dp x ep) as sharded state dominates (activations and the interpreter do not shard).

Limitations: RSS on CPU only (on GPU the same split holds for device memory, which this does
not measure); the peak after save is reached on rank 0, which also holds one shard of
gathered experts; ranks share the machine's cores, so the load times in the JSON are only
indicative.
"""

from __future__ import annotations

import json
import os
import resource
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from benchmarks import envelope, write_report
from moerl.errors import ConfigError

BENCH_MODEL = {
    "hidden_size": 512,
    "num_layers": 4,
    "num_heads": 8,
    "num_kv_heads": 4,
    "head_dim": 64,
    "num_experts": 64,
    "experts_per_token": 8,
    "moe_intermediate_size": 256,
    "max_position_embeddings": 64,
    "seed": 0,
}


def _peak_mb() -> float:
    """This process's peak RSS in MiB. Linux carries `ru_maxrss` over fork + exec, so a rank
    spawned by a big parent would report the parent's peak; VmHWM (the same high-water mark,
    of this process's own memory map) does not. `ru_maxrss` where /proc is missing."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024  # kB
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


def _batch(n: int, vocab: int):
    from moerl.records import TrainSample

    g = torch.Generator().manual_seed(0)
    return [
        TrainSample(
            prompt_token_ids=torch.randint(4, vocab, (24,), generator=g).tolist(),
            response_token_ids=torch.randint(4, vocab, (16,), generator=g).tolist(),
            response_logprobs=[-3.0] * 16,
            advantage=float((-1) ** i),
            policy_version=0,
        )
        for i in range(n)
    ]


def _local_mb(t) -> float:
    t = t.to_local() if hasattr(t, "to_local") else t
    return t.numel() * t.element_size() / 2**20


def _rank(
    rank: int, world: int, dp: int, model_dir: str, work: str, model: dict, out_file: str
) -> None:
    os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    torch.set_num_threads(1)
    # the model code is imported before the base is read: growth past it is weights and steps
    from transformers import AutoModelForCausalLM, Qwen3MoeForCausalLM  # noqa: F401

    from moerl.components.policy_update.ep_train import save_ep, setup, train_ep
    from moerl.config import parse_config

    base = _peak_mb()
    dist.init_process_group(
        "gloo",
        init_method=f"file://{work}/rendezvous-{dp}x{world // dp}",
        rank=rank,
        world_size=world,
    )
    try:
        cfg = parse_config(
            {
                "model": {"tiny": model},
                "trainer": {
                    "parallelism": {"expert_parallel_size": world // dp, "data_parallel_shard": dp},
                    "optimizer": {"optimizer_steps_per_iteration": 1},
                },
            }
        )
        t0 = time.perf_counter()
        m, opt, counters, blocks, layout, _, mesh = setup(cfg, Path(model_dir))
        expert_ids = {id(p) for b in blocks for p in (b.gate_up_proj_LIH, b.down_proj_LHI)}
        held = {True: 0.0, False: 0.0}
        total = 0.0  # the whole model's bytes (a DTensor's numel is the whole tensor's)
        for p in m.parameters():
            held[id(p) in expert_ids] += _local_mb(p)
            total += p.numel() * p.element_size() / 2**20 if id(p) not in expert_ids else 0.0
        # float32 experts of every layer
        total += sum(
            b.num_experts * 3 * b.gate_up_proj_LIH.shape[2] * b.down_proj_LHI.shape[2] * 4 / 2**20
            for b in blocks
        )
        rec: dict[str, Any] = {
            "rank": rank,
            "world": world,
            "dp": dp,
            "ep": world // dp,
            "rss_base_mb": base,
            "rss_load_mb": _peak_mb(),
            "load_s": time.perf_counter() - t0,
            "experts_held": int(blocks[0].gate_up_proj_LIH.to_local().shape[0]),
            "expert_mb_held": held[True],
            "replicated_mb_held": held[False],
            "model_mb": total,
        }
        train_ep(m, opt, counters, blocks, _batch(8, m.config.vocab_size), cfg, seed=0)
        rec["rss_step_mb"] = _peak_mb()
        state = sum(
            _local_mb(p) + (_local_mb(p.grad) if p.grad is not None else 0.0)
            for p in m.parameters()
        )
        state += sum(
            _local_mb(v)
            for st in opt.state.values()
            for v in st.values()
            if torch.is_tensor(v) and v.dim()
        )
        rec["state_mb_held"] = state  # weights + grads + both Adam moments, this rank's shards
        rec["state_mb_expected"] = 4 * total / world
        rec["state_ratio"] = state / rec["state_mb_expected"]
        save_ep(
            m,
            opt,
            counters,
            blocks,
            layout,
            mesh,
            Path(model_dir),
            Path(work) / f"saved-{dp}x{world // dp}",
        )
        rec["rss_save_mb"] = _peak_mb()
        records: list[Any] = [None] * world
        dist.all_gather_object(records, rec)
        if rank == 0:
            Path(out_file).write_text(json.dumps(records))
    finally:
        dist.destroy_process_group()


def _ratio_rows(records: list[dict], expert_mb_total: float) -> list[dict]:
    ref = next((r for r in records if r["world"] == 1), None)
    for r in records:
        r["expert_mb_expected"] = expert_mb_total / r["world"]
        for phase in ("load", "step"):
            grew = r[f"rss_{phase}_mb"] - r["rss_base_mb"]
            r[f"{phase}_growth_mb"] = grew
            if ref is not None:
                r[f"{phase}_growth_x_ep1"] = grew / max(
                    ref[f"rss_{phase}_mb"] - ref["rss_base_mb"], 1e-9
                )
    return records


def format_table(report: dict[str, Any]) -> str:
    m = report["model"]
    lines = [
        f"Qwen3-MoE E={m['num_experts']} H={m['hidden_size']} I={m['moe_intermediate_size']} "
        f"layers={m['num_layers']} float32: experts {report['expert_mb_total']:.0f} MB, "
        f"other {report['other_mb_total']:.0f} MB; peak RSS (VmHWM) per rank, MiB",
        "dp x ep | rank | experts | expert MB expected/held | state MB expected/held (ratio) | base | load "
        "| step | save | load-base (x 1 rank) | step-base (x 1 rank) | 1/world",
    ]
    for r in report["results"]:
        lines.append(
            " | ".join(
                [
                    f"{r['dp']}x{r['ep']}",
                    str(r["rank"]),
                    str(r["experts_held"]),
                    f"{r['expert_mb_expected']:.0f}/{r['expert_mb_held']:.0f}",
                    f"{r['state_mb_expected']:.0f}/{r['state_mb_held']:.0f} ({r['state_ratio']:.2f})",
                    *(f"{r[f'rss_{k}_mb']:.0f}" for k in ("base", "load", "step", "save")),
                    *(
                        f"{r[f'{k}_growth_mb']:.0f} ({r.get(f'{k}_growth_x_ep1', float('nan')):.2f})"
                        for k in ("load", "step")
                    ),
                    f"{1 / r['world']:.2f}",
                ]
            )
        )
    return "\n".join(lines)


def parse_world_sizes(text: str | tuple[int, ...]) -> tuple[int, ...]:
    """`--world-sizes 1,2,4` -> (1, 2, 4); anything else is a one-line ConfigError."""
    if not isinstance(text, str):
        return tuple(text)
    try:
        sizes = tuple(int(w) for w in text.split(","))
    except ValueError:
        sizes = ()
    if not sizes or min(sizes) < 1:
        raise ConfigError(
            f"bench ep-memory --world-sizes: {text!r} is not allowed; give comma-separated "
            "positive integers, e.g. 1,2,4"
        )
    return sizes


def parse_meshes(text: str | tuple[tuple[int, int], ...]) -> tuple[tuple[int, int], ...]:
    """`--meshes 1x4,2x2` -> ((1, 4), (2, 2)) as (dp, ep); anything else is a one-line ConfigError."""
    if not isinstance(text, str):
        return tuple(text)
    try:
        meshes = tuple((int(a), int(b)) for a, b in (m.lower().split("x") for m in text.split(",")))
    except ValueError:
        meshes = ()
    if not meshes or min(min(m) for m in meshes) < 1:
        raise ConfigError(
            f"bench ep-memory --meshes: {text!r} is not allowed; give comma-separated DPxEP pairs of "
            "positive integers, e.g. 1x4,2x2,4x1"
        )
    return meshes


def run_bench_ep_memory(
    world_sizes: str | tuple[int, ...] = (1, 2, 4),
    out: Path | None = None,
    meshes: str | tuple[tuple[int, int], ...] | None = None,
    num_layers: int | None = None,
    num_experts: int | None = None,
    hidden_size: int | None = None,
    moe_intermediate_size: int | None = None,
) -> dict[str, Any]:
    """Spawn each mesh (dp, ep) in turn on this machine (`meshes`, else 1 x each of
    `world_sizes`); print the table, write JSON to `out`.

    Args:
        world_sizes: meshes 1xW (expert parallel only), comma-separated
        out: the report (JSON)
        meshes: DPxEP meshes, e.g. 1x4,2x2,4x1 (overrides --world-sizes)
        num_layers: the tiny MoE's layers (default 4)
        num_experts: routed experts (default 64)
        hidden_size: hidden size (default 512)
        moe_intermediate_size: each expert's intermediate size (default 256)
    """
    model_overrides = {
        "num_layers": num_layers,
        "num_experts": num_experts,
        "hidden_size": hidden_size,
        "moe_intermediate_size": moe_intermediate_size,
    }
    world_sizes = parse_world_sizes(world_sizes)
    meshes = parse_meshes(meshes) if meshes else None
    import torch.multiprocessing as mp

    from moerl.config import parse_config
    from moerl.models.tiny import build_tiny_model

    model = {**BENCH_MODEL, **{k: v for k, v in model_overrides.items() if v is not None}}
    meshes = meshes or tuple((1, w) for w in world_sizes)
    for dp, ep in meshes:  # bad sizes fail here, in one line, before any rank starts
        tiny = parse_config(
            {
                "model": {"tiny": model},
                "trainer": {"parallelism": {"expert_parallel_size": ep, "data_parallel_shard": dp}},
            }
        ).model.tiny
    results: list[dict] = []
    with tempfile.TemporaryDirectory(prefix="moerl-ep-memory-") as work:
        model_dir = build_tiny_model(tiny, Path(work) / "model")
        for dp, ep in meshes:
            out_file = str(Path(work) / f"ranks-{dp}x{ep}.json")
            mp.spawn(
                _rank,
                args=(dp * ep, dp, str(model_dir), work, model, out_file),
                nprocs=dp * ep,
                join=True,
            )
            results += json.loads(Path(out_file).read_text())
    per_layer = tiny.num_experts * 3 * tiny.hidden_size * tiny.moe_intermediate_size * 4
    expert_mb = per_layer * tiny.num_layers / 2**20
    report = envelope(
        "ep-memory",
        True,
        model=model,
        expert_mb_total=expert_mb,
        other_mb_total=results[0]["model_mb"] - expert_mb,
        methodology=__doc__.split("Methodology: ")[1].split("Limitations:")[0].strip(),
        results=_ratio_rows(results, expert_mb),
    )
    print(format_table(report))
    if out is not None:
        out.parent.mkdir(parents=True, exist_ok=True)
        write_report(out, report)
    return report
