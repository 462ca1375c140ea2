"""The version registry's commits, as the async trainer makes them: from the publisher's thread
once a version is durable (`Commits`), again after a failover took some back (`recommit`), at a
takeover where the registry and the store disagree (`reconcile`), and made durable in Valkey
where the server can (`check_durable`).

Design, details and limitations: docs/async.md#componentspolicy_updateworkerpy.
"""

from __future__ import annotations

import json
import logging

from moerl import tracking
from moerl.bus import BusError, RunBus
from moerl.bus.weights import wire_sha
from moerl.components.policy_update.gather import TrainerState
from moerl.components.publish_checkpoint.publisher import Job
from moerl.config import RunConfig
from moerl.errors import CheckpointError, ConfigError
from moerl.records import PolicyVersion
from moerl.store.runs import run_store, version_uri
from moerl.store.tiers import run_tiers

log = logging.getLogger(__name__)


def store_epoch(cfg: RunConfig, run_id: str) -> int:
    """The newest trainer epoch the run's tiers recorded in `latest.json` (0: none); every
    trainer fences both tiers with its epoch at its takeover. The cache tier's is best effort
    (an unusable one is left to `Tiers.recover`); the durable store's failure is raised."""
    tiers = run_tiers(cfg.checkpoint, run_id)
    newest = tiers.durable.latest_epoch() or 0
    if tiers.cache is not None:
        try:
            newest = max(newest, tiers.cache.latest_epoch() or 0)
        except CheckpointError as err:
            log.warning("the cache tier's latest epoch is unreadable (%s); the store's alone", err)
    return newest


def reconcile(bus: RunBus, cfg: RunConfig, run_id: str, latest: int, epoch: int) -> None:
    """Make the registry and the consumed set agree with the store's `latest`."""
    reg = bus.registry()
    if reg is not None and reg.version >= latest:
        return
    store = run_store(cfg.checkpoint, run_id)
    if reg is None and latest > 0:
        # a resumed run on a Valkey that never saw it (a new server, or its data lost): the
        # versions up to `latest` used their groups already, so issuance must not redo them
        log.warning(
            "the registry is empty but version %d is published: resuming from it on a fresh Valkey",
            latest,
        )
        bus.incr(
            groups_used=latest * cfg.task.prompts_per_iteration,
            prompts_issued=latest * cfg.task.prompts_per_iteration,
        )
        manifest = store.manifest(latest)
        # the data and the unit ids continue where the run was, never from 0 (ids would collide
        # with trained groups, and the first prompts would be trained again)
        bus.restore_positions(
            int(manifest.meta.get("cursor", 0)), int(manifest.meta.get("unit_seq", 0))
        )
        bus.register(latest, version_uri(store, latest), manifest.sha256())
        return
    manifest = store.manifest(latest)
    groups = json.loads(manifest.meta.get("groups", "[]"))
    entries = json.loads(manifest.meta.get("entries", "[]"))
    counts = json.loads(manifest.meta.get("counts", "{}"))
    if groups or counts:
        log.warning(
            "version %d was published but not committed (trainer died in between); committing its %d "
            "groups now",
            latest,
            len(groups),
        )
    bus.commit_version(
        epoch, latest, version_uri(store, latest), manifest.sha256(), entries, groups, **counts
    )


def recommit(bus: RunBus, cfg: RunConfig, run_id: str, committed: int, epoch: int) -> None:
    """Before each gather: a registry behind the last version this trainer committed lost
    commits (a failover to a replica that lagged). Commit them again from their manifests, in
    order, so their groups are consumed again before any of them can be gathered twice."""
    reg = bus.registry()
    start = reg.version if reg is not None else 0
    if start >= committed:
        return
    log.warning(
        "the registry says version %d but this trainer committed %d (Valkey lost commits: a failover); "
        "committing versions %d-%d again from their manifests",
        start,
        committed,
        start + 1,
        committed,
    )
    bus.incr(commits_replayed=committed - start)
    store = run_store(cfg.checkpoint, run_id)
    for v in range(start + 1, committed + 1):
        m = store.manifest(v)
        bus.commit_version(
            epoch,
            v,
            version_uri(store, v),
            m.sha256(),
            json.loads(m.meta.get("entries", "[]")),
            json.loads(m.meta.get("groups", "[]")),
            **json.loads(m.meta.get("counts", "{}")),
        )


def check_durable(bus: RunBus, cfg: RunConfig, run_id: str) -> bool:
    """Whether commits can be made durable (WAITAOF). A server without an append-only file
    can lose acknowledged commits (a restart, a failover): refused unless
    `valkey.require_durable` is false, and then recorded on the run, loudly."""
    replicas = bus.replicas()
    if replicas and not cfg.valkey.wait_aof_replicas:
        raise ConfigError(
            f"valkey.wait_aof_replicas: 0, but the server has {replicas} replica(s): a failover to one "
            "that lags would take back commits the trainer moved on from; set it to at least 1 (each "
            "commit then waits until a replica has it in its append-only file)"
        )
    try:
        bus.wait_durable(0, cfg.valkey.wait_aof_timeout_s)
        return True
    except BusError as err:
        if cfg.valkey.require_durable:
            raise ConfigError(
                f"valkey: {err}; a restart or failover could take back committed versions and train "
                "their samples again. Turn on appendonly (appendfsync always or everysec), or set "
                "valkey.require_durable: false to run without that guarantee"
            ) from err
        log.warning(
            "Valkey is not durable (%s): commits may be lost on a restart; recorded on the run", err
        )
        tracking.set_tags(
            tracking.resolve_uri(cfg.tracking), run_id, {"moerl.valkey_durable": "false"}
        )
        return False


class Commits:
    """The publisher thread's two calls for each version: once it is servable (`servable`), and
    once it is durable (`commit`: its groups consumed in the registry's commit)."""

    def __init__(
        self, cfg: RunConfig, pbus: RunBus, epoch: int, durable: bool, state: TrainerState
    ) -> None:
        self.cfg, self.pbus, self.epoch, self.durable, self.state = cfg, pbus, epoch, durable, state
        self.stream = cfg.resolved.stream

    def servable(self, p: PolicyVersion) -> None:
        # before any engine can serve it from files; by the wire, under its wire name too
        self.state.known[p.version] = (
            frozenset({p.manifest_sha256, wire_sha(self.epoch, p.version)})
            if self.cfg.rollout.resolved.weight_sync == "collective"
            else p.manifest_sha256
        )
        self.pbus.set_servable(self.epoch, p.version, p.uri, p.manifest_sha256)
        if self.stream:  # its prompts once an engine can serve it: every sample on-policy
            self.state.version = max(self.state.version, p.version)

    def commit(self, job: Job) -> None:
        ctx, p = job.context, job.policy
        # published to S3 first: counted where operators look
        if job.metrics.get("weights/cache_tier_failed"):
            self.pbus.incr(cache_tier_failed=1)
        if not self.pbus.commit_version(
            self.epoch,
            job.version,
            p.uri,
            p.manifest_sha256,
            ctx["entries"],
            ctx["groups"],
            **ctx["counts"],
        ):
            reg = self.pbus.registry()
            raise CheckpointError(
                f"trainer: the commit of version {job.version} was refused: the registry "
                f"already holds version {reg.version if reg else '?'}, so another trainer "
                "committed it; stopping"
            )
        self.state.committed = job.version
        if (
            self.durable
        ):  # the commit survives a crash or failover of Valkey before anyone acts on it
            self._wait_durable(job.version)

    def _wait_durable(self, version: int) -> None:
        vk = self.cfg.valkey
        local, reps = self.pbus.wait_durable(vk.wait_aof_replicas, vk.wait_aof_timeout_s)
        if local < 1 or reps < vk.wait_aof_replicas:
            self.pbus.incr(commits_not_durable=1)
            log.warning(
                "the commit of version %d is not yet durable after %.0f s (fsynced locally: %d, "
                "replicas: %d of %d)",
                version,
                vk.wait_aof_timeout_s,
                local,
                reps,
                vk.wait_aof_replicas,
            )
