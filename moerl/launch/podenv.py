"""The pod's own scratch: what every pipeline task does first.

On the cluster every task is a pod with its own filesystem. Its image's work directory may be
read-only for the non-root user, and nothing written there by one task is seen by another. So
`moerl compile --target eks` mounts an emptyDir at `cluster.scratch_dir` in every task and sets
`MOERL_SCRATCH` to it; `enter_pod` then makes that directory the task's working directory,
HOME and TMPDIR. Relative paths in the config (`checkpoint.cache_dir`) resolve inside it, and
so do the caches libraries keep under HOME.

The local proof of cluster-safety (`tests/test_cluster_local.py`) sets `MOERL_SANDBOX_ROOT`
instead: every task then enters a fresh, empty directory of its own under that root, so a task
that relied on a file another task left behind would fail here as it would on the cluster.

Neither variable set (`moerl run`): nothing changes.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

SCRATCH_ENV = "MOERL_SCRATCH"
SANDBOX_ROOT_ENV = "MOERL_SANDBOX_ROOT"


def enter_pod() -> Path | None:
    """Move this task into its scratch directory (see the module docstring); returns it, or
    None when the task runs outside a pod-shaped environment."""
    if os.environ.get(SANDBOX_ROOT_ENV):  # first: kfp.local also sets the compiled MOERL_SCRATCH
        root = Path(os.environ[SANDBOX_ROOT_ENV])
        root.mkdir(parents=True, exist_ok=True)
        scratch = Path(tempfile.mkdtemp(prefix="task-", dir=root))
        os.environ[SCRATCH_ENV] = str(scratch)
    elif os.environ.get(SCRATCH_ENV):
        scratch = Path(os.environ[SCRATCH_ENV])
        scratch.mkdir(parents=True, exist_ok=True)
    else:
        return None
    home, tmp = scratch / "home", scratch / "tmp"
    home.mkdir(exist_ok=True)
    tmp.mkdir(exist_ok=True)
    os.environ["HOME"] = str(home)
    os.environ["TMPDIR"] = str(tmp)
    tempfile.tempdir = None  # re-read TMPDIR
    os.chdir(scratch)
    return scratch
