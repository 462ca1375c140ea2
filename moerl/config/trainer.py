"""The GRPO policy update, in sections by concern: the optimizer, the schedule (streamed or
whole-batch), the policy loss, the training-inference mismatch corrections, the trainer's
parallelism and memory, and the MoE router's training. `MOVED` maps each key that moved (out of
`trainer.` into a section, or between sections) to its new place; the loader refuses the old key
naming the new one, and `moerl config migrate` rewrites a file."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from moerl.config.base import _Section


class OptimizerConfig(_Section):
    """AdamW and the optimizer step: learning rate, minibatches per version, gradient clip."""

    learning_rate: float = Field(2e-3, gt=0.0, le=1.0)
    """AdamW learning rate."""
    weight_decay: float = Field(0.0, ge=0.0)
    """AdamW weight decay."""
    optimizer_steps_per_iteration: int = Field(8, ge=1)
    """Optimizer steps per policy version (the batch split into this many minibatches)."""
    max_grad_norm: float = Field(1.0, gt=0.0)
    """Gradient-norm clip per optimizer step."""
    max_consecutive_skipped_steps: int = Field(3, ge=1)
    """A step with a non-finite loss or gradient is skipped and counted; this many in a row fail
    the run."""


class ScheduleConfig(_Section):
    """When a version trains against the arrival of its groups (async mode): minibatch by
    minibatch as they come (streamed), or once its whole batch is in."""

    stream: bool | None = None
    """Async mode: train each version minibatch by minibatch as its groups arrive
    (optimizer_steps_per_iteration chunks of groups, in arrival order) against the engine's
    logprobs as pi_old (the engine served this very version), and issue the next version's
    prompts once it is servable: the rollout and the trainer work at once, on-policy, and the
    trainer's pi_old pass is skipped. null: wherever it can (async, buffer.max_staleness 0, no
    buffer.min_signal_groups, router_replay not R2, persistent_ranks); true: required (refused
    where it cannot); false: each version trains once its whole batch is in."""


@dataclass(frozen=True)
class LossResolved:
    """`LossConfig.resolved`: the loss keys whose null the config resolves, each under its key's
    own name."""

    loss_agg_mode: Literal["token-mean", "seq-mean-token-mean"]
    """`trainer.loss.loss_agg_mode`: seq-mean-token-mean for gspo, token-mean for ppo, unless set."""


class LossConfig(_Section):
    """The policy loss: PPO-clip (token ratio) or GSPO (sequence ratio), and its aggregation."""

    policy_loss: Literal["ppo", "gspo"] = "ppo"
    """ppo: the token ratio; gspo: Qwen's GSPO, the sequence's geometric-mean ratio with its own
    clip range (docs/mismatch.md)."""
    clip_eps_low: float = Field(0.2, gt=0.0, lt=1.0)
    """PPO clip range below 1: the ratio is clipped at 1 - clip_eps_low."""
    clip_eps_high: float = Field(0.28, gt=0.0)
    """PPO clip range above 1 (DAPO's clip-higher): the ratio is clipped at 1 + clip_eps_high."""
    clip_ratio_c: float | None = Field(None, gt=1.0)
    """Dual-clip (verl's clip_ratio_c): for negative advantages the per-token loss is bounded by
    clip_ratio_c * |A|. verl's default is 3.0; null = off."""
    gspo_clip_eps_low: float = Field(3e-4, gt=0.0, lt=1.0)
    """GSPO's clip range below 1 of the sequence ratio (the paper's and verl's 3e-4)."""
    gspo_clip_eps_high: float = Field(4e-4, gt=0.0)
    """GSPO's clip range above 1 of the sequence ratio."""
    loss_agg_mode: Literal["token-mean", "seq-mean-token-mean"] | None = None
    """token-mean (DAPO's) or seq-mean-token-mean (GSPO's); null: the policy loss's own
    (`resolved.loss_agg_mode`)."""

    @property
    def resolved(self) -> LossResolved:
        """The keys whose null stands for the policy loss's own value, resolved under their
        own names."""
        own: Literal["token-mean", "seq-mean-token-mean"] = (
            "seq-mean-token-mean" if self.policy_loss == "gspo" else "token-mean"
        )
        return LossResolved(loss_agg_mode=self.loss_agg_mode or own)

    @property
    def clip_range(self) -> tuple[float, float]:
        """(eps_low, eps_high) of the policy loss in use."""
        if self.policy_loss == "gspo":
            return self.gspo_clip_eps_low, self.gspo_clip_eps_high
        return self.clip_eps_low, self.clip_eps_high

    @model_validator(mode="after")
    def _dual_clip(self) -> LossConfig:
        if self.policy_loss == "gspo" and self.clip_ratio_c is not None:
            raise ValueError(
                "clip_ratio_c (dual clip) is a token-level PPO bound; policy_loss gspo clips the "
                "sequence ratio with gspo_clip_eps_low/high: set clip_ratio_c null"
            )
        return self


class CorrectionConfig(_Section):
    """The MoE training-inference mismatch corrections against the engine's logprobs
    (docs/mismatch.md): truncated or masked importance weights and sequence rejection."""

    tis_mode: Literal["token_truncate", "token_mask", "sequence_truncate", "sequence_mask"] = (
        "token_truncate"
    )
    """The importance weight pi_old / mu against the engine: truncated or masked above tis_cap, per
    token or per sequence (TRL's vllm_importance_sampling_mode)."""
    tis_cap: float = Field(2.0, ge=1.0)
    """Truncated importance sampling: cap on exp(trainer_logp_old - engine_logp)."""
    tis_mask_low: float | None = Field(None, gt=0.0, lt=1.0)
    """Mask modes: also mask ratios below this (IcePop's lower bound); null: only the upper tail."""
    rollout_rs: Literal["off", "geometric"] = "off"
    """geometric: a sequence whose geometric-mean ratio pi_old / mu is outside
    [rollout_rs_threshold_lower, rollout_rs_threshold] leaves the loss (verl's rollout_rs); off:
    keep every sequence."""
    rollout_rs_threshold: float = Field(1.01, gt=1.0)
    """rollout_rs geometric: the upper bound of a sequence's geometric-mean ratio."""
    rollout_rs_threshold_lower: float | None = Field(None, gt=0.0, lt=1.0)
    """rollout_rs geometric: the lower bound; null: 1 / rollout_rs_threshold."""
    extreme_ratio_tau: float = Field(2.0, gt=1.0)
    """The rollout_corr/extreme_* metrics count tokens whose pi_old / mu is outside [1/tau, tau]."""
    stream_pi_old: Literal["auto", "engine", "proximal"] = "auto"
    """A streamed trainer's pi_old (`trainer.schedule.stream`). engine: the engine's logprobs (the pi_old
    pass skipped; the importance weight is 1, so nothing above corrects anything); proximal:
    the trainer's own logprobs under its weights before each minibatch's step (a forward per
    minibatch, AReaL's proximal policy, so its ratio is 1 and the clip never binds), corrected
    against the engine's as above; auto: engine where both sides compute in float32
    (rollout.dtype and model.dtype float32, no quantization, mixed_precision off: they
    agree to 1e-7 on cpu) and rollout_rs is off, else proximal."""

    @property
    def rs_bounds(self) -> tuple[float, float]:
        """(lower, upper) of the geometric sequence rejection."""
        t = self.rollout_rs_threshold
        return (self.rollout_rs_threshold_lower or 1.0 / t), t

    @model_validator(mode="after")
    def _mask_low(self) -> CorrectionConfig:
        if self.tis_mask_low is not None and not self.tis_mode.endswith("mask"):
            raise ValueError(
                f"tis_mask_low masks the lower tail in tis_mode token_mask or sequence_mask; "
                f"tis_mode is {self.tis_mode}"
            )
        return self


class DeepEPOptions(BaseModel):
    """`trainer.parallelism.deepep_options`, the keys kernels/deepep.py builds its buffer from;
    unknown keys are rejected. Kept here, without torch, so the config validates anywhere."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    api: Literal["auto", "v1", "v2"] = Field(
        "auto", description="V1 Buffer, v2 ElasticBuffer, or auto (module doc)"
    )
    mode: Literal["normal", "low_latency"] = "normal"
    num_sms: int | None = Field(
        None, ge=2, description="Buffer.set_num_sms for normal kernels (DeepEP default 20)"
    )
    num_nvl_bytes: int | None = Field(
        None, ge=0, description="override the NVLink buffer size hint"
    )
    num_rdma_bytes: int | None = Field(None, ge=0, description="override the RDMA buffer size hint")
    num_max_dispatch_tokens_per_rank: int = Field(
        128, ge=1, description="low-latency: max T on any rank"
    )
    allow_nvlink_for_low_latency_mode: bool = True
    allow_mnnvl: bool = False
    num_max_tokens_per_rank: int = Field(
        4096, ge=1, description="v2: the most tokens one rank dispatches at once"
    )
    allow_hybrid_mode: bool = Field(
        True, description="v2: RDMA between nodes, then NVLink inside (DeepEP default)"
    )
    env: dict[str, str] = Field(
        default_factory=dict, description="transport env vars set before the buffer"
    )


class ParallelismConfig(_Section):
    """Where and how the update runs: device, the (data_parallel_shard, expert_parallel_size)
    mesh, how tokens move between expert ranks, how the ranks start, precision and memory."""

    device: Literal["cpu", "cuda"] = "cpu"
    """Where the trainer runs: cpu or cuda."""
    expert_parallel_size: int = Field(1, ge=1, le=64)
    """Experts sharded over this many ranks (torchrun inside the policy_update task; gloo on CPU,
    NCCL on GPU); 1: the plain transformers MoE block."""
    data_parallel_shard: int = Field(1, ge=1, le=1024)
    """FSDP2 shard degree: the ranks form the mesh (data_parallel_shard, expert_parallel_size),
    dense weights, gradients and Adam state sharded over all of them; 1 x 1: the stage's own process as a one-rank mesh."""
    ep_backend: Literal["all_to_all", "hierarchical", "deepep"] = "all_to_all"
    """How tokens move between expert-parallel ranks: all_to_all, hierarchical (within nodes, then
    across), or DeepEP's kernels (GPU)."""
    ranks_per_node: int = Field(1, ge=1)
    """ep_backend hierarchical: ranks per node (nodes are rank groups)."""
    allow_fallback: bool = False
    """Let a missing DeepEP fall back to all_to_all (recorded as an MLflow tag) instead of failing."""
    deepep_options: dict[str, Any] = Field(default_factory=dict)
    """ep_backend deepep: DeepEP's API (`api`: auto, v1 or v2, the ElasticBuffer on NCCL GIN) and
    buffer options; the keys are moerl/config/trainer.py's DeepEPOptions."""
    launcher: Literal["local", "torchrun"] = "local"
    """How the EP ranks start. local: processes on this machine meeting through a file store;
    torchrun: torch's launcher, as on the cluster (its TCPStore listens on every interface)."""
    rank_timeout_s: float = Field(4 * 3600.0, gt=0.0)
    """The policy_update task kills every rank and fails if they have not finished by then, so a
    hung collective cannot hold the GPUs."""
    collective_timeout_s: float = Field(1800.0, gt=0.0)
    """A collective not complete after this many seconds fails its rank (a dead or hung peer), and
    with it every rank: the process group's timeout."""
    persistent_ranks: bool = True
    """pipeline.mode async on a mesh: the ranks start once and live for the whole run, weights
    and Adam state staying in memory between versions (docs/weights.md). false: the ranks start,
    load the whole state and save it again every version (the older path, kept to compare
    against; much slower at scale)."""
    mixed_precision: Literal["off", "bf16"] = "off"
    """bf16: FSDP2 mixed precision, parameters gathered and computed in bf16, master weights,
    gradient reduction and Adam state in float32 (model.dtype must be float32; always on the
    mesh path). off: everything in model.dtype."""
    activation_checkpointing: bool = False
    """Recompute each decoder layer's activations in the backward instead of keeping them, so long
    responses fit."""
    micro_batch_tokens: int = Field(8192, ge=0)
    """Padded positions per forward/backward pass: each minibatch runs in micro-batches of at most
    this many, with gradient accumulation, bounding the fp32 full-vocabulary log-softmax. 0: the
    whole minibatch in one pass."""
    logprob_chunk_tokens: int = Field(0, ge=0)
    """Compute token logprobs in chunks of at most this many positions (recomputed in the
    backward), so only that many rows of the float32 vocabulary projection exist at once. 0: the
    whole micro-batch at once."""

    @property
    def world_size(self) -> int:
        """Trainer ranks: the mesh data_parallel_shard x expert_parallel_size."""
        return self.data_parallel_shard * self.expert_parallel_size

    @property
    def on_mesh(self) -> bool:
        """Whether the mesh's ranks run as processes of their own (more than one rank); a
        one-rank mesh is the calling process (`ep_train.one_rank`). FSDP2 either way."""
        return self.world_size > 1

    def precision_policy(self, model_dtype: str) -> str:
        """The precision policy in words, for the run's tags."""
        if self.mixed_precision == "bf16":
            return "bf16 parameters and compute; float32 master weights, gradient reduction and Adam state"
        return f"{model_dtype} throughout (weights, gradients, Adam state)"

    @model_validator(mode="after")
    def _ep(self) -> ParallelismConfig:
        if self.ep_backend == "deepep" and self.device == "cpu" and not self.allow_fallback:
            raise ValueError(
                "ep_backend deepep needs device cuda (DeepEP is a GPU kernel); use all_to_all or "
                "hierarchical on CPU, or set allow_fallback: true"
            )
        if self.deepep_options:
            try:
                DeepEPOptions(**self.deepep_options)
            except ValidationError as exc:
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
        if self.ep_backend == "hierarchical" and self.expert_parallel_size % self.ranks_per_node:
            raise ValueError(
                f"expert_parallel_size ({self.expert_parallel_size}) must be a multiple of "
                f"ranks_per_node ({self.ranks_per_node})"
            )
        return self


class MoeConfig(_Section):
    """The MoE router's training: load-balancing loss, bias balancing, routing replay."""

    aux_loss_coef: float = Field(0.0, ge=0.0)
    """The router load-balancing loss's weight, with or without expert parallelism (logged as
    train/aux_loss); 0: off."""
    router_bias_update_rate: float = Field(0.0, ge=0.0, le=0.1)
    """DeepSeek-V3's auxiliary-loss-free balancing: after each step every expert's
    e_score_correction_bias moves this much towards the mean load (Megatron's
    moe_router_bias_update_rate); 0: the bias stays as loaded. Only for routers with that bias."""
    router_replay: Literal["disabled", "R2", "R3"] = "disabled"
    """Routing replay: R2 forces the trainer's own pi_old routes in the update's forwards, R3 the
    rollout engine's (needs rollout.return_routed_experts); gate weights still come from the
    trainer's router, so it learns."""


class TrainerConfig(_Section):
    """GRPO policy update: PPO-clip against the engine's logprobs, token-level aggregation."""

    seed: int = 0
    """The trainer's seed (torch's RNG and the minibatch order), offset by the version trained."""
    optimizer: OptimizerConfig = OptimizerConfig()
    """AdamW and the optimizer step."""
    schedule: ScheduleConfig = ScheduleConfig()
    """When each version trains: streamed as its groups arrive, or once its batch is in."""
    loss: LossConfig = LossConfig()
    """The policy loss and its aggregation."""
    correction: CorrectionConfig = CorrectionConfig()
    """The training-inference mismatch corrections (docs/mismatch.md)."""
    parallelism: ParallelismConfig = ParallelismConfig()
    """Device, mesh, expert-parallel transport, rank launch, precision and memory."""
    moe: MoeConfig = MoeConfig()
    """The MoE router's training."""


# Keys that moved, old dotted key -> new dotted key: the loader refuses the old one naming the
# new (`load.moved_key_problem`), `moerl config migrate` rewrites a file. First every key that
# left `trainer.` for a section; keys added after that move, in their section from the start,
# have no old place to refuse.
_BORN_IN_SECTIONS = frozenset({"collective_timeout_s", "persistent_ranks", "stream_pi_old"})
MOVED: dict[str, str] = {
    f"trainer.{key}": f"trainer.{section}.{key}"
    for section, model in (
        ("optimizer", OptimizerConfig),
        ("schedule", ScheduleConfig),
        ("loss", LossConfig),
        ("correction", CorrectionConfig),
        ("parallelism", ParallelismConfig),
        ("moe", MoeConfig),
    )
    for key in model.model_fields
    if key not in _BORN_IN_SECTIONS
}
# the streaming schedule is not an optimizer setting
MOVED["trainer.optimizer.stream"] = "trainer.schedule.stream"
