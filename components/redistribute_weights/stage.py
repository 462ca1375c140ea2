"""Redistribute weights stage: make version v the one the next rollout serves.

Design, details and limitations: docs/async.md#componentsredistribute_weightsstagepy.
"""

from __future__ import annotations

import json
import os
import socket
import time

from moerl.config import RunConfig
from moerl.errors import WeightSyncError
from moerl.records import PolicyVersion
from moerl.store.runs import SERVING, fetch_nearest, run_cache, run_store


def run_redistribute(
    cfg: RunConfig, run_id: str, policy: PolicyVersion
) -> tuple[PolicyVersion, dict[str, float]]:
    t0 = time.perf_counter()
    store = run_store(cfg.checkpoint, run_id)
    manifest = store.manifest(policy.version)
    if manifest.sha256() != policy.manifest_sha256:
        raise WeightSyncError(
            f"redistribute: manifest of version {policy.version} in {store.uri} has sha256 {manifest.sha256()}, "
            f"but the published one had {policy.manifest_sha256}; the store changed under the run"
        )
    # the served version is referenced by a live run: retention must not delete it while the
    # lease lives (a pod's hostname is new each time, so a pin that never expired would leak).
    # Pinned before the fetch, so retention cannot delete it midway.
    store.pin(
        policy.version, holder=f"serving-{socket.gethostname()}", ttl_s=cfg.checkpoint.pin_ttl_s
    )
    cache = run_cache(cfg.checkpoint, run_id)
    # the nearest verified copy: node cache, then the cache tier, then S3 (moerl.store.tiers)
    local, source = fetch_nearest(
        cfg.checkpoint, run_id, policy.version, expect_sha256=policy.manifest_sha256
    )
    serving = cache / SERVING
    tmp = serving.with_suffix(".tmp")
    tmp.write_text(
        json.dumps(
            {
                "version": policy.version,
                "path": str(local),
                "manifest_sha256": policy.manifest_sha256,
            }
        )
    )
    os.replace(tmp, serving)
    return policy, {
        "timing/redistribute_weights_s": time.perf_counter() - t0,
        "weights/serving_version": float(policy.version),
        # where it came from: 1 for the source used (a cache tier that fell back to S3 shows here)
        **{f"weights/fetched_from_{s}": float(s == source) for s in ("node", "cache", "durable")},
    }
