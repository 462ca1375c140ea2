"""Rollout engines on a node's GPUs, pure: how many engines a rollout pod runs, which devices
each gets, which workers a pod hosts, and whether an engine's weights plus its minimal KV cache
fit one GPU (the preflight refusal and `moerl bench project`'s layout table).

An engine spans TP x DP GPUs (rollout.tensor_parallel_size x data_parallel_size); a pod of G
GPUs runs G / (TP x DP) engines, engine j on devices [j*TP*DP, (j+1)*TP*DP). Per GPU, in the
serving dtype (FP8 checkpoints: 1 byte per linear weight):
    weights = (embeddings + dense) / TP + routed experts / (TP x DP)
    (attention is replicated over DP; the experts are split over TP x DP with or without
    expert parallelism: EP = TP x DP, or TP-sharded over DP x TP)
    kv = max_model_len x KV bytes per token per GPU (moerl.models.sizes: GQA heads over TP)
    fits when weights + kv <= GPU GiB x rollout.gpu_memory_utilization
Not counted: activations, CUDA graphs, the DP+EP all2all workspace (docs/rollout-scale.md).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from moerl.errors import ConfigError
from moerl.models.sizes import DTYPE_BYTES, ModelSizes, model_sizes

if TYPE_CHECKING:
    from moerl.config import RunConfig

GIB = 2**30
LAYOUT_KEYS = "rollout.tensor_parallel_size x rollout.data_parallel_size"


@dataclass(frozen=True)
class PodLayout:
    """The engines of one rollout pod."""

    gpus: int  # GPUs the pod has (0 on cpu)
    devices_per_engine: int  # TP x DP
    engines: int  # engines the pod runs

    def slices(self) -> list[tuple[int, ...]]:
        """The device indices (CUDA_VISIBLE_DEVICES) of each engine on this pod; empty tuples on
        cpu. An engine over several nodes has this node's GPUs, all of them."""
        if not self.gpus:
            return [()] * self.engines
        if self.devices_per_engine > self.gpus:
            return [tuple(range(self.gpus))]
        d = self.devices_per_engine
        return [tuple(range(j * d, (j + 1) * d)) for j in range(self.engines)]


def pod_layout(
    gpus: int, tp: int, dp: int, nodes: int = 1, gpus_key: str = "cluster.launch.gpus_per_node"
) -> PodLayout:
    """The engines of a pod of `gpus` GPUs (one of `nodes` per engine). Raises ConfigError when
    TP x DP does not divide `gpus` (one node) or is not `gpus` x `nodes` (an engine over nodes)."""
    per = tp * dp
    figures = f"{LAYOUT_KEYS} = {tp} x {dp} = {per} GPUs per engine"
    if gpus < 1:
        raise ConfigError(f"{gpus_key}: 0 GPUs per rollout pod, but {figures}; give the pod GPUs")
    if nodes > 1:
        if per != gpus * nodes:
            raise ConfigError(
                f"{figures}, but an engine over cluster.launch.rollout_nodes_per_worker = {nodes} "
                f"nodes of {gpus} GPUs ({gpus_key}) spans {gpus * nodes}; set them equal"
            )
        if tp > gpus or gpus % tp or dp % nodes:
            raise ConfigError(
                f"{figures} over {nodes} nodes (cluster.launch.rollout_nodes_per_worker): an engine "
                "over several nodes splits its data-parallel ranks evenly over them, each within "
                f"one node; rollout.tensor_parallel_size must divide the {gpus} GPUs of a node "
                "and rollout.data_parallel_size must be a multiple of the nodes"
            )
        return PodLayout(gpus, per, 1)
    if per > gpus or gpus % per:
        allowed = [d for d in range(1, gpus + 1) if gpus % d == 0]
        raise ConfigError(
            f"{figures}, which does not divide the {gpus} GPUs of a rollout pod ({gpus_key}); "
            f"allowed: {', '.join(map(str, allowed))} GPUs per engine (an engine over several nodes: "
            "cluster.launch.rollout_nodes_per_worker, async mode)"
        )
    return PodLayout(gpus, per, gpus // per)


def rollout_pod_layout(cfg: RunConfig) -> PodLayout:
    """The pod layout of `cfg`: on cuda from the rollout pod's GPUs (`ClusterConfig.rollout_gpus`),
    on cpu one engine per pod (its TP ranks are processes, not devices)."""
    ro, cl = cfg.rollout, cfg.cluster
    if ro.device != "cuda":
        return PodLayout(0, ro.devices_per_engine, 1)
    key = (
        "cluster.launch.rollout_gpus_per_node (null: gpus_per_node)"
        if cl.launch.mode == "kubernetes"
        else "cluster.groups.rollout.gpus"
    )
    nodes = cl.launch.rollout_nodes_per_worker if cl.launch.mode == "kubernetes" else 1
    return pod_layout(
        cl.rollout_gpus(), ro.tensor_parallel_size, ro.data_parallel_size, nodes, gpus_key=key
    )


def rollout_pods(workers: int, engines_per_pod: int) -> int:
    """Pods that host `workers` engines at `engines_per_pod` each (the last may hold fewer)."""
    return math.ceil(workers / engines_per_pod)


def pod_workers(workers: int, engines_per_pod: int, pod: int) -> list[int]:
    """The worker indices pod `pod` hosts: rollout-<i> for i in the result."""
    if not 0 <= pod < rollout_pods(workers, engines_per_pod):
        raise ValueError(f"pod {pod} of {rollout_pods(workers, engines_per_pod)}")
    return list(range(pod * engines_per_pod, min(workers, (pod + 1) * engines_per_pod)))


# -- the engine's memory on one GPU ------------------------------------------------------------


@dataclass(frozen=True)
class EngineFit:
    """One engine layout's memory per GPU, in GiB."""

    tp: int
    dp: int
    weights_gib: float
    kv_gib: float  # one max_model_len sequence
    usable_gib: float  # GPU GiB x memory utilization
    max_model_len: int

    @property
    def fits(self) -> bool:
        return self.weights_gib + self.kv_gib <= self.usable_gib


def engine_fit(
    sizes: ModelSizes,
    tp: int,
    dp: int,
    dtype: str,
    gpu_gib: float,
    utilization: float,
    max_model_len: int | None = None,
) -> EngineFit:
    """`EngineFit` of a TP x DP engine serving in `dtype` on GPUs of `gpu_gib`."""
    b = DTYPE_BYTES[dtype]
    linear = DTYPE_BYTES["fp8"] if sizes.fp8 else b
    weights = sizes.embed_params * b / tp + sizes.dense_params * linear / tp
    weights += sizes.expert_params * linear / (tp * dp)
    length = max_model_len or sizes.max_position_embeddings
    kv = length * sizes.kv_bytes_per_token(b, tp)
    return EngineFit(tp, dp, weights / GIB, kv / GIB, gpu_gib * utilization, length)


@dataclass(frozen=True)
class LayoutChoice:
    """The layouts `choose_layouts` found for one model on one node type."""

    tp: EngineFit | None  # the smallest TP (DP 1) that fits one node
    dp_ep: EngineFit | None  # the smallest DP >= 2 (TP 1, experts over DP) that fits one node
    # 1, or the nodes a DP x EP engine over several nodes needs (rollout_nodes_per_worker)
    nodes_needed: int
    gpus_per_node: int

    def engines_per_node(self, fit: EngineFit) -> int:
        return self.gpus_per_node // (fit.tp * fit.dp)


def choose_layouts(
    sizes: ModelSizes,
    gpus_per_node: int,
    dtype: str,
    gpu_gib: float,
    utilization: float,
    max_model_len: int | None = None,
) -> LayoutChoice:
    """The smallest TP, and the smallest DP x EP, whose weights and one max_model_len sequence
    fit a GPU of one node; when none does, the nodes a DP x EP engine over several nodes needs
    (every GPU of each node one DP rank: what cluster.launch.rollout_nodes_per_worker runs)."""
    sizes_ok = [d for d in range(1, gpus_per_node + 1) if gpus_per_node % d == 0]

    def fit(tp: int, dp: int) -> EngineFit:
        return engine_fit(sizes, tp, dp, dtype, gpu_gib, utilization, max_model_len)

    tp = next((f for d in sizes_ok if (f := fit(d, 1)).fits), None)
    dp_ep = next((f for d in sizes_ok if d >= 2 and (f := fit(1, d)).fits), None)
    nodes = 1
    if tp is None and dp_ep is None:
        nodes = next(
            (n for n in range(2, 65) if fit(1, gpus_per_node * n).fits), 65
        )  # 65: not even 64 nodes
    return LayoutChoice(tp, dp_ep, nodes, gpus_per_node)


def check_engine_fit(cfg: RunConfig, hf: Mapping[str, Any]) -> EngineFit | None:
    """Refuse (ConfigError naming the keys and the GiB) a cuda rollout engine of `cfg` whose
    weights and one max_model_len sequence of KV cache do not fit a GPU of
    cluster.groups.rollout.gpu_memory_gib x rollout.gpu_memory_utilization. None: not checked (cpu,
    or no GPU size configured)."""
    ro = cfg.rollout
    gib = cfg.cluster.groups.rollout.gpu_memory_gib
    if ro.device != "cuda" or gib is None:
        return None
    sizes = model_sizes(hf)
    dtype = ro.resolved.dtype
    got = engine_fit(
        sizes,
        ro.tensor_parallel_size,
        ro.data_parallel_size,
        dtype,
        gib,
        ro.resolved.gpu_memory_utilization,
        ro.max_model_len,
    )
    if got.fits:
        return got
    per_node = cfg.cluster.rollout_gpus() or 8
    choice = choose_layouts(
        sizes, per_node, dtype, gib, ro.resolved.gpu_memory_utilization, ro.max_model_len
    )
    hint = []
    if choice.tp is not None:
        hint.append(f"tensor_parallel_size {choice.tp.tp}")
    if choice.dp_ep is not None:
        hint.append(f"data_parallel_size {choice.dp_ep.dp} with enable_expert_parallel")
    if not hint:
        n = choice.nodes_needed
        hint.append(
            f"no layout on one node of {per_node} GPUs; data_parallel_size {per_node * n} with "
            f"enable_expert_parallel over cluster.launch.rollout_nodes_per_worker {n} nodes"
            if n <= 64
            else f"no layout on up to 64 nodes of {per_node} GPUs"
        )
    raise ConfigError(
        f"{LAYOUT_KEYS} = {got.tp} x {got.dp}, rollout.dtype {dtype}: the engine needs "
        f"{got.weights_gib:.1f} GiB of weights + {got.kv_gib:.1f} GiB of KV cache (one "
        f"{got.max_model_len}-token sequence, rollout.max_model_len) per GPU, more than "
        f"{got.usable_gib:.1f} GiB (cluster.groups.rollout.gpu_memory_gib {gib:g} x "
        f"rollout.gpu_memory_utilization {ro.resolved.gpu_memory_utilization:g}); fits: "
        + " or ".join(hint)
    )
