"""Which Kubernetes Secret keys reach a stage's pod, as which files: one mapping, read by
everything that needs it.

Design, details and limitations: docs/eks.md#moerllaunchpodsecretspy.
"""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path
from typing import TYPE_CHECKING, NamedTuple

if TYPE_CHECKING:
    from moerl.config import RunConfig

from moerl.secrets import FILE_SUFFIX, SECRETS_ROOT, file_var, write_secret_file

MLFLOW_SECRET_KEYS = ("MLFLOW_TRACKING_USERNAME", "MLFLOW_TRACKING_PASSWORD")
# The stages that get MLflow's read-only credential (`cluster.mlflow_reader_secret`).
MLFLOW_READER_STAGES = frozenset({"rollout", "rollout_worker"})
VALKEY_SECRET_KEYS = ("VALKEY_USERNAME", "VALKEY_PASSWORD")  # in the run's own Secret
# in the run's scaler Secret (`scaler_secret_name`), for KEDA's operator alone: never mounted
VALKEY_SCALER_KEYS = ("VALKEY_SCALER_USERNAME", "VALKEY_SCALER_PASSWORD")
VALKEY_ADMIN_KEY = "VALKEY_ADMIN_PASSWORD"  # in cluster.valkey_secret: start_run and close_run only
# The stages that make and delete the run's Valkey user and Secret (the admin password, and the
# Kubernetes API: their pods know their namespace, pipelines/eks.py).
VALKEY_ADMIN_STAGES = frozenset({"start_run", "close_run"})
# The stages whose pods call the user's verifiers and environments and hold no credential at all
# (no Secret, no launcher token: pipelines/eks.py `place`): start_run's preflight leaves them the
# user's code (moerl.preflight.check_user_code), since start_run holds the admin's password.
NO_CREDENTIAL_STAGES = frozenset({"check_user_code"})
# A run's own Secret (its Valkey user), named when the run starts: `run_secret_name(run_id)`.
RUN_SECRET = "moerl-run-{run_id}"
SANDBOX_SECRETS_ENV = "MOERL_SANDBOX_SECRETS"
# The launcher account's token (manifests/base/serviceaccounts.yaml): a Secret mounted only in the
# tasks that call the Kubernetes API (pipelines/eks.py `place`), found by the client through
# $MOERL_KUBE_TOKEN_DIR (`moerl.launch.watch.connect`). Every other task pod holds only the KFP run
# account's token, which may do nothing of moerl's (manifests/base/rbac.yaml).
LAUNCHER_TOKEN = "moerl-launcher-token"
LAUNCHER_TOKEN_ENV = "MOERL_KUBE_TOKEN_DIR"
# Stripped from a sandboxed task's environment whatever the config says, besides every variable a
# mapping can set and its `_FILE`: what a test process may hold that no pod is given (its own S3,
# MLflow, Valkey and cache-tier credentials). AWS_* comes back only as `service_account_env`.
SECRET_ENV_PREFIXES = (
    "AWS_",
    "MLFLOW_TRACKING_",
    "VALKEY_PASSWORD",
    "VALKEY_USERNAME",
    "VALKEY_ADMIN_",
    "MOERL_CACHE_TIER_",
)


def run_secret_name(run_id: str) -> str:
    """The Kubernetes Secret of run `run_id`'s Valkey user (a valid Secret and volume name for
    MLflow's 32-hex run ids: 42 characters)."""
    return RUN_SECRET.format(run_id=run_id)


def scaler_secret_name(run_id: str) -> str:
    """The Secret of run `run_id`'s scaler user (VALKEY_SCALER_*): read by KEDA's operator alone,
    never mounted in a pod, so a task that mounts the run's own Secret whole (KFP) never sees it."""
    return f"{run_secret_name(run_id)}-scaler"


def cache_tier_secret(key: str) -> str:
    """The Secret that holds cache-tier key `key`: one per identity (`WRITER_*` ->
    moerl-ckpt-cache-writer), because a KFP task mounts a whole Secret, and a reader's pod
    (rollout: where model-written code runs) must not find the writer's keys beside its own."""
    from moerl.store.tiers import CACHE_TIER_SECRET

    return f"{CACHE_TIER_SECRET}-{key.split('_', 1)[0].lower()}"


class SecretRef(NamedTuple):
    """One environment variable's source: key `key` of the Secret `secret`. `optional`: the pod
    starts without it when the Secret or key is missing (Kubernetes' `optional: true`)."""

    secret: str
    key: str
    optional: bool = False

    def path(self) -> str:
        """Where the pod finds this key: `SECRETS_ROOT/<secret>/<key>`. A run's own Secret is
        mounted under its template's stable name (`moerl-run`), whatever the run."""
        secret = "moerl-run" if self.secret == RUN_SECRET else self.secret
        return f"{SECRETS_ROOT}/{secret}/{self.key}"


def pod_secret_env(cfg: RunConfig, stage: str, async_mode: bool) -> dict[str, SecretRef]:
    """Credential variable -> its Secret and key, for `stage`'s pod in the sync (`async_mode`
    False) or async pipeline; in a stable order (MLflow, Valkey, the cache tier). The pod gets
    each as the file `ref.path()`, named by `<variable>_FILE` (`pod_secret_files`)."""
    from moerl.store.tiers import cache_tier_secret_env

    env: dict[str, SecretRef] = {}
    if stage in NO_CREDENTIAL_STAGES:
        return env
    mlflow = cfg.cluster.mlflow_secret
    if stage in MLFLOW_READER_STAGES and cfg.cluster.mlflow_reader_secret:
        mlflow = cfg.cluster.mlflow_reader_secret
    if mlflow:
        env |= {k: SecretRef(mlflow, k, optional=True) for k in MLFLOW_SECRET_KEYS}
    if async_mode and cfg.valkey.url:
        if stage in VALKEY_ADMIN_STAGES:
            if cfg.cluster.valkey_secret:
                env[VALKEY_ADMIN_KEY] = SecretRef(cfg.cluster.valkey_secret, VALKEY_ADMIN_KEY)
        else:  # the run's own user; required: a stage that cannot log in has nothing to do
            env |= {k: SecretRef(RUN_SECRET, k) for k in VALKEY_SECRET_KEYS}
    env |= {
        var: SecretRef(cache_tier_secret(key), key)
        for var, key in cache_tier_secret_env(cfg.checkpoint, stage).items()
    }
    return env


def pod_secret_files(cfg: RunConfig, stage: str, async_mode: bool) -> dict[str, str]:
    """`<variable>_FILE` -> the file's path, the environment `stage`'s pod gets instead of the
    credentials themselves."""
    return {
        file_var(var): ref.path() for var, ref in pod_secret_env(cfg, stage, async_mode).items()
    }


def pod_secret_mounts(
    cfg: RunConfig, stage: str, async_mode: bool
) -> dict[str, tuple[bool, list[str]]]:
    """Secret -> (optional, its keys `stage` reads), one volume each, mounted at
    `SECRETS_ROOT/<secret>` (`SecretRef.path`); `RUN_SECRET` stands for the run's own Secret."""
    mounts: dict[str, tuple[bool, list[str]]] = {}
    for ref in pod_secret_env(cfg, stage, async_mode).values():
        mounts.setdefault(ref.secret, (ref.optional, []))[1].append(ref.key)
    return mounts


# The launched stages that talk to Valkey (the async pipeline's GPU stages); the others are sync.
LAUNCHED_ASYNC_STAGES = frozenset({"async_trainer", "rollout_worker"})
# A launched pod's Secret files: readable by their owner (the kubelet's root) and, through the
# pod's fsGroup (moerl.launch.objects), by the stage's user; never by others.
LAUNCHED_SECRET_MODE = 0o400


def launched_secret_volumes(
    cfg: RunConfig, stage: str, run_id: str
) -> tuple[list[dict], list[dict]]:
    """The Secret volumes and their mounts of a pod that runs `stage` of run `run_id`, launched
    through the Kubernetes API: the same files as the compiled task's (`pod_secret_files`), but
    only the keys the stage reads (`items`), read-only, `defaultMode` 0400. The kubelet writes
    them root-owned and ORs the pod's fsGroup in as 0440, which is how a non-root stage reads
    them (a 0400 root-owned file it could not)."""
    volumes, mounts = [], []
    wanted = pod_secret_mounts(cfg, stage, stage in LAUNCHED_ASYNC_STAGES)
    for i, (secret, (optional, keys)) in enumerate(wanted.items()):
        name = run_secret_name(run_id) if secret == RUN_SECRET else secret
        mount = SecretRef(secret, "").path().rsplit("/", 1)[0]
        source: dict = {
            "secretName": name,
            "defaultMode": LAUNCHED_SECRET_MODE,
            "items": [{"key": k, "path": k, "mode": LAUNCHED_SECRET_MODE} for k in keys],
        }
        if optional:
            source["optional"] = True
        volumes.append({"name": f"moerl-secret-{i}", "secret": source})
        mounts.append({"name": f"moerl-secret-{i}", "mountPath": mount, "readOnly": True})
    return volumes, mounts


def launcher_token_dir() -> str:
    """Where a launching task finds the launcher's token, CA and namespace (its Secret volume)."""
    return f"{SECRETS_ROOT}/{LAUNCHER_TOKEN}"


def admitted_secret_keys() -> dict[str, list[str]]:
    """Stage label -> every `<secret>/<key>` a launched pod of that stage may mount, with every
    feature that adds keys on (Valkey, the cache tier, MLflow's Secret under its default name);
    the run's own Secret as `moerl-run`. What the admission policy moerl-launched-pods admits
    (manifests/base/launched-pods-policy.yaml holds it as a literal; a test compares the two)."""
    from moerl.config import parse_config

    cfg = parse_config(
        {
            "pipeline": {"mode": "async"},
            "valkey": {"url": "redis://valkey:6379/0", "username": "moerl"},
            "checkpoint": {
                "uri": "s3://b/p",
                "cache_tier": {"uri": "s3://c/p", "endpoint_url": "http://cache:8333"},
            },
        }
    )
    from moerl.launch.remote import STAGES

    out = {}
    for stage in sorted(STAGES):
        refs = pod_secret_env(cfg, stage, stage in LAUNCHED_ASYNC_STAGES).values()
        names = {f"{r.path().rsplit('/', 2)[1]}/{r.key}" for r in refs}
        out[stage.replace("_", "-")] = sorted(names)
    return out


def secret_bearing(name: str, cfg: RunConfig) -> bool:
    """Whether variable `name` may carry a credential: one a mapping can set for any stage of
    `cfg` (the cache tier's `credentials_env` may be renamed), or one of `SECRET_ENV_PREFIXES`."""
    ct = cfg.checkpoint.cache_tier.credentials_env
    # the path of a credential the test process holds as a file
    name = name.removesuffix(FILE_SUFFIX)
    return (
        name.startswith(SECRET_ENV_PREFIXES)
        or name in MLFLOW_SECRET_KEYS
        or name in VALKEY_SECRET_KEYS
        or name in VALKEY_SCALER_KEYS
        or name == VALKEY_ADMIN_KEY
        or name in (f"{ct}_ACCESS_KEY_ID", f"{ct}_SECRET_ACCESS_KEY")
    )


def sandbox_secret_env(
    path: Path,
    cfg: RunConfig,
    stage: str,
    async_mode: bool,
    environ: dict[str, str],
    files_dir: Path,
) -> dict[str, str]:
    """The environment a sandboxed task of `stage` runs with: `environ` without any
    secret-bearing variable, plus what its pod would get from the cluster's Secrets in `path`:
    each credential as a file written 0400 under `files_dir` (`<secret>/<key>`, as a pod's Secret
    volumes lay them out), named by `<VAR>_FILE`; never the value itself.

    `path` (written by the test harness, mode 0600): JSON `{"secrets": {secret: {key: value}},
    "service_account_env": {VAR: value}}`; the latter is what every task pod gets from the
    service account all KFP tasks share (IRSA: on EKS the pod identity webhook's AWS_ROLE_ARN and
    token file; here the test S3 server's keys). A required key that is missing raises, as the pod
    would not start (CreateContainerConfigError); an optional one is left out."""
    mode = path.stat().st_mode
    if mode & (stat.S_IRWXG | stat.S_IRWXO):
        raise RuntimeError(
            f"{SANDBOX_SECRETS_ENV}={path}: mode {stat.filemode(mode)} lets others read the cluster's "
            f"Secrets; chmod 600 {path}"
        )
    doc = json.loads(path.read_text())
    secrets, account = doc.get("secrets", {}), doc.get("service_account_env", {})
    env = {k: v for k, v in environ.items() if not secret_bearing(k, cfg)}
    env |= account
    for var, ref in pod_secret_env(cfg, stage, async_mode).items():
        value = secrets.get(ref.secret, {}).get(ref.key)
        if value is None:
            if ref.optional:
                continue
            raise RuntimeError(
                f"stage {stage}: its pod needs key {ref.key!r} of the Secret {ref.secret!r} for {var}, "
                f"which {path} does not hold; the pod would not start (CreateContainerConfigError): "
                "create the key (docs/eks.md)"
            )
        pod_path = Path(ref.path())
        env[file_var(var)] = str(
            write_secret_file(files_dir / pod_path.parent.name / pod_path.name, value)
        )
    return env


def apply_sandbox_secrets(
    stage: str | None, config_json: str | None, files_dir: Path | None = None
) -> None:
    """In a task sandboxed with `MOERL_SANDBOX_SECRETS`: replace this process's environment with
    `sandbox_secret_env`'s (its pod's credentials as files under `files_dir`, default a fresh
    temporary directory), and drop the variable (a pod knows none of the cluster's other
    Secrets, and neither may the processes this task starts). Nothing without the variable."""
    path = os.environ.get(SANDBOX_SECRETS_ENV)
    if not path:
        return
    if not stage or config_json is None:
        raise RuntimeError(
            f"{SANDBOX_SECRETS_ENV} is set, but this process did not say which stage it runs: call "
            "enter_pod(stage, config_json) with the component's name (the stage `place` mounts "
            "Secrets for) and its config"
        )
    from moerl.config import config_from_json

    cfg = config_from_json(config_json)
    # the pipeline `place` compiled it into: the async one for pipeline.mode async (GRPO only)
    async_mode = cfg.pipeline.mode == "async" and cfg.pipeline.kind == "grpo"
    if files_dir is None:
        import tempfile

        files_dir = Path(tempfile.mkdtemp(prefix="moerl-secrets-"))
    new = sandbox_secret_env(Path(path), cfg, stage, async_mode, dict(os.environ), files_dir)
    new.pop(SANDBOX_SECRETS_ENV, None)
    for k in [k for k in os.environ if k not in new]:
        del os.environ[k]
    os.environ.update(new)
