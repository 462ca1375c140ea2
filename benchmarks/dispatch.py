"""Dispatch/combine benchmark: every backend available here, side by side.

Shape legend: T tokens per rank, H hidden, K top-k, E experts, W ranks.

Methodology (after DeepEP's tests/): build one routing per rank (uniform, or Zipf-skewed
expert popularity), run `warmup` untimed dispatch+combine pairs, then `repeats` timed ones.
Dispatch and combine are timed separately, each between a barrier and the end of the call
(plus a CUDA synchronize on GPU); experts are the identity so only the transfer is timed.
Per repeat the slowest rank's time counts (a collective ends when its last rank does); we
report p50/p99 over repeats. Bandwidth = mean bytes per rank / p50 time, with bytes counted
the same way for every backend (`Dispatcher.bytes_moved`): per_rank_dedup, per_expert and
what the backend actually sent. Expert load imbalance = max / mean tokens per expert over the
whole group.

Differences from DeepEP's setup: no L2 flush (CPU caches are not flushed here), forward
only (no autograd graph), 20 repeats by default instead of 50, and on CPU the "network" is
gloo over loopback on a shared, small core count, so absolute numbers say nothing about
GPUs; the byte counts and the relative ordering are what carry over.

CPU:     python -m benchmarks.dispatch --out bench_dispatch.json
GPU:     kernels/gpu_bench.sh (torchrun, NCCL, and deepep where installed)
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import time
from datetime import timedelta
from pathlib import Path
from typing import Any, Literal

import torch
import torch.distributed as dist

from benchmarks import envelope, write_report
from moerl.kernels.dispatcher import make_dispatcher

ZIPF_EXPONENT = 1.0


def make_routing(
    tokens: int,
    experts: int,
    topk: int,
    skew: str,
    seed: int,
    device: str = "cpu",
) -> tuple[torch.Tensor, torch.Tensor]:
    """(topk_idx_TK, topk_weights_TK): distinct experts per token; Zipf makes expert e's
    popularity proportional to 1 / (e + 1) ** ZIPF_EXPONENT (the same hot experts on every rank)."""
    g = torch.Generator().manual_seed(seed)
    if skew == "uniform":
        p_E = torch.ones(experts)
    elif skew == "zipf":
        p_E = 1.0 / (torch.arange(experts, dtype=torch.float64) + 1) ** ZIPF_EXPONENT
    else:
        raise ValueError(f"skew must be 'uniform' or 'zipf', got {skew!r}")
    idx_TK = torch.multinomial(p_E.float().expand(tokens, -1), topk, replacement=False, generator=g)
    w_TK = torch.softmax(torch.randn(tokens, topk, generator=g), dim=1)
    return idx_TK.to(device), w_TK.to(device)


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q / 100 * len(ordered) + 0.5) - 1))]


def bench_backend(backend: str, cfg: dict, device: str) -> dict[str, Any] | None:
    """Run on every rank of the current world (or alone). Returns rank 0's summary (None
    elsewhere); {"skipped": reason} when the backend cannot be built here."""
    world, rank = (dist.get_world_size(), dist.get_rank()) if dist.is_initialized() else (1, 0)
    try:
        d = make_dispatcher(
            backend,
            cfg["experts"],
            ranks_per_node=cfg["ranks_per_node"],
            deepep_options=cfg.get("deepep_options"),
        )
    except Exception as exc:  # report, do not abort the other backends (e.g. deepep missing)
        return (
            {"backend": backend, "world": world, "skipped": f"{type(exc).__name__}: {exc}"}
            if rank == 0
            else None
        )
    dtype = getattr(torch, cfg["dtype"])
    idx_TK, w_TK = make_routing(
        cfg["tokens"], cfg["experts"], cfg["topk"], cfg["skew"], seed=rank, device=device
    )
    x_TH = torch.randn(
        cfg["tokens"], cfg["hidden"], generator=torch.Generator().manual_seed(100 + rank)
    ).to(device, dtype)

    def sync() -> None:
        if device == "cuda":
            torch.cuda.synchronize()
        if world > 1:
            dist.barrier()

    times: dict[str, list[float]] = {"dispatch": [], "combine": []}
    with torch.no_grad():
        for i in range(cfg["warmup"] + cfg["repeats"]):
            sync()
            t0 = time.perf_counter()
            recv_x_RH, _, handle = d.dispatch(x_TH, idx_TK, w_TK)
            if device == "cuda":
                torch.cuda.synchronize()
            t1 = time.perf_counter()
            sync()
            t2 = time.perf_counter()
            d.combine(recv_x_RH, handle)
            if device == "cuda":
                torch.cuda.synchronize()
            t3 = time.perf_counter()
            if i >= cfg["warmup"]:
                times["dispatch"].append(t1 - t0)
                times["combine"].append(t3 - t2)
    counts_E = torch.bincount(idx_TK.reshape(-1), minlength=cfg["experts"]).to(device)
    record = {"times": times, "bytes": d.bytes_moved(handle)}
    if world > 1:
        dist.all_reduce(counts_E)
        records: list[Any] = [None] * world
        dist.all_gather_object(records, record)
    else:
        records = [record]
    d.close()
    if rank != 0:
        return None
    return _summarize(backend, d, world, records, counts_E.cpu())


def _summarize(
    backend: str, d: Any, world: int, records: list[dict], counts_E: torch.Tensor
) -> dict[str, Any]:
    out: dict[str, Any] = {
        "backend": d.name,
        "requested": backend,
        "world": world,
        "ranks_per_node": d.ranks_per_node,
        "fallback_from": d.fallback_from,
    }
    for phase in ("dispatch", "combine"):
        slowest = [
            max(r["times"][phase][i] for r in records)
            for i in range(len(records[0]["times"][phase]))
        ]
        out[f"{phase}_p50_ms"] = 1e3 * statistics.median(slowest)
        out[f"{phase}_p99_ms"] = 1e3 * _percentile(slowest, 99)
    for key in records[0]["bytes"]:
        mean_bytes = sum(r["bytes"][key] for r in records) / world
        out[f"bytes_{key}"] = mean_bytes
        for phase in ("dispatch", "combine"):
            seconds = out[f"{phase}_p50_ms"] / 1e3
            out[f"{phase}_gbps_{key}"] = mean_bytes / seconds / 1e9 if seconds > 0 else 0.0
    out["expert_load_imbalance"] = float(counts_E.max() / counts_E.float().mean())
    return out


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _spawned_world(
    rank: int, world: int, port: int, cfg: dict, backends: list[str], out_file: str
) -> None:
    os.environ["GLOO_SOCKET_IFNAME"] = "lo"  # loopback only
    torch.set_num_threads(cfg["threads_per_rank"])
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world,
        timeout=timedelta(seconds=300),
    )
    try:
        results = [bench_backend(b, cfg, "cpu") for b in backends]
        if rank == 0:
            Path(out_file).write_text(json.dumps(results))
    finally:
        dist.destroy_process_group()


def run_bench_dispatch(
    tokens: int = 4096,
    hidden: int = 1024,
    topk: int = 8,
    experts: int = 64,
    skew: Literal["uniform", "zipf"] = "uniform",
    world_sizes: str | tuple[int, ...] = (2, 4),
    ranks_per_node: int = 2,
    warmup: int = 5,
    repeats: int = 20,
    out: Path | None = None,
    dtype: str = "bfloat16",
    threads_per_rank: int = 1,
    echo: bool = True,
) -> dict[str, Any]:
    """Benchmark on CPU: local at world 1 (in this process), then all_to_all and
    hierarchical in spawned gloo worlds. Prints a table; writes JSON to `out` if given.

    Args:
        tokens: tokens per rank
        hidden: the model's hidden size
        topk: experts per token
        experts: routed experts
        skew: routing: uniform, or zipf over the experts
        world_sizes: gloo worlds, comma-separated
        ranks_per_node: ranks per simulated node (the hierarchical backend)
        warmup: untimed rounds first
        repeats: timed rounds
        out: the report (JSON)
        dtype: the activations' dtype
        threads_per_rank: torch threads per rank
    """
    import tempfile

    import torch.multiprocessing as mp

    cfg = {
        "tokens": tokens,
        "hidden": hidden,
        "topk": topk,
        "experts": experts,
        "skew": skew,
        "ranks_per_node": 1,
        "warmup": warmup,
        "repeats": repeats,
        "dtype": dtype,
        "threads_per_rank": threads_per_rank,
        "zipf_exponent": ZIPF_EXPONENT if skew == "zipf" else None,
    }
    if isinstance(world_sizes, str):
        world_sizes = tuple(int(w) for w in world_sizes.split(","))
    previous_threads = torch.get_num_threads()
    torch.set_num_threads(threads_per_rank)
    try:
        results = [bench_backend("local", cfg, "cpu")]
    finally:
        torch.set_num_threads(previous_threads)
    for world in world_sizes:
        wcfg = cfg | {"ranks_per_node": ranks_per_node if world % ranks_per_node == 0 else 1}
        with tempfile.TemporaryDirectory() as tmp:
            out_file = str(Path(tmp, "results.json"))
            mp.spawn(
                _spawned_world,
                args=(
                    world,
                    _free_port(),
                    wcfg,
                    ["all_to_all", "hierarchical", "deepep"],
                    out_file,
                ),
                nprocs=world,
                join=True,
            )
            results += json.loads(Path(out_file).read_text())
    report = envelope(
        "dispatch",
        True,
        config=cfg
        | {
            "ranks_per_node": ranks_per_node,
            "world_sizes": list(world_sizes),
            "device": "cpu",
            "transport": "gloo over loopback",
        },
        methodology=__doc__.split("Methodology")[1].split("CPU:")[0].strip(),
        results=results,
    )
    if echo:
        print(format_table(report))
    if out is not None:
        write_report(Path(out), report)
    return report


def format_table(report: dict[str, Any]) -> str:
    c = report["config"]
    head = (
        f"T={c['tokens']}/rank H={c['hidden']} K={c['topk']} E={c['experts']} skew={c['skew']} "
        f"dtype={c['dtype']} ranks/node={c['ranks_per_node']} warmup={c['warmup']} repeats={c['repeats']}"
    )
    cols = (
        "backend",
        "W",
        "disp p50/p99 ms",
        "comb p50/p99 ms",
        "MB/rank dedup|expert|sent|inter",
        "disp GB/s dedup|expert",
        "comb GB/s dedup|expert",
        "imbal",
    )
    lines = [head, " | ".join(cols)]
    for r in report["results"]:
        if r is None:
            continue
        if "skipped" in r:
            lines.append(f"{r['backend']} | {r['world']} | skipped: {r['skipped'][:110]}")
            continue
        name = r["backend"] + (
            f"(rpn{r['ranks_per_node']})" if r["backend"] == "hierarchical" else ""
        )
        mb = "|".join(
            f"{r[f'bytes_{k}'] / 1e6:.1f}"
            for k in ("per_rank_dedup", "per_expert", "actual_sent", "actual_sent_inter_node")
        )
        lines.append(
            " | ".join(
                [
                    name,
                    str(r["world"]),
                    f"{r['dispatch_p50_ms']:.1f}/{r['dispatch_p99_ms']:.1f}",
                    f"{r['combine_p50_ms']:.1f}/{r['combine_p99_ms']:.1f}",
                    mb,
                    f"{r['dispatch_gbps_per_rank_dedup']:.2f}|{r['dispatch_gbps_per_expert']:.2f}",
                    f"{r['combine_gbps_per_rank_dedup']:.2f}|{r['combine_gbps_per_expert']:.2f}",
                    f"{r['expert_load_imbalance']:.2f}",
                ]
            )
        )
    return "\n".join(lines)


def _torchrun_main(args: argparse.Namespace) -> None:
    """Inside torchrun: one world (NCCL on GPU), every backend, rank 0 reports."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda":
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    dist.init_process_group("nccl" if device == "cuda" else "gloo")
    rpn = args.ranks_per_node or int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    cfg = {
        "tokens": args.tokens,
        "hidden": args.hidden,
        "topk": args.topk,
        "experts": args.experts,
        "skew": args.skew,
        "ranks_per_node": rpn,
        "warmup": args.warmup,
        "repeats": args.repeats,
        "dtype": args.dtype,
        "deepep_options": {"mode": args.deepep_mode},
    }
    results = [bench_backend(b, cfg, device) for b in ("all_to_all", "hierarchical", "deepep")]
    if dist.get_rank() == 0:
        report = envelope(
            "dispatch",
            True,
            config=cfg
            | {"device": device, "world": dist.get_world_size(), "transport": dist.get_backend()},
            results=results,
        )
        print(format_table(report))
        if args.out:
            write_report(Path(args.out), report)
    dist.destroy_process_group()


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--topk", type=int, default=8)
    p.add_argument("--experts", type=int, default=64)
    p.add_argument("--skew", choices=("uniform", "zipf"), default="uniform")
    p.add_argument("--world-sizes", type=int, nargs="+", default=[2, 4])
    p.add_argument(
        "--ranks-per-node",
        type=int,
        default=None,
        help="default: 2 (CPU), LOCAL_WORLD_SIZE (torchrun)",
    )
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--deepep-mode", choices=("normal", "low_latency"), default="normal")
    p.add_argument(
        "--torchrun", action="store_true", help="already inside torchrun: bench that one world"
    )
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args(argv)
    if args.torchrun:
        _torchrun_main(args)
        return
    run_bench_dispatch(
        tokens=args.tokens,
        hidden=args.hidden,
        topk=args.topk,
        experts=args.experts,
        skew=args.skew,
        world_sizes=tuple(args.world_sizes),
        ranks_per_node=args.ranks_per_node or 2,
        warmup=args.warmup,
        repeats=args.repeats,
        out=args.out,
        dtype=args.dtype,
    )


if __name__ == "__main__":
    main()
