"""Create launched workloads through the Kubernetes API, watch them to the end, delete them.

`Launcher.run(workloads)`: (1) create each object; if one create fails, delete those already
created and raise; (2) poll every `cluster.launch.poll_s` until all have succeeded, one has
failed, one has disappeared (deleted under us: HTTP 404), or the timeout passes; (3) on every
way out (success, failure, exception, or SIGTERM to the task, turned into an exception by
`moerl.procs.sigterm_raises`) delete everything it created, propagationPolicy Background, each
object once (a 404 on delete counts as deleted). Failures raise `LaunchError` subclasses whose
message names the object and the reason.

How "done" is read:
- TrainJob: condition `Complete` or `Failed` (with its reason and message).
- JobSet: condition `Completed` or `Failed`.
- Pod: phase Succeeded / Failed, with the container's terminated reason, exit code and message
  (the stage's one-line error, see `moerl.launch.remote`); a container stuck in
  CreateContainerConfigError or InvalidImageName fails at once, in ImagePullBackOff after
  `PULL_BACKOFF_S`.
A failed TrainJob or JobSet is explained by its failed pods (found by `moerl.ai/workload`).

The API objects are injected (`KubeApi`): `connect()` builds them from the in-cluster service
account or, outside a cluster, from kubeconfig; tests replay recorded API responses through the
real client.

Limitations: polling, not a watch stream (one GET per object per poll; fine for a handful of
objects per task). Deletion is requested, not awaited: pods terminate in the background within
their grace period. An owner reference to the task's own pod (`own_pod_owner`) lets the garbage
collector remove what a SIGKILLed task could not; it needs the objects in the task's namespace.
"""

from __future__ import annotations

import json
import logging
import os
import time
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kubernetes.client.exceptions import ApiException

from moerl import procs
from moerl.errors import MoerlError
from moerl.launch.objects import JOBSET_API, LABEL_WORKLOAD, TRAINJOB_API

log = logging.getLogger(__name__)

SA_NAMESPACE = "/var/run/secrets/kubernetes.io/serviceaccount/namespace"
PULL_BACKOFF_S = 600.0
_FATAL_WAITING = {"CreateContainerConfigError", "InvalidImageName", "ErrImageNeverPull", "CreateContainerError"}
_PULL_WAITING = {"ImagePullBackOff", "ErrImagePull"}
MAX_API_ERRORS = 5  # consecutive failed polls (API server restarts, throttling) before giving up


class LaunchError(MoerlError):
    """A workload launched through the Kubernetes API could not run to success."""


class WorkloadFailed(LaunchError):
    """The workload ended in failure."""


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

    @classmethod
    def from_client(cls, api_client: Any) -> "KubeApi":
        from kubernetes import client

        return cls(client.CoreV1Api(api_client), client.CustomObjectsApi(api_client))


def connect() -> KubeApi:
    """In-cluster config (the task's service account), else kubeconfig."""
    from kubernetes import client, config

    try:
        config.load_incluster_config()
    except config.ConfigException:
        try:
            config.load_kube_config()
        except (config.ConfigException, OSError) as e:
            raise LaunchError(f"no Kubernetes API access: not in a cluster and no usable kubeconfig ({e}); "
                              "cluster.launch.mode kubernetes runs inside a KFP task") from e
    return KubeApi(client.CoreV1Api(), client.CustomObjectsApi())


def resolve_namespace(configured: str | None, sa_file: str = SA_NAMESPACE) -> str:
    """`cluster.launch.namespace`, else the namespace of the task's own pod."""
    if configured:
        return configured
    try:
        ns = Path(sa_file).read_text().strip()
    except OSError as e:
        raise LaunchError(f"cannot tell the task's namespace ({sa_file}: {e.strerror}); "
                          "set cluster.launch.namespace") from e
    if not ns:
        raise LaunchError(f"{sa_file} is empty; set cluster.launch.namespace")
    return ns


def own_pod_owner(namespace: str, env: dict[str, str] | None = None) -> dict[str, Any] | None:
    """An ownerReference to the KFP task's own pod (KFP sets KFP_POD_NAME/KFP_POD_UID/
    KFP_NAMESPACE in executor containers), if the workload lives in the same namespace: owner
    references never cross namespaces."""
    env = os.environ if env is None else env
    name, uid, ns = env.get("KFP_POD_NAME"), env.get("KFP_POD_UID"), env.get("KFP_NAMESPACE")
    if not (name and uid and ns == namespace):
        return None
    return {"apiVersion": "v1", "kind": "Pod", "name": name, "uid": uid, "blockOwnerDeletion": False,
            "controller": False}


@dataclass(frozen=True)
class State:
    done: bool = False
    failed: str | None = None  # the reason, when failed
    summary: str = ""  # a short description of the current state, for logs and timeouts


def _api_status(e: BaseException) -> int | None:
    """The HTTP status of a failed API call; None when the server never answered."""
    return e.status if isinstance(e, ApiException) else None


def _container_failure(pod: dict[str, Any]) -> str | None:
    statuses = pod.get("status", {}).get("containerStatuses") or []
    for cs in statuses:
        term = (cs.get("state") or {}).get("terminated") or {}
        if term and term.get("exitCode", 0) != 0:
            msg = (term.get("message") or "").strip()
            return (f"container {cs.get('name')} {term.get('reason', 'terminated')} (exit code "
                    f"{term.get('exitCode')})" + (f": {msg[-1000:]}" if msg else ""))
    return None


def pod_state(pod: dict[str, Any], now: float, first_pull_error: dict[str, float]) -> State:
    """Done/failed from a Pod object (camelCase dict). `first_pull_error` remembers since when
    a container has failed to pull its image (keyed by pod name)."""
    name, status = pod["metadata"]["name"], pod.get("status", {})
    phase = status.get("phase", "Pending")
    if phase == "Succeeded":
        return State(done=True, summary=phase)
    if phase == "Failed":
        why = _container_failure(pod) or ": ".join(x for x in (status.get("reason"), status.get("message")) if x)
        return State(failed=why or "phase Failed", summary=phase)
    for cs in status.get("containerStatuses") or []:
        waiting = (cs.get("state") or {}).get("waiting") or {}
        reason = waiting.get("reason")
        detail = f"container {cs.get('name')} {reason}: {waiting.get('message', '')}".rstrip(": ")
        if reason in _FATAL_WAITING:
            return State(failed=detail, summary=phase)
        if reason in _PULL_WAITING:
            since = first_pull_error.setdefault(name, now)
            if now - since >= PULL_BACKOFF_S:
                return State(failed=f"{detail} for {now - since:.0f} s", summary=phase)
            return State(summary=f"{phase}: {detail}")
    first_pull_error.pop(name, None)
    unscheduled = next((c for c in status.get("conditions") or []
                        if c.get("type") == "PodScheduled" and c.get("status") == "False"), None)
    if unscheduled:
        return State(summary=f"{phase}: {unscheduled.get('reason')}: {unscheduled.get('message', '')}")
    return State(summary=phase)


def condition_state(obj: dict[str, Any], success: str) -> State:
    """Done/failed from `status.conditions` (TrainJob: Complete/Failed; JobSet: Completed/Failed)."""
    conds = {c.get("type"): c for c in obj.get("status", {}).get("conditions") or [] if c.get("status") == "True"}
    if "Failed" in conds:
        c = conds["Failed"]
        return State(failed=f"{c.get('reason', 'Failed')}: {c.get('message', '')}".rstrip(": "), summary="Failed")
    if success in conds:
        return State(done=True, summary=success)
    return State(summary=", ".join(sorted(conds)) or "no conditions yet")


class Workload(ABC):
    """One object the launcher creates, reads and deletes."""

    kind: str

    def __init__(self, api: KubeApi, namespace: str, body: dict[str, Any]) -> None:
        self.api, self.namespace, self.body = api, namespace, body
        self.name: str = body["metadata"]["name"]

    def __str__(self) -> str:
        return f"{self.kind} {self.namespace}/{self.name}"

    @abstractmethod
    def create(self) -> None: ...
    @abstractmethod
    def read(self) -> dict[str, Any]: ...  # raises ApiException (404 when gone)
    @abstractmethod
    def _delete(self) -> None: ...
    @abstractmethod
    def state(self, obj: dict[str, Any], now: float) -> State: ...

    def delete(self) -> bool:
        """Delete in the background; False when it was already gone."""
        try:
            self._delete()
        except Exception as e:
            if _api_status(e) == 404:
                return False
            raise
        return True

    def explain(self) -> str:
        """Why a failed object failed, from its pods (TrainJob/JobSet); '' when unknown."""
        try:
            pods = self.api.core.list_namespaced_pod(self.namespace, label_selector=f"{LABEL_WORKLOAD}={self.name}",
                                                     _preload_content=False)
            items = json.loads(pods.data).get("items", [])
        except Exception as e:  # noqa: BLE001 (an explanation is best effort; the failure is already known)
            log.warning("could not list the pods of %s: %s", self, e)
            return ""
        found = [f"pod {p['metadata']['name']}: {why}" for p in items if (why := _container_failure(p))]
        return "; ".join(found[:3])


class PodWorkload(Workload):
    kind = "Pod"

    def __init__(self, api: KubeApi, namespace: str, body: dict[str, Any]) -> None:
        super().__init__(api, namespace, body)
        self._pull_errors: dict[str, float] = {}

    def create(self) -> None:
        self.api.core.create_namespaced_pod(self.namespace, self.body, _preload_content=False)

    def read(self) -> dict[str, Any]:
        return json.loads(self.api.core.read_namespaced_pod(self.name, self.namespace, _preload_content=False).data)

    def _delete(self) -> None:
        self.api.core.delete_namespaced_pod(self.name, self.namespace, propagation_policy="Background",
                                            _preload_content=False)

    def state(self, obj: dict[str, Any], now: float) -> State:
        return pod_state(obj, now, self._pull_errors)

    def explain(self) -> str:
        return ""  # the pod's own state already says it


class CustomWorkload(Workload):
    """A namespaced custom resource whose conditions say how it ended."""

    api_ref: tuple[str, str, str]  # group, version, plural
    success: str

    def create(self) -> None:
        g, v, p = self.api_ref
        self.api.custom.create_namespaced_custom_object(g, v, self.namespace, p, self.body, _preload_content=False)

    def read(self) -> dict[str, Any]:
        g, v, p = self.api_ref
        return json.loads(self.api.custom.get_namespaced_custom_object(g, v, self.namespace, p, self.name,
                                                                       _preload_content=False).data)

    def _delete(self) -> None:
        g, v, p = self.api_ref
        self.api.custom.delete_namespaced_custom_object(g, v, self.namespace, p, self.name,
                                                        propagation_policy="Background", _preload_content=False)

    def state(self, obj: dict[str, Any], now: float) -> State:
        return condition_state(obj, self.success)


class TrainJobWorkload(CustomWorkload):
    kind, api_ref, success = "TrainJob", TRAINJOB_API, "Complete"


class JobSetWorkload(CustomWorkload):
    kind, api_ref, success = "JobSet", JOBSET_API, "Completed"


_KINDS: dict[str, type[Workload]] = {"Pod": PodWorkload, "TrainJob": TrainJobWorkload, "JobSet": JobSetWorkload}


def workload(api: KubeApi, namespace: str, body: dict[str, Any]) -> Workload:
    return _KINDS[body["kind"]](api, namespace, body)


class Launcher:
    """Creates, watches and deletes workloads; see the module docstring."""

    def __init__(self, poll_s: float, timeout_s: float, clock: Callable[[], float] = time.monotonic,
                 sleep: Callable[[float], None] = time.sleep) -> None:
        self.poll_s, self.timeout_s, self.clock, self.sleep = poll_s, timeout_s, clock, sleep
        self.created: list[Workload] = []
        self._deleted: set[int] = set()

    def run(self, workloads: list[Workload]) -> None:
        with procs.sigterm_raises():
            try:
                try:
                    # 1. create; a failure here still deletes what was created (the `finally`)
                    for w in workloads:
                        self._create(w)
                    # 2. watch
                    self._watch(list(workloads))
                finally:
                    # 3. delete, whatever happened
                    self.cleanup()
            except procs.Terminated:
                raise LaunchInterrupted(f"received SIGTERM while running {_names(workloads)}; "
                                        "deleted what was launched") from None

    def _create(self, w: Workload) -> None:
        log.info("creating %s", w)
        self.created.append(w)  # before the call: an interrupted create may have succeeded
        try:
            w.create()
        except ApiException as e:
            self.created.pop()  # the server answered: nothing was created
            hint = {403: f"; the task's service account needs create/get/delete on {w.kind}s in {w.namespace}",
                    404: f"; is the {w.kind} API installed on the cluster (Kubeflow Trainer v2 for TrainJob, "
                         "JobSet for JobSet) and the namespace there?"}.get(e.status, "")
            raise LaunchError(f"creating {w} failed: {_short(e)}{hint}") from None

    def cleanup(self) -> None:
        """Delete every created object not yet deleted. A SIGTERM meanwhile does not cut it
        short (the delete is retried, later SIGTERMs are ignored); it is re-raised at the end."""
        interrupted: procs.Terminated | None = None
        for w in self.created:
            while id(w) not in self._deleted:
                try:
                    existed = w.delete()
                    self._deleted.add(id(w))
                    log.info("deleted %s" if existed else "%s was already gone", w)
                except procs.Terminated as t:
                    interrupted = t
                except Exception as e:  # noqa: BLE001 (keep deleting the others; the owner reference is the backstop)
                    log.warning("could not delete %s: %s", w, e)
                    break
        if interrupted is not None:
            raise interrupted

    def _watch(self, pending: list[Workload]) -> None:
        deadline, errors, last = self.clock() + self.timeout_s, 0, {}
        while pending:
            for w in list(pending):
                try:
                    obj = w.read()
                except procs.Terminated:
                    raise
                except Exception as e:
                    status = _api_status(e)
                    if status == 404:
                        raise WorkloadDeleted(f"{w} was deleted while it ran (last state: "
                                              f"{last.get(w.name, 'unknown')})") from None
                    errors += 1
                    if errors >= MAX_API_ERRORS:
                        raise LaunchError(f"cannot read {w} ({MAX_API_ERRORS} tries in a row): {_short(e)}") from e
                    log.warning("reading %s failed (%d/%d): %s", w, errors, MAX_API_ERRORS, _short(e))
                    continue
                errors = 0
                st = w.state(obj, self.clock())
                if st.summary != last.get(w.name):
                    log.info("%s: %s", w, st.summary)
                last[w.name] = st.summary
                if st.failed:
                    detail = w.explain()
                    raise WorkloadFailed(f"{w} failed: {st.failed}" + (f" ({detail})" if detail else ""))
                if st.done:
                    pending.remove(w)
            if not pending:
                return
            if self.clock() >= deadline:
                states = "; ".join(f"{w.name}: {last.get(w.name, 'unknown')}" for w in pending)
                raise WorkloadTimeout(f"{_names(pending)} did not finish within {self.timeout_s:g} s "
                                      f"(last state: {states}); deleted it")
            self.sleep(self.poll_s)


def _names(ws: list[Workload]) -> str:
    return ", ".join(str(w) for w in ws)


def _short(e: BaseException) -> str:
    """One line about a failed call: HTTP status, reason and the API server's message."""
    if isinstance(e, ApiException):
        try:
            message = json.loads(e.body or "{}").get("message", "")
        except (ValueError, AttributeError):
            message = ""
        return f"HTTP {e.status} {e.reason or ''}".strip() + (f": {message[:500]}" if message else "")
    return f"{type(e).__name__}: {e}"[:300]
