"""The EKS target: worker groups, pod placement and resources, and how GPU stages launch."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from moerl.config.base import _Section

# What KFP's set_cpu_request / set_memory_request accept (kfp/dsl/pipeline_task.py, 2.17.3).
_CPU = r"^([0-9]*\.)?[0-9]+m?$"


_MEMORY = r"^[0-9]+(E|Ei|P|Pi|T|Ti|G|Gi|M|Mi|K|Ki)?$"
_UNITS = {"": 1, **{u: 1000**i for i, u in enumerate("KMGTPE", 1)}}
_UNITS.update({f"{u}i": 1024**i for i, u in enumerate("KMGTPE", 1)})
# The GPU groups' scratch: p5en.48xlarge has 8 x 3.84 TB of NVMe (27.9 TiB in RAID 0); 16Ti holds
# DeepSeek-V3's bf16 node cache (3 x 1.34 TB) with room left for images, logs and kubelet's reserve.
NVME_SCRATCH = "16Ti"


def quantity_bytes(quantity: str) -> int:
    """Bytes of a size in `_MEMORY`'s form (200Gi, 16Ti, 500G, 1024)."""
    digits = quantity.rstrip("EPTGMKi")
    return int(digits) * _UNITS[quantity[len(digits) :]]


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
    """The taint key tolerated."""
    operator: Literal["Equal", "Exists"] = "Equal"
    """Equal: the taint's value must be `value`; Exists: any value."""
    value: str | None = None
    """The taint value (empty with Exists)."""
    effect: Literal["NoSchedule", "PreferNoSchedule", "NoExecute"] | None = None
    """The taint effect tolerated; null: all."""

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

    image: str | None = None
    """The group's container image; null: pipeline.base_image."""
    node_selector: dict[str, str] = {}
    """Node labels the group's pods must land on."""
    tolerations: list[Toleration] = []
    """Taints the group's pods tolerate."""
    cpu: str = Field("1", pattern=_CPU)
    """CPU request per task: 2, 0.5 or 500m."""
    memory: str = Field("4Gi", pattern=_MEMORY)
    """Memory request and limit per task, e.g. 4Gi or 4096Mi."""
    gpus: int = Field(0, ge=0, le=16)
    """GPUs (nvidia.com/gpu) for tasks that run an engine or a trainer in the task
    (cluster.launch.mode in_task); launched workloads take cluster.launch.gpus_per_node."""
    shm: str | None = Field(None, pattern=_MEMORY)
    """A memory-backed /dev/shm of this size for tasks that run an engine or a trainer in the task;
    null: none."""
    timeout_s: int = Field(6 * 3600, ge=600)
    """The pod's activeDeadlineSeconds; a launcher task stops watching 120 s before it."""
    gpu_memory_gib: float | None = Field(None, gt=0.0, le=4096.0)
    """GiB of memory of one GPU of the group's nodes (p5en's H200: 140; nvidia-smi reports 143,771
    MiB): what preflight fits a rollout engine's weights and KV cache in (docs/rollout-scale.md).
    null: not checked."""
    scratch_size: str | None = Field(None, pattern=_MEMORY)
    """The scratch emptyDir's size limit of the group's tasks; null: cluster.scratch_size. trainer
    and rollout: 16Ti, for p5en's NVMe in RAID 0 (Karpenter); on a root volume, set less."""


def _group(
    name: str,
    cpu: str,
    memory: str,
    shm: str | None = None,
    timeout_s: int = 6 * 3600,
    gpus: int = 0,
    gpu_memory_gib: float | None = None,
    scratch_size: str | None = None,
) -> GroupConfig:
    return GroupConfig(
        node_selector={"moerl.ai/group": name},
        tolerations=[Toleration(key="moerl.ai/group", value=name, effect="NoSchedule")],
        cpu=cpu,
        memory=memory,
        shm=shm,
        timeout_s=timeout_s,
        gpus=gpus,
        gpu_memory_gib=gpu_memory_gib,
        scratch_size=scratch_size,
    )


class GroupsConfig(_Section):
    """trainer: GPU trainers, on-demand. rollout: GPU rollout workers, Spot. cpu: environments,
    rule rewards, run bookkeeping. buffer: memory-optimized nodes for the experience buffer and
    the checkpoint cache (publish, redistribute). reward: reward-model inference (the reward
    stage and scorers when `reward.kind` is model or mixed), a small GPU each."""

    trainer: GroupConfig = _group(
        "trainer",
        "16",
        "64Gi",
        shm="32Gi",
        timeout_s=12 * 3600,
        gpus=8,
        gpu_memory_gib=140.0,
        scratch_size=NVME_SCRATCH,
    )
    """GPU trainers, on-demand nodes."""
    rollout: GroupConfig = _group(
        "rollout",
        "16",
        "64Gi",
        shm="32Gi",
        timeout_s=12 * 3600,
        gpus=8,
        gpu_memory_gib=140.0,
        scratch_size=NVME_SCRATCH,
    )
    """GPU rollout workers, Spot nodes."""
    cpu: GroupConfig = _group("cpu", "2", "8Gi")
    """Environments, rule rewards and run bookkeeping."""
    buffer: GroupConfig = _group("buffer", "4", "32Gi")
    """Memory-optimized nodes: the experience buffer and the checkpoint cache (publish,
    redistribute)."""
    reward: GroupConfig = _group("reward", "8", "32Gi", shm="8Gi", gpus=1)
    """Reward-model inference (reward kind model or mixed), a small GPU each."""

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
    """in_task: inside the KFP task's pod; kubernetes: a workload created through the Kubernetes
    API."""
    namespace: str | None = None
    """The launched workloads' namespace; null: the task's own pod's."""
    service_account: str | None = "moerl-worker"
    """The launched pods' service account (IRSA: S3 only), never the launching task's own; null:
    the namespace's default."""
    rollout_service_account: str | None = "moerl-rollout"
    """The launched rollout pods' account, which may read versions and write only its pins and
    exchange outputs; null: service_account."""
    trainer_runtime: str = "moerl-torch-distributed"
    """The ClusterTrainingRuntime of the trainer's TrainJob; moerl's gives the trainer pods the
    priority class moerl-trainer."""
    rollout_priority_class: str | None = "moerl-rollout"
    """The launched rollout pods' PriorityClass, below the trainer's so a full cluster preempts
    Spot rollout first; null: none."""
    trainer_nodes: int | None = Field(None, ge=1, le=512)
    """Nodes of the trainer's TrainJob; null: from the mesh (trainer.parallelism.data_parallel_shard x
    trainer.parallelism.expert_parallel_size ranks at gpus_per_node per node). Sync mode only; the ranks
    must split evenly."""
    fleet_scaler: Literal["keda", "trainer"] = "keda"
    """An elastic rollout fleet (rollout.min_workers < rollout.max_workers) on the cluster: keda:
    a KEDA ScaledObject on the run's units stream scales its Deployment, the trainer keeping its
    lagCount at the measured value; trainer: no KEDA installed, the trainer's controller sets the
    Deployment's replicas by the same rule (docs/async.md, "An elastic fleet")."""
    rollout_nodes_per_worker: int = Field(1, ge=1, le=64)
    """Nodes per rollout worker; > 1: one engine across nodes (expert parallelism)."""
    gpus_per_node: int = Field(8, ge=0, le=16)
    """GPUs (nvidia.com/gpu) per launched node."""
    rollout_gpus_per_node: int | None = Field(None, ge=0, le=16)
    """GPUs of a launched rollout pod (one pod per node): it runs rollout_gpus_per_node /
    (rollout.tensor_parallel_size x rollout.data_parallel_size) engines, each on its own GPUs
    (docs/rollout-scale.md). null: gpus_per_node."""
    efa_per_node: int = Field(16, ge=0, le=64)
    """EFA devices per launched pod (p5en.48xlarge has 16)."""
    hugepages_2mi: str | None = Field("5120Mi", pattern=_MEMORY)
    """2 MiB hugepages per launched pod (EFA and DeepEP use them); null: none."""
    cpu_per_node: str = Field("96", pattern=_CPU)
    """CPU request per launched pod."""
    memory_per_node: str = Field("1024Gi", pattern=_MEMORY)
    """Memory request and limit per launched pod."""
    poll_s: float = Field(10.0, gt=0.0)
    """How often the launching task polls the launched workload's pods."""
    pending_timeout_s: float = Field(1800.0, ge=60.0)
    """A launched workload none of whose pods has left Pending by then fails with the scheduler's
    message; raise it where GPU nodes scale up from zero slowly."""


class ClusterConfig(_Section):
    """`moerl compile --target eks`: what every task of the compiled pipeline gets."""

    scratch_dir: str = "/scratch"
    """An emptyDir mounted in every task: its working directory, HOME, TMPDIR and checkpoint cache."""
    scratch_size: str = Field("200Gi", pattern=_MEMORY)
    """The scratch emptyDir's size limit of the groups that set none of their own
    (cluster.groups.<group>.scratch_size)."""
    groups: GroupsConfig = GroupsConfig()
    """The worker groups tasks are placed in."""
    mlflow_secret: str | None = "moerl-mlflow"
    """The Kubernetes Secret with MLflow's writer credentials (MLFLOW_TRACKING_USERNAME,
    MLFLOW_TRACKING_PASSWORD), mounted as files in every stage's pod but the rollout stages';
    null: none."""
    mlflow_reader_secret: str | None = "moerl-mlflow-reader"
    """The Secret with MLflow's read-only credentials (same keys), the rollout stages' instead,
    so their pods cannot rewrite a run's tags (manifests/base/mlflow.yaml); null: the writer's."""
    valkey_secret: str | None = "moerl-valkey"
    """The Kubernetes Secret with Valkey's passwords (VALKEY_ADMIN_PASSWORD for the run's own user,
    VALKEY_PASSWORD for the shared user moerl), mounted as files; null: none."""
    launch: LaunchConfig = LaunchConfig()
    """How the GPU stages run on the cluster."""
    async_timeout_s: int = Field(14 * 24 * 3600, ge=3600)
    """Async mode: the deadline of every task and launched workload, in place of the groups'
    per-task timeout_s (the default, 14 days, leaves room for Spot restarts)."""

    def rollout_gpus(self) -> int:
        """GPUs of one rollout pod: cluster.launch.rollout_gpus_per_node (null: gpus_per_node)
        when launched (launch.mode kubernetes), cluster.groups.rollout.gpus in the task's pod."""
        la = self.launch
        if la.mode == "kubernetes":
            return (
                la.gpus_per_node if la.rollout_gpus_per_node is None else la.rollout_gpus_per_node
            )
        return self.groups.rollout.gpus

    def scratch_of(self, group: GroupConfig) -> str:
        """The scratch emptyDir's size limit of a task of `group`."""
        return group.scratch_size or self.scratch_size

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
