"""The async trainer's intake: the issuer thread beside it, which issues work by admission, and
the gather of each version's scored groups (`gather`, from the trainer's `Inbox`), handed
minibatch by minibatch to a streamed trainer (`stream_chunk`).

Design, details and limitations: docs/async.md#componentspolicy_updateworkerpy.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from moerl.bus import SCORED, RunBus
from moerl.components.buffer.worker import Batch, classify, prompts_to_issue
from moerl.components.policy_update.intake import EntryCheck, scored_samples
from moerl.components.policy_update.watchdog import Watchdog
from moerl.config import RunConfig
from moerl.errors import DataError
from moerl.records import ScoredSample
from moerl.tasks.dataset import load_dataset
from moerl.tracking import check_pinned

log = logging.getLogger(__name__)
CONSUMER = "trainer"
BEACON_EVERY_S = 5.0
QUOTA_EVERY_S = 2.0


@dataclass
class TrainerState:
    """What the trainer's loop shares with its threads, in place of one-element lists. The
    issuer reads `version` and `gathered`, which the loop writes; the publisher's thread writes
    `committed`, adds to `known` (which the loop prunes), and, streamed, moves `version` once a
    version is servable (the loop then leaves it alone). Each write is one attribute or dict
    operation, atomic under the GIL."""

    version: int
    """The version admission issues for: the last one trained (streamed: the last servable)."""
    committed: int
    """The last version this trainer committed."""
    known: dict[int, str | frozenset[str]] = field(default_factory=dict)
    """What each recent version number means (its manifest sha256; with the collective weight
    path, also its wire name: moerl.bus.weights): a sample an engine generated under the same
    number with other weights (a version lost, then published again) is stale."""
    gathered: tuple[int, int] = (0, 0)
    """(groups, signal groups) the trainer holds for the version it gathers."""


class Issuer(threading.Thread):
    """Issues work units by admission and backpressure, every `period_s`, until stopped."""

    def __init__(
        self,
        cfg: RunConfig,
        bus: RunBus,
        state: TrainerState,
        epoch: int,
        period_s: float = 0.05,
    ):
        super().__init__(name="moerl-issuer", daemon=True)
        self.cfg, self.bus, self.state, self.epoch, self.period_s = (
            cfg,
            bus,
            state,
            epoch,
            period_s,
        )
        self.stop_event = threading.Event()
        self.paused = False
        self.quota_at, self.over = -1e9, False  # the last look at valkey.run_quota_mb, its answer
        self.error: BaseException | None = None
        self.ds = load_dataset(cfg.task.dataset, cfg.task.max_bad_fraction, cfg.checkpoint)
        check_pinned(self.ds, cfg, bus.run_id)  # a restarted trainer reads what the run began on

    def over_quota(self) -> bool:
        """`valkey.run_quota_mb`: the run's streams hold more (read every QUOTA_EVERY_S); the
        first look over it and the first under it again are logged."""
        quota = self.cfg.valkey.run_quota_mb
        if quota is None:
            return False
        if time.monotonic() - self.quota_at >= QUOTA_EVERY_S:
            self.quota_at, held = time.monotonic(), self.bus.stream_bytes()
            over = held > quota << 20
            if over != self.over:
                log.warning(
                    "issuance %s: the run's streams hold %.0f MB (valkey.run_quota_mb %d)",
                    "paused" if over else "resumed",
                    held / 2**20,
                    quota,
                )
            self.over = over
        return self.over

    def step(self) -> int:
        self.bus.check_epoch(self.epoch)  # a superseded trainer issues nothing more
        if self.over_quota():
            return 0
        c = self.bus.counters()
        settled = c["groups_used"] + c["groups_stale"] + c["groups_failed"] + c["prompts_dead"]
        in_flight = c["prompts_issued"] - settled
        n, self.paused = prompts_to_issue(
            used=c["groups_used"],
            in_flight=in_flight,
            version=self.state.version,
            batch_prompts=self.cfg.task.prompts_per_iteration,
            versions=self.cfg.pipeline.versions,
            max_staleness=self.cfg.buffer.max_staleness,
            backlog=self.bus.backlog(),
            paused=self.paused,
            cfg=self.cfg.buffer,
            signal_used=c["trained"] // self.cfg.rollout.samples_per_prompt,
            gathered=self.state.gathered,
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

    def __init__(self, bus: RunBus, check: EntryCheck | None = None) -> None:
        """`check`: the whole check of each entry (the trainer's); None: its samples parse."""
        self.bus, self.check_entry = bus, check
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
        validate = self.check_entry or scored_samples
        if self.after is not None:
            got, self.after = self.bus.take_pending(
                SCORED,
                CONSUMER,
                self.after,
                validate=validate,
                count=n,
                skip=in_hand,
                max_deliveries=None
                if self.check_entry is None
                else self.check_entry.max_deliveries,
            )
            if got or self.after is not None:
                return got
        return self.bus.take_scored(CONSUMER, n, block_ms=200, validate=validate)


class _Gathering:
    """One version's gather under way (`gather`): the batch so far, the samples it dropped,
    and (streamed) the chunk being taken."""

    def __init__(
        self,
        bus: RunBus,
        cfg: RunConfig,
        version: int,
        epoch: int,
        held: frozenset[str],
        known: dict[int, str | frozenset[str]] | None,
        on_chunk: Callable[[list[list[ScoredSample]]], None] | None,
    ) -> None:
        self.bus, self.cfg, self.version, self.epoch = bus, cfg, version, epoch
        self.held, self.known, self.on_chunk = held, known, on_chunk
        self.B, self.S = cfg.task.prompts_per_iteration, cfg.buffer.min_signal_groups
        self.limit = cfg.buffer.resolved.max_gather_groups or 0  # set wherever S is
        self.batch = Batch()
        self.dropped = {"duplicates": 0, "stale_dropped": 0, "failed": 0}
        self.chunk = stream_chunk(cfg)
        self.taken: int = 0  # groups of the chunk being taken
        self.trainable: list[list[ScoredSample]] = []  # those of them it trains on

    @property
    def target(self) -> int:
        """The groups the version waits for: B, or (dynamic sampling) S with signal."""
        return self.B if self.S is None else self.S

    def wanted(self) -> int:
        """Groups still to take: B in all, or (dynamic sampling) S with signal, within the limit."""
        if self.S is None:
            return self.B - self.batch.n_groups
        return min(self.S - len(self.batch.used), self.limit - self.batch.n_groups)

    def add(self, eid: str, group: dict, consumed: set[str]) -> None:
        """Settle a group the version cannot take (a duplicate, stale, failed), else take it."""
        gid, samples = group["group_id"], group["samples"]
        seen = consumed | self.held | set(self.batch.group_ids)
        d = classify(gid, samples, self.version, self.cfg.buffer.max_staleness, seen, self.known)
        n = len(samples)
        if d == "duplicate":
            self.bus.settle(self.epoch, [eid], [], duplicates=n)
            self.dropped["duplicates"] += n
        elif d == "stale":
            self.bus.settle(self.epoch, [eid], [gid], stale_dropped=n, groups_stale=1)
            self.dropped["stale_dropped"] += n
        elif d == "failed":
            self.bus.settle(self.epoch, [eid], [gid], failed=n, groups_failed=1)
            self.dropped["failed"] += n
        else:
            self._take(eid, group, used=d == "used")

    def _take(self, eid: str, group: dict, used: bool) -> None:
        """Into the batch; streamed, a full chunk (or the last groups) goes to `on_chunk`."""
        samples = group["samples"]
        self.batch.entry_ids.append(eid)
        self.batch.group_ids.append(group["group_id"])
        self.batch.groups.append(samples)
        if "t_generated" in group:
            self.batch.waits_s.append(max(0.0, time.time() - float(group["t_generated"])))
        if used:
            self.batch.used.append(samples)
            self.trainable.append(samples)
        self.taken += 1
        if self.on_chunk is not None and (self.taken == self.chunk or self.wanted() == 0):
            self.on_chunk(self.trainable)
            self.taken, self.trainable = 0, []

    def metrics(self, t0: float, rescans: int) -> dict[str, float]:
        """The gather's metrics; with dynamic sampling, a shortfall of signal groups is logged."""
        extra: dict[str, float] = {}
        if self.S is not None:
            short = max(0, self.S - len(self.batch.used))
            if short:
                log.warning(
                    "version %d: %d groups consumed, only %d with reward variance (buffer.min_signal_groups %d, "
                    "buffer.max_gather_groups %d); training on those",
                    self.version,
                    self.batch.n_groups,
                    len(self.batch.used),
                    self.S,
                    self.limit,
                )
            extra = {
                "buffer/signal_groups": float(len(self.batch.used)),
                "buffer/signal_shortfall_groups": float(short),
            }
        return {
            "timing/buffer_wait_s": time.perf_counter() - t0,
            "buffer/pending_rescans": float(rescans),
            **extra,
            **{f"buffer/{k}_samples": float(v) for k, v in self.dropped.items()},
        }


def gather(
    bus: RunBus,
    cfg: RunConfig,
    version: int,
    inbox: Inbox,
    epoch: int,
    issuer: Issuer,
    held: frozenset[str] = frozenset(),
    held_entries: frozenset[str] = frozenset(),
    known: dict[int, str | frozenset[str]] | None = None,
    on_chunk: Callable[[list[list[ScoredSample]]], None] | None = None,
    check: Callable[[], None] | None = None,
    publishing: Callable[[], int] = lambda: 0,
) -> tuple[Batch, dict[str, float]]:
    """Block until B fresh groups are in; settle the rest as they come. `held`, `held_entries`:
    the groups and entries of versions still being published (trained, not yet committed).
    `on_chunk` (`trainer.schedule.stream`): called with the trainable groups of every `stream_chunk`
    groups taken, in arrival order, and of the last ones, as they come in. `check`: called at
    every loop, raises what makes the wait pointless (a failed publisher: streamed, the next
    version's prompts wait for its publication). `publishing`: the publications in flight
    (progress, for the watchdog: moerl.components.policy_update.watchdog)."""
    t0 = time.perf_counter()
    g = _Gathering(bus, cfg, version, epoch, held, known, on_chunk)
    issuer.state.gathered = (0, 0)
    dog = Watchdog(bus, cfg, version, g.target, publishing)
    while g.wanted() > 0:
        _alive(bus, issuer, epoch)
        if check is not None:
            check()
        in_hand = set(held_entries) | set(g.batch.entry_ids)
        inbox.check(in_hand)
        got = inbox.take(g.wanted(), in_hand)
        dog.look(g.batch.n_groups)  # only groups taken or committed are progress
        if not got:
            continue
        consumed = bus.consumed([group["group_id"] for _, group in got])
        for eid, group in got:
            g.add(eid, group, consumed)
        issuer.state.gathered = (g.batch.n_groups, len(g.batch.used))
    return g.batch, g.metrics(t0, inbox.rescans)


def stream_chunk(cfg: RunConfig) -> int:
    """`trainer.schedule.stream`: the groups in one streamed minibatch, ceil(B / optimizer steps), so
    that a version takes at most `optimizer_steps_per_iteration` steps (fewer when B is not a
    multiple of it, and none for a minibatch whose groups all lack reward variance)."""
    steps = cfg.trainer.optimizer.optimizer_steps_per_iteration
    return max(1, -(-cfg.task.prompts_per_iteration // steps))


def check_failures(bus: RunBus, cfg: RunConfig) -> None:
    """Fail the run when too many scored samples failed (`reward.max_failed_fraction`)."""
    c = bus.counters()
    if (
        c["scored"] >= cfg.task.prompts_per_iteration * cfg.rollout.samples_per_prompt
        and c["score_failed"] / c["scored"] > cfg.reward.max_failed_fraction
    ):
        raise DataError(
            f"reward: {c['score_failed']} of {c['scored']} scored samples failed "
            f"(> reward.max_failed_fraction {cfg.reward.max_failed_fraction}); see the scorers' logs"
        )
