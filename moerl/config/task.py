"""What is learned and how it is scored: the task, its sandbox, the reward and the reward model."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator, model_validator

from moerl.config.base import _Section
from moerl.userfiles import short_repr


class SandboxConfig(_Section):
    """The sandboxed execution pool verifiers (`reward.sandbox`) and environments
    (`task.sandbox`) run in (`moerl/tasks/sandbox.py`): a fresh process per call (per episode)
    with no credentials, cut off after `sample_timeout_s` or past `memory_mb`. A
    sample whose verifier or environment is cut off is failed and counted
    (`reward/timeout_samples`, `reward/memory_samples`, `env/timeout_episodes`), never scored 0."""

    workers: int = Field(1, ge=1, le=256)
    """Calls run at once per scoring process."""
    sample_timeout_s: float = Field(5.0, gt=0.0, le=3600.0, allow_inf_nan=False)
    """The most one verifier or environment call may take; a call past it is cut off and its sample
    failed."""
    memory_mb: int = Field(2048, ge=128, le=1 << 20)
    """MiB one call's processes may hold resident together (and each its address space); a call
    past it is killed and its sample failed."""
    isolation: Literal["namespaces", "none"] = "namespaces"
    """namespaces: each call in its own user, network, pid, mount and ipc namespaces (no network,
    a read-only filesystem but its tmpfs scratch, at most 128 processes), refused at start where
    the kernel, the pod's seccomp profile or a masked /proc forbids them (docs/tasks.md). none:
    only the environment allow-list and the limits, warned about and tagged on the run."""


class TaskConfig(_Section):
    """The verifiable task: a JSONL dataset of {id, task, prompt | messages, answer, meta?} rows,
    single-turn, or multi-turn with an environment (`moerl/tasks/environments.py`)."""

    dataset: str = "builtin:digits-copy"
    """The prompts: builtin:<name> (a dataset shipped in moerl/data); a local JSONL or Parquet
    file or folder of shards; or s3://bucket/key or s3://bucket/prefix/ (its *.jsonl,
    *.jsonl.gz and *.parquet shards, read with checkpoint.endpoint_url and the pod's role, a
    window at a time; a shard rewritten under a run is refused). On EKS: builtin: or s3://."""
    max_bad_fraction: float = Field(0.05, ge=0.0, le=1.0)
    """Malformed dataset rows are skipped and counted; more than this fraction of them fails the
    load."""
    prompts_per_iteration: int = Field(64, ge=1)
    """Prompts (GRPO groups) per policy version: the generation batch."""
    shuffle_seed: int = 0
    """Seed of the order prompts are drawn in."""
    environment: str | None = None
    """A multi-turn environment for every row, package.module:Factory (reset(row) -> observation,
    step(text) -> (observation, reward, done)), run in the sandboxed pool; null: single-turn."""
    environments: dict[str, str] = Field(default_factory=dict)
    """Per task (a row's `task`): its environment, in the same form; wins over `environment`."""
    max_turns: int = Field(4, ge=1, le=256)
    """Model turns per episode at most (each at most rollout.max_new_tokens tokens, the episode at
    most rollout.max_total_tokens when set)."""
    sandbox: SandboxConfig = SandboxConfig()
    """The sandboxed pool environment calls run in; sample_timeout_s bounds one reset or step call,
    and an episode whose call is cut off ends failed and is counted."""

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


_REGISTERED = r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,127}/(latest|[1-9][0-9]{0,8})$"


class RewardModelRef(_Section):
    """The reward model the reward stage scores with: a version of a model registered in
    MLflow's model registry by `pipeline.kind: reward_model` (components/reward_model)."""

    registered: str = Field(pattern=_REGISTERED)
    """The registered reward model: <name>/<version> or <name>/latest."""
    max_batch: int = Field(64, ge=1, le=65536)
    """Samples per forward pass."""
    device: Literal["cpu", "cuda"] = "cpu"
    """Where the reward model runs."""
    normalize: Literal["none", "sigmoid", "zscore"] = "sigmoid"
    """sigmoid: sigma(score) in (0, 1), comparable with the verifiers' [0, 1]; zscore: standardized
    over the samples scored together; none: the raw score."""


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
    """rules: verifiers; model: a registered reward model (`model`); mixed: both, weighted."""
    verifier: str = "auto"
    """A shipped verifier (auto: each row's task default; positional; exact) or your own,
    package.module:function, called in the sandbox as fn(response, answer, meta) -> float (or
    fn(response, answer)); checked on one row of each task before any work starts."""
    verifiers: dict[str, str] = Field(default_factory=dict)
    """Per task (a row's `task`): its verifier, in the same forms as `verifier`; wins over
    `verifier`."""
    sandbox: SandboxConfig = SandboxConfig()
    """The sandboxed pool verifiers run in (one per scoring process)."""
    model: RewardModelRef | None = None
    """The reward model for kind model or mixed; null with kind rules."""
    rules_weight: float = Field(0.5, ge=0.0)
    """kind mixed: the verifier score's weight."""
    model_weight: float = Field(0.5, ge=0.0)
    """kind mixed: the normalized reward-model score's weight."""
    max_failed_fraction: float = Field(0.5, ge=0.0, le=1.0)
    """A run whose verifiers (or reward model) fail on more than this fraction of samples in one
    iteration stops."""
    scorers: int = Field(1, ge=1, le=1024)
    """Async mode: reward scorer processes, scaled independently of rollout."""
    timeout_s: float = Field(60.0, gt=0.0, le=86400.0)
    """Async mode: the most one GRPO group's scoring may take, reward model included; a group past
    it is failed and counted (score_timeouts) and its scorer restarts, since a hung reward-model
    call cannot be stopped in-process."""

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

    data: str = "builtin:prefs-digits"
    """The preference pairs {id, prompt, chosen, rejected}: builtin:<name>, or JSONL / Parquet
    from the same sources as task.dataset (a local file or folder, s3://). On EKS: builtin: or
    s3://."""
    eval_fraction: float = Field(0.2, gt=0.0, lt=1.0)
    """Fraction of the pairs held out for pairwise accuracy."""
    split_seed: int = 0
    """Seed of the train / held-out split."""
    epochs: int = Field(3, ge=1, le=1000)
    """Passes over the training pairs."""
    batch_size: int = Field(32, ge=1, le=65536)
    """Pairs per optimizer step."""
    learning_rate: float = Field(2e-3, gt=0.0, allow_inf_nan=False)
    """AdamW learning rate."""
    weight_decay: float = Field(0.0, ge=0.0, allow_inf_nan=False)
    """AdamW weight decay."""
    max_grad_norm: float = Field(1.0, gt=0.0, allow_inf_nan=False)
    """Gradient-norm clip per optimizer step."""
    seed: int = 0
    """The training seed (the head's initialization and the batch order)."""
    registry_name: str = Field("moerl-reward-model", pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,127}$")
    """The registered model in MLflow's model registry the trained reward model becomes a version
    of."""
    min_accuracy: float = Field(0.0, ge=0.0, le=1.0)
    """The publish gate: a model below this held-out accuracy fails the run and is not published."""
