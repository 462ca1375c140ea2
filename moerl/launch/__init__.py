"""How a stage's processes start and live: the pod's scratch, child processes, and GPU stages
launched through the Kubernetes API (`cluster.launch.mode: kubernetes`).

Design, details and limitations: docs/launch.md#module-notes.
"""

from __future__ import annotations

from typing import Any


def run_remote(*args: Any, **kwargs: Any) -> Any:
    """`moerl.launch.task.run_remote`, imported on first use (kubernetes and boto3 are needed
    only in this mode)."""
    from moerl.launch.task import run_remote as _run_remote

    return _run_remote(*args, **kwargs)


__all__ = ["run_remote"]
