"""Publication off the trainer's critical path (async mode).

Design, details and limitations: docs/async.md#componentspublish_checkpointpublisherpy.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from moerl.components.publish_checkpoint.outage import retrying, tidy_own
from moerl.config import RunConfig
from moerl.records import PolicyVersion
from moerl.store.base import RemoteParts
from moerl.store.fence import new_owner
from moerl.store.manifest import Manifest
from moerl.store.tiers import Tiers, run_tiers

log = logging.getLogger(__name__)


@dataclass
class Job:
    version: int
    src: Path
    meta: dict[str, str]
    handed: float  # perf_counter when the trainer handed it over
    context: dict = field(default_factory=dict)  # the caller's (what on_durable commits)
    policy: PolicyVersion | None = None
    metrics: dict[str, float] = field(default_factory=dict)


class Publisher:
    def __init__(
        self,
        cfg: RunConfig,
        run_id: str,
        on_servable: Callable[[PolicyVersion], None],
        on_durable: Callable[[Job], None],
        exclusive: bool = True,
        epoch: int | None = None,
        parts: RemoteParts | None = None,
    ) -> None:
        """`epoch`: the trainer's (`RunBus.claim_trainer`): every tier write and `latest` move is
        fenced by it, so a replaced trainer's publisher is refused (`moerl.store.fence`)."""
        self.cfg, self.run_id, self.exclusive, self.epoch = cfg, run_id, exclusive, epoch
        # `parts`: the files of each version that other nodes hold and put themselves
        self.parts = parts
        # who claims each version: the same on every retry of it, which so finds its own claim
        self.owner = new_owner()
        self.on_servable, self.on_durable = on_servable, on_durable
        self._q: queue.Queue[Job | None] = queue.Queue()
        self._in_flight: list[Job] = []
        self._finished: list[Job] = []
        self._lock = threading.Condition()
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="moerl-publisher", daemon=True)
        self._thread.start()

    # -- the trainer's side ---------------------------------------------------------------
    def submit(
        self, version: int, src: Path, meta: dict[str, str], context: dict | None = None
    ) -> float:
        """Hand `version` (the files under `src`, left in place until it is durable) over;
        returns the seconds waited for a free slot (the stall)."""
        t0 = time.perf_counter()
        with self._lock:
            while True:
                self._raise()
                if len(self._in_flight) < self.cfg.checkpoint.max_unpublished:
                    break
                self._lock.wait(0.2)
            job = Job(version, Path(src), dict(meta), time.perf_counter(), dict(context or {}))
            self._in_flight.append(job)
        self._q.put(job)
        return time.perf_counter() - t0

    def in_flight(self) -> list[Job]:
        with self._lock:
            return list(self._in_flight)

    def take_finished(self) -> list[Job]:
        """Versions made durable since the last call, in order."""
        with self._lock:
            out, self._finished = self._finished, []
        return out

    def drain(self, timeout_s: float | None = None) -> None:
        """Wait until every version handed over is durable; raise the publisher's failure."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        with self._lock:
            while self._in_flight:
                self._raise()
                if deadline is not None and time.monotonic() > deadline:
                    raise TimeoutError(
                        f"publisher: {len(self._in_flight)} versions still unpublished"
                    )
                self._lock.wait(0.2)
            self._raise()

    def close(self) -> None:
        self._q.put(None)
        self._thread.join(timeout=5)

    def _raise(self) -> None:
        if self.error is not None:
            raise self.error

    def check(self) -> None:
        """Raise the publisher thread's error, if it failed (a caller waiting on something a
        publication would bring: the streamed trainer's next version's prompts)."""
        self._raise()

    # -- the thread -----------------------------------------------------------------------
    def _run(self) -> None:
        while (job := self._q.get()) is not None:
            try:
                metrics = self._publish(job)
            except BaseException as err:  # noqa: BLE001 - handed to the trainer, which raises it
                log.error("publisher: version %d failed: %s", job.version, err)
                with self._lock:
                    self.error = err
                    self._lock.notify_all()
                return
            with self._lock:
                self._in_flight.remove(job)
                self._finished.append(job)
                self._lock.notify_all()
            log.info(
                "version %d durable (servable after %.2f s, durable after %.2f s)",
                job.version,
                metrics["weights/published_to_servable_s"],
                metrics["weights/published_to_durable_s"],
            )

    def _publish(self, job: Job) -> dict[str, float]:
        """`job`'s servable copy, then its durable one, each retried while the store is away
        (`outage.retrying`, within checkpoint.outage_s; the trainer waits on max_unpublished
        meanwhile), what a failed attempt left under this publisher's claim removed first."""
        from moerl.components.publish_checkpoint.stage import publish_durable, publish_servable

        budget, v = self.cfg.checkpoint.outage_s, job.version
        tiers = run_tiers(self.cfg.checkpoint, self.run_id, self.epoch)
        manifest, policy, metrics = retrying(
            f"publisher: version {v}'s first copy",
            lambda: publish_servable(
                self.cfg,
                self.run_id,
                job.src,
                v,
                job.meta,
                self.exclusive,
                self.epoch,
                self.parts,
                owner=self.owner,
            ),
            budget,
            before_retry=lambda: tidy_own([tiers.cache, tiers.durable], v, self.owner),
        )
        metrics["weights/published_to_servable_s"] = time.perf_counter() - job.handed
        self.on_servable(policy)
        metrics.update(
            retrying(
                f"publisher: version {v}'s durable copy",
                lambda: publish_durable(
                    self.cfg,
                    self.run_id,
                    job.src,
                    manifest,
                    self.exclusive,
                    started=job.handed,
                    # the durable store's `latest` names it already: an attempt whose reply was lost
                    already=not metrics["weights/cache_tier"] or _durable(tiers, manifest),
                    epoch=self.epoch,
                    parts=self.parts,
                    owner=self.owner,
                ),
                budget,
                before_retry=lambda: tidy_own([tiers.durable], v, self.owner),
            )
        )
        job.policy, job.metrics = policy, metrics
        self.on_durable(job)
        return metrics


def _durable(tiers: Tiers, manifest: Manifest) -> bool:
    """Whether the durable store's `latest` is `manifest`'s version (published)."""
    return tiers.durable.latest() == manifest.version
