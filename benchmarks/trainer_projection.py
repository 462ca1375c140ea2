"""The async trainer's per-version overhead at the seed's scale, on paper: before and after a
persistent mesh.

Part of `moerl bench project` (the "trainer per version" table). Every input and formula is in
the report (`MODEL` below: the two designs, the symbols, the formulas and the limitations); a
reader can check each number by hand. docs/benchmarks.md shows the table and the command.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import asdict, dataclass, replace
from typing import Any

from moerl.errors import ConfigError

GB = 1e9

MODEL = """\
Before (today: restart per version). Each version the trainer's ranks are spawned again
(process, process group, mesh), each rank reads its rows of the float32 master weights (the HF
copy under `master/` when the serving dtype differs) and its shard of Adam's state (Distributed
Checkpoint) from node-local disk, trains, saves Adam's state through DCP (every rank its shards,
in parallel), then rank 0 alone receives every tensor whole (gathered in float32 over the mesh,
one 256 MiB shard at a time, then copied to the host) and writes the HF checkpoint in the
serving dtype, and the same again for the float32 master copy
(components/policy_update/ep_train.py `_save`, ep_checkpoint.py `save_ep_checkpoint`: per
shard, gather then write, not overlapped). Then one publisher pod hashes and uploads the whole
version directory (weights, master copy, optimizer) to the cache tier, then to S3.

After (the persistent mesh being built). The ranks live for the whole run: no restart, no
reload. Every rank writes its own part of the HF checkpoint in the serving dtype, in parallel
(the dense tensors, FSDP-sharded by rows, all-gathered first; the experts are whole on their
rank); the float32 master weights and Adam's state go through DCP, every rank writing its shard
straight to S3 in parallel, every `checkpoint.state_every` versions (k); only the engine weights
go to the cache tier.

Symbols (inputs; every default is an assumption the report carries, overridable by keyword):

    N   trainer nodes (16)          G  GPUs per node (8)       W = N * G ranks
    P   total parameters    Pa  active parameters per token    Pd  dense (non-routed) parameters
    s   serving bytes/param (bf16: 2)   m  master (fp32: 4)    a  Adam's two moments (8)
    b_w one rank's write rate (serialize + write), b_r one rank's read rate: measured here, one
        rank on one H200: 19.9 GB (4.9 GB HF + 15 GB optimizer state) saved in 27.4 s = 0.73 GB/s
        and loaded in 15.5 s = 1.28 GB/s (docs/bench-reports/gpu-h200.md)
    D_w, D_r  a node's local NVMe write / read (8 / 16 GB/s: p5en's local NVMe drives through
        one filesystem, assumed)
    b_s3  a node's S3 throughput (10 GB/s: a 100 Gbit/s path at ~80 % for many parallel
          multipart transfers, assumed)
    R_put, R_get  S3 requests/s per prefix (3,500 PUT, 5,500 GET; a version is one prefix)
    part  bytes per multipart part (checkpoint.multipart_chunk_mb, 8 MiB)
    b_g   the gather rate into one rank (10 GB/s: a tensor crosses that rank's EFA, 50 GB/s,
          and is copied to pageable host memory, the slower step; assumed)
    b_pub one publisher pod's upload rate, hashing included (5 GB/s, assumed)
    b_c   one cache-tier node's network (50 Gbit/s = 6.25 GB/s), c cache nodes (1)
    T_0   rank start: processes + NCCL init + mesh at W ranks (60 s, assumed)
    T     tokens per version: prompts x samples x tokens (256 x 16 x 4,096)
    F, eta  GPU dense BF16 peak (989 TFLOP/s) and efficiency (0.4), as the rest of the projection

Formulas (seconds per version):
    per-node rates   r_w = min(G * b_w, D_w)   r_r = min(G * b_r, D_r)   r_s3 = min(G * b_w, b_s3)
    S3 of B bytes    T_s3(B) = max(B / (N * r_s3), B / (R_put * part))     all nodes in parallel,
                                                                   or the prefix's PUT ceiling
    training         T_train = 6 * Pa * T / (W * F * eta)          (no dispatch time: a floor)
  before (restart per version):
    restart          T_start = T_0
    load             T_load  = P * (m + a) / (N * r_r)             master rows + Adam shards
    optimizer DCP    T_dcp   = P * a / (N * r_w)                   every rank, in parallel
    HF to rank 0     T_hf    = P * m / b_g + P * s / min(b_w, D_w) gathered in fp32, written in s
    master copy      T_mst   = P * m / b_g + P * m / min(b_w, D_w) (only when s != m)
    critical path    C_b     = T_start + T_load + T_train + T_dcp + T_hf + T_mst
    publication      U_b     = P * (s + m + a) / min(b_pub, c * b_c) + P * (s + m + a) / b_pub
                               (one pod: the whole directory to the cache tier, then to S3;
                                off the critical path, but checkpoint.max_unpublished = 1 makes
                                the trainer wait for it)
    version period   V_b     = max(C_b, U_b)
  after (persistent mesh):
    export           T_exp   = P * s / (N * r_w) + Pd * s / b_g    every rank its part; the dense
                                                                   all-gather first
    state            T_st    = P * (m + a) / (N * r_w) / k         every rank its DCP shard to
                                                                   its node's disk, every k
                                                                   versions, amortized
    critical path    C_a     = T_train + T_exp + T_st
    publication      U_a     = P * s / min(N * r_s3, c * b_c) + T_s3(P * s + P * (m + a) / k)
                               off the critical path: the engine weights to the cache tier,
                               then weights and state to S3, every node its own files
    version period   V_a     = max(C_a, U_a)
  both:
    not training     1 - T_train / V                               the share of a version's wall
                                                                   time the GPUs do not train
    resume           T_0 + max(P * (m + a) / (N * min(G * b_r, b_s3)), P * (m + a) / (R_get * part))
                     + (k - 1) / 2 * V_a after (the updates since the last state are lost:
                     that much training, on average)
  bytes per version (per tier):
    before  local write P*(a+s+m), local read P*(m+a), into rank 0 2*P*m, publisher pod out
            2*P*(s+m+a), cache tier P*(s+m+a), S3 P*(s+m+a)
    after   local write P*s, all-gathered per rank Pd*s, cache tier P*s, S3 P*s + P*(m+a)/k

Limitations: bandwidths only (no request latency, no file-system metadata, no DCP planning);
the rank rates b_w and b_r come from one rank of this repository's code on one H200, not from
128 ranks sharing a node's CPUs and disks (r_w and r_r cap them at the node's NVMe); the
training time is a compute floor (no dispatch/combine, no logprob passes of the old policy or
the reference), so every "not training" share is an upper bound for its inputs; page cache,
which can serve `load` from memory when the same node ran the previous version, is not counted.
"""
MiB = 2**20


@dataclass(frozen=True)
class VersionInputs:
    nodes: int = 16
    gpus_per_node: int = 8
    rank_write_gbps: float = 19.9 / 27.4  # b_w, GB/s: measured, one rank on one H200
    rank_read_gbps: float = 19.9 / 15.5  # b_r, GB/s: measured, one rank on one H200
    nvme_write_gbps: float = 8.0  # D_w, per node, assumed
    nvme_read_gbps: float = 16.0  # D_r, per node, assumed
    s3_gbps: float = 10.0  # b_s3, GB/s per node, assumed (100 Gbit/s at ~80 %)
    s3_put_per_s: float = 3500.0  # R_put per prefix
    s3_get_per_s: float = 5500.0  # R_get per prefix
    part_mib: float = 8.0  # checkpoint.multipart_chunk_mb
    gather_gbps: float = 10.0  # b_g, into one rank, assumed
    publisher_gbps: float = 5.0  # b_pub, one pod, hashing included, assumed
    cache_gbps: float = 6.25  # b_c, one cache node (50 Gbit/s)
    cache_nodes: int = 1
    start_s: float = 60.0  # T_0 at W ranks, assumed
    prompts: int = 256
    samples: int = 16
    tokens_per_sample: int = 4096
    gpu_tflops: float = 989.0
    efficiency: float = 0.4
    train_s: float | None = None  # T_train given directly; None: the formula
    serving_bytes: float = 2.0
    master_bytes: float = 4.0
    adam_bytes: float = 8.0
    state_every: int = 1  # k, checkpoint.state_every


def _check(inp: VersionInputs) -> None:
    for key, v in asdict(inp).items():
        if key in ("train_s", "start_s") or isinstance(v, bool):
            continue
        if isinstance(v, int) and v < 1 or v <= 0:
            raise ConfigError(f"bench project: trainer version {key} must be > 0, got {v}")
    if inp.start_s < 0 or (inp.train_s is not None and inp.train_s <= 0):
        raise ConfigError("bench project: trainer version start_s must be >= 0 and train_s > 0")
    if not 0 < inp.efficiency <= 1:
        raise ConfigError("bench project: trainer version efficiency must be in (0, 1]")


def version_times(
    name: str, total: float, active: float, dense: float, inp: VersionInputs
) -> dict[str, Any]:
    """One model's row: seconds per version of every term before and after, the share of a
    version not spent training, bytes per tier, and a resume's cost. Units: seconds, GB."""
    _check(inp)
    n, g = inp.nodes, inp.gpus_per_node
    p, s, m, a, k = total, inp.serving_bytes, inp.master_bytes, inp.adam_bytes, inp.state_every
    b_w, b_r = inp.rank_write_gbps * GB, inp.rank_read_gbps * GB
    d_w, d_r = inp.nvme_write_gbps * GB, inp.nvme_read_gbps * GB
    b_s3, b_g = inp.s3_gbps * GB, inp.gather_gbps * GB
    b_pub, b_cache = inp.publisher_gbps * GB, inp.cache_gbps * GB * inp.cache_nodes
    r_w, r_r, r_s3 = min(g * b_w, d_w), min(g * b_r, d_r), min(g * b_w, b_s3)
    put, get = inp.s3_put_per_s * inp.part_mib * MiB, inp.s3_get_per_s * inp.part_mib * MiB

    def t_s3(nbytes: float) -> float:
        return max(nbytes / (n * r_s3), nbytes / put)

    tokens = inp.prompts * inp.samples * inp.tokens_per_sample
    train = (
        inp.train_s
        if inp.train_s is not None
        else 6 * active * tokens / (n * g * inp.gpu_tflops * 1e12 * inp.efficiency)
    )
    master_copy = s != m
    before = {
        "restart_s": inp.start_s,
        "load_s": p * (m + a) / (n * r_r),
        "optimizer_dcp_s": p * a / (n * r_w),
        "hf_rank0_s": p * m / b_g + p * s / min(b_w, d_w),
        "master_copy_s": (p * m / b_g + p * m / min(b_w, d_w)) if master_copy else 0.0,
        "train_s": train,
    }
    c_b = sum(before.values())
    whole = p * (s + m + a) if master_copy else p * (s + a)
    u_b = whole / min(b_pub, b_cache) + whole / b_pub
    v_b = max(c_b, u_b)
    before |= {
        "critical_path_s": c_b,
        "publication_s": u_b,
        "version_s": v_b,
        "publication_bounds": u_b > c_b,
        "not_training": 1 - train / v_b,
    }
    after = {
        "export_s": p * s / (n * r_w) + dense * s / b_g,
        "state_s": p * (m + a) / (n * r_w) / k,
        "train_s": train,
    }
    c_a = sum(after.values())
    u_a = p * s / min(n * r_s3, b_cache) + t_s3(p * s + p * (m + a) / k)
    v_a = max(c_a, u_a)
    after |= {
        "state_upload_s": t_s3(p * (m + a)),
        "state_prefix_bound": p * (m + a) / put > p * (m + a) / (n * r_s3),
        "critical_path_s": c_a,
        "publication_s": u_a,
        "version_s": v_a,
        "publication_bounds": u_a > c_a,
        "not_training": 1 - train / v_a,
    }
    state = p * (m + a)
    read = inp.start_s + max(state / (n * min(g * b_r, b_s3)), state / get)
    return {
        "model": name,
        "params": p,
        "active_params": active,
        "dense_params": dense,
        "tokens_per_version": tokens,
        "before": before,
        "after": after,
        "resume_s": {"before": read, "after": read + (k - 1) / 2 * v_a},
        "gb_per_version": {
            "before": {
                "local_write": p * (a + s + (m if master_copy else 0)) / GB,
                "local_read": state / GB,
                "into_rank0": p * m * (2 if master_copy else 1) / GB,
                "publisher_pod_out": 2 * whole / GB,
                "cache_tier": whole / GB,
                "s3": whole / GB,
            },
            "after": {
                "local_write": p * s / GB,
                "all_gathered_per_rank": dense * s / GB,
                "cache_tier": p * s / GB,
                "s3": (p * s + state / k) / GB,
            },
        },
    }


def version_table(models: Iterable[Any], inp: VersionInputs) -> dict[str, Any]:
    """Every model (a `project.ModelShape`) at `inp`, with the inputs, formulas and a sweep of
    the after's not-training share over state_every and the multipart part size."""
    _check(inp)
    shapes = list(models)
    rows = [
        version_times(
            sh.name, sh.total_params, sh.active_params, sh.total_params - sh.expert_params, inp
        )
        for sh in shapes
    ]
    sweep = []
    for k in sorted({1, 2, 4, 8, inp.state_every}):
        for part in sorted({8.0, 64.0, inp.part_mib}):
            i2 = replace(inp, state_every=k, part_mib=part)
            sweep.append(
                {
                    "state_every": k,
                    "part_mib": part,
                    **{
                        sh.name: version_times(
                            sh.name,
                            sh.total_params,
                            sh.active_params,
                            sh.total_params - sh.expert_params,
                            i2,
                        )["after"]["not_training"]
                        for sh in shapes
                    },
                }
            )
    return {"inputs": asdict(inp), "formulas": formulas(), "rows": rows, "sweep_after": sweep}


def formulas() -> list[str]:
    """The formulas, as the module docstring states them (one per line)."""
    doc = MODEL
    start, end = doc.index("Symbols (inputs"), doc.index("Limitations:")
    return [line.rstrip() for line in doc[start:end].strip().splitlines()]


def format_versions(rep: dict[str, Any]) -> str:
    from benchmarks import format_table

    i = rep["inputs"]
    rows = []
    for r in rep["rows"]:
        b, a = r["before"], r["after"]
        rows.append(
            [
                r["model"],
                b["restart_s"] + b["load_s"],
                b["optimizer_dcp_s"] + b["hf_rank0_s"] + b["master_copy_s"],
                b["publication_s"],
                b["train_s"],
                b["version_s"],
                b["not_training"],
                a["export_s"],
                a["state_s"],
                a["publication_s"],
                a["version_s"],
                a["not_training"],
                r["resume_s"]["before"],
                r["resume_s"]["after"],
            ]
        )
    bytes_rows = [
        [r["model"], "before", *(f"{v:,.0f}" for v in r["gb_per_version"]["before"].values())]
        for r in rep["rows"]
    ]
    head = (
        f"trainer per version on {i['nodes']} x {i['gpus_per_node']} GPUs: "
        f"{i['prompts']} x {i['samples']} x {i['tokens_per_sample']} tokens, restart "
        f"{i['start_s']:g} s, rank write/read {i['rank_write_gbps']:.2f}/{i['rank_read_gbps']:.2f} "
        f"GB/s, NVMe {i['nvme_write_gbps']:g}/{i['nvme_read_gbps']:g} GB/s/node, S3 "
        f"{i['s3_gbps']:g} GB/s/node ({i['s3_put_per_s']:g} PUT/s x {i['part_mib']:g} MiB per "
        f"prefix), gather {i['gather_gbps']:g} GB/s, publisher {i['publisher_gbps']:g} GB/s, cache "
        f"{i['cache_nodes']} x {i['cache_gbps']:g} GB/s, state every {i['state_every']} (seconds)"
    )
    table = format_table(
        [
            "model",
            "before: restart+load",
            "save",
            "publish",
            "train",
            "version",
            "not training",
            "after: export",
            "state",
            "publish",
            "version",
            "not training",
            "resume before",
            "after",
        ],
        rows,
    )
    gb = format_table(
        ["model", "", *rep["rows"][0]["gb_per_version"]["before"]],
        bytes_rows,
    )
    gb_after = format_table(
        ["model", "", *rep["rows"][0]["gb_per_version"]["after"]],
        [
            [r["model"], "after", *(f"{v:,.0f}" for v in r["gb_per_version"]["after"].values())]
            for r in rep["rows"]
        ],
    )
    sweep = "after's not-training share by state_every / part MiB: " + "; ".join(
        f"k={w['state_every']}, {w['part_mib']:g} MiB: "
        + ", ".join(f"{r['model']} {w[r['model']]:.0%}" for r in rep["rows"])
        for w in rep["sweep_after"]
    )
    return "\n".join([head, table, "GB per version:", gb, gb_after, sweep])
