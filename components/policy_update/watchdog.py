"""The trainer's progress watchdog while it gathers a version (`pipeline.stall_timeout_s`).

Progress is what trains: a group taken into the batch, a version's groups committed
(`groups_used`), or a publication in flight (the publisher's own retries and budgets bound
it). Dead-lettered, stale and failed groups are not progress: a run whose groups are all
refused (too large for the bus) or dropped fails within its budget
(`pipeline.max_dropped_fraction`), naming the budget and the counts, instead of generating for
ever. A status line is logged every STATUS_EVERY_S while a gather waits.

Limitations: a publication in flight keeps the watchdog quiet however slow it is; a publisher
that hangs without failing is bounded only by its store client's timeouts.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from moerl.bus import RunBus
from moerl.config import RunConfig
from moerl.errors import DataError

log = logging.getLogger(__name__)
STATUS_EVERY_S = 60.0
DROPPED = ("groups_dead", "groups_stale")


def stalled(
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
        f"{c['scored']}, groups dead {c['groups_dead']}, stale {c['groups_stale']}, failed "
        f"{c['groups_failed']}, rollout workers alive {workers}/{cfg.rollout.workers}"
    )


@dataclass
class Watchdog:
    """One gather's watchdog: `look` at every loop, with the groups taken so far."""

    bus: RunBus
    cfg: RunConfig
    version: int
    want: int
    publishing: Callable[[], int] = lambda: 0
    clock: Callable[[], float] = time.monotonic
    start: dict[str, int] = field(default_factory=dict)
    last: tuple[int, ...] = ()
    moved_at: float = 0.0
    said_at: float = 0.0

    def __post_init__(self) -> None:
        c = self.bus.counters()
        self.start = {k: c[k] for k in DROPPED}
        self.last = (0, c["groups_used"])
        self.moved_at = self.said_at = self.clock()

    def look(self, taken: int) -> None:
        """Raise when the gather stalled or its drops broke their budget; log its status."""
        c, now = self.bus.counters(), self.clock()
        pulse = (taken, c["groups_used"])
        publishing = self.publishing()
        if pulse != self.last or publishing:
            self.last, self.moved_at = pulse, now
        drops = {k: c[k] - self.start[k] for k in DROPPED}
        self._budget(taken, drops)
        if now - self.said_at >= STATUS_EVERY_S:
            self.said_at = now
            log.info(
                "trainer: gathering version %d: %d of %d groups taken; since it began %d dead, %d "
                "stale; %d publication(s) in flight; quiet %.0f s of pipeline.stall_timeout_s %.0f",
                self.version + 1,
                taken,
                self.want,
                drops["groups_dead"],
                drops["groups_stale"],
                publishing,
                now - self.moved_at,
                self.cfg.pipeline.stall_timeout_s,
            )
        quiet = now - self.moved_at
        if quiet > self.cfg.pipeline.stall_timeout_s:
            raise stalled(self.bus, self.cfg, self.version, taken, self.want, quiet)

    def _budget(self, taken: int, drops: dict[str, int]) -> None:
        """Dead and stale groups since the gather began, against the groups it took: more than
        `pipeline.max_dropped_fraction` of them fails, once they outnumber what admission keeps
        in flight ((max_staleness + 2) x B), so a burst of stale groups after a rollback or a
        restart never trips it, and a producer that keeps refusing does."""
        budget = self.cfg.pipeline.max_dropped_fraction
        dropped = sum(drops.values())
        floor = (self.cfg.buffer.max_staleness + 2) * self.cfg.task.prompts_per_iteration
        if budget >= 1.0 or dropped < floor:
            return
        if dropped / (dropped + taken) > budget:
            raise DataError(
                f"trainer: {dropped} of {dropped + taken} groups since version {self.version + 1} "
                f"began were dropped (dead {drops['groups_dead']}, stale {drops['groups_stale']}), "
                f"over pipeline.max_dropped_fraction {budget:g}: the run generates without training "
                "(the dead-letter stream says why: a group too large for the bus, a malformed one; "
                "stale: buffer.max_staleness)"
            )
