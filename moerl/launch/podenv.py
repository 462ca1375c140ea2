"""The pod's own scratch: what every pipeline task does first.

Design, details and limitations: docs/eks.md#moerllaunchpodenvpy.
"""

from __future__ import annotations

import logging
import os
import tempfile
from pathlib import Path

SCRATCH_ENV = "MOERL_SCRATCH"
SANDBOX_ROOT_ENV = "MOERL_SANDBOX_ROOT"


def enter_pod(stage: str | None = None, config_json: str | None = None) -> Path | None:
    """Move this task into its scratch directory (see the module docstring); returns it, or
    None when the task runs outside a pod-shaped environment. `stage` (the component's name, as
    `pipelines/eks.py` `place` names it) and `config_json` are read only in a sandbox given the
    cluster's Secrets, to give the task its pod's credentials and no others."""
    from moerl.launch.podsecrets import apply_sandbox_secrets
    from moerl.launch.procs import process_age_s

    age = process_age_s()
    if age is not None:  # its imports, when it started python anew (docs/launch.md, zygote)
        logging.getLogger(__name__).info(
            "%s: entered %.2f s after its process began", stage or "task", age
        )
    scratch: Path | None = None
    if os.environ.get(SANDBOX_ROOT_ENV):  # first: kfp.local also sets the compiled MOERL_SCRATCH
        root = Path(os.environ[SANDBOX_ROOT_ENV])
        root.mkdir(parents=True, exist_ok=True)
        scratch = Path(tempfile.mkdtemp(prefix="task-", dir=root))
    elif os.environ.get(SCRATCH_ENV):
        scratch = Path(os.environ[SCRATCH_ENV])
        scratch.mkdir(parents=True, exist_ok=True)
    # before anything else runs: nothing may run with the test's credentials. The pod's Secret
    # files land in its own sandbox (0400, as a pod's Secret volumes hold them)
    apply_sandbox_secrets(stage, config_json, scratch / "secrets" if scratch is not None else None)
    if scratch is None:
        return None
    os.environ[SCRATCH_ENV] = str(scratch)
    home, tmp = scratch / "home", scratch / "tmp"
    home.mkdir(exist_ok=True)
    tmp.mkdir(exist_ok=True)
    os.environ["HOME"] = str(home)
    os.environ["TMPDIR"] = str(tmp)
    tempfile.tempdir = None  # re-read TMPDIR
    os.chdir(scratch)
    return scratch
