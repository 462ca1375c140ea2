"""Cluster-shaped test runs: every task or process in a fresh directory of its own
(`MOERL_SANDBOX_ROOT`, moerl/launch/podenv.py), sharing only real servers.

One thing is shared on purpose: torch inductor's compile cache. vLLM's CPU backend builds a
precompiled header of the torch headers (~150 MB, ~40 s on 2 cores) in it, and a fresh TMPDIR
would rebuild it in every rollout task. It holds compiler output keyed by source hash, never run
data (checkpoints, records, tracking), so sharing it proves nothing away; on a cluster an image can
bake it in. Everything else a task writes stays in its own sandbox.

With `secrets` (a file `write_sandbox_secrets` wrote: the cluster's
Secrets and the service account's AWS identity), a task also runs with only the credentials its
stage's pod gets (`pod_secret_env`), none of this process's.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from moerl.launch.podenv import SANDBOX_ROOT_ENV
from moerl.launch.podsecrets import SANDBOX_SECRETS_ENV

COMPILE_CACHE_ENV = "TORCHINDUCTOR_CACHE_DIR"


@contextmanager
def sandboxed(root: Path, secrets: Path | None = None) -> Iterator[None]:
    """Processes started inside get a sandbox each under `root`, and this process's compile cache;
    with `secrets`, only their own pod's credentials (see the module docstring)."""
    from torch._inductor.runtime.cache_dir_utils import cache_dir

    old = {k: os.environ.get(k) for k in (SANDBOX_ROOT_ENV, COMPILE_CACHE_ENV, SANDBOX_SECRETS_ENV)}
    os.environ[COMPILE_CACHE_ENV] = cache_dir()  # resolved before TMPDIR moves anywhere
    os.environ[SANDBOX_ROOT_ENV] = str(root)
    if secrets is not None:
        os.environ[SANDBOX_SECRETS_ENV] = str(secrets)
    try:
        yield
    finally:
        for k, v in old.items():
            os.environ.pop(k, None) if v is None else os.environ.__setitem__(k, v)


def write_sandbox_secrets(
    path: Path,
    secrets: dict[str, dict[str, str]],
    service_account_env: dict[str, str] | None = None,
) -> Path:
    """Write the file `moerl.launch.podsecrets.sandbox_secret_env` reads (the cluster's Secrets
    and the service account's AWS identity), created 0600 (never readable by others, even for an
    instant)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        json.dump({"secrets": secrets, "service_account_env": service_account_env or {}}, f)
    return path
