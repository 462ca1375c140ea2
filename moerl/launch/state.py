"""How a launched workload is doing, read from its API objects (pure: dicts in, `State` out).

Design, details and limitations: docs/launch.md#moerllaunchstatepy.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Any

PULL_BACKOFF_S = 600.0
FATAL_WAITING = frozenset(
    {"CreateContainerConfigError", "InvalidImageName", "ErrImageNeverPull", "CreateContainerError"}
)
PULL_WAITING = frozenset({"ImagePullBackOff", "ErrImagePull"})


@dataclass(frozen=True)
class State:
    done: bool = False
    failed: str | None = None  # the reason, when failed
    summary: str = ""  # a short description of the current state, for logs and timeouts
    started: bool = False  # some pod has left phase Pending (or the workload has ended)


def container_failure(pod: dict[str, Any]) -> str | None:
    """The first container that terminated with a non-zero exit code, as one line."""
    for cs in pod.get("status", {}).get("containerStatuses") or []:
        term = (cs.get("state") or {}).get("terminated") or {}
        if term and term.get("exitCode", 0) != 0:
            msg = (term.get("message") or "").strip()
            return (
                f"container {cs.get('name')} {term.get('reason', 'terminated')} (exit code "
                f"{term.get('exitCode')})" + (f": {msg[-1000:]}" if msg else "")
            )
    return None


def _live_pod_state(pod: dict[str, Any], now: float, first_pull_error: dict[str, float]) -> State:
    """A pod that has not ended: failed when a container cannot start; else why it waits.
    `first_pull_error` remembers since when a pod's image pull has failed (keyed by pod name)."""
    name, status = pod["metadata"]["name"], pod.get("status", {})
    phase = status.get("phase", "Pending")
    started = phase != "Pending"
    for cs in status.get("containerStatuses") or []:
        waiting = (cs.get("state") or {}).get("waiting") or {}
        reason = waiting.get("reason")
        detail = f"container {cs.get('name')} {reason}: {waiting.get('message', '')}".rstrip(": ")
        if reason in FATAL_WAITING:
            return State(failed=detail, summary=phase, started=started)
        if reason in PULL_WAITING:
            since = first_pull_error.setdefault(name, now)
            if now - since >= PULL_BACKOFF_S:
                return State(
                    failed=f"{detail} for {now - since:.0f} s", summary=phase, started=started
                )
            return State(summary=f"{phase}: {detail}", started=started)
    first_pull_error.pop(name, None)
    unscheduled = next(
        (
            c
            for c in status.get("conditions") or []
            if c.get("type") == "PodScheduled" and c.get("status") == "False"
        ),
        None,
    )
    if unscheduled:
        return State(
            summary=f"{phase}: {unscheduled.get('reason')}: {unscheduled.get('message', '')}",
            started=started,
        )
    return State(summary=phase, started=started)


def pod_state(pod: dict[str, Any], now: float, first_pull_error: dict[str, float]) -> State:
    """Done/failed from a Pod object (camelCase dict)."""
    status = pod.get("status", {})
    phase = status.get("phase", "Pending")
    if phase == "Succeeded":
        return State(done=True, summary=phase, started=True)
    if phase == "Failed":
        why = container_failure(pod) or ": ".join(
            x for x in (status.get("reason"), status.get("message")) if x
        )
        return State(failed=why or "phase Failed", summary=phase, started=True)
    return _live_pod_state(pod, now, first_pull_error)


def pods_state(pods: list[dict[str, Any]], now: float, first_pull_error: dict[str, float]) -> State:
    """The pods of a TrainJob or JobSet: failed when one cannot start (the rules of
    `pod_state` for waiting containers), else a summary: how many in each phase and why the
    first pending one waits."""
    if not pods:
        return State(summary="no pods yet")
    started = any(p.get("status", {}).get("phase", "Pending") != "Pending" for p in pods)
    waits = []
    for p in pods:
        if p.get("status", {}).get("phase", "Pending") in ("Succeeded", "Failed"):
            continue  # ended: the workload's conditions say what that means
        st = _live_pod_state(p, now, first_pull_error)
        if st.failed:
            return State(
                failed=f"pod {p['metadata']['name']}: {st.failed}",
                summary=st.summary,
                started=started,
            )
        if not st.started and st.summary != "Pending":
            waits.append(f"{p['metadata']['name']}: {st.summary}")
    phases = Counter(p.get("status", {}).get("phase", "Pending") for p in pods)
    summary = "pods " + ", ".join(f"{n} {phase}" for phase, n in sorted(phases.items()))
    return State(summary=summary + (f" ({waits[0]})" if waits else ""), started=started)


def condition_state(obj: dict[str, Any], success: str) -> State:
    """Done/failed from `status.conditions` (TrainJob: Complete/Failed; JobSet: Completed/Failed)."""
    conds = {
        c.get("type"): c
        for c in obj.get("status", {}).get("conditions") or []
        if c.get("status") == "True"
    }
    if "Failed" in conds:
        c = conds["Failed"]
        return State(
            failed=f"{c.get('reason', 'Failed')}: {c.get('message', '')}".rstrip(": "),
            summary="Failed",
            started=True,
        )
    if success in conds:
        return State(done=True, summary=success, started=True)
    return State(summary=", ".join(sorted(conds)) or "no conditions yet")
