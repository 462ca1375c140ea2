"""How a stage tells a trainer that is gone for good from one that is restarting."""

from __future__ import annotations

import logging
import time

from moerl.bus.client import connect
from moerl.bus.run import RunBus

log = logging.getLogger(__name__)


class TrainerWatch:
    """How a rollout worker or a scorer tells a trainer that is gone for good from one that is
    restarting. On the cluster a failed trainer task is retried (a new pod, maybe a new node);
    once its retries are spent nothing else would ever set `done`, so the workers would lease
    and retry for days, and the run's exit handler, which waits for every task, would never
    mark it FAILED. So: no trainer beacon for `lost_after_s` (`pipeline.trainer_lost_s`) and
    the run is abandoned (`RunBus.set_failed`); every stage sees that and stops, and the run
    fails through the trainer's own failure. Checks Valkey at most every `every_s`."""

    def __init__(
        self, bus: RunBus, lost_after_s: float, every_s: float = 1.0, clock=time.monotonic
    ):
        self.bus, self.lost_after_s, self.every_s, self.clock = bus, lost_after_s, every_s, clock
        self.last_seen = self.last_check = clock()
        self.reason: str | None = None

    def abandoned(self) -> bool:
        if self.reason is not None:
            return True
        now = self.clock()
        if now - self.last_check < self.every_s:
            return False
        self.last_check = now
        if self.bus.trainer_alive():
            self.last_seen = now
        elif now - self.last_seen > self.lost_after_s:
            self.bus.set_failed(
                f"no trainer for {now - self.last_seen:.0f} s (pipeline.trainer_lost_s "
                f"{self.lost_after_s:g}): its task failed for good"
            )
        self.reason = self.bus.failed()
        if self.reason:
            log.error("the run was abandoned: %s; stopping", self.reason)
        return self.reason is not None


def abandon_run(
    url: str, username: str | None, run_id: str, reason: str, reconnect_s: float = 10.0
) -> bool:
    """Mark run `run_id` failed on its bus (`RunBus.set_failed`), best effort: what a task that
    the long-lived stages started beside, and that failed before the trainer could start
    (init_policy), does so that they stop at their next check instead of waiting
    `pipeline.trainer_lost_s` for a trainer that will never come. True when it was set."""
    try:
        RunBus(connect(url, reconnect_s, username), run_id).set_failed(reason)
        return True
    except Exception as err:  # noqa: BLE001 - the task's own failure is what matters; the stages time out
        log.warning(
            "could not mark run %s failed on its bus (%s): its stages stop after pipeline.trainer_lost_s",
            run_id,
            err,
        )
        return False
