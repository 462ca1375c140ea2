"""Trainer (async mode): consume batches as they become ready, publish each version, commit
it to the registry; issue work by admission from a thread beside it.

The loop reads as steps: take the run over (`_take_over`), load the state it continues from
(`_resume`), then each version gathered (`gather.py`), trained (streamed: `streamed.py`),
handed to the publisher and logged (`_Loop.version`); the publisher's thread commits each
durable version (`commits.py`). The loop, the issuer and the publisher's thread share one
`TrainerState`.

Design, details and limitations: docs/async.md#componentspolicy_updateworkerpy.
"""

from __future__ import annotations

import argparse
import functools
import json
import logging
import os
import shutil
import socket
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from moerl import tracking
from moerl.bus import RunBus, connect
from moerl.components.buffer.worker import Batch, batch_metrics, train_samples
from moerl.components.policy_update.commits import (
    Commits,
    check_durable,
    recommit,
    reconcile,
    store_epoch,
)
from moerl.components.policy_update.gather import (
    CONSUMER,
    Inbox,
    Issuer,
    TrainerState,
    check_failures,
    gather,
)
from moerl.components.policy_update.intake import EntryCheck
from moerl.components.policy_update.launcher import MeshFailed, run_mesh_trainer
from moerl.components.policy_update.streamed import Streamed
from moerl.components.policy_update.wire_send import WireSender
from moerl.components.publish_checkpoint.publisher import Publisher
from moerl.components.rollout.fleet import FleetController, KubeActuator
from moerl.config import RunConfig, config_from_json
from moerl.errors import CheckpointError, ConfigError, DataError, MoerlError
from moerl.launch.podenv import enter_pod
from moerl.provenance import stage_start
from moerl.records import PolicyVersion, write_records
from moerl.store.runs import version_uri
from moerl.store.tiers import Tiers, run_tiers

if TYPE_CHECKING:
    from moerl.components.policy_update.mesh import Leader

log = logging.getLogger(__name__)


def _train(
    cfg: RunConfig,
    samples,
    version: int,
    state_dir: Path,
    out_dir: Path,
    mesh: Leader | None = None,
) -> dict[str, float]:
    from moerl.components.policy_update.trainer import run_policy_update

    t0 = time.perf_counter()
    if mesh is not None:  # the run's ranks, state in memory: they write the version's files
        metrics = mesh.train_version(samples, version, out_dir)
    else:  # ranks started per version: load and save through files
        batch_path = out_dir.parent / "batch.jsonl"
        write_records(batch_path, samples)
        metrics = run_policy_update(cfg, batch_path, state_dir, out_dir, version)
    # the mesh's own (fewer samples than ranks train nothing either), else none at all
    metrics.setdefault("train/empty_batch", float(not samples))
    metrics["timing/policy_update_s"] = time.perf_counter() - t0
    return metrics


def _take_over(cfg: RunConfig, run_id: str, bus: RunBus) -> tuple[int, Tiers, int]:
    """Claim the run (`epoch`: any older trainer still running is fenced off) and recover the
    version it continues from (`latest`), with the run's tiers fenced by the epoch."""
    bus.ensure_groups()
    abandoned = bus.failed()
    if abandoned:
        raise DataError(
            f"trainer: run {run_id} was abandoned ({abandoned}); start a new run or resume it with a "
            "new pipeline run"
        )
    from moerl.components.publish_checkpoint.outage import retrying

    def waited(what: str, call):  # a store away for minutes (a brownout): checkpoint.outage_s
        return retrying(f"trainer recovery: {what}", call, cfg.checkpoint.outage_s)

    # the run's one trainer from here on: any older trainer still running is fenced off
    # above the store's newest too: a Valkey that lost its counter (a flush) restarts it at 1
    floor = waited("reading the store's trainer epoch", lambda: store_epoch(cfg, run_id))
    epoch = bus.claim_trainer(f"{socket.gethostname()}/{os.getpid()}", floor=floor)
    # every tier write and `latest` move fenced by the epoch
    tiers = run_tiers(cfg.checkpoint, run_id, epoch)
    # a version servable but not durable is promoted, if it is the one the servable pointer names
    # and it carries no trainer/ state (the cache tier never holds it: one with state is dropped
    # and trained again, and set_servable below points the engines back at `latest`)
    # (a complete cache-tier copy that no pointer names is another writer's, and is dropped)
    ptr = bus.servable()
    latest = waited(
        f"reading run {run_id}'s versions in {tiers.durable.uri}",
        lambda: tiers.recover(servable=None if ptr is None else (ptr.version, ptr.manifest_sha256)),
    )
    if latest is None:
        raise CheckpointError(
            f"trainer: run {run_id} has no published version under {cfg.checkpoint.uri}; "
            "init_policy publishes version 0 first"
        )
    return epoch, tiers, latest


def run_trainer(cfg: RunConfig, run_id: str, mesh: Leader | None = None) -> PolicyVersion:
    """The async trainer's loop. `mesh`: rank 0 of the run's mesh (`mesh.py`), which trains
    every version with the other ranks; None: this process as a one-rank mesh for the run
    (`trainer.parallelism.world_size` 1), or ranks started per version
    (`trainer.parallelism.persistent_ranks: false`)."""
    tc = cfg.trainer.parallelism
    if mesh is None and tc.persistent_ranks and not tc.on_mesh:
        from moerl.components.policy_update.mesh import in_process

        with in_process(cfg, run_id) as leader:  # this process, a one-rank mesh for the run
            return run_trainer(cfg, run_id, leader)
    stage_start(cfg, CONSUMER, run_id)  # records where it runs; enforces `require:`
    bus = RunBus(
        connect(cfg.valkey.url, cfg.valkey.reconnect_s, cfg.valkey.username),
        run_id,
        cfg.units.visibility_timeout_s,
        cfg.units.max_attempts,
    )
    epoch, tiers, latest = _take_over(cfg, run_id, bus)
    durable = check_durable(bus, cfg, run_id)
    reconcile(bus, cfg, run_id, latest, epoch)
    # engines serve what this trainer continues from (a lost servable version is rolled back)
    bus.set_servable(
        epoch, latest, version_uri(tiers.durable, latest), tiers.durable.manifest(latest).sha256()
    )
    # issuing first: the engines generate the first batch while the state loads (admission
    # needs only the version, the epoch and the dataset)
    issuer = Issuer(
        cfg,
        RunBus(connect(cfg.valkey.url, cfg.valkey.reconnect_s, cfg.valkey.username), run_id),
        TrainerState(version=latest, committed=latest),
        epoch,
    )
    issuer.start()
    fleet = None
    try:
        fleet = fleet_controller(cfg, run_id)
        return _train_versions(cfg, run_id, mesh, bus, tiers, latest, epoch, durable, issuer)
    finally:
        issuer.stop_event.set()
        issuer.join(timeout=5)
        if fleet is not None:
            fleet.stop()


def fleet_controller(cfg: RunConfig, run_id: str):
    """On the cluster (`cluster.launch.mode: kubernetes`) with an elastic fleet: the fleet's
    controller (components/rollout/fleet.py), started; else None (the local launcher runs its
    own, and a fixed fleet has none)."""
    if not (cfg.rollout.elastic and cfg.cluster.launch.mode == "kubernetes"):
        return None
    bus = RunBus(connect(cfg.valkey.url, cfg.valkey.reconnect_s, cfg.valkey.username), run_id)
    keda = cfg.cluster.launch.fleet_scaler == "keda"
    try:
        actuator = KubeActuator(run_id)
    except Exception as err:  # noqa: BLE001 - named and re-raised: the run cannot scale as asked
        raise ConfigError(
            f"rollout.min_workers / max_workers on the cluster: the trainer scales the run's fleet "
            f"through the Kubernetes API from its pod (cluster.launch.fleet_scaler "
            f"{cfg.cluster.launch.fleet_scaler}), and could not reach it: {err}"
        ) from err
    controller = FleetController(cfg, bus, actuator, keda=keda)
    controller.start()
    log.info(
        "fleet: %s between %d and %d workers",
        "KEDA scales the fleet, its lagCount kept by this trainer"
        if keda
        else "this trainer scales the fleet",
        *cfg.rollout.fleet_bounds,
    )
    return controller


@dataclass
class _Start:
    """Where the trainer continues from: the state's folder, the load's metrics (logged with the
    first version), and whether the mesh continues from older weights than the engines serve."""

    state_dir: Path
    metrics: dict[str, float] = field(default_factory=dict)
    behind: bool = False


def _resume(
    cfg: RunConfig, run_id: str, mesh: Leader | None, tiers: Tiers, latest: int, work: Path
) -> _Start:
    """Lay out (and, on the run's mesh, load) the state the trainer continues from: `latest`'s,
    or on a mesh the newest version that carries the trainer's state (`checkpoint.state_every`)."""
    from moerl.components.publish_checkpoint.stage import prepare_resume

    if mesh is None:
        prepare_resume(cfg, run_id, latest, work / f"v{latest}")
        return _Start(work / f"v{latest}")
    from moerl.components.policy_update.ep_optimizer import STATE_SHARDS
    from moerl.components.policy_update.mesh import newest_with_state

    # checkpoint.state_every > 1: the newest versions may carry engine weights only
    start = newest_with_state(tiers.durable, latest)
    if start < latest:
        log.warning(
            "version %d is the newest with the trainer's state (checkpoint.state_every %d): "
            "continuing from its weights and Adam state; the updates of versions %d-%d are lost "
            "(they stay published, their groups consumed)",
            start,
            cfg.resolved.state_every,
            start + 1,
            latest,
        )
    state_dir = work / f"v{start}"
    # once for the run, every rank reading only its shard: without the ranks' state shards, each
    # rank fetches those it reads
    prepare = functools.partial(prepare_resume, cfg, run_id, start, state_dir, exclude=STATE_SHARDS)
    metrics = mesh.load_state(state_dir, start, at=latest, prepare=prepare)
    metrics["trainer/resumed_versions_lost"] = float(latest - start)
    return _Start(state_dir, metrics, behind=start < latest)


def _known_shas(cfg: RunConfig, tiers: Tiers, latest: int) -> dict[int, str]:
    """The manifest sha256 of each version a sample may still be trained from (`TrainerState.known`)."""
    known: dict[int, str] = {}
    for v in range(max(0, latest - cfg.buffer.max_staleness), latest + 1):
        try:
            known[v] = tiers.durable.manifest(v).sha256()
        except CheckpointError:  # pruned by retention: samples that old are stale by number anyway
            pass
    return known


@dataclass
class _Rates:
    """The counters at the last version logged, for the per-second rates between versions."""

    t: float
    tokens: float
    generated: float
    consumed: float

    def advance(self, metrics: dict[str, float]) -> dict[str, float]:
        """The rates since the last version, from this version's `async/*` metrics."""
        now = _Rates(
            time.perf_counter(),
            metrics["async/tokens_generated"],
            metrics["async/generated"],
            metrics["async/trained"] + metrics["async/filtered"],
        )
        dt = max(now.t - self.t, 1e-9)
        out = {
            "throughput/rollout_tokens_per_s": (now.tokens - self.tokens) / dt,
            "async/producer_samples_per_s": (now.generated - self.generated) / dt,
            "async/consumer_samples_per_s": (now.consumed - self.consumed) / dt,
        }
        self.t, self.tokens, self.generated, self.consumed = (
            now.t,
            now.tokens,
            now.generated,
            now.consumed,
        )
        return out


class _Loop:
    """The trainer's versions, one at a time (`version`), then the run's end (`finish`). The
    publisher makes each version servable, then durable, then commits it on its own thread
    (`Commits`), off the loop's critical path."""

    def __init__(
        self,
        cfg: RunConfig,
        run_id: str,
        mesh: Leader | None,
        bus: RunBus,
        epoch: int,
        issuer: Issuer,
        publisher: Publisher,
        start: _Start,
    ) -> None:
        self.cfg, self.run_id, self.mesh, self.bus, self.epoch = cfg, run_id, mesh, bus, epoch
        self.issuer, self.state, self.publisher = issuer, issuer.state, publisher
        self.uri = tracking.resolve_uri(cfg.tracking)
        self.stream = cfg.resolved.stream
        self.state_dir, self.load_metrics = start.state_dir, start.metrics
        self.resumed_behind = start.behind  # the mesh continues from older weights than `latest`'s
        self.inbox = Inbox(bus, EntryCheck.for_run(cfg, bus, start.state_dir))
        # rollout.weight_sync collective: each version by session, beside its publication
        self.wire = (
            WireSender(cfg, bus, mesh, epoch, self.state)
            if mesh is not None and cfg.rollout.resolved.weight_sync == "collective"
            else None
        )
        self.t_start, self.busy = time.perf_counter(), 0.0
        c0 = bus.counters()
        self.rates = _Rates(
            self.t_start, c0["tokens_generated"], c0["generated"], c0["trained"] + c0["filtered"]
        )

    def version(self, version: int, out_dir: Path) -> None:
        """Train version `version` + 1 into `out_dir`: 1. gather its groups (streamed: trained
        minibatch by minibatch as they come); 2. train (streamed: save); 3. (weight_sync
        collective) send it to the engines; 4. hand it to the publisher (which may stall on
        `checkpoint.max_unpublished`); 5. log it and beat."""
        t_v = time.perf_counter()
        streamed = self._streamed(version)
        batch, metrics = self._gather(version, streamed)
        check_failures(self.bus, self.cfg)
        t_busy = time.perf_counter()
        metrics.update(self._train(batch, version, streamed, out_dir))
        if streamed is not None:  # its steps ran while it gathered
            metrics["timing/buffer_wait_s"] -= streamed.seconds
        if self.wire is not None:  # to the engines first: the publisher's backlog never gates it
            metrics.update(self.wire.send(version + 1))
        metrics["weights/trainer_stall_s"] = self._submit(batch, version, out_dir)
        self.busy += time.perf_counter() - t_busy
        self.state_dir = out_dir
        self._published()
        self._log(version, batch, metrics, t_v)

    def _streamed(self, version: int) -> Streamed | None:
        """Streamed (`trainer.schedule.stream`): the version's minibatches, trained as they come."""
        behind, self.resumed_behind = self.resumed_behind, False
        if not self.stream:
            return None
        # a resumed mesh that continues from older weights than the engines serve
        # (checkpoint.state_every): their logprobs are not its pi_old this version
        pi_old = "proximal" if behind else self.cfg.resolved.stream_pi_old
        return Streamed(self.cfg, self.bus, self.mesh, version, pi_old)

    def _gather(self, version: int, streamed: Streamed | None) -> tuple[Batch, dict[str, float]]:
        """The version's groups, beside those of the versions still publishing."""
        jobs = self.publisher.in_flight()
        held = frozenset(g for job in jobs for g in job.context["groups"])
        held_entries = frozenset(e for job in jobs for e in job.context["entries"])
        recommit(self.bus, self.cfg, self.run_id, self.state.committed, self.epoch)
        known = self.state.known  # (list(): one C-level copy; the publisher's thread adds to it)
        for v in [v for v in list(known) if v < version - self.cfg.buffer.max_staleness]:
            known.pop(v, None)
        return gather(
            self.bus,
            self.cfg,
            version,
            self.inbox,
            self.epoch,
            self.issuer,
            held,
            held_entries,
            # streamed, the version's own sha is known only once it is servable, after the
            # gather began: the live map (the publisher's thread only adds to it)
            known if self.stream else dict(known),
            on_chunk=streamed,
            check=self._check,
            publishing=lambda: len(self.publisher.in_flight()),
        )

    def _check(self) -> None:
        """At every loop of a gather: the publisher's failure raised; catch-ups served."""
        self.publisher.check()
        if self.wire is not None:
            self.wire.serve_catchups()

    def _train(
        self, batch: Batch, version: int, streamed: Streamed | None, out_dir: Path
    ) -> dict[str, float]:
        """The version's update and files (streamed: its steps ran, it is saved), with the
        state load's metrics on the first version."""
        if streamed is not None:
            metrics = streamed.save(out_dir)
            self.busy += streamed.seconds
        else:
            samples = train_samples(batch.used, self.cfg.buffer)
            metrics = _train(self.cfg, samples, version, self.state_dir, out_dir, self.mesh)
        metrics.update(self.load_metrics)  # the first version's only
        self.load_metrics = {}
        return metrics

    def _submit(self, batch: Batch, version: int, out_dir: Path) -> float:
        """Hand the version to the publisher (servable, durable, then committed with its
        groups); the seconds the loop stalled on it."""
        n_used = sum(len(g) for g in batch.used)
        n_filtered = sum(len(g) for g in batch.groups) - n_used
        counts = {"trained": n_used, "filtered": n_filtered, "groups_used": batch.n_groups}
        meta = {
            "groups": json.dumps(batch.group_ids),
            "entries": json.dumps(batch.entry_ids),
            "counts": json.dumps(counts),
            **{k: str(v) for k, v in self.bus.positions().items()},
        }
        # a superseded trainer must not publish (the store refuses a second v+1 too)
        self.bus.check_epoch(self.epoch)
        stall = self.publisher.submit(
            version + 1,
            out_dir,
            meta,
            context={"entries": batch.entry_ids, "groups": batch.group_ids, "counts": counts},
        )
        if not self.stream:  # streamed: once servable (`Commits.servable`)
            self.state.version = version + 1
        return stall

    def _published(self) -> None:
        """Log each durable version's publication metrics at its iteration's step; drop its
        folder unless it is the state the trainer continues from."""
        for job in self.publisher.take_finished():
            tracking.log_metrics(self.uri, self.run_id, job.version - 1, job.metrics)
            if job.src != self.state_dir:
                shutil.rmtree(job.src, ignore_errors=True)

    def _log(self, version: int, batch: Batch, metrics: dict[str, float], t_v: float) -> None:
        metrics.update(batch_metrics(batch, version))
        metrics.update(_async_metrics(self.bus, self.t_start, self.busy))
        metrics["timing/iteration_s"] = time.perf_counter() - t_v
        metrics["policy/version"] = float(version)
        metrics["reward/failed_samples"] = metrics["buffer/failed_samples"]
        metrics.update(self.rates.advance(metrics))
        tracking.log_metrics(self.uri, self.run_id, version, metrics)
        self.bus.heartbeat(
            CONSUMER,
            busy_s=self.busy,
            wall_s=time.perf_counter() - self.t_start,
            version=float(version + 1),
            reward_mean=metrics["reward/mean"],
            loss=metrics.get("train/loss", 0.0),
        )

    def finish(self, pbus: RunBus) -> PolicyVersion:
        """The last version durable and committed, the final counters logged, the run done."""
        self.publisher.drain()
        self._published()
        # the run's final counters, after the last commit moved them: the values logged with the
        # last version were read before its groups were committed, one version short of the
        # balance (generated - duplicates = trained + filtered + stale_dropped + failed +
        # samples_dead). Same step, later timestamp: MLflow's latest value is this one.
        last = self.cfg.pipeline.versions - 1
        tracking.log_metrics(
            self.uri, self.run_id, last, _async_metrics(self.bus, self.t_start, self.busy)
        )
        policy = pbus.registry()
        if policy is None:  # every version was committed to it: Valkey lost its registry
            raise CheckpointError("trainer: the version registry is empty at the end of the run")
        self.bus.set_done()
        # bounded state: a shared Valkey forgets finished runs
        self.bus.expire_run(self.cfg.valkey.finished_ttl_s)
        return PolicyVersion(
            version=policy.version, uri=policy.uri, manifest_sha256=policy.manifest_sha256
        )


def _train_versions(
    cfg: RunConfig,
    run_id: str,
    mesh: Leader | None,
    bus: RunBus,
    tiers: Tiers,
    latest: int,
    epoch: int,
    durable: bool,
    issuer: Issuer,
) -> PolicyVersion:
    """The trainer's loop from `latest` on, once it owns the run (`epoch`) and issues work:
    1. the state it continues from; 2. what each recent version number means; 3. the publisher
    and its commits; 4. every version to `pipeline.versions`; 5. the run's end."""
    work = Path(tempfile.mkdtemp(prefix="moerl-trainer-"))
    start = _resume(cfg, run_id, mesh, tiers, latest, work)
    pbus = RunBus(connect(cfg.valkey.url, cfg.valkey.reconnect_s, cfg.valkey.username), run_id)
    issuer.state.known.update(_known_shas(cfg, tiers, latest))
    commits = Commits(cfg, pbus, epoch, durable, issuer.state)
    publisher = Publisher(
        cfg,
        run_id,
        on_servable=commits.servable,
        on_durable=commits.commit,
        epoch=epoch,
        parts=None if mesh is None else mesh.parts,  # the files the mesh's other nodes hold
    )
    try:
        loop = _Loop(cfg, run_id, mesh, bus, epoch, issuer, publisher, start)
        for version in range(latest, cfg.pipeline.versions):
            loop.version(version, work / f"v{version + 1}")
        return loop.finish(pbus)
    finally:
        publisher.close()
        shutil.rmtree(work, ignore_errors=True)


def _async_metrics(bus: RunBus, t_start: float, busy: float) -> dict[str, float]:
    """Counters, stream depths and per-stage busy fractions, as `async/*` metrics."""
    c = bus.counters()
    out = {f"async/{k}": float(v) for k, v in c.items()}
    out.update({f"async/depth_{k}": float(v) for k, v in bus.depth().items()})
    wall = time.perf_counter() - t_start
    out["async/trainer_busy_fraction"] = busy / max(wall, 1e-9)
    for name, st in bus.stats().items():
        if name != CONSUMER and st.get("wall_s"):
            out[f"async/busy_fraction/{name}"] = st.get("busy_s", 0.0) / st["wall_s"]
        # a rollout worker's start -> its first generated group (fast start)
        if st.get("first_sample_s"):
            out[f"async/first_sample_s/{name}"] = st["first_sample_s"]
        if st.get("engine_load_s"):  # its last engine's load (the early engine's, on dummy weights)
            out[f"async/engine_load_s/{name}"] = st["engine_load_s"]
        if st.get("unit_tail_median_s"):  # multi-turn: a unit's last episode against its median one
            out[f"async/unit_tail_ratio/{name}"] = st["unit_tail_last_s"] / st["unit_tail_median_s"]
    out["async/workers_alive"] = float(sum(n.startswith("rollout") for n in bus.alive()))
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", required=True)
    ap.add_argument("--run-id", required=True)
    a = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s trainer %(levelname)s %(message)s")
    text = Path(a.config).read_text()
    cfg = config_from_json(text)
    # as the component does: the process's own scratch when pod-shaped, and in a sandbox given
    # the cluster's Secrets, its pod's credentials and no others
    enter_pod("async_trainer", text)
    try:
        result = run_async_trainer(cfg, a.run_id)
    except MeshFailed as err:  # a rank's own exit code (rank 0's, when it failed)
        log.error("%s", err)
        return err.code
    except MoerlError as err:  # one line, no traceback: fenced off, abandoned, a bad commit
        log.error("%s", err)
        return err.exit_code
    if result:  # "" on a node other than the mesh's first
        print(result, flush=True)
    return 0


def run_async_trainer(cfg: RunConfig, run_id: str) -> str:
    """The async trainer stage, wherever it runs (a local process, a launched pod, a TrainJob
    node): the final PolicyVersion as JSON, or "" on a mesh node other than the first. On a mesh
    with `trainer.parallelism.persistent_ranks`, the ranks start once for the run and rank 0
    runs `run_trainer` (`mesh.py`); otherwise `run_trainer` in this process."""
    tc = cfg.trainer.parallelism
    if tc.on_mesh and tc.persistent_ranks:
        return run_mesh_trainer(cfg, run_id)
    return run_trainer(cfg, run_id).model_dump_json()


if __name__ == "__main__":
    sys.exit(main())
