"""A follower node of an engine over several nodes (components/rollout/group.py): node ranks
1..N-1 of the group's JobSet.

It runs this node's share of the engine's data-parallel ranks headless (`HeadlessEngine`),
joined to the leader's engine and started on dummy weights: every version reaches its ranks by
the leader's hot swap, which each rank reads from this node's own cache. So the follower's
other job is to fetch each servable version into its node cache before the leader swaps
(`moerl.store.runs.engine_copy`: the same verified path and manifest sha256 the leader uses),
hold it there (a shared lock, which pruning respects) and report it (`GroupBus.report_holds`);
the leader swaps once every node holds it.

Exit codes, as the leader's: 0 when the leader finished the run; EXIT_DRAINED after a drain (a
Spot notice on any node of the group: the follower keeps its engine ranks up while the leader
finishes or requeues its units, then exits, so KFP relaunches the group); 1 when its engine
ranks died, the leader failed, or the leader stopped beating.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import sys
import threading
import time
from typing import TYPE_CHECKING

from moerl.bus import RunBus, connect
from moerl.config import RunConfig
from moerl.errors import CheckpointError, ConfigError
from moerl.store.runs import engine_copy, run_cache

if TYPE_CHECKING:
    from moerl.components.rollout.engine import HeadlessEngine

log = logging.getLogger(__name__)

DRAIN_MARGIN_S = 20.0  # beyond rollout.grace_seconds: the leader's publish and exit
LEADER_LOST_S = 60.0  # the leader's beat (15 s TTL) unseen this long by a working bus: lost
SLOW_BUS_S = 5.0  # a bus call this slow was an outage: the leader's silence meanwhile is not its
POLL_S = 0.5


class Follower:
    """One follower node's loop (see the module docstring)."""

    def __init__(self, cfg: RunConfig, run_id: str, worker: str, bus: RunBus, spec) -> None:
        from moerl.components.rollout.group import GroupBus

        self.cfg, self.run_id, self.worker, self.bus, self.spec = cfg, run_id, worker, bus, spec
        self.gbus = GroupBus(bus, worker, spec)
        self.name = f"{worker}.node{spec.rank}"
        self.engine: HeadlessEngine | None = None
        self.held: tuple[int, str] | None = None  # the newest version held, reported
        # every held copy (locked shared, which pruning respects) by version: the newest, and
        # those the leader may still swap in (its target and newer)
        self._holds: dict[int, contextlib.ExitStack] = {}
        self._notice_at: float | None = None
        self._fanout = None

    def notice(self, signum, frame) -> None:
        """SIGTERM (a Spot notice): the whole group drains (`run` tells the leader)."""
        if self._notice_at is None:
            self._notice_at = time.monotonic()
            log.warning("%s: SIGTERM: draining the engine group", self.name)

    # -- the engine ranks ----------------------------------------------------------------
    def _start_engine(self) -> None:
        from moerl.components.publish_checkpoint.stage import model_skeleton
        from moerl.components.rollout.engine import HeadlessEngine
        from moerl.components.rollout.group import ENV_NODE_CACHE
        from moerl.components.rollout.transport import check_engine_transport

        skel = model_skeleton(self.cfg, run_cache(self.cfg.checkpoint, self.run_id) / "skeleton")
        os.environ[ENV_NODE_CACHE] = str(run_cache(self.cfg.checkpoint, self.run_id))
        placement = self.spec.engine_kwargs(self.cfg.rollout.data_parallel_size)
        t0 = time.perf_counter()
        # `require:` enforced on this node's ranks too, before they start (the leader records
        # the group's transport)
        engine = self.engine = HeadlessEngine(
            skel,
            self.cfg.rollout,
            placement,
            check=lambda vc: check_engine_transport(self.cfg, vc, started=False),
        )
        log.info(
            "%s: engine ranks %s started headless for %s:%d in %.1f s",
            self.name,
            engine.ranks,
            self.spec.leader,
            self.spec.rpc_port,
            time.perf_counter() - t0,
        )

    # -- versions --------------------------------------------------------------------------
    def _swarm(self):
        from moerl.components.rollout.worker import fanout_swarm

        return fanout_swarm(self)

    def _fetch_servable(self) -> None:
        """Fetch the servable version into this node's cache if it is new, hold it, report it."""
        reg = self.bus.servable()
        if reg is None or self.held == (reg.version, reg.manifest_sha256):
            return
        hold = contextlib.ExitStack()
        sources: list[str] = []
        t0 = time.perf_counter()
        try:
            hold.enter_context(
                engine_copy(
                    self.cfg.checkpoint,
                    self.run_id,
                    reg.version,
                    expect_sha256=reg.manifest_sha256,
                    swarm=self._swarm(),
                    sources=sources,
                )
            )
        except CheckpointError as err:
            hold.close()
            self.bus.incr(weights_fetch_failed=1)
            log.warning("%s: cannot fetch version %d yet (%s)", self.name, reg.version, err)
            time.sleep(1.0)
            return
        old = self._holds.pop(reg.version, None)  # the same number under another manifest
        if old is not None:
            old.close()
        self._holds[reg.version] = hold
        self.held = (reg.version, reg.manifest_sha256)
        self.gbus.report_holds(self.spec.rank, reg.version, reg.manifest_sha256)
        self._release_older()
        self.bus.incr(**{f"weights_from_{s}": 1 for s in sources})
        log.info(
            "%s: holds version %d (fetched from %s in %.2f s)",
            self.name,
            reg.version,
            ", ".join(sources) or "the node cache",
            time.perf_counter() - t0,
        )

    def _release_older(self) -> None:
        """Let go of the copies the leader can no longer swap in: older than its target (what it
        serves or is about to swap in) and not the newest held. The newest held is the copy
        fetched last (`held`), not the highest number: after a trainer rollback the pointer names
        a lower number, which the leader swaps in next. The engine holds its weights in memory;
        the node cache may prune them."""
        target = self.gbus.target()
        newest = self.held[0] if self.held is not None else None
        for v in [v for v in self._holds if v != newest and (target is None or v < target)]:
            self._holds.pop(v).close()

    # -- the loop ------------------------------------------------------------------------
    def _beat(self, stop: threading.Event) -> None:
        """From a thread, whatever the loop does (a fetch of a large version, the engine's
        start): this node's beat, its holds re-sent (a report a Valkey failover lost comes
        back), and a Spot notice passed on to the group at once."""
        while not stop.wait(2.0):
            try:
                self.gbus.beat(self.spec.rank)
                if self.held is not None:
                    self.gbus.report_holds(self.spec.rank, *self.held)
                if self._notice_at is not None and self.gbus.drain_asked() is None:
                    self.gbus.ask_drain(self.spec.rank, "SIGTERM (a Spot notice)")
            except Exception as err:  # noqa: BLE001 - liveness is advisory; the loop reports real failures
                log.warning("%s: heartbeat failed: %s", self.name, err)

    def _wait_leader_starting(self) -> None:
        """Start the engine ranks only once the leader builds its engine (vLLM's headless cores
        give up on a front-end that does not answer within 5 minutes); bounded by
        `rollout.group_fetch_timeout_s`. Meanwhile the first version is fetched."""
        t0 = time.monotonic()
        while not self.gbus.leader_starting():
            if self.gbus.ended() is not None or self._notice_at is not None:
                return
            if time.monotonic() - t0 > self.cfg.rollout.group_fetch_timeout_s:
                raise TimeoutError(
                    f"{self.name}: the leader {self.spec.leader} did not start its engine in "
                    f"{self.cfg.rollout.group_fetch_timeout_s:g} s (rollout.group_fetch_timeout_s)"
                )
            if not self.bus.done():
                self._fetch_servable()
            time.sleep(POLL_S)

    def run(self) -> int:
        from moerl.components.rollout.worker import EXIT_DRAINED

        self.gbus.beat(self.spec.rank)
        stop = threading.Event()
        beat = threading.Thread(target=self._beat, args=(stop,), name="moerl-beat", daemon=True)
        beat.start()
        try:
            self._fetch_servable()  # the first version, beside the engine's start
            self._wait_leader_starting()
            self._start_engine()
            return self._loop(EXIT_DRAINED)
        except BaseException as err:
            # the leader's engine would wait for this node's ranks: the group drains
            try:
                self.gbus.ask_drain(self.spec.rank, f"failed: {type(err).__name__}: {err}")
            except Exception:  # noqa: BLE001 - the leader also sees this node stop beating
                pass
            raise
        finally:
            stop.set()
            beat.join(timeout=5)
            self.close()

    def _loop(self, exit_drained: int) -> int:
        assert self.engine is not None
        t0 = time.monotonic()
        leader_seen_at: float | None = None
        grace = self.cfg.rollout.grace_seconds + DRAIN_MARGIN_S
        while True:
            now = time.monotonic()
            ended = self.gbus.ended()
            if ended is None and self.engine.dead():
                # the leader's end may close the engine first: its word decides
                dead, ended = self.engine.dead(), self.gbus.ended()
                if ended is None:
                    self.gbus.ask_drain(self.spec.rank, f"engine ranks exited: {dead}")
                    log.error("%s: its engine ranks exited: %s", self.name, dead)
                    return 1
            if ended is not None:
                if ended in (0, exit_drained):
                    log.info("%s: the leader ended with %d", self.name, ended)
                    return ended
                log.error("%s: the leader failed (exit %d)", self.name, ended)
                return 1
            if self._notice_at is not None:
                if self.gbus.drain_asked() is None:
                    self.gbus.ask_drain(self.spec.rank, "SIGTERM (a Spot notice)")
                if now - self._notice_at > grace:
                    log.error("%s: the leader did not finish its drain in %.0f s", self.name, grace)
                    return exit_drained
            t_read = time.monotonic()
            alive = self.gbus.alive(0)
            if time.monotonic() - t_read > SLOW_BUS_S and leader_seen_at is not None:
                leader_seen_at = time.monotonic()  # an outage, not the leader's silence
            if alive:
                leader_seen_at = now
            else:
                since = leader_seen_at if leader_seen_at is not None else t0
                bound = (
                    LEADER_LOST_S
                    if leader_seen_at is not None
                    else self.cfg.rollout.group_fetch_timeout_s
                )
                if now - since > bound:
                    log.error(
                        "%s: the leader %s has not beaten for %.0f s",
                        self.name,
                        self.worker,
                        now - since,
                    )
                    return 1
            if self._notice_at is None and not self.bus.done():
                self._fetch_servable()
                self._release_older()
            time.sleep(POLL_S)

    def close(self) -> None:
        for hold in self._holds.values():
            hold.close()
        self._holds.clear()
        if self._fanout is not None:
            self._fanout.stop()
            self._fanout = None
        if self.engine is not None:
            self.engine.close()
            self.engine = None


def run_follower(cfg: RunConfig, run_id: str, worker: str) -> int:
    """Serve as follower node of `worker`'s engine group (MOERL_NODE_RANK >= 1) until the leader
    ends; the exit code (see the module docstring)."""
    from moerl.components.rollout.group import GroupSpec
    from moerl.provenance import stage_start

    spec = GroupSpec.from_env(cfg)
    if spec is None or spec.is_leader:
        raise ConfigError(
            f"{worker}: a follower needs MOERL_GROUP_SIZE >= 2 and MOERL_NODE_RANK >= 1 "
            "(the engine group's JobSet sets them)"
        )
    stage_start(cfg, f"{worker}.node{spec.rank}", run_id)  # where it runs; enforces `require:`
    if cfg.valkey.url is None:
        raise ConfigError("valkey.url is unset: a follower joins its run's bus")
    bus = RunBus(connect(cfg.valkey.url, cfg.valkey.reconnect_s, cfg.valkey.username), run_id)
    f = Follower(cfg, run_id, worker, bus, spec)
    previous = signal.signal(signal.SIGTERM, f.notice)
    try:
        return f.run()
    finally:
        signal.signal(signal.SIGTERM, previous)


def main(argv: list[str] | None = None) -> int:
    """`python -m moerl.components.rollout.follower --config FILE --run-id R --name N` (a local
    group's follower node; on EKS the rollout_worker stage runs `run_follower` on node ranks
    >= 1)."""
    from moerl.components.rollout.worker import process_args

    return run_follower(*process_args(argv, ".follower"))


if __name__ == "__main__":
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    sys.exit(main())
