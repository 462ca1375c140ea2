"""The typed run parameters every compiled pipeline shows on the KFP run form.

Each field's description is its config key's description in the models (docs/config.md); the
first task (`start_run`) merges the form into the compiled config and validates it, and keys
the compiled graph was built from are refused per run. docs/eks.md ("the run form")
explains the form. Pure logic; no KFP import, so `moerl submit` and the tests use it as is.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any

from moerl.config import RunConfig, apply_overrides, parse_config
from moerl.config.docs import field_description
from moerl.errors import ConfigError

GRPO, REWARD_MODEL = "grpo", "reward_model"


@dataclass(frozen=True)
class RunParam:
    """One typed run-form field: its KFP name and type, and the config key it sets in each
    pipeline kind (None: not on that pipeline's form). What it means is that key's description
    in the config models (`describe`), so the form and docs/config.md say the same."""

    name: str
    type: type
    grpo_key: str | None
    rm_key: str | None
    optional: bool = False  # "" sets the key to null (e.g. model.path: the embedded tiny model)
    async_only: bool = False

    def key(self, kind: str) -> str | None:
        return self.grpo_key if kind == GRPO else self.rm_key

    def describe(self, kind: str) -> str:
        """The form's description of this field in a pipeline of `kind`: the config key's own
        description, then the key it sets."""
        key = self.key(kind)
        if key is None:
            raise ValueError(f"run parameter {self.name} is not on the {kind} run form")
        suffix = f"{key}; empty: null" if self.optional else key
        return f"{field_description(key)} ({suffix})"


PARAMS: tuple[RunParam, ...] = (
    RunParam("model", str, "model.path", "model.path", optional=True),
    RunParam("warm_start", str, "model.warm_start", None),
    RunParam("dataset", str, "task.dataset", "reward_model.data"),
    RunParam("versions", int, "pipeline.versions", None, async_only=True),
    RunParam("epochs", int, None, "reward_model.epochs"),
    RunParam(
        "learning_rate", float, "trainer.optimizer.learning_rate", "reward_model.learning_rate"
    ),
    RunParam("prompts_per_iteration", int, "task.prompts_per_iteration", None),
    RunParam("samples_per_prompt", int, "rollout.samples_per_prompt", None),
    RunParam("rollout_workers", int, "rollout.workers", None, async_only=True),
    RunParam("reward_scorers", int, "reward.scorers", None, async_only=True),
    RunParam("reward_kind", str, "reward.kind", None),
    RunParam("reward_model", str, "reward.model.registered", None, optional=True),
    RunParam("run_name", str, "tracking.run_name", "tracking.run_name", optional=True),
)

OVERRIDES_DESCRIPTION = (
    "Any other config key for this run, as a list of dotted.key=value strings (the value is YAML), "
    'e.g. ["trainer.loss.clip_eps_high=0.3", "rollout.temperature=0.9"]; applied after the fields '
    "above."
)


def params_for(cfg: RunConfig) -> tuple[RunParam, ...]:
    """The fields on `cfg`'s run form (its pipeline kind and mode)."""
    kind = cfg.pipeline.kind
    return tuple(
        p
        for p in PARAMS
        if p.key(kind) is not None and not (p.async_only and cfg.pipeline.mode != "async")
    )


def _get(data: dict[str, Any], key: str) -> Any:
    node: Any = data
    for part in key.split("."):
        if not isinstance(node, dict):
            return None
        node = node.get(part)
    return node


def defaults(cfg: RunConfig) -> dict[str, Any]:
    """Each field's default: the config's own value ("" for an unset optional key)."""
    data = cfg.model_dump(mode="json")
    out: dict[str, Any] = {}
    for p in params_for(cfg):
        v = _get(data, p.key(cfg.pipeline.kind) or "")
        out[p.name] = "" if v is None else p.type(v)
    return out


def signature(cfg: RunConfig, fixed: list[inspect.Parameter]) -> inspect.Signature:
    """The pipeline function's signature: `fixed` (config_json, run_id, git_sha), then each
    field typed with the config's value as its default, then `overrides: list = []`."""
    dflt = defaults(cfg)
    typed = [
        inspect.Parameter(
            p.name, inspect.Parameter.POSITIONAL_OR_KEYWORD, annotation=p.type, default=dflt[p.name]
        )
        for p in params_for(cfg)
    ]
    over = inspect.Parameter(
        "overrides", inspect.Parameter.POSITIONAL_OR_KEYWORD, annotation=list, default=[]
    )
    return inspect.Signature(fixed + typed + [over])


def docstring(summary: str, fixed: dict[str, str], cfg: RunConfig) -> str:
    """A Google-style docstring whose Args KFP turns into the parameters' descriptions."""
    lines = [summary, "", "Args:"]
    for name, text in fixed.items():
        lines.append(f"    {name}: {text}")
    for p in params_for(cfg):
        lines.append(f"    {p.name}: {p.describe(cfg.pipeline.kind)}")
    lines.append(f"    overrides: {OVERRIDES_DESCRIPTION}")
    return "\n".join(lines)


# --------------------------------------------------------------------------- merging

# What the compiled graph and its pods were built from (see the module docstring).
_COMPILED_KEYS = (
    "pipeline.kind",
    "pipeline.mode",
    "pipeline.name",
    "pipeline.base_image",
    "pipeline.worker_retries",
    "pipeline.task_retries",
    "pipeline.retry_max_duration_s",
    "pipeline.pipeline_root",
    "cluster",
    "tracking.uri",
    "tracking.experiment",
    "valkey.url",
    "valkey.username",
    "trainer.parallelism.device",
    "rollout.device",
    "trainer.parallelism.expert_parallel_size",
    "trainer.parallelism.data_parallel_shard",
    "checkpoint.fanout",
)


def compiled_shape(cfg: RunConfig) -> dict[str, str]:
    """The values (dotted key -> value) the compiled pipeline's graph and pod settings depend
    on; a run's merged config must keep them."""
    from moerl.config import flatten

    shape = {
        k: v
        for k, v in flatten(cfg).items()
        if any(k == p or k.startswith(p + ".") for p in _COMPILED_KEYS)
    }
    if cfg.pipeline.mode == "sync" and cfg.pipeline.kind == GRPO:
        shape["pipeline.iterations"] = str(cfg.pipeline.iterations)  # unrolled at compile time
    # the reward stage's pod group: the CPU group for rules, the reward group with a model
    shape["reward.kind"] = "rules" if cfg.reward.kind == "rules" else "model or mixed"
    shape["reward.model.device"] = (
        cfg.reward.model.device if cfg.reward.model else "(no reward model)"
    )
    return shape


def _why(key: str) -> str:
    if key == "pipeline.iterations":
        return "the sync pipeline unrolls every iteration when it is compiled"
    if key in ("tracking.uri", "tracking.experiment", "valkey.url", "valkey.username"):
        return "the exit task and the pods' Secrets are bound to it when the pipeline is compiled"
    if key.startswith("pipeline."):
        return "the compiled graph is built from it"
    if key == "reward.kind":
        return "the reward stage's pod group is compiled from it: the CPU group for rules, the reward group otherwise"
    return "the pods' placement and resources are compiled from it"


def merge(
    base: RunConfig, values: dict[str, Any], overrides: list[str], target: str = "local"
) -> RunConfig:
    """The run's config: `base` with the run-form `values` (by parameter name) and then the
    `overrides` applied, validated. Raises a one-line ConfigError naming the parameter or key."""
    kind = base.pipeline.kind
    known = {p.name: p for p in params_for(base)}
    data = base.model_dump(mode="json")
    for name, value in values.items():
        p = known.get(name)
        if p is None:
            raise ConfigError(
                f"run parameter {name!r}: not a parameter of this pipeline; its parameters are "
                f"{', '.join(sorted(known))} and overrides"
            )
        key = p.key(kind)
        assert key is not None
        if isinstance(value, bool) or not isinstance(
            value, (p.type, int) if p.type is float else p.type
        ):
            raise ConfigError(
                f"run parameter {name} ({key}): expected {p.type.__name__}, got {value!r}"
            )
        if p.optional and value == "":
            value = None
        if key == "reward.model.registered":
            data["reward"]["model"] = (
                None
                if value is None
                else {**(data["reward"].get("model") or {}), "registered": value}
            )
            continue
        _set(data, key, value)
    if not isinstance(overrides, list) or not all(isinstance(o, str) for o in overrides):
        raise ConfigError(
            f"run parameter overrides: expected a list of dotted.key=value strings, got {overrides!r}"
        )
    try:
        data = apply_overrides(data, list(overrides))
    except ConfigError as err:
        raise ConfigError(f"run parameter overrides: {err}".replace("--set ", "")) from None
    try:
        cfg = parse_config(data)
    except ConfigError as err:
        raise ConfigError(f"run parameters: {err}") from None
    was, now = compiled_shape(base), compiled_shape(cfg)
    for key in sorted(was.keys() | now.keys()):
        if was.get(key) != now.get(key):
            raise ConfigError(
                f"run parameters: {key} cannot change per run ({_why(key)}): the pipeline was compiled "
                f"with {was[key]!r}, the run asks for {now[key]!r}; compile again with "
                f"`moerl compile --set {key}=...`"
            )
    if target == "eks":
        from moerl.pipelines.eks import check_cluster_safe

        try:
            check_cluster_safe(cfg)
        except ConfigError as err:
            raise ConfigError(f"run parameters: {err}") from None
    return cfg


def _set(data: dict[str, Any], key: str, value: Any) -> None:
    *parents, leaf = key.split(".")
    node = data
    for part in parents:
        node = node.setdefault(part, {})
    node[leaf] = value


def changed(base: RunConfig, cfg: RunConfig) -> dict[str, str]:
    """Dotted key -> new value of every key the run's parameters changed (for the MLflow run)."""
    from moerl.config import flatten

    before, after = flatten(base), flatten(cfg)
    return {k: v for k, v in after.items() if before.get(k) != v}
