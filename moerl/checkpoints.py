"""Where a run's policy versions live: one lineage of versions per run.

Each run publishes under `<checkpoint.uri>/runs/<run_id>/`, so two runs never race for the
same version numbers or the same `latest` pointer, and the node-local cache is keyed the same
way (`<cache_dir>/<run_id>/v000001`).
"""

from __future__ import annotations

from pathlib import Path

from moerl.config import CheckpointConfig
from moerl.store import CheckpointStore, open_store


def run_store(cfg: CheckpointConfig, run_id: str) -> CheckpointStore:
    if not run_id or "/" in run_id:
        raise ValueError(f"run_id must be a non-empty name without '/', got {run_id!r}")
    return open_store(cfg.model_copy(update={"uri": f"{cfg.uri.rstrip('/')}/runs/{run_id}"}))


def run_cache(cfg: CheckpointConfig, run_id: str) -> Path:
    return Path(cfg.cache_dir) / run_id


def version_uri(store: CheckpointStore, version: int) -> str:
    return f"{store.uri.rstrip('/')}/versions/v{version:06d}"


# Rollout engines never need the trainer state published beside the weights.
ENGINE_EXCLUDE = ("trainer/",)


def fetch_for_engine(cfg: CheckpointConfig, run_id: str, version: int) -> Path:
    """Version `version` in the node-local cache, verified, without the trainer state."""
    return run_store(cfg, run_id).fetch(version, run_cache(cfg, run_id), exclude=ENGINE_EXCLUDE)
