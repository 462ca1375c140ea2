"""What can be checked before a run's stages start, whatever runs them (`moerl run`, sync or
async, a resumed run, and the pipeline's first tasks): `preflight`, so a bad dataset, model
path, reward model, registered version or store, or a pod scratch too small for the model
(`check_scratch`), fails before any work, with one line naming the key. `check_user_code`:
the part that calls the user's verifiers and environments, which a pipeline runs in a task of
its own that holds no credential (`start_run` holds the Valkey admin's and the launcher's).
Below the stages (docs/architecture.md, "Layers"): a stage calls it, and it reads no stage.
"""

from __future__ import annotations

import json
import logging
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from moerl import provenance, tracking
from moerl.bus.sizes import check_group_size
from moerl.config import RunConfig
from moerl.config.cluster import quantity_bytes
from moerl.errors import CheckpointError, ConfigError, RequirementError
from moerl.launch.layout import check_engine_fit, rollout_pod_layout
from moerl.launch.objects import trainer_nodes
from moerl.models.families import family_of, replay_problem
from moerl.models.sizes import DTYPE_BYTES, ModelSizes, model_sizes
from moerl.models.source import check_model, hf_config, model_view
from moerl.registry import reward_model
from moerl.registry.policy import resolve_policy
from moerl.secrets import read_secret
from moerl.store.runs import open_store
from moerl.store.tiers import CACHE_TIER_SECRET, cache_tier_store
from moerl.tasks.dataset import load_dataset
from moerl.tasks.environments import CLOSE, RESET, STEP, environment_for, environment_key
from moerl.tasks.preferences import load_preferences
from moerl.tasks.prompting import uses_template
from moerl.tasks.sandbox import Limits, SandboxPool
from moerl.tasks.verifiers import CALL_VERIFIER, as_score, verifier_key, verifier_target

log = logging.getLogger(__name__)


def preflight(cfg: RunConfig, here: bool = True, user_code: bool = True) -> None:
    """Everything that can be checked before work starts; raises a MoerlError naming the field.
    `here`: the stages run on this machine, so `require:` is probed here too (the pipeline's
    first task runs on a CPU pod and leaves that to each stage's own start). `user_code` False:
    the user's verifiers and environments are not called (`check_user_code` does that)."""
    if not here and cfg.rollout.elastic and cfg.cluster.launch.mode != "kubernetes":
        lo, hi = cfg.rollout.fleet_bounds
        raise ConfigError(
            f"rollout.min_workers {lo} / rollout.max_workers {hi} in a pipeline: the elastic "
            "fleet is a Deployment the trainer's launcher creates, which needs "
            f"cluster.launch.mode kubernetes (it is {cfg.cluster.launch.mode}); set it, or remove "
            "min_workers and max_workers"
        )
    if cfg.rollout.weight_sync == "collective" and cfg.pipeline.mode != "async":
        raise ConfigError(
            f"rollout.weight_sync collective with pipeline.mode {cfg.pipeline.mode}: the sessions "
            "run between the async trainer's ranks and the live rollout workers; set pipeline.mode "
            "async, or weight_sync files (or auto)"
        )
    if cfg.pipeline.mode == "async" and cfg.pipeline.kind == "grpo":  # groups the bus refuses
        check_group_size(cfg, *_route_bytes(cfg))
    if here and (cfg.require.gpu or cfg.require.deepep or cfg.require.efa):
        missing = provenance.missing_requirements(cfg.require, provenance.runtime_probe())
        if missing:
            raise RequirementError("; ".join(missing))
    if cfg.pipeline.kind == "reward_model":
        load_preferences(cfg.reward_model.data, cfg.task.max_bad_fraction, ck=cfg.checkpoint)
    else:
        ds = load_dataset(cfg.task.dataset, cfg.task.max_bad_fraction, cfg.checkpoint)
        # the index's sample (first row, each task's first, the first chat row), not every row
        check_prompts(cfg, ds.sample)
        if user_code:
            _check_user_code(cfg, ds.sample)
    # the reward model must exist and verify
    if cfg.pipeline.kind == "grpo" and cfg.reward.kind != "rules":
        assert cfg.reward.model is not None  # RewardConfig requires it unless kind is rules
        rm = reward_model.resolve(tracking.resolve_uri(cfg.tracking), cfg.reward.model)
        reward_model.fetch(cfg.checkpoint, rm)
    # the registered version must exist, before any work
    if cfg.model.warm_start.startswith("registry:"):
        resolve_policy(tracking.resolve_uri(cfg.tracking), cfg.model.warm_start)
    if not here:  # the pipeline's first task: the rollout pods' engines (moerl/launch/layout.py)
        rollout_pod_layout(cfg)
    if cfg.model.path:  # local, S3 or a hub: checked from its small files and headers
        family = family_of(check_model(cfg.model.path, cfg.checkpoint))
        _check_mesh(cfg)
        _check_engine_fit(cfg)
        if not here:  # the pipeline's tasks, each in its scratch (the tiny model always fits)
            _check_scratch(cfg)
    else:
        family = family_of(cfg.model.tiny.architecture)
    if family.vllm_cpu_problem and cfg.rollout.device == "cpu" and cfg.pipeline.kind == "grpo":
        raise ConfigError(
            f"model: {family.name} with rollout.device cpu: {family.vllm_cpu_problem}, so the engine "
            "would sample from another policy than the one trained; allowed: rollout.device cuda, or "
            "another model.tiny.architecture"
        )
    bias_problem = family.router_bias_problem(cfg.trainer.moe.router_bias_update_rate)
    if bias_problem:
        raise ConfigError(
            f"trainer.moe.router_bias_update_rate {cfg.trainer.moe.router_bias_update_rate}: "
            f"{bias_problem}; set it to 0, and balance with trainer.moe.aux_loss_coef"
        )
    if cfg.pipeline.kind == "grpo" and (
        cfg.trainer.moe.router_replay != "disabled" or cfg.rollout.return_routed_experts
    ):
        replay = replay_problem(family)
        if replay:
            key = (
                "trainer.moe.router_replay"
                if cfg.trainer.moe.router_replay != "disabled"
                else "rollout.return_routed_experts"
            )
            raise ConfigError(
                f"{key}: {replay}: set "
                "trainer.moe.router_replay disabled and rollout.return_routed_experts false"
            )
    _check_cache_tier(cfg)  # first: the durable check creates a local store's folder
    open_store(cfg.checkpoint).check_access()


def check_user_code(cfg: RunConfig) -> None:
    """`preflight`'s calls of the user's code alone, on the dataset's sample: each environment
    and each verifier once, in the sandbox (`check_environments`, `check_verifiers`)."""
    if cfg.pipeline.kind == "grpo":
        ds = load_dataset(cfg.task.dataset, cfg.task.max_bad_fraction, cfg.checkpoint)
        _check_user_code(cfg, ds.sample)


def _check_user_code(cfg: RunConfig, rows) -> None:
    if cfg.pipeline.kind == "grpo":
        check_environments(cfg, rows)
    if cfg.pipeline.kind == "grpo" and cfg.reward.kind != "model":
        check_verifiers(cfg, rows)


def _route_bytes(cfg: RunConfig) -> tuple[int, str]:
    """Route bytes per token when the engines return routes (`route_bytes`), else 0."""
    if not cfg.rollout.return_routed_experts:
        return 0, ""
    if cfg.model.path:
        return route_bytes(hf_config(cfg.model.path, cfg.checkpoint))
    t = cfg.model.tiny
    return route_bytes(
        {"num_hidden_layers": t.num_layers, "num_experts_per_tok": t.experts_per_token},
        t.num_experts,
        t.num_layers,
    )


def route_bytes(
    hf: Mapping[str, Any], experts: int | None = None, layers: int | None = None
) -> tuple[int, str]:
    """MoE layers x top-k x id bytes (1 under 255 experts, else 2) of an HF config, and the
    same in words."""
    hf = hf.get("text_config") or hf
    if experts is None or layers is None:
        fam = family_of(dict(hf))
        experts, layers = fam.num_experts(hf), len(fam.moe_layer_ids(hf))
    k, width = int(hf["num_experts_per_tok"]), 1 if experts < 255 else 2
    return layers * k * width, f"{layers} MoE layers x top-{k} x {width} B a token"


def _check_cache_tier(cfg: RunConfig) -> None:
    """A cache tier that is configured but unusable (no bucket, refused keys, nobody listening)
    would send every read to S3 for the whole run: refused before work starts, naming the key.
    An `embedded` one is started by the run itself, after this check."""
    ct = cfg.checkpoint.cache_tier
    if ct.uri is None or ct.endpoint_url == "embedded":
        return
    # The check is real wherever it runs (the pipeline's start_run gets the cache server's reader
    # keys: moerl.store.tiers READER_STAGES). Held keys are not required: a cache tier on AWS S3
    # is reached through the AWS chain (IRSA), as the config allows. But a task without keys that
    # is refused was most likely never given them, so the error says so rather than "denied".
    names = (f"{ct.credentials_env}_ACCESS_KEY_ID", f"{ct.credentials_env}_SECRET_ACCESS_KEY")
    keys, held = " / ".join(names), any(read_secret(n) for n in names)  # a pod holds them as files
    try:
        # a fresh or restarted cache server holds no bucket (it keeps them in memory): the
        # writer creates it at its first publication, and this task (the reader) cannot
        store = cache_tier_store(cfg.checkpoint, "preflight")
        assert store is not None  # cache_tier.uri is set (checked above)
        if not store.check_access(missing_ok=True):
            log.warning(
                "checkpoint.cache_tier: bucket of %s does not exist yet at %s; the first publication "
                "creates it (the writer's identity may)",
                ct.uri,
                ct.endpoint_url,
            )
    except CheckpointError as e:
        if not held:
            raise ConfigError(
                f"checkpoint.cache_tier ({ct.uri} at {ct.endpoint_url}) is not usable: {e}. This process holds no "
                f"cache-tier keys ({keys} unset), so it used the AWS chain (on EKS: the pod's IRSA role, which the "
                f"cache server does not know). Set both variables to the cache server's reader keys; on EKS they come "
                f"from the Secret {CACHE_TIER_SECRET + '-reader'!r} (keys READER_ACCESS_KEY_ID / READER_SECRET_ACCESS_KEY, "
                "docs/eks.md), mounted into each stage's pod by moerl.launch.podsecrets.pod_secret_env; or unset "
                "checkpoint.cache_tier.uri"
            ) from e
        raise ConfigError(
            f"checkpoint.cache_tier ({ct.uri} at {ct.endpoint_url}) is not usable: {e}; fix "
            f"checkpoint.cache_tier.uri / endpoint_url and its keys ({keys}), or unset "
            "cache_tier.uri"
        ) from e


def check_prompts(cfg: RunConfig, rows) -> None:
    """Rows that give chat `messages` need the policy's tokenizer to have a chat template (the
    embedded tiny tokenizer has none; a `model.path` checkpoint's is read from its
    tokenizer_config.json), unless `rollout.chat_template` is false, which refuses them."""
    chat = next((r for r in rows if r.messages), None)
    if chat is None and cfg.rollout.chat_template is not True:
        return
    has_template = False
    if cfg.model.path:
        root = model_view(cfg.model.path, cfg.checkpoint)
        tc = root / "tokenizer_config.json"
        has_template = (tc.is_file() and bool(json.loads(tc.read_text()).get("chat_template"))) or (
            root / "chat_template.jinja"
        ).is_file()
    uses_template(has_template, cfg.rollout, chat or rows[0])


def check_verifiers(cfg: RunConfig, rows) -> None:
    """Every task in the dataset has a verifier, and each verifier, called in the sandbox on one
    row of each task it scores (the row's own answer as the response), returns a finite number:
    a bad import path, a wrong signature or a verifier that raises stops the run here, naming
    the key, before any work."""
    rc = cfg.reward
    first: dict[str, Any] = {}  # each task's first row
    for row in rows:
        first.setdefault(row.task, row)
    calls, keys = [], []
    for task, row in sorted(first.items()):
        try:
            target = verifier_target(rc.verifier, task, rc.verifiers)
        except KeyError as err:
            if environment_for(task, cfg.task.environment, cfg.task.environments):
                continue  # its environment rewards its episodes (one that gives none fails its sample)
            raise ConfigError(str(err).strip("\"'")) from None
        calls.append((CALL_VERIFIER, [target, row.answer, row.answer, row.meta]))
        keys.append((verifier_key(rc.verifier, task, rc.verifiers), target, task, row.id))
    limits = Limits(
        timeout_s=max(rc.sandbox.sample_timeout_s, 30.0),
        memory_mb=rc.sandbox.memory_mb,
        isolation=rc.sandbox.isolation,
    )
    with SandboxPool(limits) as pool:
        outcomes = pool.run(calls)
    for (key, target, task, row_id), o in zip(keys, outcomes):
        bad = as_score(o.ok, o.value, o.error)
        if isinstance(bad, str):
            raise ConfigError(
                f"{key}: {target} cannot score task {task!r} (called in the sandbox on row {row_id!r} "
                f"with its own answer): {bad}; a verifier is package.module:function taking "
                "(response, answer, meta) or (response, answer) and returning a number"
            )


def check_environments(cfg: RunConfig, rows) -> None:
    """Each environment, made in the sandbox for one row of each task it serves, resets on the
    row and steps on the row's answer as the model's message, returning what the interface
    says (`moerl/tasks/environments.py`): a bad import path, a factory that fails, a missing
    method or a wrong return stops the run here, naming the key, before any work."""
    tc = cfg.task
    if not (tc.environment or tc.environments):
        return
    unknown = sorted(set(tc.environments) - {r.task for r in rows})
    if unknown:
        raise ConfigError(
            f"task.environments: no dataset row has task {unknown[0]!r}; the dataset's tasks: "
            f"{', '.join(sorted({r.task for r in rows}))}"
        )
    first: dict[str, Any] = {}  # each task's first row
    for row in rows:
        first.setdefault(row.task, row)
    limits = Limits(
        timeout_s=max(tc.sandbox.sample_timeout_s, 30.0),
        memory_mb=tc.sandbox.memory_mb,
        isolation=tc.sandbox.isolation,
    )
    with SandboxPool(limits) as pool:
        for task, row in sorted(first.items()):
            env = environment_for(task, tc.environment, tc.environments)
            if env is None:
                continue
            key = f"preflight-{task}"
            got = pool.run(
                [(RESET, [env, key, row.model_dump()]), (STEP, [key, row.answer])], keys=[key, key]
            )
            pool.run([(CLOSE, [[key]])], keys=[key])
            pool.release([key])
            bad = next(
                (f"{what}: {o.error}" for what, o in zip(("reset", "step"), got) if not o.ok), None
            )
            if bad:
                raise ConfigError(
                    f"{environment_key(task, tc.environments)}: {env} cannot run task {task!r} (made "
                    f"in the sandbox, reset on row {row.id!r} and stepped with its answer): {bad}; an "
                    "environment is package.module:Factory whose instances have reset(row) -> str | None "
                    "and step(text) -> (observation, reward, done)"
                )


def _check_mesh(cfg: RunConfig) -> None:
    """A user's model on the trainer's mesh: its experts must split evenly over ep."""
    ep = cfg.trainer.parallelism.expert_parallel_size
    assert cfg.model.path is not None  # called for a model.path model only
    hf = hf_config(cfg.model.path, cfg.checkpoint)
    experts = family_of(hf).num_experts(hf)  # each family names the field its own way
    if ep > 1 and experts % ep:
        raise ConfigError(
            f"trainer.parallelism.expert_parallel_size: {ep} does not divide the {experts} experts of model.path "
            f"{cfg.model.path}; allowed: a divisor of {experts}"
        )


def _check_engine_fit(cfg: RunConfig) -> None:
    """A cuda rollout engine whose weights and one max_model_len sequence of KV cache do not fit
    a GPU (moerl.launch.layout.check_engine_fit): refused, naming the keys and the GiB."""
    assert cfg.model.path is not None  # called for a model.path model only
    check_engine_fit(cfg, hf_config(cfg.model.path, cfg.checkpoint))


def _check_scratch(cfg: RunConfig) -> None:
    """A model.path model whose versions, trainer state or download outgrow a task's scratch
    emptyDir (`check_scratch`): refused, naming the keys and the GB."""
    assert cfg.model.path is not None  # called for a model.path model only
    check_scratch(cfg, hf_config(cfg.model.path, cfg.checkpoint))


# -- the pods' scratch ------------------------------------------------------------------------


@dataclass(frozen=True)
class ScratchNeed:
    """What one kind of task writes into its scratch emptyDir at its peak, against its limit."""

    what: str  # the task and what it holds, in words
    group: str  # the worker group it runs on (cluster.groups.<group>)
    need: int  # bytes
    limit: int  # bytes: cluster.scratch_of(group)
    key: str  # the key that sets the limit, and its value
    fix: str  # what else would make it fit

    @property
    def fits(self) -> bool:
        return self.need <= self.limit


def _gb(n: float) -> str:
    return f"{n / 1e9:,.1f} GB" if n >= 1e8 else f"{n / 1e6:,.1f} MB"


def scratch_needs(cfg: RunConfig, hf: Mapping[str, Any]) -> list[ScratchNeed]:
    """The peak scratch of each big writer of a GRPO run of the model of HF config `hf` (bytes
    from `moerl.models.sizes`; a version's engine weights are in rollout.dtype):
    - a rollout pod's node cache: one version per sync task (a fresh pod each); async,
      checkpoint.cache_keep + 1 (the newest cache_keep with the one fetched, and the served);
    - a trainer node: its share (over its nodes) of the versions it keeps, each engine weights
      plus master weights and Adam (3 x model.dtype bytes per parameter): 2 in sync (the one it
      continues from, the one it writes), checkpoint.max_unpublished + 2 in async;
    - init_policy: a hub model (hf://) downloaded whole, or a warm start's version (an S3 model
      is copied server-side: none); sync redistribute_weights: one version.
    Not counted: the model's small files, logs, the libraries' caches under HOME."""
    if cfg.pipeline.kind != "grpo":
        return []
    cl, ck, sizes = cfg.cluster, cfg.checkpoint, model_sizes(hf)
    engine = sizes.total_params * DTYPE_BYTES[cfg.rollout.resolved.dtype]
    state = sizes.total_params * 3 * DTYPE_BYTES[cfg.model.dtype]
    weights = f"{_gb(engine)} of engine weights (rollout.dtype {cfg.rollout.resolved.dtype})"

    def need(group: str, what: str, n: float, fix: str) -> ScratchNeed:
        g = getattr(cl.groups, group)
        key = f"cluster.groups.{group}.scratch_size" if g.scratch_size else "cluster.scratch_size"
        size = cl.scratch_of(g)
        return ScratchNeed(what, group, math.ceil(n), quantity_bytes(size), f"{key} {size}", fix)

    sync = cfg.pipeline.mode == "sync"
    if sync:
        cache = need("rollout", f"a rollout task: 1 version of {weights}", engine, "")
    else:
        cache = need(
            "rollout",
            f"a rollout pod's node cache: {ck.cache_keep + 1} versions (checkpoint.cache_keep "
            f"{ck.cache_keep} + 1) of {weights}",
            (ck.cache_keep + 1) * engine,
            ", or lower checkpoint.cache_keep",
        )
    nodes = trainer_nodes(cfg) if cl.launch.mode == "kubernetes" else 1
    kept = 2 if sync else ck.max_unpublished + 2
    every = cfg.resolved.state_every
    stated = kept if sync or every == 1 else 1 + math.ceil((kept - 1) / every)
    why = "" if sync else f" (checkpoint.max_unpublished {ck.max_unpublished} + 2)"
    needs = [
        cache,
        need(
            "trainer",
            f"a trainer node: 1/{nodes} of {kept} versions{why} of {weights}, {stated} of them "
            f"with {_gb(state)} of master weights and Adam (model.dtype {cfg.model.dtype})",
            (kept * engine + stated * state) / nodes,
            ", or more trainer nodes (cluster.launch.trainer_nodes)",
        ),
    ]
    if cfg.model.warm_start != "none":
        needs.append(need("buffer", f"init_policy: the warm start's {weights}", engine, ""))
    spec = cfg.model.path or ""
    if spec.startswith("hf://"):  # also a warm start "previous" that finds no previous run
        src = _checkpoint_bytes(hf, sizes)
        needs.append(
            need(
                "buffer",
                f"init_policy: the hub model {spec}, downloaded whole ({_gb(src)})",
                src,
                ", or stage it in S3 (model.path s3://: copied server-side, not through the disk)",
            )
        )
    if sync:
        needs.append(
            need(
                "buffer",
                f"redistribute_weights: 1 version of {weights}",
                engine,
                ", or pipeline.mode async",
            )
        )
    return needs


def _checkpoint_bytes(hf: Mapping[str, Any], sizes: ModelSizes) -> int:
    """A published checkpoint's weight bytes: its dtype, FP8 linear layers at 1 byte."""
    b = DTYPE_BYTES.get(str(hf.get("torch_dtype") or hf.get("dtype") or "bfloat16"), 2)
    linear = DTYPE_BYTES["fp8"] if sizes.fp8 else b
    return sizes.embed_params * b + (sizes.dense_params + sizes.expert_params) * linear


def check_scratch(cfg: RunConfig, hf: Mapping[str, Any]) -> list[ScratchNeed]:
    """Refuse (ConfigError naming the keys and the GB) a run whose tasks would outgrow their
    scratch emptyDir (`scratch_needs`): the pod would be evicted at the limit, and retried."""
    needs = scratch_needs(cfg, hf)
    short = [n for n in needs if not n.fits]
    if short:
        raise ConfigError(
            "the pods' scratch is too small: "
            + "; ".join(
                f"{n.what} needs {_gb(n.need)}, more than the {_gb(n.limit)} of {n.key}; "
                f"allowed: cluster.groups.{n.group}.scratch_size of at least "
                f"{math.ceil(n.need / 2**30)}Gi, which "
                f"the node's disk must hold (docs/eks.md){n.fix}"
                for n in short
            )
        )
    return needs
