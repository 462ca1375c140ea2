"""Which Kubernetes Secret keys reach a stage's pod, as which environment variables: one mapping,
read by everything that needs it.

- `pipelines/eks.py` `place` mounts exactly these into each compiled task
  (`kubernetes.use_secret_as_env`), and `moerl.launch.task.launch_env` into the pods a launcher
  task starts (`cluster.launch.mode: kubernetes`).
- `moerl.launch.podenv.enter_pod` gives a cluster-shaped local task exactly these, and nothing
  else, when a test names the cluster's Secrets in `MOERL_SANDBOX_SECRETS` (`sandbox_secret_env`):
  a stage that reads a credential its pod would not get then fails on this machine as it would on
  EKS, instead of borrowing whatever the test process held. (That is how `start_run` came to have
  no cache-tier keys on EKS while the local cluster test passed: issue 35.)

The Secrets: `cluster.mlflow_secret` (MLflow's basic-auth user and password, every task,
optional: a server without auth needs none), `cluster.valkey_secret` (the async pipeline's
Valkey password, optional likewise), and `moerl-ckpt-cache` (the cache server's writer or reader
keys, by what the stage does: `moerl.store.tiers.cache_tier_secret_env`; required, so a
missing key stops the pod before it runs rather than sending it to IRSA, which the cache server
refuses). S3 itself is not a Secret: every pod reaches the durable store through its service
account's IAM role (IRSA), which the harness stands in for with `service_account_env`.
"""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path
from typing import TYPE_CHECKING, NamedTuple

if TYPE_CHECKING:
    from moerl.config import RunConfig

MLFLOW_SECRET_KEYS = ("MLFLOW_TRACKING_USERNAME", "MLFLOW_TRACKING_PASSWORD")
VALKEY_SECRET_KEYS = ("VALKEY_PASSWORD",)
SANDBOX_SECRETS_ENV = "MOERL_SANDBOX_SECRETS"
# Stripped from a sandboxed task's environment whatever the config says, besides every variable a
# mapping can set: what a test process may hold that no pod is given (its own S3, MLflow, Valkey
# and cache-tier credentials). AWS_* comes back only as `service_account_env` (IRSA's stand-in).
SECRET_ENV_PREFIXES = ("AWS_", "MLFLOW_TRACKING_", "VALKEY_PASSWORD", "MOERL_CACHE_TIER_")


class SecretRef(NamedTuple):
    """One environment variable's source: key `key` of the Secret `secret`. `optional`: the pod
    starts without it when the Secret or key is missing (Kubernetes' `optional: true`)."""

    secret: str
    key: str
    optional: bool = False


def pod_secret_env(cfg: RunConfig, stage: str, async_mode: bool) -> dict[str, SecretRef]:
    """Environment variable -> its Secret and key, for `stage`'s pod in the sync (`async_mode`
    False) or async pipeline; in a stable order (MLflow, Valkey, the cache tier)."""
    from moerl.store.tiers import CACHE_TIER_SECRET, cache_tier_secret_env

    env: dict[str, SecretRef] = {}
    if cfg.cluster.mlflow_secret:
        env |= {k: SecretRef(cfg.cluster.mlflow_secret, k, optional=True) for k in MLFLOW_SECRET_KEYS}
    if async_mode and cfg.cluster.valkey_secret:
        env |= {k: SecretRef(cfg.cluster.valkey_secret, k, optional=True) for k in VALKEY_SECRET_KEYS}
    env |= {var: SecretRef(CACHE_TIER_SECRET, key) for var, key in cache_tier_secret_env(cfg.checkpoint, stage).items()}
    return env


def secret_bearing(name: str, cfg: RunConfig) -> bool:
    """Whether variable `name` may carry a credential: one a mapping can set for any stage of
    `cfg` (the cache tier's `credentials_env` may be renamed), or one of `SECRET_ENV_PREFIXES`."""
    ct = cfg.checkpoint.cache_tier.credentials_env
    return (name.startswith(SECRET_ENV_PREFIXES) or name in MLFLOW_SECRET_KEYS or name in VALKEY_SECRET_KEYS
            or name in (f"{ct}_ACCESS_KEY_ID", f"{ct}_SECRET_ACCESS_KEY"))


def sandbox_secret_env(path: Path, cfg: RunConfig, stage: str, async_mode: bool,
                       environ: dict[str, str]) -> dict[str, str]:
    """The environment a sandboxed task of `stage` runs with: `environ` without any
    secret-bearing variable, plus what its pod would get from the cluster's Secrets in `path`.

    `path` (written by the test harness, mode 0600): JSON `{"secrets": {secret: {key: value}},
    "service_account_env": {VAR: value}}`; the latter is what every task pod gets from the
    service account all KFP tasks share (IRSA: on EKS the pod identity webhook's AWS_ROLE_ARN and
    token file; here the test S3 server's keys). A required key that is missing raises, as the pod
    would not start (CreateContainerConfigError); an optional one is left out."""
    mode = path.stat().st_mode
    if mode & (stat.S_IRWXG | stat.S_IRWXO):
        raise RuntimeError(f"{SANDBOX_SECRETS_ENV}={path}: mode {stat.filemode(mode)} lets others read the cluster's "
                           f"Secrets; chmod 600 {path}")
    doc = json.loads(path.read_text())
    secrets, account = doc.get("secrets", {}), doc.get("service_account_env", {})
    env = {k: v for k, v in environ.items() if not secret_bearing(k, cfg)}
    env |= account
    for var, ref in pod_secret_env(cfg, stage, async_mode).items():
        value = secrets.get(ref.secret, {}).get(ref.key)
        if value is None:
            if ref.optional:
                continue
            raise RuntimeError(f"stage {stage}: its pod needs key {ref.key!r} of the Secret {ref.secret!r} for {var}, "
                               f"which {path} does not hold; the pod would not start (CreateContainerConfigError): "
                               "create the key (docs/deploy.md)")
        env[var] = value
    return env


def apply_sandbox_secrets(stage: str | None, config_json: str | None) -> None:
    """In a task sandboxed with `MOERL_SANDBOX_SECRETS`: replace this process's environment with
    `sandbox_secret_env`'s, and drop the variable (a pod knows none of the cluster's other
    Secrets, and neither may the processes this task starts). Nothing without the variable."""
    path = os.environ.get(SANDBOX_SECRETS_ENV)
    if not path:
        return
    if not stage or config_json is None:
        raise RuntimeError(f"{SANDBOX_SECRETS_ENV} is set, but this process did not say which stage it runs: call "
                           "enter_pod(stage, config_json) with the component's name (the stage `place` mounts "
                           "Secrets for) and its config")
    from moerl.config import config_from_json

    cfg = config_from_json(config_json)
    # the pipeline `place` compiled it into: the async one for pipeline.mode async (GRPO only)
    async_mode = cfg.pipeline.mode == "async" and cfg.pipeline.kind == "grpo"
    new = sandbox_secret_env(Path(path), cfg, stage, async_mode, dict(os.environ))
    new.pop(SANDBOX_SECRETS_ENV, None)
    for k in [k for k in os.environ if k not in new]:
        del os.environ[k]
    os.environ.update(new)


def write_sandbox_secrets(path: Path, secrets: dict[str, dict[str, str]],
                          service_account_env: dict[str, str] | None = None) -> Path:
    """Write the file `sandbox_secret_env` reads, created 0600 (never readable by others, even
    for an instant)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        json.dump({"secrets": secrets, "service_account_env": service_account_env or {}}, f)
    return path
