"""The time to serve one policy version to the rollout fleet, at the seed's scale, on paper.

Part of `moerl bench project`. For each model, S = the engine's weights in BF16 (every
parameter, 2 bytes: what each rollout node must hold); N rollout nodes; every input below is
an assumption the report carries and the command line changes:

    b_efa    a node's EFA line rate: 3,200 Gbps on p5en = 400 GB/s
    b_s3     one node's S3 throughput (default 100 Gbps = 12.5 GB/s)
    R_get    S3 GET requests per second per prefix (5,500: AWS's documented floor; a version's
             objects share one prefix, runs/<run>/versions/vNNNNNN/<objects>/)
    part     bytes per ranged GET (checkpoint.multipart_chunk_mb, 8 MiB)
    b_cache  one cache-tier node's network (default 50 Gbps = 6.25 GB/s: r7i.48xlarge), c nodes
    b_tcp    a rollout node's TCP throughput to its peers over the pod network (default 100 Gbps)
    chunk    the fan-out's chunk (checkpoint.chunk_mb, 64 MiB)
    n_t      trainer nodes that upload their share of a version (the trainer's FSDP shards)
    eta      the collective's share of b_efa a broadcast sustains (default 0.5, an assumption:
             not measured on EFA); g = 8 GPUs per node

Formulas (seconds):

    EFA bound      T_efa   = S / b_efa                              (one node at line rate)
    S3 only        T_s3    = max(S / b_s3, N * S / (R_get * part))  (each node's link, or the
                                                                     prefix's request ceiling)
    cache tier     T_cache = max(S / b_tcp, N * S / (c * b_cache))  (every node from the tier)
    fan-out        T_fan   = max(S / b_tcp, S / (c * b_cache)) + N * chunk / b_tcp
                             (the tier sends each chunk about once; every node receives S and
                              sends about S; N chunks of pipeline fill)
    servable       T_pub   = S / min(n_t * b_s3, c * b_cache)       (trainer -> cache tier)
    files path     T_files = T_pub + T_fan                          (servable, then fanned out)
    collective     T_wire  = S / (eta * b_efa) + N * chunk / (eta * b_efa) + S / (n_t * g * b_efa)
                             (every trainer rank broadcasts its share S / (n_t * g) over its own
                              group at once; each rollout node receives S once over EFA and its
                              GPUs share it over NVLink; the last term the share's gather; no
                              disk, no S3 on the path)

Limitations: bandwidths only (no request latency, no TCP slow start, no CPU cost of hashing:
sha256 runs at about 1-2 GB/s per core, so a node needs b_tcp / 1.5 GB/s cores hashing to keep
up); S3 repartitions a hot prefix over minutes, which lifts the request ceiling for long runs;
the fan-out runs over TCP (ENA), not EFA, so T_efa is a floor no TCP fan-out reaches.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import asdict, dataclass
from typing import Any

GB = 1e9
GBPS = 1e9 / 8  # bytes/s in one Gbit/s


@dataclass(frozen=True)
class FleetInputs:
    rollout_nodes: int = 32
    trainer_nodes: int = 16
    efa_gbps: float = 3200.0
    s3_gbps: float = 100.0
    s3_get_per_s: float = 5500.0
    part_mib: float = 8.0
    cache_gbps: float = 50.0
    cache_nodes: int = 1
    tcp_gbps: float = 100.0
    chunk_mib: float = 64.0
    wire_efficiency: float = 0.5
    gpus_per_node: int = 8


def serve_times(model_name: str, total_params: float, inp: FleetInputs) -> dict[str, Any]:
    S, N = total_params * 2, inp.rollout_nodes
    b_efa, b_s3, b_cache, b_tcp = (
        inp.efa_gbps * GBPS,
        inp.s3_gbps * GBPS,
        inp.cache_gbps * GBPS * inp.cache_nodes,
        inp.tcp_gbps * GBPS,
    )
    prefix = inp.s3_get_per_s * inp.part_mib * 2**20
    t = {
        "efa_bound_s": S / b_efa,
        "s3_only_s": max(S / b_s3, N * S / prefix),
        "cache_tier_s": max(S / b_tcp, N * S / b_cache),
        "fanout_s": max(S / b_tcp, S / b_cache) + N * inp.chunk_mib * 2**20 / b_tcp,
        "servable_s": S / min(inp.trainer_nodes * b_s3, b_cache),
    }
    wire = inp.wire_efficiency * b_efa
    t["files_s"] = t["servable_s"] + t["fanout_s"]
    t["collective_s"] = (
        S / wire
        + N * inp.chunk_mib * 2**20 / wire
        + S / (inp.trainer_nodes * inp.gpus_per_node * b_efa)
    )
    return {
        "model": model_name,
        "bytes_gb": S / GB,
        **t,
        "fanout_vs_s3": t["s3_only_s"] / t["fanout_s"],
        "fanout_vs_cache_tier": t["cache_tier_s"] / t["fanout_s"],
        "fanout_vs_efa_bound": t["fanout_s"] / t["efa_bound_s"],
        "files_vs_collective": t["files_s"] / t["collective_s"],
    }


def fleet_table(models: Iterable[tuple[str, float]], inp: FleetInputs) -> dict[str, Any]:
    return {
        "inputs": asdict(inp),
        "rows": [serve_times(name, params, inp) for name, params in models],
        "formulas": [
            line
            for line in __doc__.split("Formulas (seconds):")[1]
            .split("Limitations:")[0]
            .splitlines()
            if line.strip()
        ],
    }


def format_fleet(rep: dict[str, Any]) -> str:
    from benchmarks import format_table

    i = rep["inputs"]
    rows = [
        [
            r["model"],
            r["bytes_gb"],
            r["efa_bound_s"],
            r["s3_only_s"],
            r["cache_tier_s"],
            r["fanout_s"],
            r["fanout_vs_s3"],
            r["servable_s"],
            r.get("files_s", 0.0),
            r.get("collective_s", 0.0),
            r.get("files_vs_collective", 0.0),
        ]
        for r in rep["rows"]
    ]
    return (
        f"one version to {i['rollout_nodes']} rollout nodes (S3 {i['s3_gbps']:g} Gbps/node, {i['s3_get_per_s']:g} "
        f"GET/s per prefix x {i['part_mib']:g} MiB; cache tier {i['cache_nodes']} x {i['cache_gbps']:g} Gbps; "
        f"fan-out TCP {i['tcp_gbps']:g} Gbps, {i['chunk_mib']:g} MiB chunks; EFA {i['efa_gbps']:g} Gbps, "
        f"collective at {i.get('wire_efficiency', 0.5):g} of it)\n"
        + format_table(
            [
                "model",
                "GB",
                "EFA bound s",
                "S3 only s",
                "cache tier s",
                "fan-out s",
                "fan-out x S3",
                "servable s",
                "files s",
                "collective s",
                "files / collective",
            ],
            rows,
        )
    )
