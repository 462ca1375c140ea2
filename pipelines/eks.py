"""The EKS target: what a pipeline must be to run on a real KFP on EKS, and what each task gets.

`check_cluster_safe` refuses a config that only works on one machine; `place` gives one task,
through kfp-kubernetes, its worker group's settings, scratch, credentials and timeout. What
each refusal and setting is, and why: docs/eks.md.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from moerl.config import GroupConfig, RunConfig
from moerl.errors import ConfigError
from moerl.launch.podsecrets import (
    LAUNCHER_TOKEN,
    LAUNCHER_TOKEN_ENV,
    RUN_SECRET,
    VALKEY_ADMIN_STAGES,
    SecretRef,
    launcher_token_dir,
    pod_secret_files,
    pod_secret_mounts,
)
from moerl.secrets import SECRETS_ROOT

if TYPE_CHECKING:  # kfp only where a pipeline is built: the first task's run-form check imports
    from kfp import dsl  # check_cluster_safe inside a task, whose kfp runtime lacks kfp.kubernetes

GROUPS = ("trainer", "rollout", "cpu", "buffer", "reward")
# Which worker group runs each stage (the seed's four groups; `reward` is chosen in group_of).
STAGE_GROUP: dict[str, str] = {
    "start_run": "cpu",
    "check_user_code": "cpu",
    "log_iteration": "cpu",
    "finish_run": "cpu",
    "close_run": "cpu",
    "reward": "cpu",
    "reward_scorer": "cpu",
    "buffer": "buffer",
    "init_policy": "buffer",
    "resume_policy": "buffer",
    "redistribute_weights": "buffer",
    "rollout": "rollout",
    "rollout_worker": "rollout",
    "policy_update": "trainer",
    "async_trainer": "trainer",
    # the reward-model pipeline (pipelines/reward_model.py)
    "prepare_preferences": "cpu",
    "train_reward_model": "trainer",
    "evaluate_reward_model": "trainer",
    "publish_reward_model": "buffer",
}
# Stages that run an engine or a trainer in their own pod (when not launched out-of-band).
ENGINE_STAGES = frozenset({"rollout", "rollout_worker", "policy_update", "async_trainer"})
GPU_STAGES = ENGINE_STAGES  # the ones `cluster.launch.mode: kubernetes` launches through the API
# Stages that score with a reward model when `reward.kind` is model or mixed (the reward group).
REWARD_MODEL_STAGES = frozenset({"reward", "reward_scorer"})
# The reward-model pipeline's stages that run the model (on the trainer group).
MODEL_STAGES = frozenset({"train_reward_model", "evaluate_reward_model"})
# Stages whose process calls the user's verifiers or environments (moerl.tasks.sandbox), unless
# launched (`runs_user_code`): never given the Valkey admin's password or the launcher's token.
USER_CODE_STAGES = frozenset(
    {"check_user_code", "reward", "reward_scorer", "rollout", "rollout_worker"}
)
# Sync stages whose task is a pure function of its inputs (same seed, same artifacts): a retry
# after a lost pod (Spot) redoes the same work. policy_update publishes the version it trains,
# and a retry after that publication returns the published version (`update.already_published`).
# Not init_policy (it publishes version 0 under a fresh run), not bookkeeping.
RETRYABLE_STAGES = frozenset(
    {"rollout", "reward", "buffer", "policy_update", "redistribute_weights"}
)
RETRY_BACKOFF = "30s"
SHM_VOLUME, SCRATCH_VOLUME = "dshm", "scratch"


def check_cluster_safe(cfg: RunConfig) -> None:
    """Refuse, naming every offending key and what is allowed, a config whose tasks would pass
    state through this machine's filesystem or track to a local file."""
    problems = [
        *_storage_problems(cfg),
        *_group_problems(cfg),
        *_service_problems(cfg),
    ]
    if cfg.cluster.launch.mode == "kubernetes":
        from moerl.launch.task import check_launchable

        for stage in sorted(launched_stages(cfg)):
            try:
                check_launchable(cfg, stage)
            except ConfigError as err:
                if str(err) not in problems:
                    problems.append(str(err))
    if problems:
        raise ConfigError("not cluster-safe for --target eks: " + "; ".join(problems))


def _storage_problems(cfg: RunConfig) -> list[str]:
    """What the run reads and writes (checkpoints, model, data) on a path only this machine
    sees."""
    problems: list[str] = []
    ck, scratch = cfg.checkpoint, cfg.cluster.scratch_dir
    if not ck.uri.startswith("s3://"):
        problems.append(
            f"checkpoint.uri: {ck.uri!r} is a local path, which each pod sees empty; use s3://bucket/prefix"
        )
    if ck.cache_dir.startswith("/") and not (ck.cache_dir + "/").startswith(scratch + "/"):
        problems.append(
            f"checkpoint.cache_dir: {ck.cache_dir!r} is outside the pod's scratch volume "
            f"(cluster.scratch_dir {scratch!r}); use a relative path (it resolves inside the scratch) "
            f"or one under {scratch}/"
        )
    if ck.cache_dir.startswith("~"):
        problems.append(
            f"checkpoint.cache_dir: {ck.cache_dir!r} is under a home directory; use a relative path"
        )
    if cfg.model.path and not cfg.model.path.startswith(("s3://", "hf://")):
        problems.append(
            f"model.path: {cfg.model.path!r} is a path on this machine, which no pod sees; stage the "
            "model in S3 (s3://bucket/prefix/, README: bring your model) or name a hub commit "
            "(hf://org/name@<commit>), or leave it unset (the tiny model from model.tiny)"
        )
    for key, spec, what in (
        ("task.dataset", cfg.task.dataset, "dataset"),
        ("reward_model.data", cfg.reward_model.data, "preference set"),
    ):
        if key == "reward_model.data" and cfg.pipeline.kind != "reward_model":
            continue
        if not spec.startswith(("builtin:", "s3://")):
            problems.append(
                f"{key}: {spec!r} is a file on this machine, which no pod sees; stage it in S3 "
                f"(s3://bucket/key, or a prefix of JSONL/Parquet shards) or use a builtin: {what} "
                "shipped in the image"
            )
    return problems


def _group_problems(cfg: RunConfig) -> list[str]:
    """The worker groups' GPUs and images: a cuda stage on a group without GPUs, an image with
    no registry, a rollout layout the group's GPUs cannot hold."""
    problems: list[str] = []
    if (
        cfg.reward.kind != "rules"
        and cfg.reward.model is not None  # always set unless kind is rules (RewardConfig)
        and cfg.reward.model.device == "cuda"
        and not cfg.cluster.groups.reward.gpus
    ):
        problems.append(
            "cluster.groups.reward.gpus: 0, but reward.model.device is cuda; give the reward group GPUs"
        )
    images = {}  # what each group's tasks would pull, under the key that sets it
    for g in GROUPS:
        if g == "reward" and cfg.reward.kind == "rules":  # no task runs on it
            continue
        own = getattr(cfg.cluster.groups, g).image
        images[f"cluster.groups.{g}.image" if own else "pipeline.base_image"] = (
            own or cfg.pipeline.base_image
        )
    for key, image in images.items():
        if image and "/" not in image.split("@")[0]:
            problems.append(
                f"{key}: {image!r} names no registry, so the cluster would pull docker.io/library/{image}; "
                "give the registry path of the image you pushed, e.g. 123456789012.dkr.ecr.us-west-2"
                f".amazonaws.com/{image}"
            )
    for device_key, group, device in (
        ("trainer.parallelism.device", "trainer", cfg.trainer.parallelism.device),
        ("rollout.device", "rollout", cfg.rollout.device),
    ):
        gpus = getattr(cfg.cluster.groups, group).gpus
        if cfg.cluster.launch.mode == "in_task" and device == "cuda" and not gpus:
            problems.append(
                f"cluster.groups.{group}.gpus: 0, but {device_key} is cuda; give the group's tasks GPUs"
            )
    if cfg.rollout.device == "cuda" and cfg.cluster.rollout_gpus():  # TP x DP divides them
        from moerl.launch.layout import rollout_pod_layout

        try:
            rollout_pod_layout(cfg)
        except ConfigError as err:
            problems.append(str(err))
    return problems


def _service_problems(cfg: RunConfig) -> list[str]:
    """The services the pods reach (MLflow, the checkpoint cache, Valkey), and fan-out outside
    the async pipeline."""
    problems: list[str] = []
    ck = cfg.checkpoint
    uri = cfg.tracking.uri or ""
    if not uri.startswith(("http://", "https://")):
        problems.append(
            f"tracking.uri: {uri or 'unset (a SQLite file in the working directory)'!s} is not an MLflow "
            "server; set http(s)://host:port of the tracking server (credentials from the Secret "
            "cluster.mlflow_secret)"
        )
    if ck.cache_tier.endpoint_url == "embedded":
        problems.append(
            "checkpoint.cache_tier.endpoint_url: 'embedded' starts a server on this machine; give the "
            "cache server's Service URL (manifests/base/ckpt-cache.yaml: http://moerl-ckpt-cache.moerl"
            ".svc:8333)"
        )
    if ck.fanout and cfg.pipeline.mode != "async":
        problems.append(
            "checkpoint.fanout: only the async pipeline's long-lived rollout workers fan out; set it false"
        )
    if cfg.pipeline.mode == "async" and not cfg.valkey.url:
        problems.append(
            "valkey.url: the async pipeline needs a Valkey Service its pods can reach; set "
            "redis://host:6379/0 (password from the Secret cluster.valkey_secret)"
        )
    if cfg.pipeline.mode == "async" and cfg.valkey.url and not cfg.valkey.username:
        problems.append(
            "valkey.username: unset, so every stage would log in as the server's default (admin) user; "
            "set moerl, the least-privilege ACL user manifests/base/valkey.yaml defines"
        )
    if cfg.pipeline.mode == "async" and cfg.valkey.url and not cfg.cluster.valkey_secret:
        problems.append(
            "cluster.valkey_secret: null, but the async pipeline's first task makes the run's own Valkey "
            "user with the admin password it holds (key VALKEY_ADMIN_PASSWORD); set it to moerl-valkey "
            "(docs/eks.md)"
        )
    return problems


def launched_stages(cfg: RunConfig) -> frozenset[str]:
    """The GPU stages whose launch `check_cluster_safe` checks: all of them, but the sync
    pipeline's `rollout` in an async one (which runs `rollout_worker` instead: a rollout group
    over several nodes is an async-only shape)."""
    if cfg.pipeline.mode == "async":
        return GPU_STAGES - {"rollout"}
    return GPU_STAGES


def group_of(cfg: RunConfig, stage: str) -> tuple[str, GroupConfig]:
    """The worker group a stage's task runs on: its own, or the CPU group for a GPU stage whose
    workload is launched through the Kubernetes API."""
    name = STAGE_GROUP[stage]
    if stage in GPU_STAGES and cfg.cluster.launch.mode == "kubernetes":
        name = "cpu"
    # reward-model inference: its own group
    if stage in REWARD_MODEL_STAGES and cfg.reward.kind != "rules":
        name = "reward"
    return name, getattr(cfg.cluster.groups, name)


def runs_user_code(cfg: RunConfig, stage: str) -> bool:
    """Whether `stage`'s task itself runs the user's code: a launched GPU stage's task only
    launches (the code runs in the launched pod, moerl/launch/objects.py)."""
    launched = stage in GPU_STAGES and cfg.cluster.launch.mode == "kubernetes"
    return stage in USER_CODE_STAGES and not launched


def place(
    task: dsl.PipelineTask,
    cfg: RunConfig,
    stage: str,
    async_mode: bool = False,
    run_secret: Any = None,
) -> dsl.PipelineTask:
    """Give `task` (running `stage`) its group's image, placement, resources, volumes, secrets
    and timeout for the cluster (see the module docstring). `run_secret`: the name of the run's
    own Secret (start_run's `valkey_secret` output), for the async stages that log in to Valkey."""
    from kfp import kubernetes

    name, group = group_of(cfg, stage)
    _on_group(task, cfg, group, name, stage)
    scratch = cfg.cluster.scratch_dir
    kubernetes.empty_dir_mount(
        task,
        volume_name=SCRATCH_VOLUME,
        mount_path=scratch,
        size_limit=cfg.cluster.scratch_of(group),
    )
    task.set_env_variable("MOERL_SCRATCH", scratch)
    if (stage in ENGINE_STAGES and name != "cpu") or name == "reward" or stage in MODEL_STAGES:
        # the engine, trainer or reward model runs in this task
        if group.shm:
            kubernetes.empty_dir_mount(
                task,
                volume_name=SHM_VOLUME,
                mount_path="/dev/shm",
                medium="Memory",
                size_limit=group.shm,
            )
        if group.gpus:
            task.set_accelerator_type("nvidia.com/gpu").set_accelerator_limit(group.gpus)
    launcher = stage in GPU_STAGES and name == "cpu"
    run_user = async_mode and stage in VALKEY_ADMIN_STAGES and cfg.valkey.url is not None
    token = launcher or (stage == "close_run" and cfg.cluster.launch.mode == "kubernetes")
    if runs_user_code(cfg, stage) and (token or run_user or stage in VALKEY_ADMIN_STAGES):
        raise ValueError(
            f"place({stage}): a task that runs the user's code gets no admin credential"
        )
    if token or run_user:
        # a launcher: its workload's namespace, owner and account; close_run: where to sweep;
        # start_run and close_run (async): where they create and delete the run's own Secret
        kubernetes.use_field_path_as_env(task, "MOERL_POD_NAMESPACE", "metadata.namespace")
        kubernetes.use_field_path_as_env(task, "MOERL_SERVICE_ACCOUNT", "spec.serviceAccountName")
        # the launcher account's token, in these tasks only: the run's own account (every task
        # pod's token, which KFP's launcher needs) may do nothing of moerl's (docs/eks.md)
        kubernetes.use_secret_as_volume(
            task, secret_name=LAUNCHER_TOKEN, mount_path=launcher_token_dir()
        )
        task.set_env_variable(LAUNCHER_TOKEN_ENV, launcher_token_dir())
    _mount_secrets(task, cfg, stage, async_mode, run_secret)
    if cfg.checkpoint.fanout and stage == "rollout_worker" and not launcher:
        # peers reach this worker's chunk server at the pod's address (NetworkPolicy: rollout pods only)
        task.set_env_variable("MOERL_FANOUT_BIND", "0.0.0.0")
        kubernetes.use_field_path_as_env(task, "MOERL_FANOUT_ADVERTISE", "status.podIP")
    _set_timeout(task, cfg, group, name, stage)
    return task


def _on_group(
    task: dsl.PipelineTask, cfg: RunConfig, group: GroupConfig, name: str, stage: str
) -> None:
    """`task`'s image, resources, node selectors and tolerations from its group `name`, and the
    pod labels that name the run's part, group and stage."""
    from kfp import kubernetes

    task.set_container_image(group.image or cfg.pipeline.base_image)
    task.set_cpu_request(group.cpu)
    task.set_memory_request(group.memory)
    task.set_memory_limit(group.memory)
    for key, value in sorted(group.node_selector.items()):
        kubernetes.add_node_selector(task, label_key=key, label_value=value)
    for tol in group.tolerations:
        kubernetes.add_toleration(
            task, key=tol.key, operator=tol.operator, value=tol.value, effect=tol.effect
        )
    kubernetes.add_pod_label(task, "app.kubernetes.io/part-of", "moerl")
    kubernetes.add_pod_label(task, "moerl.ai/group", name)
    kubernetes.add_pod_label(task, "moerl.ai/stage", stage.replace("_", "-"))


def _mount_secrets(
    task: dsl.PipelineTask, cfg: RunConfig, stage: str, async_mode: bool, run_secret: Any
) -> None:
    """`stage`'s Secrets as volumes (the run's own under `run_secret`'s name), and their files'
    paths in the environment."""
    from kfp import kubernetes

    # the stage's credentials as files, one volume per Secret, and only their paths in the
    # environment (moerl.secrets): the single mapping the launcher and the local cluster test's
    # sandbox also read, so what a pod gets here is what was tested. kfp-kubernetes 2.17 mounts
    # the whole Secret with Kubernetes' default mode (no items, no defaultMode), so every Secret
    # here holds only what each stage that mounts it may read (moerl/launch/podsecrets.py)
    for secret, (optional, _keys) in pod_secret_mounts(cfg, stage, async_mode).items():
        if secret == RUN_SECRET:  # the run's own Secret: its name is start_run's output
            if run_secret is None:
                raise ValueError(
                    f"place({stage}): this stage logs in to Valkey as the run's own user; pass "
                    "run_secret=start_run's valkey_secret output"
                )
            secret_name, mount = run_secret, SecretRef(RUN_SECRET, "").path().rsplit("/", 1)[0]
        else:
            secret_name, mount = secret, f"{SECRETS_ROOT}/{secret}"
        kubernetes.use_secret_as_volume(
            task, secret_name=secret_name, mount_path=mount, optional=optional
        )
    for var, path in pod_secret_files(cfg, stage, async_mode).items():
        task.set_env_variable(var, path)


def _set_timeout(
    task: dsl.PipelineTask, cfg: RunConfig, group: GroupConfig, name: str, stage: str
) -> None:
    """`task`'s timeout (a launcher's: its workload's) and, for a retryable stage, its retries
    with backoff."""
    from kfp import kubernetes

    timeout = cfg.cluster.timeout_s(group, cfg.pipeline.mode)
    if stage in GPU_STAGES and name == "cpu":  # a launcher waits as long as its workload may run
        timeout = cfg.cluster.timeout_s(
            getattr(cfg.cluster.groups, STAGE_GROUP[stage]), cfg.pipeline.mode
        )
    kubernetes.set_timeout(task, timeout)
    if stage in RETRYABLE_STAGES and cfg.pipeline.task_retries:
        task.set_retry(
            num_retries=cfg.pipeline.task_retries,
            backoff_duration=RETRY_BACKOFF,
            backoff_factor=2.0,
            backoff_max_duration=f"{timeout}s",
        )
