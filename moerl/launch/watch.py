"""Create launched workloads through the Kubernetes API, watch them to the end, delete them.

Design, details and limitations: docs/launch.md#moerllaunchwatchpy.
"""

from __future__ import annotations

import json
import logging
import os
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kubernetes.client.exceptions import ApiException

from moerl.errors import MoerlError
from moerl.launch import procs
from moerl.launch.objects import JOBSET_API, LABEL_WORKLOAD, TRAINJOB_API, jobset_owner
from moerl.launch.state import State, condition_state, container_failure, pod_state, pods_state

log = logging.getLogger(__name__)

SA_NAMESPACE = "/var/run/secrets/kubernetes.io/serviceaccount/namespace"
# Set on a launcher task by pipelines/eks.py (downward API): KFP itself gives its executor
# container only KFP_POD_NAME and KFP_POD_UID.
ENV_POD_NAMESPACE, ENV_SERVICE_ACCOUNT = "MOERL_POD_NAMESPACE", "MOERL_SERVICE_ACCOUNT"
MAX_API_ERRORS = 5  # consecutive failed polls (API server restarts, throttling) before giving up
# A workload none of whose pods has left phase Pending this long after its creation fails
# (unschedulable, stuck in ContainerCreating, or no pods at all).
PENDING_TIMEOUT_S = 1800.0
DELETE_TRIES, DELETE_BACKOFF_S = 5, 2.0  # waits of 2, 4, 8, 16 s between the tries: 30 s


class LaunchError(MoerlError):
    """A workload launched through the Kubernetes API could not run to success."""


class WorkloadFailed(LaunchError):
    """The workload ended in failure."""


class WorkloadPending(WorkloadFailed):
    """No pod of the workload started running within the pending timeout."""


class WorkloadDeleted(LaunchError):
    """The workload was deleted while it was being watched (by a person, a drain, the GC)."""


class WorkloadTimeout(LaunchError):
    """The workload did not finish within the task's timeout."""


class LaunchInterrupted(LaunchError):
    """The task got SIGTERM; everything it launched was deleted."""


@dataclass
class KubeApi:
    """The two API groups the launcher uses (kubernetes.client objects, or test doubles)."""

    core: Any  # kubernetes.client.CoreV1Api
    custom: Any  # kubernetes.client.CustomObjectsApi
    networking: Any = None  # kubernetes.client.NetworkingV1Api; None: on custom's ApiClient
    apps_v1: Any = None  # kubernetes.client.AppsV1Api; None: on custom's ApiClient
    rbac_v1: Any = None  # kubernetes.client.RbacAuthorizationV1Api; None: likewise

    @classmethod
    def from_client(cls, api_client: Any) -> KubeApi:
        from kubernetes import client

        return cls(
            client.CoreV1Api(api_client),
            client.CustomObjectsApi(api_client),
            client.NetworkingV1Api(api_client),
        )

    def network(self) -> Any:
        """The networking.k8s.io/v1 API (NetworkPolicies)."""
        if self.networking is None:
            from kubernetes import client

            self.networking = client.NetworkingV1Api(self.custom.api_client)
        return self.networking

    def apps(self) -> Any:
        """The apps/v1 API (an elastic run's fleet Deployment)."""
        if self.apps_v1 is None:
            from kubernetes import client

            self.apps_v1 = client.AppsV1Api(self.custom.api_client)
        return self.apps_v1

    def rbac(self) -> Any:
        """The rbac.authorization.k8s.io/v1 API (a fleet's per-run Role and RoleBinding)."""
        if self.rbac_v1 is None:
            from kubernetes import client

            self.rbac_v1 = client.RbacAuthorizationV1Api(self.custom.api_client)
        return self.rbac_v1


def connect() -> KubeApi:
    """The launcher's token (`moerl.launch.podsecrets.LAUNCHER_TOKEN_ENV`), else in-cluster
    config (the pod's own account), else kubeconfig."""
    from kubernetes import client, config

    from moerl.launch.podsecrets import LAUNCHER_TOKEN_ENV

    try:
        if token_dir := os.environ.get(LAUNCHER_TOKEN_ENV):
            config.incluster_config.InClusterConfigLoader(
                token_filename=f"{token_dir}/token", cert_filename=f"{token_dir}/ca.crt"
            ).load_and_set()
        else:
            config.load_incluster_config()
    except config.ConfigException:
        try:
            config.load_kube_config()
        except (config.ConfigException, OSError) as e:
            raise LaunchError(
                f"no Kubernetes API access: not in a cluster and no usable kubeconfig ({e}); "
                "cluster.launch.mode kubernetes runs inside a KFP task"
            ) from e
    return KubeApi(client.CoreV1Api(), client.CustomObjectsApi(), client.NetworkingV1Api())


def resolve_namespace(configured: str | None, sa_file: str = SA_NAMESPACE) -> str:
    """`cluster.launch.namespace`, else the namespace of the task's own pod."""
    if configured:
        return configured
    try:
        ns = Path(sa_file).read_text().strip()
    except OSError as e:
        raise LaunchError(
            f"cannot tell the task's namespace ({sa_file}: {e.strerror}); "
            "set cluster.launch.namespace"
        ) from e
    if not ns:
        raise LaunchError(f"{sa_file} is empty; set cluster.launch.namespace")
    return ns


def own_namespace(env: Mapping[str, str] | None = None, sa_file: str = SA_NAMESPACE) -> str | None:
    """The task pod's namespace: $MOERL_POD_NAMESPACE, else its service account's namespace
    file (a pod's service account is always in the pod's namespace); None outside a pod."""
    environ = os.environ if env is None else env
    if environ.get(ENV_POD_NAMESPACE):
        return environ[ENV_POD_NAMESPACE]
    try:
        return Path(sa_file).read_text().strip() or None
    except OSError:
        return None


def own_pod_owner(
    namespace: str, env: Mapping[str, str] | None = None, sa_file: str = SA_NAMESPACE
) -> dict[str, Any] | None:
    """An ownerReference to the KFP task's own pod (KFP_POD_NAME / KFP_POD_UID, which KFP sets
    in every executor container), if the workload lives in that pod's namespace (`own_namespace`):
    owner references never cross namespaces."""
    environ = os.environ if env is None else env
    name, uid = environ.get("KFP_POD_NAME"), environ.get("KFP_POD_UID")
    if not (name and uid and own_namespace(environ, sa_file) == namespace):
        return None
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "name": name,
        "uid": uid,
        "blockOwnerDeletion": False,
        "controller": False,
    }


def _api_status(e: BaseException) -> int | None:
    """The HTTP status of a failed API call; None when the server never answered."""
    return e.status if isinstance(e, ApiException) else None


def _retryable(e: BaseException) -> bool:
    """Worth another try: no answer, a server error, a conflict, throttling. Not 403 and the like."""
    status = _api_status(e)
    return status is None or status >= 500 or status in (409, 429)


class Workload(ABC):
    """One object the launcher creates, reads and deletes."""

    kind: str

    def __init__(self, api: KubeApi, namespace: str, body: dict[str, Any]) -> None:
        self.api, self.namespace, self.body = api, namespace, body
        self.name: str = body["metadata"]["name"]
        self._pull_errors: dict[str, float] = {}  # pod name -> when its image pull first failed

    def __str__(self) -> str:
        return f"{self.kind} {self.namespace}/{self.name}"

    @abstractmethod
    def create(self) -> None: ...
    @abstractmethod
    def read(self) -> dict[str, Any]: ...  # raises ApiException (404 when gone)
    @abstractmethod
    def _delete(self) -> None: ...
    @abstractmethod
    def poll(self, now: float) -> State: ...  # read it (and its pods); raises as `read`

    def delete(self) -> bool:
        """Delete in the background; False when it was already gone."""
        try:
            self._delete()
        except Exception as e:
            if _api_status(e) == 404:
                return False
            raise
        return True

    def pods(self) -> list[dict[str, Any]]:
        """The pods labelled with this workload's name (a TrainJob's or JobSet's)."""
        resp = self.api.core.list_namespaced_pod(
            self.namespace, label_selector=f"{LABEL_WORKLOAD}={self.name}", _preload_content=False
        )
        return json.loads(resp.data).get("items", [])


class PodWorkload(Workload):
    kind = "Pod"

    def create(self) -> None:
        self.api.core.create_namespaced_pod(self.namespace, self.body, _preload_content=False)

    def read(self) -> dict[str, Any]:
        return json.loads(
            self.api.core.read_namespaced_pod(
                self.name, self.namespace, _preload_content=False
            ).data
        )

    def _delete(self) -> None:
        self.api.core.delete_namespaced_pod(
            self.name, self.namespace, propagation_policy="Background", _preload_content=False
        )

    def poll(self, now: float) -> State:
        return pod_state(self.read(), now, self._pull_errors)


class CustomWorkload(Workload):
    """A namespaced custom resource whose conditions say how it ended, and whose pods say
    whether it can start."""

    api_ref: tuple[str, str, str]  # group, version, plural
    success: str

    def create(self) -> None:
        g, v, p = self.api_ref
        self.api.custom.create_namespaced_custom_object(
            g, v, self.namespace, p, self.body, _preload_content=False
        )

    def read(self) -> dict[str, Any]:
        g, v, p = self.api_ref
        return json.loads(
            self.api.custom.get_namespaced_custom_object(
                g, v, self.namespace, p, self.name, _preload_content=False
            ).data
        )

    def _delete(self) -> None:
        g, v, p = self.api_ref
        self.api.custom.delete_namespaced_custom_object(
            g,
            v,
            self.namespace,
            p,
            self.name,
            propagation_policy="Background",
            _preload_content=False,
        )

    def poll(self, now: float) -> State:
        cond = condition_state(self.read(), self.success)
        if cond.failed:
            detail = self._explain()
            return State(
                failed=cond.failed + (f" ({detail})" if detail else ""),
                summary=cond.summary,
                started=True,
            )
        if cond.done:
            return cond
        pods = pods_state(self.pods(), now, self._pull_errors)
        return State(
            failed=pods.failed, summary=f"{cond.summary}; {pods.summary}", started=pods.started
        )

    def _explain(self) -> str:
        """Why it failed, from its failed pods; '' when unknown."""
        try:
            items = self.pods()
        except Exception as e:  # noqa: BLE001 (an explanation is best effort; the failure is already known)
            log.warning("could not list the pods of %s: %s", self, e)
            return ""
        found = [
            f"pod {p['metadata']['name']}: {why}" for p in items if (why := container_failure(p))
        ]
        return "; ".join(found[:3])


class TrainJobWorkload(CustomWorkload):
    kind, api_ref, success = "TrainJob", TRAINJOB_API, "Complete"


class JobSetWorkload(CustomWorkload):
    """A JobSet, and the NetworkPolicies it owns (`owned`: a rollout group's,
    `objects.rollout_group_policy`), created right after it with an ownerReference to it: the
    garbage collector deletes them with the JobSet, so the cleanup deletes only the JobSet."""

    kind, api_ref, success = "JobSet", JOBSET_API, "Completed"

    def __init__(
        self,
        api: KubeApi,
        namespace: str,
        body: dict[str, Any],
        owned: list[dict[str, Any]] | None = None,
    ) -> None:
        super().__init__(api, namespace, body)
        self.owned = list(owned or [])

    def create(self) -> None:
        g, v, p = self.api_ref
        resp = self.api.custom.create_namespaced_custom_object(
            g, v, self.namespace, p, self.body, _preload_content=False
        )
        if not self.owned:
            return
        # from here on the JobSet exists: a failure is a LaunchError (not an ApiException), so
        # the launcher keeps it among what it created and deletes it
        try:
            uid = json.loads(resp.data)["metadata"]["uid"]
        except (ValueError, KeyError, TypeError, AttributeError) as e:
            raise LaunchError(
                f"created {self} but its create response carries no metadata.uid ({e!r}); "
                "cannot own its NetworkPolicy"
            ) from None
        for obj in self.owned:
            body = {
                **obj,
                "metadata": {
                    **obj["metadata"],
                    "ownerReferences": [jobset_owner(self.name, uid)],
                },
            }
            what = f"{obj['kind']} {self.namespace}/{obj['metadata']['name']}"
            log.info("creating %s, owned by %s", what, self)
            try:
                self.api.network().create_namespaced_network_policy(
                    self.namespace, body, _preload_content=False
                )
            except ApiException as e:
                hint = (
                    f"; the task's service account needs create on networkpolicies.networking.k8s.io "
                    f"in {self.namespace} (manifests/base/rbac.yaml)"
                    if e.status == 403
                    else ""
                )
                raise LaunchError(
                    f"creating {what} for {self} failed: {short_error(e)}{hint}"
                ) from None


class DeploymentWorkload(Workload):
    """An elastic run's rollout fleet (`moerl.launch.fleet`): the Deployment, then what it owns
    (`owned`: the per-run Role and RoleBinding, KEDA's TriggerAuthentication and ScaledObject),
    created with an ownerReference to it, so deleting the Deployment deletes them. A fleet never
    ends: the launcher creates it beside the trainer (`Launcher.run`'s `companions`) and deletes
    it at cleanup. KEDA's API missing (404): its objects are left out, and the trainer's
    controller sizes the fleet through the per-run Role."""

    kind = "Deployment"

    def __init__(
        self,
        api: KubeApi,
        namespace: str,
        body: dict[str, Any],
        owned: list[dict[str, Any]] | None = None,
    ) -> None:
        super().__init__(api, namespace, body)
        self.owned = list(owned or [])
        self.keda: bool | None = None  # whether KEDA's objects were created; None: none asked

    def create(self) -> None:
        from moerl.launch.fleet import deployment_owner

        resp = self.api.apps().create_namespaced_deployment(
            self.namespace, self.body, _preload_content=False
        )
        if not self.owned:
            return
        try:  # from here on it exists: a LaunchError keeps it among what the launcher deletes
            uid = json.loads(resp.data)["metadata"]["uid"]
        except (ValueError, KeyError, TypeError, AttributeError) as e:
            raise LaunchError(
                f"created {self} but its create response carries no metadata.uid ({e!r})"
            ) from None
        for obj in self.owned:
            meta = {**obj["metadata"], "ownerReferences": [deployment_owner(self.name, uid)]}
            self._create_owned({**obj, "metadata": meta})

    def _create_owned(self, body: dict[str, Any]) -> None:
        from moerl.launch.fleet import SCALEDOBJECT_API, TRIGGERAUTH_API

        kind, keda = (
            body["kind"],
            {"TriggerAuthentication": TRIGGERAUTH_API, "ScaledObject": SCALEDOBJECT_API},
        )
        what = f"{kind} {self.namespace}/{body['metadata']['name']}"
        log.info("creating %s, owned by %s", what, self)
        try:
            if kind == "Role":
                self.api.rbac().create_namespaced_role(self.namespace, body, _preload_content=False)
            elif kind == "RoleBinding":
                self.api.rbac().create_namespaced_role_binding(
                    self.namespace, body, _preload_content=False
                )
            elif kind in keda:
                if self.keda is False:
                    return
                g, v, p = keda[kind]
                self.api.custom.create_namespaced_custom_object(
                    g, v, self.namespace, p, body, _preload_content=False
                )
                self.keda = True
            else:
                raise LaunchError(f"{self} owns no {kind}")
        except ApiException as e:
            if e.status == 404 and kind in keda:
                log.warning(
                    "%s: KEDA's API (keda.sh/v1alpha1) is not installed; the trainer's controller "
                    "sizes the fleet through its per-run Role (docs/eks.md)",
                    self,
                )
                self.keda = False
                return
            hint = (
                f"; the task's service account needs create on {kind}s in {self.namespace} "
                "(manifests/base/rbac.yaml)"
                if e.status == 403
                else ""
            )
            raise LaunchError(
                f"creating {what} for {self} failed: {short_error(e)}{hint}"
            ) from None

    def read(self) -> dict[str, Any]:
        return json.loads(
            self.api.apps()
            .read_namespaced_deployment(self.name, self.namespace, _preload_content=False)
            .data
        )

    def _delete(self) -> None:
        self.api.apps().delete_namespaced_deployment(
            self.name, self.namespace, propagation_policy="Background", _preload_content=False
        )

    def poll(self, now: float) -> State:
        status = self.read().get("status") or {}
        ready, want = status.get("readyReplicas", 0), status.get("replicas", 0)
        return State(summary=f"{ready}/{want} fleet pods ready", started=bool(ready))


KINDS: dict[str, type[Workload]] = {
    "Pod": PodWorkload,
    "TrainJob": TrainJobWorkload,
    "JobSet": JobSetWorkload,
    "Deployment": DeploymentWorkload,
}


def workload(
    api: KubeApi,
    namespace: str,
    body: dict[str, Any],
    owned: list[dict[str, Any]] | None = None,
) -> Workload:
    """The `Workload` for `body`; `owned`: NetworkPolicies a JobSet owns (`JobSetWorkload`), or
    what a fleet's Deployment owns (`DeploymentWorkload`)."""
    if body["kind"] == "Deployment":
        return DeploymentWorkload(api, namespace, body, owned)
    if owned:
        if body["kind"] != "JobSet":
            raise ValueError(f"only a JobSet owns objects here, not a {body['kind']}")
        return JobSetWorkload(api, namespace, body, owned)
    return KINDS[body["kind"]](api, namespace, body)


def delete_retrying(w: Workload, sleep: Callable[[float], None] = time.sleep) -> bool:
    """`w.delete()`, retried while the failure may pass (`_retryable`), `DELETE_TRIES` times
    with doubling waits from `DELETE_BACKOFF_S`. True: deleted; False: already gone. Raises the
    last error when it gives up."""
    delay = DELETE_BACKOFF_S
    for attempt in range(1, DELETE_TRIES + 1):
        try:
            return w.delete()
        except procs.Terminated:
            raise
        except Exception as e:
            if attempt == DELETE_TRIES or not _retryable(e):
                raise
            log.warning(
                "deleting %s failed (%d/%d), retrying in %g s: %s",
                w,
                attempt,
                DELETE_TRIES,
                delay,
                short_error(e),
            )
        sleep(delay)
        delay *= 2
    raise AssertionError("unreachable: the last try returns or raises")


class Launcher:
    """Creates, watches and deletes workloads; see the module docstring."""

    def __init__(
        self,
        poll_s: float,
        timeout_s: float,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], None] = time.sleep,
        pending_timeout_s: float = PENDING_TIMEOUT_S,
    ) -> None:
        self.poll_s, self.timeout_s, self.clock, self.sleep = poll_s, timeout_s, clock, sleep
        self.pending_timeout_s = pending_timeout_s
        self.created: list[Workload] = []
        self._created_at: dict[int, float] = {}
        # had a pod out of Pending once (its pods may go away later)
        self._started: set[int] = set()
        self._deleted: set[int] = set()

    def run(self, workloads: list[Workload], companions: list[Workload] | None = None) -> None:
        """Create `workloads`, then `companions` (an elastic run's fleet beside its trainer),
        watch `workloads` to their end, and delete everything created, whatever happened."""
        with procs.sigterm_raises():
            try:
                try:
                    # 1. create; a failure here still deletes what was created (the `finally`)
                    for w in [*workloads, *(companions or [])]:
                        self._create(w)
                    # 2. watch
                    self._watch(list(workloads))
                finally:
                    # 3. delete, whatever happened
                    self.cleanup()
            except procs.Terminated:
                raise LaunchInterrupted(
                    f"received SIGTERM while running {_names(workloads)}; deleted what was launched"
                ) from None

    def _create(self, w: Workload) -> None:
        log.info("creating %s", w)
        self.created.append(w)  # before the call: an interrupted create may have succeeded
        try:
            w.create()
        except ApiException as e:
            self.created.pop()  # the server answered: nothing was created
            hint = {
                403: f"; the task's service account needs create/get/delete on {w.kind}s in {w.namespace}",
                404: f"; is the {w.kind} API installed on the cluster (Kubeflow Trainer v2 for TrainJob, "
                "JobSet for JobSet) and the namespace there?",
            }.get(e.status, "")
            raise LaunchError(f"creating {w} failed: {short_error(e)}{hint}") from None
        self._created_at[id(w)] = self.clock()

    def cleanup(self) -> None:
        """Delete every created object not yet deleted (`delete_retrying`). A SIGTERM meanwhile
        does not cut it short (the delete starts over, later SIGTERMs are ignored); it is
        re-raised at the end."""
        interrupted: procs.Terminated | None = None
        for w in self.created:
            while id(w) not in self._deleted:
                try:
                    existed = delete_retrying(w, self.sleep)
                except procs.Terminated as t:
                    interrupted = t
                    continue
                except Exception as e:  # noqa: BLE001 (keep deleting the others; the owner reference is the backstop)
                    log.warning(
                        "could not delete %s: %s; delete it by hand (kubectl delete %s -n %s %s)",
                        w,
                        short_error(e),
                        w.kind.lower(),
                        w.namespace,
                        w.name,
                    )
                    break
                self._deleted.add(id(w))
                log.info("deleted %s" if existed else "%s was already gone", w)
        if interrupted is not None:
            raise interrupted

    def _watch(self, pending: list[Workload]) -> None:
        deadline, errors = self.clock() + self.timeout_s, 0
        last: dict[str, str] = {}  # each workload's last summary, logged when it changes
        while pending:
            for w in list(pending):
                try:
                    st = w.poll(self.clock())
                except procs.Terminated:
                    raise
                except Exception as e:
                    if _api_status(e) == 404:
                        raise WorkloadDeleted(
                            f"{w} was deleted while it ran (last state: "
                            f"{last.get(w.name, 'unknown')})"
                        ) from None
                    errors += 1
                    if errors >= MAX_API_ERRORS:
                        raise LaunchError(
                            f"cannot read {w} ({MAX_API_ERRORS} tries in a row): {short_error(e)}"
                        ) from e
                    log.warning(
                        "reading %s failed (%d/%d): %s", w, errors, MAX_API_ERRORS, short_error(e)
                    )
                    continue
                errors = 0
                if st.summary != last.get(w.name):
                    log.info("%s: %s", w, st.summary)
                last[w.name] = st.summary
                if st.failed:
                    raise WorkloadFailed(f"{w} failed: {st.failed}")
                if st.done:
                    pending.remove(w)
                    continue
                if st.started:
                    self._started.add(id(w))
                waited = self.clock() - self._created_at.get(id(w), self.clock())
                if id(w) not in self._started and waited >= self.pending_timeout_s:
                    raise WorkloadPending(
                        f"{w} failed: pending for {waited:.0f} s, no pod started running "
                        f"(last state: {st.summary}); deleted it"
                    )
            if not pending:
                return
            if self.clock() >= deadline:
                states = "; ".join(f"{w.name}: {last.get(w.name, 'unknown')}" for w in pending)
                raise WorkloadTimeout(
                    f"{_names(pending)} did not finish within {self.timeout_s:g} s "
                    f"(last state: {states}); deleted it"
                )
            self.sleep(self.poll_s)


def _names(ws: list[Workload]) -> str:
    return ", ".join(str(w) for w in ws)


def short_error(e: BaseException) -> str:
    """One line about a failed call: HTTP status, reason and the API server's message."""
    if isinstance(e, ApiException):
        try:
            message = json.loads(e.body or "{}").get("message", "")
        except (ValueError, AttributeError):
            message = ""
        return f"HTTP {e.status} {e.reason or ''}".strip() + (
            f": {message[:500]}" if message else ""
        )
    return f"{type(e).__name__}: {e}"[:300]
