"""Trainer (async mode): consume batches as they become ready, publish each version, bump the
registry; issue work by admission from a thread beside it.

Design, details and limitations: docs/stages.md#componentspolicy_updateworkerpy.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import socket
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from moerl import tracking
from moerl.bus import SCORED, BusError, RunBus, connect
from moerl.components.buffer.worker import (
    Batch,
    batch_metrics,
    classify,
    prompts_to_issue,
    train_samples,
)
from moerl.config import RunConfig, config_from_json
from moerl.errors import CheckpointError, ConfigError, DataError, MoerlError
from moerl.launch.podenv import enter_pod
from moerl.records import PolicyVersion, ScoredSample, write_records
from moerl.store.runs import run_store, version_uri
from moerl.store.tiers import run_tiers
from moerl.tasks.dataset import load_dataset
from moerl.tracking import check_pinned

if TYPE_CHECKING:
    from moerl.components.policy_update.mesh import Leader

log = logging.getLogger(__name__)
CONSUMER = "trainer"
BEACON_EVERY_S = 5.0


class Issuer(threading.Thread):
    """Issues work units by admission and backpressure, every `period_s`, until stopped."""

    def __init__(
        self,
        cfg: RunConfig,
        bus: RunBus,
        version_ref: list[int],
        epoch: int,
        period_s: float = 0.05,
    ):
        super().__init__(name="moerl-issuer", daemon=True)
        self.cfg, self.bus, self.version_ref, self.epoch, self.period_s = (
            cfg,
            bus,
            version_ref,
            epoch,
            period_s,
        )
        self.stop_event = threading.Event()
        self.paused = False
        self.gathered = (0, 0)  # (groups, signal groups) the trainer holds for its current version
        self.error: BaseException | None = None
        self.ds = load_dataset(cfg.task.dataset, cfg.task.max_bad_fraction, cfg.checkpoint)
        check_pinned(self.ds, cfg, bus.run_id)  # a restarted trainer reads what the run began on

    def step(self) -> int:
        self.bus.check_epoch(self.epoch)  # a superseded trainer issues nothing more
        c = self.bus.counters()
        settled = c["groups_used"] + c["groups_stale"] + c["groups_failed"] + c["prompts_dead"]
        in_flight = c["prompts_issued"] - settled
        n, self.paused = prompts_to_issue(
            used=c["groups_used"],
            in_flight=in_flight,
            version=self.version_ref[0],
            batch_prompts=self.cfg.task.prompts_per_iteration,
            versions=self.cfg.pipeline.versions,
            max_staleness=self.cfg.buffer.max_staleness,
            backlog=self.bus.backlog(),
            paused=self.paused,
            cfg=self.cfg.buffer,
            signal_used=c["trained"] // self.cfg.rollout.samples_per_prompt,
            gathered=self.gathered,
        )
        issued = 0
        while issued < n:
            size = min(self.cfg.units.max_prompts, n - issued)
            start = self.bus.cursor(size)
            prompts = self.ds.window(start, size, self.cfg.task.shuffle_seed)
            self.bus.issue_unit([p.model_dump() for p in prompts])
            issued += size
        return issued

    def run(self) -> None:
        try:
            beacon_at = 0.0
            while not self.stop_event.is_set():
                # the workers' TrainerWatch reads it
                if time.monotonic() - beacon_at > BEACON_EVERY_S:
                    self.bus.trainer_beacon()
                    beacon_at = time.monotonic()
                self.step()
                self.stop_event.wait(self.period_s)
        except BaseException as err:  # noqa: BLE001 - surfaced by the trainer loop
            self.error = err


def _reconcile(bus: RunBus, cfg: RunConfig, run_id: str, latest: int, epoch: int) -> None:
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


def _recommit(bus: RunBus, cfg: RunConfig, run_id: str, committed: int, epoch: int) -> None:
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


def _check_durable(bus: RunBus, cfg: RunConfig, run_id: str) -> bool:
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


def _scored_samples(group: dict) -> None:
    """Parse a scored group in place: every field the trainer reads is checked here, so a group
    that does not parse (a bug, or a forged entry) is dead-lettered by the bus instead of
    crashing the trainer at every restart: its samples are ScoredSamples of one prompt, its
    `t_generated` (if any) a finite time no later than now (plus clock skew)."""
    import math

    samples = [ScoredSample.model_validate(s) for s in group["samples"]]
    if len({s.prompt_id for s in samples}) != 1:
        raise ValueError("a group's samples answer one prompt; these answer several")
    if "t_generated" in group:
        t = group["t_generated"]
        if (
            isinstance(t, bool)
            or not isinstance(t, (int, float))
            or not math.isfinite(t)
            or not 0 < t < time.time() + 3600
        ):
            raise ValueError(f"t_generated must be a unix time, got {str(t)[:40]!r}")
    group["samples"] = samples


def _alive(bus: RunBus, issuer: Issuer, epoch: int) -> None:
    """Raise instead of waiting on: the issuer thread died (nothing would be issued again, and
    the workers would take the missing beacon for a dead trainer), the run was abandoned, or a
    newer trainer took the run over."""
    if issuer.error is not None:
        raise issuer.error
    if not issuer.is_alive():
        raise DataError("trainer: the issuer thread stopped; see the log above")
    reason = bus.failed()
    if reason:
        raise DataError(f"trainer: run abandoned ({reason})")
    bus.check_epoch(epoch)


class Inbox:
    """Where the trainer's groups come from, across versions: first the entries already
    delivered to its consumer and not in its hands (its pending list: what a killed
    predecessor held, or what a reply lost to a dropped connection delivered unseen), then new
    ones. Never more than asked, so a version takes exactly its B groups and the rest stays
    pending for the next one.

    Why it lives across versions: a trainer killed during a publication held two versions'
    groups (the one publishing and the one it was gathering), and a restarted trainer that read
    its pending list only inside its first gather, stopping when that version was full, left
    the rest pending for good: never trained, never settled, so admission counted them in
    flight for ever and issued nothing once the run's last prompts were out (the issue-35 hang
    after an S3 outage). Now every gather, and every loop of it, compares the pending count
    with what the trainer holds (one XPENDING summary): entries pending and not held are
    re-read from the start of the list."""

    def __init__(self, bus: RunBus) -> None:
        self.bus = bus
        self.after: str | None = "0"  # a new trainer first takes back what its predecessor held
        self.rescans = 0

    def check(self, in_hand: set[str]) -> None:
        """Rescan the pending list when it holds entries the trainer does not (a lost reply)."""
        if self.after is None and self.bus.pending_count(SCORED, CONSUMER) > len(in_hand):
            self.after, self.rescans = "0", self.rescans + 1
            log.warning(
                "the trainer's pending list holds entries it does not (a lost reply, or a predecessor's); "
                "reading them back"
            )

    def take(self, n: int, in_hand: set[str]) -> list[tuple[str, dict]]:
        if self.after is not None:
            got, self.after = self.bus.take_pending(
                SCORED, CONSUMER, self.after, validate=_scored_samples, count=n, skip=in_hand
            )
            if got or self.after is not None:
                return got
        return self.bus.take_scored(CONSUMER, n, block_ms=200, validate=_scored_samples)


def _stalled(
    bus: RunBus, cfg: RunConfig, version: int, have: int, want: int, quiet_s: float
) -> DataError:
    """The watchdog's one line: what the trainer waited on, and what the run looked like."""
    c = bus.counters()
    settled = c["groups_used"] + c["groups_stale"] + c["groups_failed"] + c["prompts_dead"]
    workers = sum(n.startswith("rollout") for n in bus.alive())
    return DataError(
        f"trainer: no progress for {quiet_s:.0f} s (pipeline.stall_timeout_s) while gathering version {version + 1}: "
        f"waited on scored groups, holding {have} of {want}; prompts issued {c['prompts_issued']}, unsettled "
        f"{c['prompts_issued'] - settled}, backlog {bus.backlog()} groups, generated {c['generated']}, scored "
        f"{c['scored']}, rollout workers alive {workers}/{cfg.rollout.workers}"
    )


def _gather(
    bus: RunBus,
    cfg: RunConfig,
    version: int,
    inbox: Inbox,
    epoch: int,
    issuer: Issuer,
    held: frozenset[str] = frozenset(),
    held_entries: frozenset[str] = frozenset(),
    known: dict[int, str] | None = None,
    on_chunk: Callable[[list[list[ScoredSample]]], None] | None = None,
    check: Callable[[], None] | None = None,
) -> tuple[Batch, dict[str, float]]:
    """Block until B fresh groups are in; settle the rest as they come. `held`, `held_entries`:
    the groups and entries of versions still being published (trained, not yet committed).
    `on_chunk` (`trainer.optimizer.stream`): called with the trainable groups of every `stream_chunk`
    groups taken, in arrival order, and of the last ones, as they come in. `check`: called at
    every loop, raises what makes the wait pointless (a failed publisher: streamed, the next
    version's prompts wait for its publication)."""
    B, k = cfg.task.prompts_per_iteration, cfg.buffer.max_staleness
    S, limit = cfg.buffer.min_signal_groups, cfg.buffer.gather_limit
    batch, dropped = Batch(), {"duplicates": 0, "stale_dropped": 0, "failed": 0}
    t0 = time.perf_counter()

    def wanted() -> int:
        """Groups still to take: B in all, or (dynamic sampling) S with signal, within the limit."""
        if S is None:
            return B - batch.n_groups
        return min(S - len(batch.used), limit - batch.n_groups)

    def pulse() -> tuple[int, ...]:  # what moves when the run makes progress
        c = bus.counters()
        return (
            c["prompts_issued"],
            c["generated"],
            c["scored"],
            c["groups_used"],
            c["groups_stale"],
            c["groups_failed"],
            c["prompts_dead"],
            c["samples_dead"],
            batch.n_groups,
        )

    issuer.gathered = (0, 0)
    last_pulse, moved_at = pulse(), time.monotonic()
    chunk = stream_chunk(cfg)
    taken, trainable = 0, []  # the chunk being taken: its groups, those it trains on
    while wanted() > 0:
        _alive(bus, issuer, epoch)
        if check is not None:
            check()
        in_hand = set(held_entries) | set(batch.entry_ids)
        inbox.check(in_hand)
        got = inbox.take(wanted(), in_hand)
        if not got:
            now_pulse = pulse()
            if now_pulse != last_pulse:
                last_pulse, moved_at = now_pulse, time.monotonic()
            elif time.monotonic() - moved_at > cfg.pipeline.stall_timeout_s:
                raise _stalled(
                    bus,
                    cfg,
                    version,
                    batch.n_groups,
                    B if S is None else S,
                    time.monotonic() - moved_at,
                )
            continue
        moved_at = time.monotonic()
        consumed = bus.consumed([g["group_id"] for _, g in got])
        for eid, g in got:
            gid = g["group_id"]
            samples = g["samples"]
            d = classify(gid, samples, version, k, consumed | held | set(batch.group_ids), known)
            n = len(samples)
            if d == "duplicate":
                bus.settle(epoch, [eid], [], duplicates=n)
                dropped["duplicates"] += n
            elif d == "stale":
                bus.settle(epoch, [eid], [gid], stale_dropped=n, groups_stale=1)
                dropped["stale_dropped"] += n
            elif d == "failed":
                bus.settle(epoch, [eid], [gid], failed=n, groups_failed=1)
                dropped["failed"] += n
            else:
                batch.entry_ids.append(eid)
                batch.group_ids.append(gid)
                batch.groups.append(samples)
                if "t_generated" in g:
                    batch.waits_s.append(max(0.0, time.time() - float(g["t_generated"])))
                if d == "used":
                    batch.used.append(samples)
                    trainable.append(samples)
                taken += 1
                if on_chunk is not None and (taken == chunk or wanted() == 0):
                    on_chunk(trainable)
                    taken, trainable = 0, []
        issuer.gathered = (batch.n_groups, len(batch.used))
    extra: dict[str, float] = {}
    if S is not None:
        short = max(0, S - len(batch.used))
        if short:
            log.warning(
                "version %d: %d groups consumed, only %d with reward variance (buffer.min_signal_groups %d, "
                "buffer.max_gather_groups %d); training on those",
                version,
                batch.n_groups,
                len(batch.used),
                S,
                limit,
            )
        extra = {
            "buffer/signal_groups": float(len(batch.used)),
            "buffer/signal_shortfall_groups": float(short),
        }
    return batch, {
        "timing/buffer_wait_s": time.perf_counter() - t0,
        "buffer/pending_rescans": float(inbox.rescans),
        **extra,
        **{f"buffer/{k}_samples": float(v) for k, v in dropped.items()},
    }


def stream_chunk(cfg: RunConfig) -> int:
    """`trainer.optimizer.stream`: the groups in one streamed minibatch, ceil(B / optimizer steps), so
    that a version takes at most `optimizer_steps_per_iteration` steps (fewer when B is not a
    multiple of it, and none for a minibatch whose groups all lack reward variance)."""
    steps = cfg.trainer.optimizer.optimizer_steps_per_iteration
    return max(1, -(-cfg.task.prompts_per_iteration // steps))


def _weight_key(key: str) -> str | None:
    """The total a per-minibatch mean of `key` is weighted by when merged, if any."""
    if key.startswith("rollout_corr/"):
        split = key.split("/")
        return "/".join([*split[:-1], "tokens"]) if len(split) > 2 else "rollout_corr/tokens"
    if key == "train/logprob_mismatch":
        return "train/tokens"
    if key.startswith(("moe/routing_", "moe/replay_")) or key == (
        "moe/token_any_layer_mismatch_fraction"
    ):
        return "moe/routing_tokens"
    return None


# what the whole-batch path reports from its last step
LAST_STEP = ("moe/tokens_expert_", "moe/expert_load_imbalance", "moe/router_max_load_ratio")


def merge_steps(steps: list[dict[str, float]], engine_pi_old: bool = True) -> dict[str, float]:
    """One version's metrics from its streamed minibatches' (`trainer.optimizer.stream`), each reduced as
    the whole-batch path reduces it over steps: counts and token totals summed, maxima and
    minima kept, per-token means weighted by their tokens, the load statistics the last
    step's, `train/*` averaged over the minibatches that took a step. With the engine's
    logprobs as pi_old (`engine_pi_old`), what compares pi_old with them is left out (0)."""
    out: dict[str, float] = {"trainer/streamed_minibatches": float(len(steps))}
    stepped = [m for m in steps if m.get("train/steps", 0.0) > 0] or steps
    for key in sorted({k for m in steps for k in m}):
        if engine_pi_old and (key == "train/logprob_mismatch" or key.startswith("rollout_corr/")):
            continue
        have = [m for m in steps if key in m]
        vals = [m[key] for m in have]
        weight = _weight_key(key)
        if key in ("train/steps", "train/skipped_steps") or key.endswith(
            ("tokens", "rs_masked_sequences")
        ):
            out[key] = sum(vals)
        elif key.endswith("_max"):
            out[key] = max(vals)
        elif key.endswith("_min"):
            out[key] = min(vals)
        elif key.startswith(LAST_STEP):
            out[key] = vals[-1]
        elif weight is not None:
            w = [m.get(weight, 0.0) for m in have]
            out[key] = sum(v * x for v, x in zip(vals, w)) / sum(w) if sum(w) else vals[-1]
        else:
            some = [m[key] for m in stepped if key in m] or vals
            out[key] = sum(some) / len(some)
    out["train/empty_batch"] = float(not steps or all(m["train/empty_batch"] for m in steps))
    return out


class Streamed:
    """`trainer.optimizer.stream`: one version trained minibatch by minibatch on the run's mesh, each as
    `_gather` takes its groups (`__call__`), then written (`save`)."""

    def __init__(
        self, cfg: RunConfig, bus: RunBus, mesh: Leader | None, version: int, pi_old: str
    ) -> None:
        if mesh is None:
            raise ConfigError(
                "trainer.optimizer.stream: true cannot run without the run's mesh; set "
                "trainer.parallelism.persistent_ranks: true"
            )
        self.cfg, self.bus, self.mesh, self.version = cfg, bus, mesh, version
        self.pi_old = pi_old  # engine | proximal (RunConfig.stream_pi_old, or the caller's)
        self.steps: list[dict[str, float]] = []
        self.seconds = 0.0  # in the minibatches' steps
        # samples too few for every rank to take one (a minibatch of mostly zero-variance
        # groups), carried into the next minibatch
        self.carry: list = []

    def __call__(self, groups: list[list[ScoredSample]]) -> None:
        _check_failures(self.bus, self.cfg)
        t = time.perf_counter()
        samples = self.carry + train_samples(groups, self.cfg.buffer)
        self.carry = samples if 0 < len(samples) < self.mesh.control.world else []
        if self.carry:
            samples = []
        self.steps.append(self.mesh.train_step(samples, self.version, len(self.steps), self.pi_old))
        self.seconds += time.perf_counter() - t

    def save(self, out_dir: Path) -> dict[str, float]:
        """The version's files, and its metrics (`merge_steps`, the save's)."""
        t = time.perf_counter()
        metrics = merge_steps(self.steps, self.pi_old == "engine")
        # what was left over after the last minibatch: fewer samples than ranks, untrained
        metrics["train/dropped_samples"] = float(len(self.carry))
        metrics["trainer/stream_pi_old_engine"] = float(self.pi_old == "engine")
        metrics.update(self.mesh.save_version(self.version, out_dir))
        metrics["timing/policy_update_s"] = self.seconds + time.perf_counter() - t
        return metrics


def _check_failures(bus: RunBus, cfg: RunConfig) -> None:
    c = bus.counters()
    if (
        c["scored"] >= cfg.task.prompts_per_iteration * cfg.rollout.samples_per_prompt
        and c["score_failed"] / c["scored"] > cfg.reward.max_failed_fraction
    ):
        raise DataError(
            f"reward: {c['score_failed']} of {c['scored']} scored samples failed "
            f"(> reward.max_failed_fraction {cfg.reward.max_failed_fraction}); see the scorers' logs"
        )


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
    from moerl.provenance import stage_start

    stage_start(cfg, CONSUMER, run_id)  # records where it runs; enforces `require:`
    bus = RunBus(
        connect(cfg.valkey.url, cfg.valkey.reconnect_s, cfg.valkey.username),
        run_id,
        cfg.units.visibility_timeout_s,
        cfg.units.max_attempts,
    )
    bus.ensure_groups()
    abandoned = bus.failed()
    if abandoned:
        raise DataError(
            f"trainer: run {run_id} was abandoned ({abandoned}); start a new run or resume it with a "
            "new pipeline run"
        )
    # the run's one trainer from here on: any older trainer still running is fenced off
    epoch = bus.claim_trainer(f"{socket.gethostname()}/{os.getpid()}")
    # every tier write and `latest` move fenced by the epoch
    tiers = run_tiers(cfg.checkpoint, run_id, epoch)
    # a version servable but not durable is promoted, if it is the one the servable pointer names
    # and it carries no trainer/ state (the cache tier never holds it: one with state is dropped
    # and trained again, and set_servable below points the engines back at `latest`)
    # (a complete cache-tier copy that no pointer names is another writer's, and is dropped)
    ptr = bus.servable()
    latest = tiers.recover(servable=None if ptr is None else (ptr.version, ptr.manifest_sha256))
    if latest is None:
        raise CheckpointError(
            f"trainer: run {run_id} has no published version under {cfg.checkpoint.uri}; "
            "init_policy publishes version 0 first"
        )
    durable = _check_durable(bus, cfg, run_id)
    _reconcile(bus, cfg, run_id, latest, epoch)
    # engines serve what this trainer continues from (a lost servable version is rolled back)
    bus.set_servable(
        epoch, latest, version_uri(tiers.durable, latest), tiers.durable.manifest(latest).sha256()
    )
    version_ref = [latest]
    # issuing first: the engines generate the first batch while the state loads (admission
    # needs only the version, the epoch and the dataset)
    issuer = Issuer(
        cfg,
        RunBus(connect(cfg.valkey.url, cfg.valkey.reconnect_s, cfg.valkey.username), run_id),
        version_ref,
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
    from moerl.components.rollout.fleet import FleetController, KubeActuator

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


def _train_versions(
    cfg: RunConfig,
    run_id: str,
    mesh: Leader | None,
    bus: RunBus,
    tiers,
    latest: int,
    epoch: int,
    durable: bool,
    issuer: Issuer,
) -> PolicyVersion:
    """The trainer's loop from `latest` on, once it owns the run (`epoch`) and issues work."""
    from moerl.components.publish_checkpoint.publisher import Job, Publisher
    from moerl.components.publish_checkpoint.stage import prepare_resume

    version_ref = issuer.version_ref
    uri = tracking.resolve_uri(cfg.tracking)
    work = Path(tempfile.mkdtemp(prefix="moerl-trainer-"))
    state_dir = work / f"v{latest}"
    load_metrics: dict[str, float] = {}
    resumed_behind = False  # the mesh continues from older weights than `latest`'s
    if mesh is not None:  # once for the run: every rank reads only its shard
        from moerl.components.policy_update.mesh import newest_with_state

        # checkpoint.state_every > 1: the newest versions may carry engine weights only
        start = newest_with_state(tiers.durable, latest)
        if start < latest:
            log.warning(
                "version %d is the newest with the trainer's state (checkpoint.state_every %d): "
                "continuing from its weights and Adam state; the updates of versions %d-%d are lost "
                "(they stay published, their groups consumed)",
                start,
                cfg.checkpoint.state_every,
                start + 1,
                latest,
            )
        from moerl.components.policy_update.ep_optimizer import STATE_SHARDS

        state_dir = work / f"v{start}"
        # without the ranks' state shards: each rank fetches those it reads
        load_metrics = mesh.load_state(
            state_dir,
            start,
            at=latest,
            prepare=lambda: prepare_resume(cfg, run_id, start, state_dir, exclude=STATE_SHARDS),
        )
        load_metrics["trainer/resumed_versions_lost"] = float(latest - start)
        resumed_behind = start < latest
    else:
        prepare_resume(cfg, run_id, latest, state_dir)
    pbus = RunBus(connect(cfg.valkey.url, cfg.valkey.reconnect_s, cfg.valkey.username), run_id)

    # what each recent version number means (its manifest sha256): a sample an engine generated
    # under the same number with other weights (a version lost, then published again) is stale
    known: dict[int, str] = {}
    for v in range(max(0, latest - cfg.buffer.max_staleness), latest + 1):
        try:
            known[v] = tiers.durable.manifest(v).sha256()
        except CheckpointError:  # pruned by retention: samples that old are stale by number anyway
            pass

    stream = cfg.streams

    def servable(p: PolicyVersion) -> None:
        known[p.version] = p.manifest_sha256  # before any engine can serve it
        pbus.set_servable(epoch, p.version, p.uri, p.manifest_sha256)
        if stream:  # its prompts once an engine can serve it: every sample on-policy
            version_ref[0] = max(version_ref[0], p.version)

    # the last version this trainer committed (the publisher's thread moves it)
    committed = [latest]

    def commit(job: Job) -> None:
        ctx, p = job.context, job.policy
        # published to S3 first: counted where operators look
        if job.metrics.get("weights/cache_tier_failed"):
            pbus.incr(cache_tier_failed=1)
        if not pbus.commit_version(
            epoch,
            job.version,
            p.uri,
            p.manifest_sha256,
            ctx["entries"],
            ctx["groups"],
            **ctx["counts"],
        ):
            reg = pbus.registry()
            raise CheckpointError(
                f"trainer: the commit of version {job.version} was refused: the registry "
                f"already holds version {reg.version if reg else '?'}, so another trainer "
                "committed it; stopping"
            )
        committed[0] = job.version
        if durable:  # the commit survives a crash or failover of Valkey before anyone acts on it
            local, reps = pbus.wait_durable(
                cfg.valkey.wait_aof_replicas, cfg.valkey.wait_aof_timeout_s
            )
            if local < 1 or reps < cfg.valkey.wait_aof_replicas:
                pbus.incr(commits_not_durable=1)
                log.warning(
                    "the commit of version %d is not yet durable after %.0f s (fsynced locally: %d, "
                    "replicas: %d of %d)",
                    job.version,
                    cfg.valkey.wait_aof_timeout_s,
                    local,
                    reps,
                    cfg.valkey.wait_aof_replicas,
                )

    publisher = Publisher(
        cfg,
        run_id,
        on_servable=servable,
        on_durable=commit,
        epoch=epoch,
        parts=None if mesh is None else mesh.parts,  # the files the mesh's other nodes hold
    )

    def published() -> None:
        """Log each durable version's publication metrics at its iteration's step; drop its
        folder unless it is the state the trainer continues from."""
        for job in publisher.take_finished():
            tracking.log_metrics(uri, run_id, job.version - 1, job.metrics)
            if job.src != state_dir:
                shutil.rmtree(job.src, ignore_errors=True)

    t_start, busy = time.perf_counter(), 0.0
    c0 = bus.counters()
    last = {
        "t": t_start,
        "tokens": c0["tokens_generated"],
        "generated": c0["generated"],
        "consumed": c0["trained"] + c0["filtered"],
    }
    try:
        inbox = Inbox(bus)
        for version in range(latest, cfg.pipeline.versions):
            t_v = time.perf_counter()
            jobs = publisher.in_flight()
            held = frozenset(g for job in jobs for g in job.context["groups"])
            held_entries = frozenset(e for job in jobs for e in job.context["entries"])
            _recommit(bus, cfg, run_id, committed[0], epoch)
            # (list(): one C-level copy; the publisher's thread adds to `known`)
            for v in [v for v in list(known) if v < version - cfg.buffer.max_staleness]:
                known.pop(v, None)
            out_dir = work / f"v{version + 1}"
            streamed = None
            if stream:
                # a resumed mesh that continues from older weights than the engines serve
                # (checkpoint.state_every): their logprobs are not its pi_old this version
                pi_old = "proximal" if resumed_behind else cfg.stream_pi_old
                streamed = Streamed(cfg, bus, mesh, version, pi_old)
            resumed_behind = False
            batch, metrics = _gather(
                bus,
                cfg,
                version,
                inbox,
                epoch,
                issuer,
                held,
                held_entries,
                # streamed, the version's own sha is known only once it is servable, after the
                # gather began: the live map (the publisher's thread only adds to it)
                known if stream else dict(known),
                on_chunk=streamed,
                check=publisher.check,
            )
            _check_failures(bus, cfg)
            t_busy = time.perf_counter()
            if streamed is not None:
                metrics.update(streamed.save(out_dir))
                metrics["timing/buffer_wait_s"] -= streamed.seconds  # steps ran while it gathered
                busy += streamed.seconds
            else:
                samples = train_samples(batch.used, cfg.buffer)
                metrics.update(_train(cfg, samples, version, state_dir, out_dir, mesh))
            metrics.update(load_metrics)  # the first version's only
            load_metrics = {}
            n_used = sum(len(g) for g in batch.used)
            n_filtered = sum(len(g) for g in batch.groups) - n_used
            counts = {"trained": n_used, "filtered": n_filtered, "groups_used": batch.n_groups}
            meta = {
                "groups": json.dumps(batch.group_ids),
                "entries": json.dumps(batch.entry_ids),
                "counts": json.dumps(counts),
                **{k: str(v) for k, v in bus.positions().items()},
            }
            # a superseded trainer must not publish (the store refuses a second v+1 too)
            bus.check_epoch(epoch)
            # off the critical path: the publisher makes it servable, then durable, then commits
            metrics["weights/trainer_stall_s"] = publisher.submit(
                version + 1,
                out_dir,
                meta,
                context={"entries": batch.entry_ids, "groups": batch.group_ids, "counts": counts},
            )
            if not stream:  # streamed: once servable (`servable`)
                version_ref[0] = version + 1
            busy += time.perf_counter() - t_busy
            state_dir = out_dir
            published()
            metrics.update(batch_metrics(batch, version))
            metrics.update(_async_metrics(bus, t_start, busy))
            metrics["timing/iteration_s"] = time.perf_counter() - t_v
            metrics["policy/version"] = float(version)
            metrics["reward/failed_samples"] = metrics["buffer/failed_samples"]
            now = time.perf_counter()
            cur = {
                "t": now,
                "tokens": metrics["async/tokens_generated"],
                "generated": metrics["async/generated"],
                "consumed": metrics["async/trained"] + metrics["async/filtered"],
            }
            dt = max(now - last["t"], 1e-9)
            metrics["throughput/rollout_tokens_per_s"] = (cur["tokens"] - last["tokens"]) / dt
            metrics["async/producer_samples_per_s"] = (cur["generated"] - last["generated"]) / dt
            metrics["async/consumer_samples_per_s"] = (cur["consumed"] - last["consumed"]) / dt
            last = cur
            tracking.log_metrics(uri, run_id, version, metrics)
            bus.heartbeat(
                CONSUMER,
                busy_s=busy,
                wall_s=time.perf_counter() - t_start,
                version=float(version + 1),
                reward_mean=metrics["reward/mean"],
                loss=metrics.get("train/loss", 0.0),
            )
        publisher.drain()  # the last version durable and committed before the run is done
        published()
        # the run's final counters, after the last commit moved them: the values logged with the
        # last version were read before its groups were committed, one version short of the
        # balance (generated - duplicates = trained + filtered + stale_dropped + failed +
        # samples_dead). Same step, later timestamp: MLflow's latest value is this one.
        tracking.log_metrics(
            uri, run_id, cfg.pipeline.versions - 1, _async_metrics(bus, t_start, busy)
        )
        policy = pbus.registry()
        if policy is None:  # every version was committed to it: Valkey lost its registry
            raise CheckpointError("trainer: the version registry is empty at the end of the run")
        bus.set_done()
        # bounded state: a shared Valkey forgets finished runs
        bus.expire_run(cfg.valkey.finished_ttl_s)
        return PolicyVersion(
            version=policy.version, uri=policy.uri, manifest_sha256=policy.manifest_sha256
        )
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
    from moerl.components.policy_update.launcher import MeshFailed

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
        from moerl.components.policy_update.launcher import run_mesh_trainer

        return run_mesh_trainer(cfg, run_id)
    return run_trainer(cfg, run_id).model_dump_json()


if __name__ == "__main__":
    sys.exit(main())
