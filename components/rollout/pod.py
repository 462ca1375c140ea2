"""One rollout pod's engines: `run_rollout_pod` runs the rollout workers pod `pod` hosts
(`moerl.launch.layout.pod_workers`: rollout.workers at GPUs per pod / (TP x DP) engines a pod).

One worker runs in this process. Several run as child processes (`moerl.launch.procs`), each
`python -m moerl.components.rollout.worker` with CUDA_VISIBLE_DEVICES set to its engine's
devices (`PodLayout.slices`) and the pod's EFA devices; they share the pod's node cache (its
flocks) and each serves its own fan-out port. A SIGTERM (a Spot notice) goes to every child,
which drains as a lone worker would. The first child that fails has its siblings drained too,
so the slot's retry restarts the whole pod; the pod's exit code is `pod_exit`'s.
"""

from __future__ import annotations

import logging
import os
import subprocess
import tempfile
import time
from pathlib import Path

from moerl.config import RunConfig, config_to_json
from moerl.errors import ConfigError
from moerl.launch.layout import PodLayout, pod_workers, rollout_pod_layout

log = logging.getLogger(__name__)

WORKER_MODULE = "moerl.components.rollout.worker"
DRAIN_MARGIN_S = 20.0  # beyond rollout.grace_seconds, for a child's publish and exit


def pod_exit(codes: list[int | None]) -> int:
    """The pod's exit code from its workers': 0 when every one finished the run; else the first
    failure's (a crash, 1, before a drain, EXIT_DRAINED), so KFP retries the slot."""
    bad = [c for c in codes if c]
    crashes = [c for c in bad if c != _drained()]
    return (crashes or bad or [0])[0]


def _drained() -> int:
    from moerl.components.rollout.worker import EXIT_DRAINED

    return EXIT_DRAINED


def worker_env(layout: PodLayout, engine: int, base: dict[str, str]) -> dict[str, str]:
    """Engine `engine`'s environment: `base` with its devices (none on cpu); indices into the
    devices `base` already limits the pod to (its CUDA_VISIBLE_DEVICES), if it does."""
    env = dict(base)
    devices = layout.slices()[engine]
    if devices:
        visible = [d for d in base.get("CUDA_VISIBLE_DEVICES", "").split(",") if d]
        if visible and len(visible) < layout.gpus:
            raise ConfigError(
                f"the rollout pod sees {len(visible)} GPUs (CUDA_VISIBLE_DEVICES "
                f"{base['CUDA_VISIBLE_DEVICES']}), its layout needs {layout.gpus}"
            )
        env["CUDA_VISIBLE_DEVICES"] = ",".join(visible[d] if visible else str(d) for d in devices)
    return env


def run_rollout_pod(cfg: RunConfig, run_id: str, pod: int) -> int:
    """Serve rollout with every worker of pod `pod` until the run is done (0) or a drain."""
    from moerl.components.rollout.worker import run_rollout_worker

    layout = rollout_pod_layout(cfg)
    names = [f"rollout-{i}" for i in pod_workers(cfg.rollout.workers, layout.engines, pod)]
    if len(names) == 1:
        os.environ.update(worker_env(layout, 0, dict(os.environ)))
        return run_rollout_worker(cfg, run_id, names[0])
    log.info(
        "rollout pod %d: %d engines of %d GPUs each: %s",
        pod,
        len(names),
        layout.devices_per_engine,
        ", ".join(f"{n} on {layout.slices()[j] or 'cpu'}" for j, n in enumerate(names)),
    )
    return supervise(cfg, run_id, layout, names)


def supervise(
    cfg: RunConfig, run_id: str, layout: PodLayout, names: list[str], module: str = WORKER_MODULE
) -> int:
    """Run `python -m module --config F --run-id R --name N` for each of `names`, engine j on
    `layout.slices()[j]`, until all exit (see the module docstring); the pod's exit code."""
    from moerl.launch import procs

    grace = cfg.rollout.grace_seconds + DRAIN_MARGIN_S
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        f.write(config_to_json(cfg))
    config = Path(f.name)
    children: list[subprocess.Popen] = []
    try:
        with procs.sigterm_raises():
            for j, name in enumerate(names):
                args = ["--config", str(config), "--run-id", run_id, "--name", name]
                env = worker_env(layout, j, dict(os.environ))
                children.append(procs.spawn(module, args, env))
            while all(p.poll() is None or p.returncode == 0 for p in children):
                if all(p.poll() is not None for p in children):
                    return 0
                time.sleep(0.5)
            failed = next(p for p in children if p.returncode)
            log.error(
                "%s exited %d: draining the pod's other engines",
                names[children.index(failed)],
                failed.returncode,
            )
            procs.kill_groups(children, grace)
    except procs.Terminated:
        log.info("SIGTERM: draining the pod's %d engines", len(children))
        procs.kill_groups(children, grace)
    finally:
        if any(p.poll() is None for p in children):
            procs.kill_groups(children)
        config.unlink(missing_ok=True)
    return pod_exit([p.returncode for p in children])
