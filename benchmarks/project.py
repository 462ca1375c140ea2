"""`moerl bench project`: the seed's scale on paper.

No GPU cluster is at hand, so this projects one. Given a model shape, the expert-parallel
layout, the batch and sequence lengths, the links and two dispatchers (a baseline and a faster
one), it predicts:
- the share of a decode step and of a training step spent in dispatch/combine;
- rollout throughput (output tokens/s) with each dispatcher, and the gain of the faster one;
- how that gain shrinks once the environment/verifier and reward time per trajectory are
  counted, and at which decode batch sizes it would reach a claimed gain (the seed's +40 %).

Every input and every formula is written into the report. The model is deliberately simple
(a roofline for compute, bytes / bandwidth + a fixed latency for each collective, no overlap
of communication with compute) so a reader can check it by hand. Symbols:

    L   MoE layers            h  hidden size            k  experts per token   E  experts
    P   active parameters     N  nodes in the EP group  G  GPUs per node       EP = N * G
    B   decode sequences per GPU (tokens per GPU per decode step)
    Tt  training tokens per GPU per optimizer micro-step
    F   GPU peak dense FLOP/s  M  HBM bytes/s  eta  the efficiency applied to both
    bd, bc  bytes per element on the wire in dispatch / combine
    f_remote_node  expected distinct OTHER nodes a token's k experts fall on (uniform routing):
                   (N - 1) * (1 - C(E - E/N, k) / C(E, k))
    f_remote_rank  expected (token, expert) pairs on other GPUs: k * (1 - 1/EP)
    imb  expert load imbalance (max/mean tokens per expert): the slowest GPU sets the pace

Decode step (per GPU):
    t_compute = max(2 * P * B / (F * eta), (W + KV) / (M * eta))
    W = dense_params * 2 + local_expert_params * 2 * min(1, B * EP * k / E)   weights read (BF16)
    KV = B * (prompt_len + response_len / 2) * kv_bytes_per_token          the KV cache read
                                                                 (mean context over a response)
    bytes_inter = B * h * (bd + bc) * f_inter                    f_inter: f_remote_node for a
                                                                 node-deduplicating dispatcher
                                                                 (DeepEP), k * (N-1)/N otherwise
    bytes_intra = B * h * (bd + bc) * f_intra                    f_intra: k * (G-1)/EP
    t_comm = L * (2 * lat + imb * (bytes_inter / BW_inter + bytes_intra / BW_nvlink))
    BW_inter = min(dispatcher GB/s, EFA GB/s per GPU)
    share = t_comm / (t_compute + t_comm);   tokens/s = B * EP / (t_compute + t_comm)
Training micro-step (per GPU): the same with Tt tokens, 6 * P * Tt FLOPs (forward + backward),
    communication twice (forward dispatch/combine and their backward), BF16 both ways.
Rollout with the environment: a trajectory of R response tokens takes R / (tokens/s per
sequence) to generate plus env_s in the environment/verifier and reward model, unoverlapped:
    trajectories/s = B * EP / (R * t_step + env_s),  gain = fast / base - 1.

Calibration from this machine: the routing byte formula is checked against
`kernels.dispatcher.routing_bytes` on a uniform routing of the same shape (the same counting
the dispatch benchmark reports); a `moerl bench suite` report, when given, sets env_s from the
measured ratio of verifier + reward time to generation time (its expert imbalance is reported,
not applied: a tiny seeded model's routing does not transfer to a trained model).

Limitations: no overlap of communication and compute (DeepEP's hooks and two-batch overlap
hide some of it: the projection is then an upper bound on the communication share); attention
FLOPs are not counted (the KV-cache reads are); prefill is not modelled (decode dominates RL
rollouts with long responses); the published dispatcher figures come from other clusters
(H800 + CX7, p5 with EFA) and transfer to p5en only approximately.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from benchmarks.redistribution import FleetInputs, fleet_table, format_fleet
from moerl.errors import ConfigError


@dataclass(frozen=True)
class ModelShape:
    name: str
    hidden: int
    moe_layers: int
    experts: int
    topk: int
    active_params: float  # per token
    total_params: float
    expert_params: float  # routed experts, all layers
    kv_bytes_per_token: float  # KV cache, all layers, BF16
    source: str


# Public model cards / config.json (hidden_size, num_hidden_layers, num_experts, num_experts_per_tok,
# moe_intermediate_size); expert params = layers * experts * 3 * hidden * moe_intermediate.
MODELS: dict[str, ModelShape] = {
    "qwen3-30b-a3b": ModelShape(
        "Qwen3-30B-A3B",
        2048,
        48,
        128,
        8,
        3.3e9,
        30.5e9,
        48 * 128 * 3 * 2048 * 768,
        48 * 4 * 128 * 2 * 2,
        "Qwen/Qwen3-30B-A3B config.json: hidden 2048, 48 layers, 128 experts, top-8, "
        "moe_intermediate 768, 4 KV heads of 128",
    ),
    "qwen3-235b-a22b": ModelShape(
        "Qwen3-235B-A22B",
        4096,
        94,
        128,
        8,
        22e9,
        235e9,
        94 * 128 * 3 * 4096 * 1536,
        94 * 4 * 128 * 2 * 2,
        "Qwen/Qwen3-235B-A22B config.json: hidden 4096, 94 layers, 128 experts, top-8, "
        "moe_intermediate 1536, 4 KV heads of 128",
    ),
    "deepseek-v3": ModelShape(
        "DeepSeek-V3",
        7168,
        58,
        256,
        8,
        37e9,
        671e9,
        58 * 256 * 3 * 7168 * 2048,
        61 * (512 + 64) * 2,
        "deepseek-ai/DeepSeek-V3 config.json: hidden 7168, 61 layers (first 3 dense), "
        "256 routed experts, top-8, moe_intermediate 2048, MLA KV 512 + 64 rope",
    ),
}


@dataclass(frozen=True)
class Dispatcher:
    name: str
    gbps: float  # effective inter-node bandwidth per GPU per direction, GB/s
    latency_us: float  # fixed cost of one dispatch or one combine
    node_dedup: bool  # sends one copy per (token, node) across nodes, forwarded over NVLink
    source: str


DISPATCHERS: dict[str, Dispatcher] = {
    # AWS's p5 comparison (4 nodes, 4096 tokens, top-8, 256 experts): NCCL all-to-all busbw 45.1 GB/s.
    # The per-collective latency is an assumption (small-message all-to-all across 16+ peers); change it.
    "nccl-a2a": Dispatcher(
        "nccl-a2a",
        45.1,
        60.0,
        False,
        "NCCL alltoall busbw 45.1 GB/s (AWS p5 comparison, docs/benchmarks.md); "
        "latency 60 us assumed",
    ),
    # DeepEP-NVSHMEM-libfabric on the same p5 setup: 43.7 / 46.1 GB/s; its low-latency kernels
    # take 118 / 195 us for 128 tokens at EP16 (H800 + CX7), so the fixed cost is well under that.
    "deepep": Dispatcher(
        "deepep",
        44.9,
        20.0,
        True,
        "DeepEP-NVSHMEM-libfabric 43.7 / 46.1 GB/s (AWS p5 comparison, mean); node-deduplicated "
        "internode dispatch; latency 20 us assumed (LL kernels: 118/195 us for 128 tokens at EP16)",
    ),
}


@dataclass(frozen=True)
class Inputs:
    model: str = "qwen3-30b-a3b"
    nodes: int = 4
    gpus_per_node: int = 8
    decode_batch: int = 128  # sequences per GPU in a decode step
    prompt_len: int = 512
    response_len: int = 2048
    train_tokens_per_gpu: int = 16384  # tokens per GPU per training micro-step
    nvlink_gbps: float = 450.0  # NVLink4, per GPU per direction
    efa_gbps_per_gpu: float = 50.0  # p5en: 3,200 Gbps per instance / 8 GPUs
    gpu_tflops: float = 989.0  # H100/H200 dense BF16 peak
    hbm_tbps: float = 4.8  # H200
    efficiency: float = 0.4
    dispatch_bytes: float = 1.0  # FP8 dispatch (DeepEP's default in inference)
    combine_bytes: float = 2.0  # BF16 combine
    imbalance: float = 1.0
    env_s: float = 0.0  # environment/verifier + reward seconds per trajectory, not overlapped
    baseline: str = "nccl-a2a"
    fast: str = "deepep"
    claimed_gain: float = 0.40
    dispatchers: dict[str, Dispatcher] = field(default_factory=lambda: dict(DISPATCHERS))


def remote_node_fraction(experts: int, topk: int, nodes: int) -> float:
    """Expected distinct other nodes a token's k distinct experts land on, uniform routing."""
    if nodes <= 1:
        return 0.0
    per_node = experts // nodes
    p_none = math.comb(experts - per_node, topk) / math.comb(experts, topk)
    return (nodes - 1) * (1.0 - p_none)


def _check(inp: Inputs) -> ModelShape:
    if inp.model not in MODELS:
        raise ConfigError(
            f"bench project: --model must be one of {', '.join(MODELS)}, got {inp.model!r}"
        )
    for name in (inp.baseline, inp.fast):
        if name not in inp.dispatchers:
            raise ConfigError(
                f"bench project: dispatcher {name!r} unknown; known: {', '.join(inp.dispatchers)}"
            )
    for key in ("nodes", "gpus_per_node", "decode_batch", "response_len", "train_tokens_per_gpu"):
        if getattr(inp, key) < 1:
            raise ConfigError(
                f"bench project: --{key.replace('_', '-')} must be >= 1, got {getattr(inp, key)}"
            )
    for key in (
        "nvlink_gbps",
        "efa_gbps_per_gpu",
        "gpu_tflops",
        "hbm_tbps",
        "dispatch_bytes",
        "combine_bytes",
    ):
        if getattr(inp, key) <= 0:
            raise ConfigError(
                f"bench project: --{key.replace('_', '-')} must be > 0, got {getattr(inp, key)}"
            )
    if not 0 < inp.efficiency <= 1:
        raise ConfigError(f"bench project: --efficiency must be in (0, 1], got {inp.efficiency}")
    if inp.imbalance < 1 or inp.env_s < 0:
        raise ConfigError("bench project: --imbalance must be >= 1 and --env-s >= 0")
    shape = MODELS[inp.model]
    ep = inp.nodes * inp.gpus_per_node
    if shape.experts % ep:
        raise ConfigError(
            f"bench project: {shape.experts} experts of {shape.name} do not split over EP = {ep} "
            f"({inp.nodes} nodes x {inp.gpus_per_node} GPUs)"
        )
    return shape


def _comm_s(
    tokens: int, inp: Inputs, shape: ModelShape, d: Dispatcher, bytes_per_elem: float, passes: int
) -> dict[str, float]:
    """Dispatch + combine seconds per step for `tokens` tokens per GPU, over all MoE layers."""
    n, g = inp.nodes, inp.gpus_per_node
    ep = n * g
    f_inter = (
        remote_node_fraction(shape.experts, shape.topk, n)
        if d.node_dedup
        else shape.topk * (n - 1) / n
    )
    f_intra = shape.topk * (g - 1) / ep
    bytes_inter = tokens * shape.hidden * bytes_per_elem * f_inter
    bytes_intra = tokens * shape.hidden * bytes_per_elem * f_intra
    bw_inter = min(d.gbps, inp.efa_gbps_per_gpu) * 1e9
    per_layer = 2 * d.latency_us * 1e-6 + inp.imbalance * (
        bytes_inter / bw_inter + bytes_intra / (inp.nvlink_gbps * 1e9)
    )
    return {
        "seconds": passes * shape.moe_layers * per_layer,
        "bytes_inter_per_layer": bytes_inter,
        "bytes_intra_per_layer": bytes_intra,
        "f_inter": f_inter,
        "f_intra": f_intra,
    }


def _decode(inp: Inputs, shape: ModelShape, d: Dispatcher) -> dict[str, Any]:
    ep = inp.nodes * inp.gpus_per_node
    b = inp.decode_batch
    flops_s = 2 * shape.active_params * b / (inp.gpu_tflops * 1e12 * inp.efficiency)
    dense = shape.total_params - shape.expert_params
    touched = min(1.0, b * ep * shape.topk / shape.experts)
    weight_bytes = dense * 2 + shape.expert_params / ep * 2 * touched
    kv_bytes = b * (inp.prompt_len + inp.response_len / 2) * shape.kv_bytes_per_token
    hbm_s = (weight_bytes + kv_bytes) / (inp.hbm_tbps * 1e12 * inp.efficiency)
    compute = max(flops_s, hbm_s)
    comm = _comm_s(b, inp, shape, d, inp.dispatch_bytes + inp.combine_bytes, passes=1)
    step = compute + comm["seconds"]
    tok_s = b * ep / step
    traj_s = b * ep / (inp.response_len * step + inp.env_s)
    return {
        "compute_s": compute,
        "flops_bound_s": flops_s,
        "hbm_bound_s": hbm_s,
        "comm_s": comm["seconds"],
        "step_s": step,
        "comm_share": comm["seconds"] / step,
        "output_tokens_per_s": tok_s,
        "trajectories_per_s": traj_s,
        **{k: v for k, v in comm.items() if k != "seconds"},
    }


def _train(inp: Inputs, shape: ModelShape, d: Dispatcher) -> dict[str, Any]:
    t = inp.train_tokens_per_gpu
    compute = 6 * shape.active_params * t / (inp.gpu_tflops * 1e12 * inp.efficiency)
    comm = _comm_s(t, inp, shape, d, 2.0 + 2.0, passes=2)  # BF16 both ways, forward and backward
    step = compute + comm["seconds"]
    return {
        "compute_s": compute,
        "comm_s": comm["seconds"],
        "step_s": step,
        "comm_share": comm["seconds"] / step,
    }


def project(inp: Inputs) -> dict[str, Any]:
    """The projection for `inp`: per dispatcher, decode and training; the gains; and sweeps of
    the rollout gain over decode batch size and environment time."""
    shape = _check(inp)
    base, fast = inp.dispatchers[inp.baseline], inp.dispatchers[inp.fast]
    res = {
        name: {"decode": _decode(inp, shape, d), "train": _train(inp, shape, d)}
        for name, d in ((base.name, base), (fast.name, fast))
    }
    b, f = res[base.name]["decode"], res[fast.name]["decode"]
    gain_tokens = f["output_tokens_per_s"] / b["output_tokens_per_s"] - 1
    gain_traj = f["trajectories_per_s"] / b["trajectories_per_s"] - 1
    batches = sorted({1, 8, 16, 32, 64, 128, 256, 512, inp.decode_batch})
    sweep_batch = []
    for bb in batches:
        i2 = replace(inp, decode_batch=bb)
        db, df = _decode(i2, shape, base), _decode(i2, shape, fast)
        sweep_batch.append(
            {
                "decode_batch": bb,
                "comm_share_baseline": db["comm_share"],
                "gain_tokens": df["output_tokens_per_s"] / db["output_tokens_per_s"] - 1,
                "gain_trajectories": df["trajectories_per_s"] / db["trajectories_per_s"] - 1,
            }
        )
    gen_s = inp.response_len * b["step_s"]  # baseline seconds to generate one trajectory
    sweep_env = []
    # env time as a multiple of baseline generation time
    for frac in (
        0.0,
        0.1,
        0.25,
        0.5,
        1.0,
        2.0,
    ):
        i2 = replace(inp, env_s=frac * gen_s)
        db, df = _decode(i2, shape, base), _decode(i2, shape, fast)
        sweep_env.append(
            {
                "env_over_generation": frac,
                "env_s": frac * gen_s,
                "gain_trajectories": df["trajectories_per_s"] / db["trajectories_per_s"] - 1,
            }
        )
    holds = [r["decode_batch"] for r in sweep_batch if r["gain_tokens"] >= inp.claimed_gain]
    inputs = asdict(inp)
    inputs["dispatchers"] = {
        k: asdict(v) for k, v in inp.dispatchers.items() if k in (base.name, fast.name)
    }
    return {
        "model": asdict(shape),
        "ep": inp.nodes * inp.gpus_per_node,
        "inputs": inputs,
        "formulas": formulas(),
        "dispatchers": res,
        "gain": {
            "output_tokens": gain_tokens,
            "trajectories": gain_traj,
            "claimed": inp.claimed_gain,
            "claim_holds": gain_traj >= inp.claimed_gain,
            "decode_batches_where_token_gain_reaches_claim": holds,
        },
        "sweep_decode_batch": sweep_batch,
        "sweep_env": sweep_env,
    }


def formulas() -> list[str]:
    """The model's formulas, as the module docstring states them (one per line)."""
    doc = __doc__ or ""
    start, end = doc.index("Decode step (per GPU):"), doc.index("Calibration from this machine")
    return [line.rstrip() for line in doc[start:end].strip().splitlines()]


def calibrate_bytes(
    experts: int, topk: int, nodes: int, gpus_per_node: int, tokens: int = 4096, seed: int = 0
) -> dict[str, float]:
    """The projection's per-token remote-node count against `routing_bytes` on a uniform
    routing of this shape (rank 0's tokens): measured / predicted, which should be ~1."""
    from benchmarks.dispatch import make_routing
    from moerl.kernels.dispatcher import routing_bytes

    ep = nodes * gpus_per_node
    idx, _ = make_routing(tokens, experts, topk, "uniform", seed=seed)
    got = routing_bytes(idx, experts // ep, 0, ep, gpus_per_node, row_bytes=1)
    pred_node = remote_node_fraction(experts, topk, nodes) * tokens
    pred_expert = topk * (1 - 1 / ep) * tokens
    return {
        "tokens": tokens,
        "measured_per_node_dedup": got["per_node_dedup"],
        "predicted_per_node_dedup": pred_node,
        "ratio_per_node_dedup": got["per_node_dedup"] / pred_node if pred_node else 1.0,
        "measured_per_expert": got["per_expert"],
        "predicted_per_expert": pred_expert,
        "ratio_per_expert": got["per_expert"] / pred_expert if pred_expert else 1.0,
    }


def calibrate_from_suite(
    inp: Inputs, suite_report: Path, base_step_s: float
) -> tuple[Inputs, dict[str, Any]]:
    """Set env_s from a `moerl bench suite` report measured here: the measured (verifier +
    reward model) / generation time ratio, applied to the projected generation time. The
    measured expert imbalance is reported, not applied: a tiny seeded model's routing says
    nothing about a trained model's (pass --imbalance for that)."""
    import json

    rep = json.loads(Path(suite_report).read_text())
    stages = rep["results"]["stages"]
    gen = stages["rollout"]["per_repeat_mean"]["mean"]
    env = stages["reward"]["per_repeat_mean"]["mean"]
    if stages.get("reward_model", {}).get("n"):
        env += stages["reward_model"]["per_repeat_mean"]["mean"]
    ratio = env / gen if gen > 0 else 0.0
    env_s = ratio * inp.response_len * base_step_s
    used = {
        "suite_report": str(suite_report),
        "measured_env_over_generation": ratio,
        "env_s": env_s,
        "measured_rollout_imbalance_not_applied": rep["results"]["imbalance"]["rollout"][
            "max_over_mean"
        ]["mean"],
    }
    return replace(inp, env_s=env_s), used


# -- the command --------------------------------------------------------------------------------
def add_project_args(p) -> None:
    d = Inputs()
    p.add_argument("--model", default=d.model, choices=sorted(MODELS))
    p.add_argument("--nodes", type=int, default=d.nodes)
    p.add_argument("--gpus-per-node", type=int, default=d.gpus_per_node)
    p.add_argument(
        "--decode-batch",
        type=int,
        default=d.decode_batch,
        help="sequences per GPU in a decode step",
    )
    p.add_argument("--prompt-len", type=int, default=d.prompt_len)
    p.add_argument("--response-len", type=int, default=d.response_len)
    p.add_argument("--train-tokens-per-gpu", type=int, default=d.train_tokens_per_gpu)
    p.add_argument("--nvlink-gbps", type=float, default=d.nvlink_gbps)
    p.add_argument("--efa-gbps-per-gpu", type=float, default=d.efa_gbps_per_gpu)
    p.add_argument("--gpu-tflops", type=float, default=d.gpu_tflops)
    p.add_argument("--hbm-tbps", type=float, default=d.hbm_tbps)
    p.add_argument("--efficiency", type=float, default=d.efficiency)
    p.add_argument("--imbalance", type=float, default=d.imbalance)
    p.add_argument(
        "--env-s", type=float, default=d.env_s, help="environment + reward seconds per trajectory"
    )
    p.add_argument("--baseline", default=d.baseline)
    p.add_argument("--fast", default=d.fast)
    p.add_argument(
        "--baseline-gbps", type=float, default=None, help="override the baseline dispatcher's GB/s"
    )
    p.add_argument(
        "--fast-gbps",
        type=float,
        default=None,
        help="override the fast dispatcher's GB/s (e.g. measured)",
    )
    p.add_argument("--claimed-gain", type=float, default=d.claimed_gain)
    p.add_argument(
        "--calibrate-suite",
        default=None,
        metavar="REPORT",
        help="a `moerl bench suite` report.json: env time and imbalance from its measurements",
    )
    p.add_argument(
        "--trainer-nodes",
        type=int,
        default=16,
        help="memory fit: trainer nodes (GPUs per node as above)",
    )
    p.add_argument("--hbm-gb", type=float, default=141.0, help="memory fit: GB per GPU (H200: 141)")
    p.add_argument(
        "--no-activation-checkpointing", action="store_true", help="memory fit without it"
    )
    p.add_argument(
        "--logprob-chunk-tokens",
        type=int,
        default=1024,
        help="memory fit: 0 = the whole micro-batch",
    )
    p.add_argument(
        "--rollout-gpu-gib",
        type=float,
        default=140.0,
        help="rollout engines: GiB per GPU (H200: 140; cluster.groups.rollout.gpu_memory_gib)",
    )
    p.add_argument(
        "--rollout-utilization",
        type=float,
        default=0.9,
        help="rollout engines: the share of a GPU vLLM takes (rollout.gpu_memory_utilization)",
    )
    p.add_argument(
        "--max-model-len",
        type=int,
        default=None,
        help="rollout engines: the KV cache holds one sequence this long (default: each model's own)",
    )
    f = FleetInputs()
    p.add_argument(
        "--rollout-nodes", type=int, default=f.rollout_nodes, help="weights: rollout nodes served"
    )
    p.add_argument(
        "--s3-gbps", type=float, default=f.s3_gbps, help="weights: one node's S3 throughput"
    )
    p.add_argument(
        "--cache-gbps",
        type=float,
        default=f.cache_gbps,
        help="weights: one cache-tier node's network",
    )
    p.add_argument(
        "--cache-nodes", type=int, default=f.cache_nodes, help="weights: cache-tier nodes"
    )
    p.add_argument(
        "--tcp-gbps",
        type=float,
        default=f.tcp_gbps,
        help="weights: a rollout node's TCP to its peers",
    )
    p.add_argument(
        "--wire-efficiency",
        type=float,
        default=f.wire_efficiency,
        help="weights: the share of EFA's line rate the collective weight path sustains (0-1]",
    )
    p.add_argument("--out-dir", default="bench/project")


def inputs_from_args(a) -> Inputs:
    disp = dict(DISPATCHERS)
    for name, gbps in ((a.baseline, a.baseline_gbps), (a.fast, a.fast_gbps)):
        if gbps is not None:
            if name not in disp:
                raise ConfigError(
                    f"bench project: dispatcher {name!r} unknown; known: {', '.join(disp)}"
                )
            disp[name] = replace(
                disp[name],
                gbps=gbps,
                source=disp[name].source + f"; GB/s set to {gbps} by the user",
            )
    return Inputs(
        model=a.model,
        nodes=a.nodes,
        gpus_per_node=a.gpus_per_node,
        decode_batch=a.decode_batch,
        prompt_len=a.prompt_len,
        response_len=a.response_len,
        train_tokens_per_gpu=a.train_tokens_per_gpu,
        nvlink_gbps=a.nvlink_gbps,
        efa_gbps_per_gpu=a.efa_gbps_per_gpu,
        gpu_tflops=a.gpu_tflops,
        hbm_tbps=a.hbm_tbps,
        efficiency=a.efficiency,
        imbalance=a.imbalance,
        env_s=a.env_s,
        baseline=a.baseline,
        fast=a.fast,
        claimed_gain=a.claimed_gain,
        dispatchers=disp,
    )


def format_projection(rep: dict[str, Any]) -> str:
    from benchmarks import format_table

    rows = []
    for name, r in rep["dispatchers"].items():
        d, t = r["decode"], r["train"]
        rows.append(
            [
                name,
                d["step_s"] * 1e3,
                d["comm_share"],
                d["output_tokens_per_s"],
                d["trajectories_per_s"],
                t["step_s"] * 1e3,
                t["comm_share"],
            ]
        )
    g = rep["gain"]
    lines = [
        f"{rep['model']['name']} at EP = {rep['ep']} ({rep['inputs']['nodes']} nodes), decode batch "
        f"{rep['inputs']['decode_batch']} per GPU, response {rep['inputs']['response_len']} tokens",
        format_table(
            [
                "dispatcher",
                "decode step ms",
                "decode comm share",
                "tokens/s",
                "trajectories/s",
                "train step ms",
                "train comm share",
            ],
            rows,
        ),
        "",
        f"gain of {rep['inputs']['fast']} over {rep['inputs']['baseline']}: output tokens {g['output_tokens']:+.1%}, "
        f"trajectories (with env {rep['inputs']['env_s']:.2f} s) {g['trajectories']:+.1%}; "
        f"claimed {g['claimed']:+.0%}: {'holds' if g['claim_holds'] else 'does not hold'} here",
        "token gain by decode batch: "
        + ", ".join(
            f"{r['decode_batch']}: {r['gain_tokens']:+.1%}" for r in rep["sweep_decode_batch"]
        ),
        "trajectory gain by env time / generation time: "
        + ", ".join(
            f"{r['env_over_generation']:g}: {r['gain_trajectories']:+.1%}" for r in rep["sweep_env"]
        ),
    ]
    if "memory_fit" in rep:
        from benchmarks.memfit import FitInputs, format_fit

        lines += [
            "",
            format_fit(rep["memory_fit"]["rows"], FitInputs(**rep["memory_fit"]["inputs"])),
        ]
    if "engine_layout" in rep:
        from benchmarks.engine_layout import EngineInputs, format_layouts

        el = rep["engine_layout"]
        lines += ["", format_layouts(el["rows"], EngineInputs(**el["inputs"]))]
    if "redistribution" in rep:
        lines += ["", format_fleet(rep["redistribution"])]
    if "trainer_version" in rep:
        from benchmarks.trainer_projection import format_versions

        lines += ["", format_versions(rep["trainer_version"])]
    c = rep["calibration"]
    lines.append(
        f"calibration: routing bytes measured / predicted = {c['bytes']['ratio_per_node_dedup']:.3f} "
        f"(per node), {c['bytes']['ratio_per_expert']:.3f} (per expert)"
    )
    return "\n".join(lines)


def memory_fit(a) -> dict[str, Any]:
    """The memory-fit table (benchmarks/memfit.py) of every model at the trainer's mesh."""
    from dataclasses import asdict as _asdict

    from benchmarks.memfit import FitInputs, fit_table
    from benchmarks.memfit import formulas as fit_formulas

    if a.trainer_nodes < 1 or a.hbm_gb <= 0:
        raise ConfigError("bench project: --trainer-nodes must be >= 1 and --hbm-gb > 0")
    inp = FitInputs(
        nodes=a.trainer_nodes,
        gpus_per_node=a.gpus_per_node,
        hbm_gb=a.hbm_gb,
        activation_checkpointing=not a.no_activation_checkpointing,
        logprob_chunk_tokens=max(0, a.logprob_chunk_tokens),
    )
    return {
        "inputs": _asdict(inp),
        "formulas": fit_formulas(),
        "rows": fit_table(MODELS.values(), inp),
    }


def engine_layout(a) -> dict[str, Any]:
    """The rollout engine layout of every seed model on one node (benchmarks/engine_layout.py)."""
    from benchmarks.engine_layout import EngineInputs, formulas, layout_rows

    if not 0 < a.rollout_utilization <= 1 or a.rollout_gpu_gib <= 0 or a.gpus_per_node < 1:
        raise ConfigError(
            "bench project: --rollout-gpu-gib must be > 0, --rollout-utilization in (0, 1] and "
            "--gpus-per-node >= 1"
        )
    if a.max_model_len is not None and a.max_model_len < 16:
        raise ConfigError(f"bench project: --max-model-len must be >= 16, got {a.max_model_len}")
    inp = EngineInputs(
        gpus_per_node=a.gpus_per_node,
        gpu_gib=a.rollout_gpu_gib,
        utilization=a.rollout_utilization,
        max_model_len=a.max_model_len,
    )
    return {"inputs": asdict(inp), "formulas": formulas(), "rows": layout_rows(inp)}


def fleet(a) -> dict[str, Any]:
    """Serving one version to the rollout fleet (benchmarks/redistribution.py), every model."""
    if (
        min(a.rollout_nodes, a.cache_nodes, a.trainer_nodes) < 1
        or min(a.s3_gbps, a.cache_gbps, a.tcp_gbps) <= 0
        or not 0 < a.wire_efficiency <= 1
    ):
        raise ConfigError(
            "bench project: --rollout-nodes, --cache-nodes, --trainer-nodes must be >= 1, the "
            "--*-gbps > 0 and --wire-efficiency in (0, 1]"
        )
    inp = FleetInputs(
        rollout_nodes=a.rollout_nodes,
        trainer_nodes=a.trainer_nodes,
        efa_gbps=a.efa_gbps_per_gpu * 8 * a.gpus_per_node,
        s3_gbps=a.s3_gbps,
        cache_gbps=a.cache_gbps,
        cache_nodes=a.cache_nodes,
        tcp_gbps=a.tcp_gbps,
        wire_efficiency=a.wire_efficiency,
        gpus_per_node=a.gpus_per_node,
    )
    return fleet_table(((m.name, m.total_params) for m in MODELS.values()), inp)


def trainer_version(a) -> dict[str, Any]:
    """The async trainer's overhead per version, restart per version against a persistent mesh
    (benchmarks/trainer_projection.py), for the two large seed models at the trainer's mesh."""
    from benchmarks.trainer_projection import VersionInputs, version_table

    if a.trainer_nodes < 1 or a.cache_nodes < 1 or a.cache_gbps <= 0:
        raise ConfigError(
            "bench project: --trainer-nodes and --cache-nodes must be >= 1, --cache-gbps > 0"
        )
    inp = VersionInputs(
        nodes=a.trainer_nodes,
        gpus_per_node=a.gpus_per_node,
        cache_gbps=a.cache_gbps / 8,
        cache_nodes=a.cache_nodes,
        gpu_tflops=a.gpu_tflops,
        efficiency=a.efficiency,
    )
    return version_table((MODELS["qwen3-235b-a22b"], MODELS["deepseek-v3"]), inp)


def run_from_args(a) -> dict[str, Any]:
    """`moerl bench project`'s runner: `run_project` on the parsed flags (`add_project_args`)."""
    return run_project(a, Path(a.out_dir))


def run_project(a, out_dir: Path) -> dict[str, Any]:
    """`moerl bench project`: the projection with its calibration; report.json, summary.md and
    two plots in `out_dir`."""
    from benchmarks import plots, write_report
    from moerl import provenance

    inp = inputs_from_args(a)
    shape = _check(inp)
    calibration: dict[str, Any] = {
        "bytes": calibrate_bytes(shape.experts, shape.topk, inp.nodes, inp.gpus_per_node)
    }
    if a.calibrate_suite:
        base = _decode(inp, shape, inp.dispatchers[inp.baseline])["step_s"]
        inp, calibration["suite"] = calibrate_from_suite(inp, Path(a.calibrate_suite), base)
    rep = project(inp)
    rep.update(bench="project", schema=1, calibration=calibration, versions=provenance.collect())
    rep["memory_fit"] = memory_fit(a)
    rep["engine_layout"] = engine_layout(a)
    rep["redistribution"] = fleet(a)
    rep["trainer_version"] = trainer_version(a)
    ratios = (
        calibration["bytes"]["ratio_per_node_dedup"],
        calibration["bytes"]["ratio_per_expert"],
    )
    rep["ok"] = all(0.95 <= r <= 1.05 for r in ratios)
    out_dir.mkdir(parents=True, exist_ok=True)
    rep["plots"] = [
        plots.lines(
            {
                "output tokens": [
                    (r["decode_batch"], 100 * r["gain_tokens"]) for r in rep["sweep_decode_batch"]
                ],
                "trajectories": [
                    (r["decode_batch"], 100 * r["gain_trajectories"])
                    for r in rep["sweep_decode_batch"]
                ],
                f"claimed {inp.claimed_gain:.0%}": [
                    (r["decode_batch"], 100 * inp.claimed_gain) for r in rep["sweep_decode_batch"]
                ],
            },
            out_dir,
            "gain_vs_batch.png",
            "decode batch per GPU",
            "gain %",
            f"{inp.fast} over {inp.baseline}: {shape.name}, EP {rep['ep']}",
        ),
        plots.lines(
            {
                "trajectories": [
                    (r["env_over_generation"], 100 * r["gain_trajectories"])
                    for r in rep["sweep_env"]
                ]
            },
            out_dir,
            "gain_vs_env.png",
            "environment + reward time / generation time",
            "gain %",
            "the gain shrinks when the environment dominates",
        ),
    ]
    text = format_projection(rep)
    (out_dir / "summary.md").write_text(
        "# moerl bench project\n\n```\n"
        + text
        + "\n```\n\nFormulas:\n\n```\n"
        + "\n".join(rep["formulas"])
        + "\n```\n\nMemory fit:\n\n```\n"
        + "\n".join(rep["memory_fit"]["formulas"])
        + "\n```\n\nRollout engines:\n\n```\n"
        + "\n".join(rep["engine_layout"]["formulas"])
        + "\n```\n\nServing a version:\n\n```\n"
        + "\n".join(rep["redistribution"]["formulas"])
        + "\n```\n\nThe trainer per version, before and after a persistent mesh:\n\n```\n"
        + "\n".join(rep["trainer_version"]["formulas"])
        + "\n```\n"
    )
    write_report(out_dir / "report.json", rep)
    print(text)
    print(
        f"wrote {out_dir / 'report.json'}, {out_dir / 'summary.md'} and {len(rep['plots'])} plots"
    )
    return rep
