"""How a stage's processes start and live: the pod's scratch, child processes, and GPU stages
launched through the Kubernetes API (`cluster.launch.mode: kubernetes`).

- `podenv`: what every pipeline task does first (`enter_pod`: its scratch as cwd, HOME, TMPDIR).
- `podsecrets`: which Secret keys each stage's pod gets (`pod_secret_env`), for `place`, the
  launched workloads and the local cluster test's sandbox.
- `procs`: child processes that die with their parent, in process groups a launcher can kill.

KFP cannot put GPUs, EFA devices and hugepages on one task (kubeflow/pipelines#10996) and, from
2.16, drops every container capability. So in this mode the policy-update and rollout
components do not run their stage in the task's own pod: they call `run_remote`, which stages
the task's inputs to S3, launches a Kubeflow Trainer TrainJob (trainer) or a Pod (rollout
worker) with those resources, watches it, deletes it on every way out, and brings the outputs
back. See docs/launch.md.

- `objects`: the TrainJob / Pod / JobSet builders (pure).
- `state`: how a workload is doing, read from its API objects (pure).
- `watch`: create, poll and delete through the kubernetes client.
- `exchange`: the S3 prefix between the task and its pod.
- `remote`: the launched pod's entry point, `python -m moerl.launch.remote <spec-uri>`.
- `task`: `run_remote`, the task side; `sweep`, what the pipeline's exit task deletes.
"""

from __future__ import annotations

from typing import Any


def run_remote(*args: Any, **kwargs: Any) -> Any:
    """`moerl.launch.task.run_remote`, imported on first use (kubernetes and boto3 are needed
    only in this mode)."""
    from moerl.launch.task import run_remote as _run_remote

    return _run_remote(*args, **kwargs)


__all__ = ["run_remote"]
