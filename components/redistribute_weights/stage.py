"""Redistribute weights stage: make version v the one the next rollout serves.

In the sync pipeline every rollout task starts its engine fresh, so redistribution means:
fetch version v from the store into the node-local checkpoint cache once, verify every file
against the manifest, check the manifest is the one that was published, and point the cache's
`serving.json` at it. The rollout task then loads from the verified cache without another
download. The time from "published" to "servable" is recorded as `timing/redistribute_weights_s`.

Limitations: the sync mode has no live engine to hot-swap; in-place weight reload into a
running vLLM engine is the async mode's job (and needs its parity test, see DESIGN.md).
"""

from __future__ import annotations

import json
import os
import socket
import time

from moerl.checkpoints import fetch_for_engine, run_cache, run_store
from moerl.config import RunConfig
from moerl.errors import WeightSyncError
from moerl.records import PolicyVersion


def run_redistribute(cfg: RunConfig, run_id: str, policy: PolicyVersion) -> tuple[PolicyVersion, dict[str, float]]:
    t0 = time.perf_counter()
    store = run_store(cfg.checkpoint, run_id)
    manifest = store.manifest(policy.version)
    if manifest.sha256() != policy.manifest_sha256:
        raise WeightSyncError(
            f"redistribute: manifest of version {policy.version} in {store.uri} has sha256 {manifest.sha256()}, "
            f"but the published one had {policy.manifest_sha256}; the store changed under the run")
    cache = run_cache(cfg.checkpoint, run_id)
    local = fetch_for_engine(cfg.checkpoint, run_id, policy.version)
    serving = cache / "serving.json"
    tmp = serving.with_suffix(".tmp")
    tmp.write_text(json.dumps({"version": policy.version, "path": str(local), "manifest_sha256": policy.manifest_sha256}))
    os.replace(tmp, serving)
    # the served version is referenced by a live run: retention must not delete it
    store.pin(policy.version, holder=f"serving-{socket.gethostname()}")
    return policy, {
        "timing/redistribute_weights_s": time.perf_counter() - t0,
        "weights/serving_version": float(policy.version),
    }
