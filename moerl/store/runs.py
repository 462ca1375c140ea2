"""Where a run's policy versions live: one lineage of versions per run.

Each run publishes under `<checkpoint.uri>/runs/<run_id>/`, so two runs never race for the
same version numbers or the same `latest` pointer, and the node-local cache is keyed the same
way (`<cache_dir>/<run_id>/v000001`). The cache's `serving.json` names the version the
engines serve; each fetch for an engine first makes room for its version, then prunes the
cache to the newest `checkpoint.cache_keep` versions, never dropping the one fetched or served.
The lineage's stores and tiers (`run_store`, `run_tiers`, `open_store`) live in
`moerl.store.tiers` and are re-exported here.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from moerl.config import CheckpointConfig
from moerl.errors import CheckpointError
from moerl.store.base import CheckpointStore
from moerl.store.nodecache import MARKER, lock_path, make_room, prune_cache, shared
from moerl.store.tiers import ENGINE_EXCLUDE, open_store, run_store, run_tiers

__all__ = [
    "ENGINE_EXCLUDE",
    "SERVING",
    "engine_copy",
    "fetch_for_engine",
    "fetch_nearest",
    "open_store",
    "run_cache",
    "run_store",
    "run_tiers",
    "served_version",
    "version_uri",
]

log = logging.getLogger(__name__)

SERVING = "serving.json"


def run_cache(cfg: CheckpointConfig, run_id: str) -> Path:
    """The run's folder in the node cache, absolute: a relative `checkpoint.cache_dir` is this
    process's (a pod's own), resolved once here, because the copies it yields are handed to
    engine ranks, which read a relative path as one under the node cache root
    (`engine_worker.node_copy`)."""
    return Path(cfg.cache_dir).expanduser().absolute() / run_id


def version_uri(store: CheckpointStore, version: int) -> str:
    return f"{store.uri.rstrip('/')}/versions/v{version:06d}"


# Rollout engines never need the trainer state published beside the weights (`ENGINE_EXCLUDE`,
# defined in `moerl.store.tiers`: the cache tier does not hold it either).


def served_version(cache: Path) -> int | None:
    """The version `serving.json` in `cache` names; None when nothing is served yet."""
    path = Path(cache) / SERVING
    try:
        return int(json.loads(path.read_text())["version"])
    except FileNotFoundError:
        return None
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise CheckpointError(
            f"cannot read {path} ({e!r}); delete it and redistribute the version"
        ) from e


@contextmanager
def engine_copy(
    cfg: CheckpointConfig,
    run_id: str,
    version: int,
    attempts: int = 3,
    expect_sha256: str | None = None,
    swarm=None,
    sources: list[str] | None = None,
) -> Iterator[Path]:
    """Version `version` in the node cache (`fetch_for_engine`), held while the caller loads
    it: a shared lock on the copy, which the pruning of any other process on this node respects.
    A copy pruned between the fetch and the lock (a neighbour's fetch pruned it) is fetched
    again; what is yielded is always a verified local directory with a config.json, never a
    path that a loader could take for a hub id. `sources` receives where each fetch read from
    (node, peers, cache, durable: `moerl.store.tiers`)."""
    cache = run_cache(cfg, run_id)
    for _ in range(attempts):
        path, source = fetch_nearest(cfg, run_id, version, expect_sha256, swarm)
        if sources is not None:
            sources.append(source)
        with shared(lock_path(cache, version)):
            if (path / MARKER).is_file() and (path / "config.json").is_file():
                yield path
                return
        log.warning(
            "version %d: the cached copy %s went away before it was loaded; fetching it again",
            version,
            path,
        )
    raise CheckpointError(
        f"version {version}: the cached copy in {cache} was pruned {attempts} times before it could "
        "be loaded; raise checkpoint.cache_keep"
    )


def fetch_for_engine(
    cfg: CheckpointConfig, run_id: str, version: int, expect_sha256: str | None = None
) -> Path:
    return fetch_nearest(cfg, run_id, version, expect_sha256)[0]


def fetch_nearest(
    cfg: CheckpointConfig, run_id: str, version: int, expect_sha256: str | None = None, swarm=None
) -> tuple[Path, str]:
    """Version `version` in the node-local cache, verified, without the trainer state, from the
    nearest tier that has it (`moerl.store.tiers`). The cache makes room for it first (so it
    never holds more than `checkpoint.cache_keep` versions and the served one), and is pruned
    again after. A failed prune is logged, never raised."""
    cache = run_cache(cfg, run_id)
    try:
        served = served_version(cache)
        make_room(cache, cfg.cache_keep, version, {served} if served is not None else set())
    except CheckpointError as e:
        log.warning("could not make room in the fetch cache %s: %s", cache, e)
    path, source = run_tiers(cfg, run_id).fetch(
        version, cache, ENGINE_EXCLUDE, expect_sha256, swarm
    )
    try:
        served = served_version(cache)
        prune_cache(
            cache, cfg.cache_keep, protect={version} | ({served} if served is not None else set())
        )
    except CheckpointError as e:
        log.warning("could not prune the fetch cache %s: %s", cache, e)
    return path, source
