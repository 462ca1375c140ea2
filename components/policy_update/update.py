"""The sync pipeline's policy update: the published version in, the next version published out.

No trainer state passes through the pipeline: the task gets the version (a PolicyVersion) and
the batch, every node lays the version out from the checkpoint store and each rank fetches only
its state shards; the ranks train through the same `Leader` as the async trainer (its mesh, or
this process as a one-rank mesh), every rank writes its own part of the next version, and rank 0
publishes it (nodes other than 0 put their files themselves). A retry after the version was
published returns it, with the metrics recorded in its manifest, instead of training twice
(rank 0 checks, after repairing both tiers as a resumed run does).

Design, faults and limits: docs/weights.md, "The sync update".
"""

from __future__ import annotations

import hashlib
import json
import logging
import shutil
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING

from moerl.config import RunConfig
from moerl.errors import CheckpointError, ConfigError
from moerl.records import PolicyVersion, TrainSample, read_records
from moerl.store.runs import run_store, version_uri

if TYPE_CHECKING:
    from moerl.components.policy_update.mesh import Leader

log = logging.getLogger(__name__)

# manifest labels of a version the sync update published
BATCH_LABEL = "sync_batch_sha256"
METRICS_LABEL = "sync_train_metrics"


def batch_digest(batch_path: str | Path) -> str:
    """The batch's sha256: what a retry compares to know the published version is this one's."""
    h = hashlib.sha256()
    with open(batch_path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def already_published(
    cfg: RunConfig, run_id: str, version: int, digest: str
) -> tuple[PolicyVersion, dict[str, float]] | None:
    """Version `version`, if an earlier attempt of this update (the same batch) published it:
    its PolicyVersion and the metrics it recorded. First both tiers are repaired as a resumed
    run repairs them (`Tiers.recover`, one writer at a time): a complete, verified durable copy
    the earlier attempt left above `latest` becomes `latest`; anything partial, and a cache-tier
    copy that never became durable, is deleted, so the version is trained again under its
    number with no stale copy left. A version of that number trained on another batch is
    refused (the store then holds a history this pipeline did not make)."""
    from moerl.store.tiers import run_tiers

    latest = run_tiers(cfg.checkpoint, run_id).recover()
    if latest is None or latest < version:
        return None
    store = run_store(cfg.checkpoint, run_id)
    manifest = store.manifest(version)
    if manifest.meta.get(BATCH_LABEL) != digest:
        raise CheckpointError(
            f"policy_update: version {version} already exists in {store.uri} and was not trained "
            "on this iteration's batch; resume the run from its latest version instead"
        )
    metrics = json.loads(manifest.meta.get(METRICS_LABEL, "{}"))
    # this attempt published nothing; the version is the one the store holds
    metrics.update(
        {
            "weights/already_published": 1.0,
            "weights/version": float(version),
            "timing/publish_checkpoint_s": 0.0,
        }
    )
    policy = PolicyVersion(
        version=version, uri=version_uri(store, version), manifest_sha256=manifest.sha256()
    )
    return policy, metrics


def update_on(
    cfg: RunConfig,
    run_id: str,
    leader: Leader,
    policy: PolicyVersion,
    batch_path: str | Path,
    iteration: int,
) -> tuple[PolicyVersion, dict[str, float]]:
    """On rank 0 of a mesh (of one rank, or many): every rank loads `policy`'s version from the
    store, trains one version on the batch, writes its part with the trainer's state (every
    version carries it: the next task continues from it), and rank 0 publishes version + 1."""
    from moerl.components.policy_update.ep_optimizer import STATE_SHARDS
    from moerl.components.publish_checkpoint.stage import prepare_resume, run_publish

    t0 = time.perf_counter()
    digest = batch_digest(batch_path)
    made = policy.version + 1
    done = already_published(cfg, run_id, made, digest)
    if done is not None:  # a retry after the publication: the version, not a second update
        log.warning(
            "version %d was already published by an earlier attempt of this update; returning it",
            made,
        )
        return done
    work = Path(tempfile.mkdtemp(prefix="moerl-update-"))
    try:
        state_dir, out_dir = work / f"v{policy.version}", work / f"v{made}"
        # every node lays the version out without the state shards; each rank fetches its own
        metrics = leader.load_state(
            state_dir,
            policy.version,
            at=policy.version,
            prepare=lambda: prepare_resume(
                cfg, run_id, policy.version, state_dir, exclude=STATE_SHARDS
            ),
        )
        samples = read_records(batch_path, TrainSample)
        metrics.update(leader.train_version(samples, iteration, out_dir, with_state=True))
        metrics["timing/policy_update_s"] = time.perf_counter() - t0  # publication apart
        labels = {BATCH_LABEL: digest, METRICS_LABEL: json.dumps(metrics, sort_keys=True)}
        published, pub_metrics = run_publish(
            cfg, run_id, out_dir, made, meta=labels, parts=leader.parts
        )
        return published, metrics | pub_metrics
    finally:
        shutil.rmtree(work, ignore_errors=True)


def run_sync_update(
    cfg: RunConfig,
    run_id: str,
    policy: PolicyVersion,
    batch_path: str | Path,
    iteration: int,
) -> tuple[PolicyVersion, dict[str, float]] | None:
    """The sync policy_update task (in its own pod, or on each node of a TrainJob): version
    `policy.version` + 1 published, and its train/* and weights/* metrics. None on a TrainJob
    node other than the first (rank 0's node reports)."""
    from moerl.provenance import stage_start

    if not run_id:
        raise ConfigError(
            "policy_update: run_id is empty; the update reads and publishes the run's versions"
        )
    stage_start(cfg, "policy_update", run_id)  # records where it runs; enforces `require:`
    if cfg.trainer.parallelism.on_mesh:  # the mesh's ranks, launched for this version
        from moerl.components.policy_update.launcher import run_mesh_trainer

        result = run_mesh_trainer(
            cfg,
            run_id,
            [
                "--policy-json",
                policy.model_dump_json(),
                "--batch",
                str(Path(batch_path).resolve()),
                "--iteration",
                str(iteration),
            ],
            timeout_s=cfg.trainer.parallelism.rank_timeout_s,
        )
        if not result:  # a node other than the first
            return None
        out = json.loads(result)
        return PolicyVersion.model_validate(out["policy"]), out["metrics"]
    from moerl.components.policy_update.mesh import in_process

    with in_process(cfg, run_id) as leader:  # this process, a one-rank mesh
        return update_on(cfg, run_id, leader, policy, batch_path, iteration)
