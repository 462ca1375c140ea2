"""A run's own Valkey identity on EKS: made when the run starts, deleted when it ends.

Design, details and limitations: docs/eks.md#moerllaunchrunsecretpy.
"""

from __future__ import annotations

import base64
import logging
import os
from typing import TYPE_CHECKING, Any

from moerl.bus.client import (
    ADMIN_PASSWORD_ENV,
    connect,
    create_run_user,
    create_scaler_user,
    delete_run_user,
    run_user,
)
from moerl.config import RunConfig
from moerl.errors import ConfigError, MoerlError
from moerl.launch.podsecrets import VALKEY_SCALER_KEYS, run_secret_name, scaler_secret_name
from moerl.secrets import read_secret

if TYPE_CHECKING:  # the kubernetes client only where a Secret is made or deleted
    from moerl.launch.watch import KubeApi

log = logging.getLogger(__name__)


def _admin(cfg: RunConfig):
    password = read_secret(ADMIN_PASSWORD_ENV)
    if not password:
        raise ConfigError(
            f"the run's own Valkey user needs the server's admin password: ${ADMIN_PASSWORD_ENV}_FILE "
            f"(key {ADMIN_PASSWORD_ENV} of the Secret cluster.valkey_secret, "
            f"{cfg.cluster.valkey_secret!r}) is not set or empty; create the key (docs/eks.md)"
        )
    # the server's default user is its admin (manifests/base/valkey.yaml)
    return connect(cfg.valkey.url, cfg.valkey.reconnect_s, username="default", password=password)


def run_secret_body(run_id: str, user: str, password: str) -> dict[str, Any]:
    """The run's Secret: the keys `moerl.launch.podsecrets` mounts (VALKEY_USERNAME,
    VALKEY_PASSWORD), labelled with the run so an operator can find one a failed close left."""
    return _secret(
        run_secret_name(run_id), run_id, {"VALKEY_USERNAME": user, "VALKEY_PASSWORD": password}
    )


def scaler_secret_body(run_id: str, user: str, password: str) -> dict[str, Any]:
    """The run's scaler Secret (VALKEY_SCALER_*: the user KEDA's trigger reads the units stream
    as, `create_scaler_user`): its own Secret, because a KFP task mounts the run's whole."""
    return _secret(
        scaler_secret_name(run_id), run_id, dict(zip(VALKEY_SCALER_KEYS, (user, password)))
    )


def _secret(name: str, run_id: str, data: dict[str, str]) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "type": "Opaque",
        "metadata": {
            "name": name,
            "labels": {
                "app.kubernetes.io/part-of": "moerl",
                "app.kubernetes.io/managed-by": "moerl",
                "moerl.ai/run-id": run_id[:63],
            },
        },
        "data": {k: base64.b64encode(v.encode()).decode() for k, v in data.items()},
    }


def _keda(cfg: RunConfig) -> bool:
    """Whether the run has a scaler user and Secret (an elastic fleet that KEDA scales)."""
    return cfg.rollout.elastic and cfg.cluster.launch.fleet_scaler == "keda"


def namespaces(cfg: RunConfig) -> list[str]:
    """Where the run's pods run: the task's own namespace, and `cluster.launch.namespace` for
    launched pods when it is another (a Secret is mounted only in its own namespace)."""
    from moerl.launch.watch import own_namespace

    own = own_namespace()
    if not own:
        raise ConfigError(
            "cannot tell this task's namespace ($MOERL_POD_NAMESPACE, set by pipelines/eks.py, and the "
            "service account's namespace file are both missing): the run's Secret goes there"
        )
    found = [own]
    la = cfg.cluster.launch
    if la.mode == "kubernetes" and la.namespace and la.namespace != own:
        found.append(la.namespace)
    return found


def _api() -> KubeApi:
    from moerl.launch.watch import connect as kube_connect

    return kube_connect()


def open_run_identity(cfg: RunConfig, run_id: str, api: KubeApi | None = None) -> str:
    """Create run `run_id`'s Valkey user and its Secret (replaced if a retried first task made
    one); returns the Secret's name, which the run's tasks mount."""
    from kubernetes.client.exceptions import ApiException

    from moerl.launch.watch import short_error

    admin = _admin(cfg)
    bodies = [run_secret_body(run_id, *create_run_user(admin, run_id))]
    if _keda(cfg):  # an elastic fleet's scaler: read-only on the units stream (KEDA's trigger)
        bodies.append(scaler_secret_body(run_id, *create_scaler_user(admin, run_id)))
    api = api or _api()
    for ns in namespaces(cfg):
        for body in bodies:
            name = body["metadata"]["name"]
            try:
                api.core.create_namespaced_secret(ns, body)
            except ApiException as err:
                if err.status != 409:
                    raise MoerlError(
                        f"creating the run's Secret {ns}/{name}: {short_error(err)}; the launcher "
                        "account needs create on secrets (Role moerl-launcher, "
                        "manifests/base/rbac.yaml)"
                    ) from err
                # a retried start_run: the new password
                api.core.replace_namespaced_secret(name, ns, body)
    log.info("run %s: Valkey user %s, Secrets %s", run_id, run_user(run_id), len(bodies))
    return run_secret_name(run_id)


def close_run_identity(cfg: RunConfig, run_id: str, api: KubeApi | None = None) -> list[str]:
    """Delete run `run_id`'s Valkey user and Secret(s), whichever exist; returns what was
    deleted. Raises MoerlError, after trying both, if either could not be deleted."""
    from kubernetes.client.exceptions import ApiException

    from moerl.launch.watch import short_error

    done: list[str] = []
    problems: list[str] = []
    try:
        if delete_run_user(_admin(cfg), run_id):
            done.append(f"Valkey user {run_user(run_id)}")
    except MoerlError as err:
        problems.append(f"deleting Valkey user {run_user(run_id)}: {err}")
    names = [run_secret_name(run_id)] + ([scaler_secret_name(run_id)] if _keda(cfg) else [])
    try:
        api = api or _api()
        for ns in namespaces(cfg):
            for name in names:
                try:
                    api.core.delete_namespaced_secret(name, ns)
                    done.append(f"Secret {ns}/{name}")
                except ApiException as err:
                    if err.status != 404:
                        problems.append(f"deleting Secret {ns}/{name}: {short_error(err)}")
    except MoerlError as err:
        problems.append(f"deleting Secret {names[0]}: {err}")
    if problems:
        raise MoerlError(
            f"closing run {run_id}'s Valkey identity: "
            + "; ".join(problems)
            + (f" (deleted {', '.join(done)})" if done else "")
        )
    return done


def uses_run_identity(cfg: RunConfig, target: str) -> bool:
    """Whether a run of `cfg` compiled for `target` has its own Valkey user: the async pipeline
    on EKS (locally, `moerl run --mode async` makes one in its embedded server)."""
    return (
        target == "eks"
        and cfg.pipeline.mode == "async"
        and cfg.pipeline.kind == "grpo"
        and cfg.valkey.url is not None
    )


def holds_admin() -> bool:
    """Whether this task's pod was given the admin password's file (the EKS exit task's sign
    that the run made an identity to delete; `moerl.launch.podsecrets.VALKEY_ADMIN_STAGES`)."""
    return bool(os.environ.get(ADMIN_PASSWORD_ENV + "_FILE"))
