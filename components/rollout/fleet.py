"""The elastic rollout fleet's rule: how many workers a run wants, from what its queues show.

One rule for every controller: the local launcher (`LocalAsyncRun`), the trainer's controller
on a cluster without KEDA, and KEDA itself, whose redis-streams trigger computes the same
ceil(lag / lagCount) from `lag_count`. A worker is worth adding only if the units waiting would
still be waiting when its engine is ready: `lag_count` is what one worker drains in one
engine load time, both measured and kept on the bus (`measure`); the workers busy with a unit
are a floor. Scored groups piling up past the high watermark mean production the trainer
cannot consume: the fleet shrinks one worker at a time. Scale-downs wait `rollout.fleet_scale_down_after_s` (the largest wish
over that window wins, as Kubernetes' HPA stabilization does), scale-ups do not.

Design: docs/async.md, "An elastic fleet".
"""

from __future__ import annotations

import logging
import math
import os
import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from moerl.bus import RunBus
    from moerl.config import RunConfig

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class FleetView:
    """What the controller reads from the run's bus at one tick."""

    workers: int  # in the fleet now, starting ones included
    units_waiting: int  # issued and not yet leased by any worker (the units stream's lag)
    busy: int  # workers holding a leased unit now: never shrunk below while nothing piles up
    scored_backlog: int  # scored groups waiting for the trainer
    units_per_busy_s: float | None  # units one worker drains per second of work; None: unmeasured
    load_s: float | None  # a new worker's start to its first group; None: unmeasured


@dataclass(frozen=True)
class Wish:
    """The size the rule asks for now, and why, in words for the run's log."""

    target: int
    reason: str


def lag_count(units_per_busy_s: float, load_s: float) -> int:
    """Units one worker drains in one engine load time (at least 1): KEDA's lagCount, so that
    ceil(lag / lag_count) workers clear a backlog within one load time."""
    return max(1, math.ceil(units_per_busy_s * load_s))


def wish(view: FleetView, lo: int, hi: int, high_watermark: int) -> Wish:
    """The fleet size the queues ask for, within [lo, hi], before any stabilization."""
    if view.scored_backlog > high_watermark:
        return Wish(
            max(lo, view.workers - 1),
            f"{view.scored_backlog} scored groups wait for the trainer (> {high_watermark}): "
            "production it cannot consume",
        )
    if view.units_per_busy_s is None or view.load_s is None:
        return Wish(
            min(hi, max(lo, view.workers)),
            "no worker has measured its load time and rate yet: holding",
        )
    per = lag_count(view.units_per_busy_s, view.load_s)
    want = max(view.busy, math.ceil(view.units_waiting / per))
    return Wish(
        min(hi, max(lo, want)),
        f"{view.units_waiting} units waiting, {view.busy} workers busy; one worker drains {per} "
        f"in an engine's load time ({view.load_s:.1f} s at {view.units_per_busy_s:.2f} units/s)",
    )


class Stabilizer:
    """Scale up at once; scale down only to the largest wish of the last `hold_s` seconds, and
    only once that long has been watched (Kubernetes' HPA scale-down stabilization)."""

    def __init__(self, hold_s: float, now: float):
        self.hold_s, self.since = hold_s, now
        self.wishes: deque[tuple[float, int]] = deque()

    def __call__(self, now: float, current: int, w: Wish) -> int:
        self.wishes.append((now, w.target))
        while now - self.wishes[0][0] > self.hold_s:
            self.wishes.popleft()
        if w.target >= current:
            return w.target
        if now - self.since < self.hold_s:
            return current
        return min(current, max(t for _, t in self.wishes))


class Rates:
    """A worker's drain rate, units per second of work, from the bus's counters and the
    workers' busy seconds between two ticks (idle time does not dilute it)."""

    def __init__(self, samples_per_unit: int):
        self.samples_per_unit = max(1, samples_per_unit)
        self.last: tuple[float, float] | None = None  # (generated samples, busy seconds summed)
        self.value: float | None = None

    def update(self, generated: float, busy_s: float) -> float | None:
        if self.last is not None:
            d_gen, d_busy = generated - self.last[0], busy_s - self.last[1]
            if d_busy > 0.5 and d_gen > 0:
                r = d_gen / self.samples_per_unit / d_busy
                self.value = r if self.value is None else 0.5 * self.value + 0.5 * r
        self.last = (generated, busy_s)
        return self.value


def load_time(stats: dict[str, dict[str, float]]) -> float | None:
    """A new worker's time to its first group: the most recent measurement among the workers
    that have generated (`first_sample_s`, from their process's start)."""
    seen = [
        (s.get("started_unix", 0.0), s["first_sample_s"])
        for name, s in stats.items()
        if name.startswith("rollout") and "first_sample_s" in s
    ]
    return max(seen)[1] if seen else None


def measure(bus: RunBus, cfg: RunConfig, workers: int, rates: Rates) -> FleetView:
    """The controller's view of the run now, its measurements kept on the bus (`FLEET_KEY`),
    (`RunBus.fleet`), where operators and KEDA's lagCount read them."""
    stats = bus.stats()
    rollout = {n: s for n, s in stats.items() if n.startswith("rollout")}
    rate = rates.update(
        float(bus.counters()["generated"]), sum(s.get("busy_s", 0.0) for s in rollout.values())
    )
    view = FleetView(
        workers=workers,
        units_waiting=bus.units_waiting(),
        busy=bus.workers_holding_units(),
        scored_backlog=bus.backlog(),
        units_per_busy_s=rate,
        load_s=load_time(rollout),
    )
    kept = {"workers": float(workers), "units_waiting": float(view.units_waiting)}
    if rate is not None and view.load_s is not None:
        kept.update(
            units_per_busy_s=rate,
            load_s=view.load_s,
            lag_count=float(lag_count(rate, view.load_s)),
        )
    bus.set_fleet(kept)
    return view


def samples_per_unit(cfg: RunConfig) -> int:
    return cfg.units.max_prompts * cfg.rollout.samples_per_prompt


def high_watermark(cfg: RunConfig) -> int:
    """`rollout.fleet_high_watermark_groups` resolved: buffer.high_watermark where unset."""
    return cfg.rollout.fleet_high_watermark_groups or cfg.buffer.high_watermark


class Actuator(Protocol):
    """What the trainer's controller acts on: the fleet's replica count (no KEDA), or KEDA's
    lagCount (KEDA sets the replicas from the same rule)."""

    def replicas(self) -> int: ...

    def scale(self, replicas: int) -> None: ...

    def set_lag_count(self, lag_count: int) -> None: ...


class FleetController(threading.Thread):
    """The fleet's controller in the trainer (`cluster.launch.mode: kubernetes`, an elastic
    fleet): every `rollout.fleet_interval_s` it measures the run (`measure`). Without KEDA
    (`cluster.launch.fleet_scaler: trainer`) it sets the fleet's replicas by the rule; with KEDA
    it keeps the ScaledObject's lagCount at the measured value, and KEDA scales. The API
    failing never stops training: each failure is logged, and `failures` counts them."""

    def __init__(self, cfg: RunConfig, bus: RunBus, actuator: Actuator, keda: bool):
        super().__init__(name="moerl-fleet", daemon=True)
        self.cfg, self.bus, self.actuator, self.keda = cfg, bus, actuator, keda
        self.rates = Rates(samples_per_unit(cfg))
        self.stabilizer = Stabilizer(cfg.rollout.fleet_scale_down_after_s, time.monotonic())
        self.stop_event = threading.Event()
        self.lag_count: int | None = None  # the value last set on the ScaledObject
        self.failures = 0
        self.changes: list[tuple[float, int, str]] = []  # (unix, replicas, why)

    def tick(self, now: float) -> None:
        current = self.actuator.replicas()
        view = measure(self.bus, self.cfg, current, self.rates)
        if self.keda:
            if view.units_per_busy_s is not None and view.load_s is not None:
                lc = lag_count(view.units_per_busy_s, view.load_s)
                if lc != self.lag_count:
                    self.actuator.set_lag_count(lc)
                    log.info("fleet: KEDA's lagCount set to %d (was %s)", lc, self.lag_count)
                    self.lag_count = lc
            return
        lo, hi = self.cfg.rollout.fleet_bounds
        w = wish(view, lo, hi, high_watermark(self.cfg))
        target = self.stabilizer(now, current, w)
        self.bus.set_fleet({"target": float(target)})
        if target != current:
            self.actuator.scale(target)
            self.changes.append((time.time(), target, w.reason))
            log.info("fleet: %d -> %d rollout workers: %s", current, target, w.reason)

    def run(self) -> None:
        while not self.stop_event.wait(self.cfg.rollout.fleet_interval_s):
            try:
                self.tick(time.monotonic())
            except Exception as err:  # noqa: BLE001 - scaling is advisory; training goes on, loudly
                self.failures += 1
                log.warning(
                    "fleet: the controller's tick failed (%d so far): %s", self.failures, err
                )

    def stop(self) -> None:
        self.stop_event.set()
        self.join(timeout=5)


API_TIMEOUT_S = 30.0  # one API call at most: a hung call fails the tick, which is counted


class KubeActuator:
    """The run's fleet through the Kubernetes API from inside the cluster: the Deployment's
    scale subresource and the ScaledObject (moerl/launch/fleet.py names and builds both), with
    the trainer pod's ServiceAccount, which the run's scaler Role lets patch only these two."""

    def __init__(self, run_id: str, namespace: str | None = None, apps=None, custom=None):
        from moerl.errors import ConfigError
        from moerl.launch.fleet import ENV_FLEET_NAME
        from moerl.launch.watch import SA_NAMESPACE

        if apps is None or custom is None:
            from kubernetes import client, config

            config.load_incluster_config()
            apps, custom = client.AppsV1Api(), client.CustomObjectsApi()
        self.apps, self.custom = apps, custom
        # the name the launcher chose for the Deployment it created (random-suffixed per try)
        self.name = os.environ.get(ENV_FLEET_NAME, "")
        if not self.name:
            raise ConfigError(
                f"run {run_id}: the trainer scales its elastic fleet, but ${ENV_FLEET_NAME} (the "
                "fleet's Deployment, set by the launcher that created it) is unset"
            )
        if namespace is None:  # the trainer pod's own
            with open(SA_NAMESPACE) as f:
                namespace = f.read().strip()
        self.namespace = namespace

    def replicas(self) -> int:
        scale = self.apps.read_namespaced_deployment_scale(
            self.name, self.namespace, _request_timeout=API_TIMEOUT_S
        )
        return int(scale.spec.replicas or 0)

    def scale(self, replicas: int) -> None:
        from moerl.launch.fleet import scale_patch

        self.apps.patch_namespaced_deployment_scale(
            self.name, self.namespace, scale_patch(replicas), _request_timeout=API_TIMEOUT_S
        )

    def set_lag_count(self, lag_count: int) -> None:
        from moerl.launch.fleet import KEDA_GROUP, KEDA_VERSION, lag_count_patch

        # a list body: the client sends it as application/json-patch+json
        self.custom.patch_namespaced_custom_object(
            KEDA_GROUP,
            KEDA_VERSION,
            self.namespace,
            "scaledobjects",
            self.name,
            lag_count_patch(lag_count),
            _request_timeout=API_TIMEOUT_S,
        )
