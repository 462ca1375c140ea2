"""Rollout worker (async mode): one vLLM engine for the whole run, fed by leased work units.

Single-turn units generate several at once (`_stream`), each finished group handed to an
outbox thread that writes it to Valkey (`_Outbox`), each unit acknowledged behind its last
group; multi-turn units run one at a time (`_run_episodes`). The worker follows the bus's
servable pointer and hot-swaps each version in, between units or in flight
(`rollout.weight_update`); a heartbeat thread refreshes the leases it holds. On SIGTERM it
drains and exits with `EXIT_DRAINED` (75), never 0. The design: docs/async.md (weights, weight
updates, publication, Spot); the faults it survives: docs/reliability.md.
"""

from __future__ import annotations

import argparse
import collections
import functools
import json
import logging
import os
import queue
import signal
import socket
import statistics
import sys
import threading
import time
from collections.abc import Callable, Iterable
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from moerl.bus import BusWrite, Lease, RunBus, TrainerWatch, connect, group_id
from moerl.bus.run import Registered
from moerl.bus.weights import WIRE_PREFIX, same_weights
from moerl.components.rollout.wire_receive import WireReceiver
from moerl.config import RunConfig, config_from_json
from moerl.errors import CheckpointError, ConfigError, StoreUnavailable, WeightSyncError
from moerl.launch.podenv import enter_pod
from moerl.records import Prompt, Sample
from moerl.store.runs import engine_copy, run_cache, run_store
from moerl.tasks.prompting import encode_prompt, uses_template

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from moerl.components.rollout.engine import RolloutEngine
    from moerl.components.rollout.episodes import Episode, EpisodeDriver

log = logging.getLogger(__name__)

EXIT_DRAINED = 75  # EX_TEMPFAIL: drained after SIGTERM; the task must be retried


def group_seed(base: int, unit_id: str, k: int) -> int:
    """A seed per group, the same for every attempt at it."""
    return (base * 1_000_003 + int(unit_id.lstrip("u")) * 4099 + k) % (2**31 - 1)


def served_shas(shas: dict[int, str], versions: Iterable[int | None]) -> dict[int, str] | None:
    """The manifest sha256 an engine served for each of `versions` (those it knows; None, a
    completion without a version, is none of them)."""
    out = {v: shas[v] for v in versions if v in shas}
    return out or None


def group_samples(
    run_id: str,
    gid: str,
    prompt: dict,
    prompt_ids: list[int],
    comps,
    version: int | None,
    routes: Callable[[Any], Any] = lambda c: None,
    shas: dict[int, str] | None = None,
) -> list[dict]:
    """A finished group's samples as the bus carries them: each validated once (`Sample`), with
    its id, the prompt's text read once; `version` for completions that carry none, `routes(c)`
    a completion's routed experts (RolloutEngine.routed_experts), `shas` the manifest sha256 of
    each version the engine served (`Sample.policy_shas`)."""
    text = Prompt.model_validate(prompt).prompt_text
    out = []
    for j, c in enumerate(comps):
        v = version if c.version is None else c.version
        used = [x for _, x in c.token_versions] if c.token_versions else [v]
        out.append(
            Sample(
                prompt_id=prompt["id"],
                task=prompt["task"],
                prompt=text,
                answer=prompt["answer"],
                sample_index=j,
                sample_id=f"{run_id}/{gid}/{j}",
                prompt_token_ids=prompt_ids,
                response_token_ids=c.token_ids,
                response_logprobs=c.logprobs,
                response_text=c.text,
                finish_reason=c.finish_reason,
                policy_version=v,
                token_versions=c.token_versions,
                meta=prompt.get("meta"),
                routed_experts=routes(c),
                policy_shas=served_shas(shas or {}, used),
            ).model_dump()
        )
    return out


class _Drain:
    """SIGTERM sets a deadline; the loop drains against it."""

    def __init__(self, grace_s: float):
        self.grace_s = grace_s
        self.deadline: float | None = None

    def __call__(self, signum, frame) -> None:
        if self.deadline is None:
            self.deadline = time.monotonic() + self.grace_s
            log.warning("SIGTERM: draining for at most %.0f s", self.grace_s)

    @property
    def asked(self) -> bool:
        return self.deadline is not None

    def expired(self) -> bool:
        return self.deadline is not None and time.monotonic() >= self.deadline


@dataclass
class _InFlight:
    """A leased single-turn unit whose groups the engine is generating."""

    lease: Lease
    unit_id: str
    todo: dict[int, dict]  # k -> entry, less the groups an earlier attempt published
    ids: dict[str, list[int]] = field(default_factory=dict)  # request id -> prompt token ids
    by_rid: dict[str, int] = field(default_factory=dict)  # request id -> k
    finished: set[int] = field(default_factory=set)
    overlapped: bool = False  # leased while another unit was generating (counted with its end)
    refused: list[BusWrite] = field(default_factory=list)  # its groups the engine cannot take

    def remaining(self) -> list[int]:
        return [k for k in self.todo if k not in self.finished]


@dataclass
class _VersionDrain:
    """A between-units drain for a newer version, under way: since when (`perf_counter`), the
    engine steps it took, and the sum of their running batches (added to `_DrainTotals`)."""

    t0: float
    steps: int = 0
    seqs: int = 0


@dataclass
class _Stream:
    """The single-turn loop's state (`RolloutWorker._stream`)."""

    units: dict[str, _InFlight] = field(default_factory=dict)  # entry id -> unit
    rid_unit: dict[str, str] = field(default_factory=dict)  # request id -> entry id
    newer: bool = False  # a newer version waits for the units in flight: lease nothing more
    checked_at: float = 0.0  # when the servable pointer was last read beside generation
    empty_at: float = 0.0  # when the units stream was last found empty (read every 0.1 s)
    version_drain: _VersionDrain | None = None  # waiting for the units' tails to swap

    def add(self, u: _InFlight) -> None:
        self.units[u.lease.entry_id] = u
        self.rid_unit.update((rid, u.lease.entry_id) for rid in u.by_rid)

    def drop(self, u: _InFlight) -> None:
        self.units.pop(u.lease.entry_id, None)
        for rid in u.by_rid:
            self.rid_unit.pop(rid, None)


@dataclass
class _Prefetch:
    """`rollout.weight_update` in_flight: the fetch of the next version (`version`, its manifest
    `sha`) into the node cache, on a thread beside generation."""

    version: int
    sha: str
    thread: threading.Thread

    def ended(self) -> bool:
        return not self.thread.is_alive()


@dataclass
class _DrainTotals:
    """Between-units drains for a newer version, summed (docs/async.md): their seconds, their
    engine steps, and the sum over those steps of the engine's running batch (sequences held, at
    most `rollout.max_num_seqs`: divided by `steps`, the drains' mean batch)."""

    seconds: float = 0.0
    steps: int = 0
    seqs: int = 0


@dataclass
class _TailTotals:
    """Multi-turn units that ended whole, and the sums of their last and their median episode
    ends (seconds after the unit began): the tail, the last episode against the median one."""

    units: int = 0
    last_s: float = 0.0
    median_s: float = 0.0

    def add(self, ends: list[float]) -> None:
        """One more unit, its episodes' ends sorted."""
        self.units, self.last_s, self.median_s = (
            self.units + 1,
            self.last_s + ends[-1],
            self.median_s + statistics.median(ends),
        )


@dataclass
class _EpisodeUnit:
    """One multi-turn unit while `_run_episodes` drives it: its episodes, and what is in flight."""

    unit_id: str
    todo: dict[int, dict]
    driver: EpisodeDriver
    groups: dict[int, list[Episode]]  # prompt index -> its G episodes
    eps: list[Episode]
    where: dict[str, int]  # episode key -> prompt index
    t0: float
    # environment steps, on one thread beside the engine loop, so the engine keeps generating
    # the unit's other episodes while an environment works (a slow tool holds back its own
    # episode, not the engine); the pool is thread-safe, the driver only touched there
    envs: ThreadPoolExecutor
    rids: dict[str, Episode] = field(default_factory=dict)  # engine request -> its episode
    finished: set[int] = field(default_factory=set)  # prompts whose group is published
    in_env: set[str] = field(default_factory=set)  # episodes whose environment step runs now
    pending: list[tuple[Future, list]] = field(default_factory=list)  # environment steps
    too_long: int = 0  # its prompts the engine cannot take (`RolloutWorker._refuse`)


@dataclass(frozen=True)
class _Write:
    """One bus write, sent in one round trip with the writes waiting next to it."""

    write: BusWrite
    always: Callable[[], Any] | None = None


@dataclass(frozen=True)
class _Writes:
    """Writes handed over together (what one engine step finished, perhaps the acknowledgement
    of the unit they complete last): each goes in its place, `always` after the last."""

    writes: list[BusWrite]
    always: Callable[[], Any] | None = None


@dataclass(frozen=True)
class _Call:
    """Anything else handed over: a callable, run alone in its place."""

    fn: Callable[[], Any]
    always: Callable[[], Any] | None = None


@dataclass(frozen=True)
class _Barrier:
    """A flush: set once everything handed over before it is done."""

    done: threading.Event


@dataclass(frozen=True)
class _Stop:
    """The close: the thread ends here, once everything handed over before it is done."""


_OutboxItem = _Write | _Writes | _Call | _Barrier | _Stop


class _Outbox:
    """The worker's writes of finished work to the bus (each group's publication, then its
    unit's acknowledgement), made in order on a thread of their own, so the generation loop
    never waits for a round trip (docs/async.md, "Start-up and publication").

    Writes the thread finds waiting together go in one round trip (`RunBus.write_many`: at most
    `BATCH_WRITES` writes or about `BATCH_BYTES`). A write that fails (an error reply, or the
    bus unreachable past `valkey.reconnect_s`) stops every later one, and is raised on the loop
    at its next hand-over, `check` or `flush`. Each hand-over's `always` runs after it whether
    it ran, failed or was skipped (a lease's release: the heartbeat must stop refreshing it)."""

    BATCH_WRITES = 64
    BATCH_BYTES = 4 << 20

    def __init__(self, name: str, bus: RunBus | None = None, maxsize: int = 0):
        # maxsize: writes handed over and not yet made, at most (0: unbounded); a full outbox
        # blocks the hand-over, so a slow bus slows generation instead of queueing without end
        self._bus = bus
        self._q: queue.Queue[_OutboxItem] = queue.Queue(maxsize)
        self.error: BaseException | None = None
        self.writes, self.round_trips = 0, 0  # bus writes made, and the round trips that made them
        self._thread = threading.Thread(target=self._run, name=f"moerl-outbox-{name}", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        waiting: collections.deque[_OutboxItem] = collections.deque()
        while True:
            self._take(waiting)
            match waiting.popleft():
                case _Stop():
                    return
                case _Barrier(done):  # everything before it is done
                    done.set()
                case _Writes(writes, always):  # each in its place, `always` after the last
                    if writes:
                        each = [_Write(w) for w in writes[:-1]] + [_Write(writes[-1], always)]
                        waiting.extendleft(reversed(each))
                    elif always is not None:
                        always()
                case _Call(fn, always):
                    self._make(fn, [always])
                case _Write() as first:
                    batch = self._batch(first, waiting)
                    self._make(
                        functools.partial(self._send, [w.write for w in batch]),
                        [w.always for w in batch],
                        writes=len(batch),
                    )

    def _take(self, waiting: collections.deque[_OutboxItem]) -> None:
        """Wait for a hand-over, then take whatever else waits in one go."""
        if not waiting:
            waiting.append(self._q.get())
        while len(waiting) < self.BATCH_WRITES:
            try:
                waiting.append(self._q.get_nowait())
            except queue.Empty:
                break

    def _batch(self, first: _Write, waiting: collections.deque[_OutboxItem]) -> list[_Write]:
        """`first` and the writes waiting right behind it, within one round trip's bounds."""
        batch, size = [first], first.write.size
        while len(batch) < self.BATCH_WRITES and size < self.BATCH_BYTES:
            nxt = waiting[0] if waiting else None
            if not isinstance(nxt, _Write):
                break
            waiting.popleft()
            batch.append(nxt)
            size += nxt.write.size
        return batch

    def _send(self, writes: list[BusWrite]) -> None:
        if self._bus is None:  # `put` refuses writes to an outbox without a bus
            raise RuntimeError("this outbox has no bus to send writes on")
        self._bus.write_many(writes)

    def _make(
        self, action: Callable[[], Any], always: list[Callable[[], Any] | None], writes: int = 0
    ) -> None:
        """Run `action` (making `writes` bus writes in one round trip), unless a write failed
        before; then every `always`, whatever happened."""
        try:
            if self.error is None:
                action()
                if writes:
                    self.writes, self.round_trips = self.writes + writes, self.round_trips + 1
        except BaseException as err:  # noqa: BLE001 - raised on the generation loop
            self.error = err
            log.error(
                "the outbox's write failed; nothing later is written: %s: %s",
                type(err).__name__,
                err,
            )
        finally:
            for after in always:
                if after is not None:
                    after()

    def check(self) -> None:
        """Raise the first write that failed (the loop calls this at every pass)."""
        if self.error is not None:
            raise self.error

    def put(
        self,
        op: BusWrite | list[BusWrite] | Callable[[], Any],
        always: Callable[[], Any] | None = None,
    ) -> None:
        """Hand over a bus write (batched with its neighbours), several in order (one hand-over,
        so the thread finds them together: what one engine step finished), or a callable (run
        alone); `always` runs after it (after the last of several) whether it ran, failed or
        was skipped."""
        self.check()
        item: _OutboxItem
        if isinstance(op, BusWrite):
            item = _Write(op, always)
        elif isinstance(op, list):
            if not all(isinstance(w, BusWrite) for w in op):
                raise TypeError("a list handed to the outbox holds bus writes only")
            item = _Writes(op, always)
        else:
            item = _Call(op, always)
        if isinstance(item, (_Write, _Writes)) and self._bus is None:
            raise RuntimeError("this outbox has no bus to send writes on")
        if not self._thread.is_alive():
            raise RuntimeError("the worker's outbox is closed: nothing more can be written")
        self._q.put(item)

    def flush(self) -> None:
        """Wait until every write handed over so far is made; raise the first that failed."""
        if self._thread.is_alive():
            barrier = _Barrier(threading.Event())
            self._q.put(barrier)
            barrier.done.wait()
        self.check()

    def close(self) -> None:
        """Make what is queued, then stop the thread (errors stay in `error`)."""
        if self._thread.is_alive():
            self._q.put(_Stop())
            self._thread.join()


def fanout_swarm(node):
    """The fan-out between this run's engines (`checkpoint.fanout`) of `node` (a rollout worker,
    or a follower node of an engine group: its `cfg`, `bus`, `name`), started on first use and
    kept in its `_fanout`; None without the fan-out."""
    if not node.cfg.checkpoint.fanout:
        return None
    if node._fanout is None:
        from moerl.store.fanout import Swarm

        node._fanout = Swarm.start(node.bus, node.name, node.cfg.checkpoint)
    return node._fanout


NODE_LOST_S = 60.0  # a follower whose beat the bus has not shown this long is lost


def pointer_moved(
    reg: Registered | None, version: int | None, sha: str | None, epoch: int
) -> str | None:
    """How the servable pointer `reg` moved from what an engine serves ((version, sha), followed
    up to trainer `epoch`): `forward` (a newer number), `back` (a newer trainer epoch rolled it
    back, or published the same number again with other weights: what the engine serves is
    lost, so its units in flight finish and it moves at once), or None (the same (version, sha),
    or a pointer behind the engine that no newer epoch set: lost writes, the engine stays).
    (version, sha) and the epoch decide, never the number alone: a busy worker that compared
    numbers kept serving lost weights after a rollback."""
    if reg is None or same_weights(reg.version, reg.manifest_sha256, reg.epoch, version, sha):
        return None
    if version is None or reg.version > version:
        return "forward"
    return "back" if reg.epoch > epoch else None


class RolloutWorker:
    def __init__(self, cfg: RunConfig, run_id: str, name: str, bus: RunBus):
        self.cfg, self.run_id, self.name, self.bus = cfg, run_id, name, bus
        self.engine: RolloutEngine | None = None
        self.tokenizer: PreTrainedTokenizerBase | None = None
        self.version: int | None = None
        self.sha: str | None = None  # the served version's manifest sha256
        self.epoch = 0  # the newest trainer epoch whose servable pointer this worker followed
        self._fanout = None  # moerl.store.fanout.Swarm, with checkpoint.fanout
        self.busy_s = 0.0
        # from the process's own start (its imports included: what a new worker costs before it
        # generates, the fleet's load time; procs.process_age_s)
        from moerl.launch.procs import process_age_s

        age = process_age_s() or 0.0
        self.t_start = time.perf_counter() - age
        # in the stats: tells this process from a predecessor of the same name
        self.started_unix = time.time() - age
        self.drain = _Drain(cfg.rollout.grace_seconds)
        self.holder = f"rollout-{socket.gethostname()}-{name}"
        self._last_renew = 0.0
        # the leases this worker holds, refreshed by the heartbeat thread (`_beat`) whatever the
        # loop does (an engine load, a fetch and swap of a large version); one it lost is marked
        self._held: dict[str, bool] = {}  # entry id -> still ours
        self._held_lock = threading.Lock()
        from moerl.components.rollout.episodes import uses_environments

        self.multi_turn = uses_environments(cfg)
        self._env_pool = None  # the sandboxed pool environments run in (multi-turn tasks)
        self._tail = _TailTotals()
        self._first_sample_s: float | None = None  # start -> the first group generated (fast start)
        self._drains = _DrainTotals()
        self._early_tried = False  # rollout.early_engine: tried once
        # in_flight: the next version's fetch beside generation, and where each prefetched
        # version came from (counted when it is swapped in)
        self._prefetch: _Prefetch | None = None
        self._prefetched: dict[int, list[str]] = {}
        self._shas: dict[int, str] = {}  # version -> the manifest sha256 served under it
        # group publications and unit acknowledgements, in order; at most as many hand-overs wait
        # (a step's groups, an acknowledgement) as twice the units in flight have groups and acks
        self._outbox = _Outbox(
            name, bus, maxsize=2 * cfg.rollout.units_in_flight * (cfg.units.max_prompts + 1)
        )
        # an engine over several nodes (components/rollout/group.py): this worker is its leader
        from moerl.components.rollout.group import GroupBus, GroupSpec

        self.group = GroupSpec.from_env(cfg)
        if self.group is not None and not self.group.is_leader:
            raise ConfigError(
                f"{name}: node rank {self.group.rank} of an engine group runs the follower "
                "(components/rollout/follower.py), not the rollout worker"
            )
        self.gbus = GroupBus(bus, name, self.group) if self.group is not None else None
        self._group_wait: float | None = None  # since when a newer version waits for the nodes
        # follower rank -> when a read of the bus last found it beating (the local clock)
        self._group_seen: dict[int, float] = {}
        self._group_failure: str | None = None  # a follower lost (set by the heartbeat thread)
        self._prefetch_done: tuple[int, str] | None = None  # in_flight: fetched beside, not swapped
        # the engine's transport (`transport.check_engine_transport`), set as tags on the MLflow
        # run when this worker runs as the stage (`run_rollout_worker`), not inside a bench
        self.record_run = False
        self.transport: dict[str, str] = {}
        # rollout.weight_sync collective: versions by session over the wire (wire_receive.py)
        self._wire = (
            WireReceiver(bus, name, cfg.buffer.max_staleness, cfg.rollout.weight_sync_timeout_s)
            if cfg.rollout.resolved.weight_sync == "collective"
            else None
        )

    @property
    def bus_writes(self) -> tuple[int, int]:
        """(group publications and acknowledgements written, the round trips that wrote them)."""
        return self._outbox.writes, self._outbox.round_trips

    def settled_bus_writes(self) -> tuple[int, int]:
        """`bus_writes` once every write handed over so far is made (a barrier on the outbox's
        queue; safe from another thread). The server applies a write before the outbox counts
        it, so a count read as soon as the bus shows a write may still miss it."""
        self._outbox.flush()
        return self.bus_writes

    @property
    def _live(self) -> RolloutEngine:
        """The engine, once loaded (the loops generate only after `_serve_latest` loaded one)."""
        if self.engine is None:
            raise RuntimeError(f"{self.name}: no engine loaded yet")
        return self.engine

    # -- weights ------------------------------------------------------------------------
    def _serve_latest(self, in_flight: bool = False) -> None:
        """Serve the version the bus's servable pointer names (the registry without one): fetched
        from the nearest tier that holds its manifest (`moerl.store.tiers`), swapped in.
        `in_flight` (rollout.weight_update in_flight, sequences running): only a newer version,
        swapped between two engine steps; a failed fetch does not wait (generation goes on)."""
        reg = self.bus.servable()
        if self.engine is None and not self._early_tried:
            if self.group is not None:
                # every rank of a group's engine starts on dummy weights and gets each version
                # by a swap, checked on every rank (the nodes never load a version on their own)
                self._early_engine(required=True)
            elif self.cfg.rollout.early_engine and (reg is None or self._joins_by_wire()):
                self._early_engine()
        if self._wire is not None and self.engine is not None:
            self._wire.enroll(self._live)
            if not in_flight and self._take_session():
                return
            if not in_flight and self._wire.catching_up(self.version, self.epoch):
                return  # the trainer sends the version the fleet serves; files after a timeout
        if reg is None:
            return
        if same_weights(reg.version, reg.manifest_sha256, reg.epoch, self.version, self.sha):
            if (
                not in_flight
                and self._wire is not None
                and self._wire.to_verify(self.version, self.sha, reg.manifest_sha256)
            ):
                self._verify_wire(reg)
            return
        if in_flight and (self.version is None or reg.version <= self.version):
            return  # a rollback (a newer trainer epoch) waits for an idle engine
        if self.version is not None and reg.version < self.version and reg.epoch <= self.epoch:
            # only forward: a pointer behind what this engine serves lost writes (a Valkey
            # failover); the trainer re-commits from the store, and the pointer catches up. A
            # newer trainer epoch may move it back: the version above was lost (rolled back).
            # A version taken over the wire is ahead of its files for a while: not a warning.
            wire = self.sha is not None and self.sha.startswith(WIRE_PREFIX)
            log.log(
                logging.DEBUG if wire else logging.WARNING,
                "%s: the bus says version %d but this engine serves %d; staying on %d",
                self.name,
                reg.version,
                self.version,
                self.version,
            )
            return
        if not self._group_holds(reg):
            return  # a node of the group is still fetching it: serve what the engine has
        store = self._pin(reg.version)
        t0 = time.perf_counter()
        sources: list[str] = []
        try:
            self._load(reg, sources, t0, in_flight)
        except CheckpointError as err:
            # no tier can serve it right now (the cache tier died while the version was servable
            # and not yet durable; S3 unreachable): keep serving what this engine has, try again
            # at the next unit; an engine that has nothing yet waits the same way
            self.bus.incr(weights_fetch_failed=1)
            log.warning(
                "%s: cannot fetch version %d yet (%s); %s",
                self.name,
                reg.version,
                err,
                f"serving version {self.version} meanwhile"
                if self.version is not None
                else "waiting",
            )
            if not in_flight:
                time.sleep(1.0)
            return
        if self.version is not None and self.version != reg.version:
            store.unpin(self.version, holder=self.holder)
        self.version, self.sha, self.epoch = (
            reg.version,
            reg.manifest_sha256,
            max(self.epoch, reg.epoch),
        )
        # what each version number meant on this engine, for the samples' policy_shas (the last
        # few: a sample spans at most the versions of one unit's generation)
        self._shas = {v: h for v, h in self._shas.items() if reg.version - 16 < v < reg.version}
        self._shas[reg.version] = reg.manifest_sha256
        # bounded: a prefetch of a version this engine went past (or rolled back over) is never swapped in
        self._prefetched = {v: s for v, s in self._prefetched.items() if v > reg.version}
        self.bus.heartbeat(self.name, last_swap_s=time.perf_counter() - t0)

    def _joins_by_wire(self) -> bool:
        """A worker that starts while versions go over the wire (a session exists): its engine
        starts on dummy weights and asks for the fleet's version (a catch-up), not files."""
        return self._wire is not None and self._wire.fleet_on_wire()

    def _take_session(self) -> bool:
        """`rollout.weight_sync` collective, the engine idle: take the session that names it
        for a newer version (wire_receive.py). True once the engine serves that version."""
        assert self._wire is not None
        s = self._wire.waiting(self.version, self.epoch, fresh=True)
        if s is None:
            return False
        t0 = time.perf_counter()
        stats = self._wire.take(self._live, s)
        if stats is None:
            self.bus.incr(weight_sessions_missed=1)
            if self._live.version is None:  # its weights are unknown: the files' version next
                self.version = self.sha = None
            return False
        self.version, self.sha, self.epoch = s.version, s.sha, max(self.epoch, s.epoch)
        self._shas = {v: h for v, h in self._shas.items() if s.version - 16 < v < s.version}
        self._shas[s.version] = s.sha
        self.bus.incr(swaps_wire=1)
        self.bus.heartbeat(self.name, last_swap_s=time.perf_counter() - t0)
        log.info(
            "%s: version %d over the wire (%s) in %.2f s (%d tensors on %d ranks)",
            self.name,
            s.version,
            s.kind,
            stats.seconds,
            stats.tensors,
            stats.ranks,
        )
        return True

    def _verify_wire(self, reg: Registered) -> None:
        """The version this engine took over the wire, now servable from files, and this
        engine its checker (one member per version, in turn): load the durable copy and compare
        every rank's digests with the wire's. A mismatch fails the run, naming both."""
        assert self._wire is not None
        t0 = time.perf_counter()
        try:
            with self._copy_of(reg) as model_dir:
                stats = self._live.swap_weights(
                    model_dir, version=reg.version, sha=reg.manifest_sha256
                )
        except CheckpointError as err:  # not fetchable yet: checked at a later idle moment
            log.info("%s: cannot check version %d yet: %s", self.name, reg.version, err)
            return
        wrong = self._wire.verified(reg.version, tuple(stats.digests))
        if wrong:
            self.bus.incr(wire_verify_mismatch=1)
            log.error(wrong)
            self.bus.set_failed(wrong)
            raise WeightSyncError(wrong)
        self.bus.incr(wire_verified=1)
        self.sha = self._shas[reg.version] = reg.manifest_sha256
        log.info(
            "%s: version %d over the wire equals its durable copy (%d ranks, checked in %.2f s)",
            self.name,
            reg.version,
            stats.ranks,
            time.perf_counter() - t0,
        )

    def _group_holds(self, reg) -> bool:
        """An engine over several nodes: True once every follower node holds `reg`'s version in
        its own node cache (each reports it in Valkey), so the swap finds it on every rank; the
        leader then names it as its target, which the followers keep (never prune) until the
        leader moves on, and checks once more that every node still holds it. Raises
        WeightSyncError, naming the nodes, when no newer version could be swapped in for
        `rollout.group_fetch_timeout_s` (the clock runs from the first version that waited,
        across newer ones: followers that always lag one version behind fail too)."""
        if self.gbus is None:
            return True
        now = time.monotonic()
        missing = self.gbus.missing(reg.version, reg.manifest_sha256)
        if not missing:
            self.gbus.set_target(reg.version)
            missing = self.gbus.missing(reg.version, reg.manifest_sha256)
        if not missing:
            if self._group_wait is not None:
                self.bus.heartbeat(self.name, ttl_s=10.0, group_wait_s=now - self._group_wait)
            self._group_wait = None
            return True
        if self._group_wait is None:
            self._group_wait = now
            log.info(
                "%s: version %d: waiting for nodes %s of the engine group to hold it",
                self.name,
                reg.version,
                missing,
            )
        waited = now - self._group_wait
        if waited > self.cfg.rollout.group_fetch_timeout_s:
            from moerl.errors import WeightSyncError

            held = {r: self.gbus.holds(r) for r in missing}
            raise WeightSyncError(
                f"{self.name}: nodes {missing} of the engine group do not hold version "
                f"{reg.version} (manifest {reg.manifest_sha256[:12]}) after {waited:.0f} s "
                f"(rollout.group_fetch_timeout_s); they hold {held}"
            )
        if self.version is None:
            time.sleep(0.2)  # nothing to serve meanwhile
        return False

    def _group_watch(self) -> None:
        """From the heartbeat thread: this node's beat; a drain any node of the group asked for
        drains this worker (and a SIGTERM here drains the group); a follower that stops beating
        fails the group (`_exit_code`)."""
        if self.gbus is None or self.group is None:
            return
        try:
            self.gbus.beat(0)
            asked = self.gbus.drain_asked()
            if asked and not self.drain.asked:
                log.warning("%s: the engine group drains (%s)", self.name, asked)
                self.drain(signal.SIGTERM, None)
            elif self.drain.asked and asked is None:
                self.gbus.ask_drain(0, "SIGTERM (a Spot notice) on the leader")
            alive = {r: self.gbus.alive(r) for r in range(1, self.group.size)}
        except Exception:
            # the bus is out (the client retries for valkey.reconnect_s): the nodes' silence
            # meanwhile is not theirs; their clocks restart when it answers again
            self._group_seen = dict.fromkeys(self._group_seen, float("inf"))
            raise
        now = time.monotonic()
        for r, beating in alive.items():
            seen = self._group_seen.get(r)
            if beating or seen == float("inf"):
                self._group_seen[r] = now
            elif seen is not None and now - seen > NODE_LOST_S and self._group_failure is None:
                self._group_failure = (
                    f"node {r} of the engine group has not beaten for {now - seen:.0f} s"
                )

    def _pin(self, version: int):
        """Pin `version` in the run's store for this worker (renewed by `_renew`); the store.
        Servable may be ahead of durable: the pin then holds the version from when it lands."""
        store = run_store(self.cfg.checkpoint, self.run_id)
        store.pin(version, holder=self.holder, ttl_s=self.cfg.checkpoint.pin_ttl_s, published=False)
        return store

    def _fetched_beside(self, reg) -> bool:
        """`rollout.weight_update` in_flight: fetch `reg`'s version into the verified node cache on
        a thread while the engine generates; True once that fetch has ended (the swap then reads
        the node cache; a fetch that failed is retried, and reported, by the swap's own)."""
        key = (reg.version, reg.manifest_sha256)
        p = self._prefetch
        if p is not None and (p.version, p.sha) == key:
            if not p.ended():
                return False
            self._prefetch, self._prefetch_done = None, key
            return True
        if self._prefetch_done == key:  # fetched; the swap waits (for a group's other nodes)
            return True
        t = threading.Thread(
            target=self._prefetch_run, args=(reg,), name="moerl-prefetch", daemon=True
        )
        self._prefetch = _Prefetch(reg.version, reg.manifest_sha256, t)
        t.start()
        return False

    def _prefetch_run(self, reg) -> None:
        try:
            self._pin(reg.version)
            sources: list[str] = []
            with self._copy_of(reg, sources):
                pass
            if self.version is None or reg.version > self.version:  # not swapped in already
                self._prefetched[reg.version] = sources
        except Exception as err:  # noqa: BLE001 - the swap's own fetch retries and reports it
            log.warning(
                "%s: fetching version %d beside generation failed (%s); the swap fetches it again",
                self.name,
                reg.version,
                err,
            )

    def _new_engine(self, model_dir: Path, dummy: bool = False) -> RolloutEngine:
        """This worker's engine and tokenizer from `model_dir` (`dummy`: its config only, random
        weights; see `_early_engine`), counted in engine_loads."""
        from transformers import AutoTokenizer

        from moerl.components.rollout.engine import RolloutEngine
        from moerl.components.rollout.group import ENV_NODE_CACHE
        from moerl.components.rollout.transport import check_engine_transport

        tokenizer = AutoTokenizer.from_pretrained(model_dir)
        # every rank of this node resolves a group swap's version under this node's cache
        os.environ[ENV_NODE_CACHE] = str(run_cache(self.cfg.checkpoint, self.run_id))
        placement = None
        if self.group is not None and self.gbus is not None:
            placement = self.group.engine_kwargs(self.cfg.rollout.data_parallel_size)
            self.gbus.starting()  # the followers start their ranks now
        engine = RolloutEngine(
            model_dir,
            self.cfg.rollout,
            seed=self.cfg.rollout.seed,
            dummy=dummy,
            placement=placement,
        )
        try:  # the transport it got, recorded; `require:` refuses a silent fallback
            run_id = self.run_id if self.record_run else ""
            self.transport = check_engine_transport(self.cfg, engine.core.vllm_config, run_id)
        except Exception:
            engine.close()
            raise
        self.tokenizer, self.engine = tokenizer, engine
        self.bus.incr(engine_loads=1)
        # the start, measured (bench modes)
        self.bus.heartbeat(self.name, ttl_s=10.0, engine_load_s=engine.load_s)
        return engine

    def _early_engine(self, required: bool = False) -> None:
        """`rollout.early_engine`: an engine on dummy weights from the model's skeleton, started
        while no version is servable; version 0 is hot-swapped in when registered. `required`
        (an engine over several nodes): a failure raises instead of falling back."""
        from moerl.components.publish_checkpoint.stage import model_skeleton

        self._early_tried = True
        try:
            skel = model_skeleton(
                self.cfg, run_cache(self.cfg.checkpoint, self.run_id) / "skeleton"
            )
        except (OSError, CheckpointError) as err:
            if required:
                raise
            self.bus.incr(engine_early_start_failed=1)
            log.warning(
                "%s: rollout.early_engine: cannot lay out the model's config here (%s); waiting for "
                "version 0 and loading it instead",
                self.name,
                err,
            )
            return
        try:
            engine = self._new_engine(skel, dummy=True)
        except Exception as err:  # noqa: BLE001 - whatever vLLM raised: the normal start still works
            if required:
                raise
            self.bus.incr(engine_early_start_failed=1)
            log.warning(
                "%s: rollout.early_engine: the engine did not start on dummy weights (%s: %s); waiting for "
                "version 0 and loading it instead",
                self.name,
                type(err).__name__,
                err,
            )
            return
        self.bus.incr(engine_early_starts=1)
        log.info(
            "%s: engine started on dummy weights in %.1f s, before any version is servable",
            self.name,
            engine.load_s,
        )

    def _load(self, reg, sources: list[str], t0: float, in_flight: bool = False) -> None:
        """Fetch `reg`'s version into the node cache and load it: a new engine, or a hot swap
        (`in_flight`: with sequences running, `rollout.inflight_kv` says what they keep)."""
        # held while it loads: no neighbour on this node prunes the copy from under the engine
        with engine_copy(
            self.cfg.checkpoint,
            self.run_id,
            reg.version,
            expect_sha256=reg.manifest_sha256,
            swarm=self._swarm(),
            sources=sources,
        ) as model_dir:
            t_fetched = time.perf_counter()
            if self.engine is None:
                engine = self._new_engine(model_dir)
                engine.version = reg.version
                log.info(
                    "%s: engine loaded on version %d in %.1f s",
                    self.name,
                    reg.version,
                    engine.load_s,
                )
            else:
                running = self._live.unfinished() if in_flight else 0
                # the first version into an early engine: its load, not a swap
                first = self.version is None
                stats = self.engine.swap_weights(
                    # a group's ranks each read their own node's copy (engine_worker.node_copy)
                    model_dir.relative_to(run_cache(self.cfg.checkpoint, self.run_id))
                    if self.group is not None
                    else model_dir,
                    version=reg.version,
                    in_flight=running > 0,
                    kv=self.cfg.rollout.inflight_kv,
                    sha=reg.manifest_sha256,
                    node_cache=self.group is not None,
                )
                if first:
                    self.bus.heartbeat(self.name, ttl_s=10.0, early_engine_swap_in_s=stats.seconds)
                else:
                    self.bus.incr(swaps=1, **({"swaps_in_flight": 1} if running else {}))
                log.info(
                    "%s: hot-swapped to version %d in %.2f s (%d tensors%s)",
                    self.name,
                    reg.version,
                    stats.seconds,
                    stats.tensors,
                    f"; in flight, {running} groups running, KV {self.cfg.rollout.inflight_kv}"
                    if running
                    else "",
                )
        # where the weights came from, counted: a cache tier that fell back to S3 shows here (a
        # version fetched beside generation counts that fetch, not the node-cache read after it)
        sources = self._prefetched.pop(reg.version, []) or sources
        self.bus.incr(**{f"weights_from_{s}": 1 for s in sources})
        self.bus.heartbeat(self.name, last_fetch_s=t_fetched - t0)

    def _swarm(self):
        return fanout_swarm(self)

    def _copy_of(self, reg: Registered, sources: list[str] | None = None):
        """`reg`'s version in this node's cache, fetched from the nearest source and verified
        against its manifest, held while the block runs (moerl.store.runs.engine_copy)."""
        return engine_copy(
            self.cfg.checkpoint,
            self.run_id,
            reg.version,
            expect_sha256=reg.manifest_sha256,
            swarm=self._swarm(),
            sources=sources,
        )

    def _renew(self) -> None:
        """The serving pin's lease, renewed every quarter of its TTL; a store that is away (a
        brownout) is tried again at the next step: the lease outlives three missed renewals."""
        now = time.monotonic()
        if self.version is not None and now - self._last_renew > self.cfg.checkpoint.pin_ttl_s / 4:
            try:
                run_store(self.cfg.checkpoint, self.run_id).renew(
                    self.holder, ttl_s=self.cfg.checkpoint.pin_ttl_s
                )
            except StoreUnavailable as e:
                log.warning("%s: serving pin not renewed (%s); trying again", self.name, e)
                self._last_renew = now - self.cfg.checkpoint.pin_ttl_s / 4 + 10.0
                return
            self._last_renew = now

    # -- single-turn units, several in flight ---------------------------------------------
    def _start_unit(self, lease: Lease) -> _InFlight:
        """Submit the unit's groups (one request of n = G per prompt, seeded per group), less the
        ones another attempt already published."""
        unit_id, todo = self._todo(lease)
        G = self.cfg.rollout.samples_per_prompt
        u = _InFlight(lease, unit_id, todo)
        for k, e in todo.items():
            # the entry id too: a requeued unit (same unit id, a new entry, deliveries from 1) leased
            # here while the original attempt still runs must not give the engine a duplicate id
            rid = f"{unit_id}-{k}-{lease.entry_id}-{lease.deliveries}"
            # text, or chat template
            ids = encode_prompt(self.tokenizer, self.cfg.rollout, e["prompt"])
            if (why := self._live.prompt_refused(len(ids))) is not None:
                u.refused.append(self._refuse(unit_id, e, why))
                u.finished.add(k)
                continue
            u.ids[rid], u.by_rid[rid] = ids, k
            self._live.submit(rid, ids, G, seed=self._seed(unit_id, k))
        return u

    def _refuse(self, unit_id: str, entry: dict, why: str) -> BusWrite:
        """A prompt the engine cannot take: its group dead-lettered before it reaches the engine
        (counted `prompts_too_long` with its unit's acknowledgement); the worker goes on."""
        gid = group_id(unit_id, entry["k"], entry["prompt"]["id"])
        log.error("%s: group %s not generated: %s", self.name, gid, why)
        return self.bus.refuse_write(gid, f"{why} (refused by its producer)", json.dumps(entry))

    def _seed(self, unit_id: str, k: int) -> int | None:
        """Group k's seed with `rollout.seed_groups`, else None (the engine's generator)."""
        return (
            group_seed(self.cfg.rollout.seed, unit_id, k) if self.cfg.rollout.seed_groups else None
        )

    def _stream(self, watch: TrainerWatch) -> int:
        """The single-turn loop: up to `rollout.units_in_flight` leased units generate at once,
        each group handed to the outbox the moment its G samples finish, each unit acknowledged
        behind its last group (docs/async.md). Returns the exit code."""
        s = _Stream()
        while True:
            # a failed write ends the worker here, idle or not (its retry takes over)
            self._outbox.check()
            if not s.units:  # the engine is idle: the run may end, a drain ends, the version moves
                code = self._exit_code(watch)
                if code is not None:
                    return code
                self._between_units(s)
                if self.version is None:  # nothing servable yet (an early engine waits)
                    self._renew()
                    time.sleep(0.2)
                    continue
            self._renew()
            now = time.monotonic()
            if s.units:
                self._follow_pointer(s, now)
            if self._has_room(s, now):
                self._lease_next(s, now)
            if not s.units:
                continue
            self._step(s)
            # a lease another worker took: drop its unfinished groups
            for u in list(s.units.values()):
                if not self._still_held(u.lease):
                    self._abandon_unit(s, u)
            if self.drain.expired():  # the grace ran out: requeue what did not finish
                for u in list(s.units.values()):
                    self._abandon_unit(s, u)
                self.bus.incr(drains=1)
                return EXIT_DRAINED

    def _between_units(self, s: _Stream) -> None:
        """The engine is idle: a drain for a newer version ends (what waiting for the units'
        tails cost is reported), and the servable version is swapped in."""
        if s.version_drain is not None:
            d = self._drains
            d.seconds = d.seconds + time.perf_counter() - s.version_drain.t0
            d.steps, d.seqs = d.steps + s.version_drain.steps, d.seqs + s.version_drain.seqs
            self.bus.heartbeat(
                self.name,
                ttl_s=10.0,
                version_drain_s=d.seconds,
                version_drain_steps=d.steps,
                version_drain_seqs=d.seqs,
            )
            s.version_drain = None
        self._serve_latest()
        s.newer = False

    def _follow_pointer(self, s: _Stream, now: float) -> None:
        """Beside generation, every 0.5 s or as soon as a fetch beside it ended: a newer version
        is swapped in between two steps (`rollout.weight_update` in_flight, forward only), or
        else stops the leasing until the units in flight finish (the drain, timed)."""
        fetched = self._prefetch is not None and self._prefetch.ended()
        if now - s.checked_at <= 0.5 and not fetched:
            return
        s.checked_at = now
        reg = self.bus.servable()
        moved = pointer_moved(reg, self.version, self.sha, self.epoch)
        if moved == "forward" and self.cfg.rollout.weight_update == "in_flight":
            if self._fetched_beside(reg):  # the fetch ran on a thread while the engine generated
                self._serve_latest(in_flight=True)
            s.newer = False
            return
        if moved is not None and reg is not None and not self._group_holds(reg):
            moved = None  # a node of the group still fetches it: no drain until all hold it
        if (
            moved is None
            and self._wire is not None
            and self._wire.waiting(self.version, self.epoch)
        ):
            moved = "forward"  # a session names this engine: its units finish, then it takes it
        s.newer = moved is not None
        if s.newer and s.version_drain is None:
            s.version_drain = _VersionDrain(time.perf_counter())

    def _has_room(self, s: _Stream, now: float) -> bool:
        """Whether to lease another unit: no drain asked, no newer version waiting, fewer than
        `rollout.units_in_flight` units, and fewer unfinished sequences than a full running batch
        plus a full batch waiting (so the engine's scheduler has the next unit's prefill queued
        when this one's sequences end: they often end together). Beside generation, an empty
        units stream is read again after 0.1 s."""
        return (
            not self.drain.asked
            and not s.newer
            and not (self._wire is not None and self._wire.behind(self.version))
            and len(s.units) < self.cfg.rollout.units_in_flight
            and self._live.unfinished_sequences() < 2 * self.cfg.rollout.max_num_seqs
            and (not s.units or now - s.empty_at > 0.1)
        )

    def _lease_next(self, s: _Stream, now: float) -> None:
        """Lease a unit (waiting up to 0.2 s when the engine is idle) and submit its groups."""
        lease = self.bus.lease_unit(
            self.name, block_ms=0 if s.units else 200, held=self._held_ids()
        )
        if lease is None:
            s.empty_at = now
            return
        self._hold(lease)  # refreshed from now on by the heartbeat thread
        if not s.units:  # a version registered while we waited: its units were issued for it
            self._serve_latest()
        u = self._start_unit(lease)
        u.overlapped = bool(s.units)
        s.add(u)
        if not u.remaining():  # every group published by an earlier attempt, or refused
            self._complete_unit(s, u, u.refused)
        else:
            self._hand_over(u.refused)

    def _step(self, s: _Stream) -> None:
        """One engine step: the groups it finished go to the outbox in one hand-over, each unit
        it completed acknowledged behind them."""
        drain = s.version_drain
        if drain is not None:  # the running batch (the rest of the sequences wait)
            drain.steps += 1
            drain.seqs += min(self._live.unfinished_sequences(), self.cfg.rollout.max_num_seqs)
        t0 = time.perf_counter()
        writes: list[BusWrite] = []  # the groups this step finished, handed over together
        try:
            for rid, comps in self._live.step():
                u = s.units[s.rid_unit.pop(rid)]
                k = u.by_rid[rid]
                writes.append(self._group_write(u.unit_id, u.todo[k], comps, u.ids[rid]))
                u.finished.add(k)
                self._first_group_generated()
                if len(u.finished) == len(u.todo):  # its last groups and its acknowledgement
                    self._complete_unit(s, u, writes)
                    writes = []
        finally:
            self._hand_over(writes)
            self.busy_s += time.perf_counter() - t0

    def _first_group_generated(self) -> None:
        """The time from the worker's start to its first generated group, logged and reported
        once (`first_sample_s`)."""
        if self._first_sample_s is not None:
            return
        self._first_sample_s = time.perf_counter() - self.t_start
        log.info("%s: first group generated %.1f s after start", self.name, self._first_sample_s)
        self.bus.heartbeat(self.name, ttl_s=10.0, first_sample_s=self._first_sample_s)

    def _complete_unit(self, s: _Stream, u: _InFlight, last_groups: list[BusWrite]) -> None:
        """Drop a unit none of whose groups remains from the loop's books and acknowledge it
        behind `last_groups` (those of its groups the step finished, still to hand over)."""
        s.drop(u)
        self._ack_behind(
            u.lease,
            last_groups,
            units_overlapped=int(u.overlapped),
            prompts_too_long=len(u.refused),
        )

    def _abandon_unit(self, s: _Stream, u: _InFlight) -> None:
        """Drop a unit with groups still generating from the loop's books (its lease lost, or a
        drain out of grace), abort them and give them up or requeue them (`_end_unfinished`)."""
        remaining = u.remaining()
        s.drop(u)
        if u.overlapped:
            self.bus.incr(units_overlapped=1)
        try:
            self._end_unfinished(
                u.lease, remaining, [rid for rid, k in u.by_rid.items() if k in remaining]
            )
        finally:
            self._release(u.lease)

    def _todo(self, lease: Lease) -> tuple[str, dict[int, dict]]:
        """The unit's id and its entries by k, less the groups another attempt already published."""
        unit_id = lease.unit["unit_id"]
        entries = lease.unit["prompts"]
        gids = {e["k"]: group_id(unit_id, e["k"], e["prompt"]["id"]) for e in entries}
        done_already = self.bus.published(list(gids.values()))
        return unit_id, {e["k"]: e for e in entries if gids[e["k"]] not in done_already}

    def _ack_behind(
        self,
        lease: Lease,
        last_groups: list[BusWrite],
        units_overlapped: int,
        prompts_too_long: int = 0,
    ) -> None:
        """Acknowledge a unit on the outbox, behind its `last_groups` in one hand-over (so one
        round trip sends them and the acknowledgement), then release its lease, also when a
        failed write before skips the acknowledgement; the loop goes on at once.
        `units_overlapped` goes to the counters with the acknowledgement."""
        ack = self.bus.ack_write(
            lease, units_overlapped=units_overlapped, prompts_too_long=prompts_too_long
        )
        self._outbox.put(
            [*last_groups, ack],
            always=lambda: self._release(lease),
        )

    def _ack_now(self, lease: Lease, **counts: int) -> None:
        """Acknowledge a unit once its groups' publications are made (the outbox flushed)."""
        self._outbox.flush()
        self.bus.ack_unit(lease, **counts)

    def _end_unfinished(self, lease: Lease, remaining: list[int], rids: list[str] | None) -> bool:
        """End a unit whose prompts `remaining` did not finish, once its groups' publications
        are made (the outbox flushed): its requests still in flight are aborted (`rids`; None:
        every request), then the prompts are given up (another worker took the lease: True) or
        requeued (a drain out of grace: False)."""
        unit_id = lease.unit["unit_id"]
        self._outbox.flush()
        if rids is not None:
            self._live.abort(rids)
        else:
            self._live.abort_all()
        if not self._still_held(lease):
            # another worker reclaimed the unit: it regenerates what is missing; ours is dropped
            self.bus.incr(leases_lost=1)
            log.warning(
                "%s: lost the lease of %s; dropped its %d unfinished prompts",
                self.name,
                unit_id,
                len(remaining),
            )
            return True
        self.bus.requeue_unit(lease, remaining)  # a drain ran out of grace
        log.warning("%s: requeued %d unfinished prompts of %s", self.name, len(remaining), unit_id)
        return False

    def _run_episodes(self, lease: Lease) -> bool:
        """`_run_unit` for multi-turn tasks (`task.environment`): G episodes per prompt, each
        turn its own seeded request, submitted the moment the episode's previous turn and
        environment step end; a group is published when its G episodes have ended, so a long
        episode holds back only its own group. Environment calls run in the worker's sandboxed
        pool from a thread beside the engine loop, so the engine generates other episodes while
        they run (`env_*` counters)."""
        from moerl.components.rollout.episodes import EpisodeDriver, env_pool

        unit_id, todo = self._todo(lease)
        if self._env_pool is None:
            self._env_pool = env_pool(self.cfg)
        driver = EpisodeDriver(self.cfg, self.tokenizer, self._env_pool)
        # 1. G episodes per prompt, each with its own key (unit, prompt, sample, delivery).
        run = self._episode_unit(lease, unit_id, todo, driver)
        # 2. Run them to their ends, or until a drain or a lost lease stops the unit.
        try:
            self._drive_episodes(lease, run)
        finally:
            run.envs.shutdown(wait=True)  # each call is bounded by task.sandbox.sample_timeout_s
            self.busy_s += time.perf_counter() - run.t0
            driver.finish(run.eps)  # what a drain or a lost lease left open
            self.bus.incr(
                env_calls=driver.calls,
                env_timeouts=driver.timeouts,
                env_errors=driver.errors,
                env_ms=int(driver.env_s * 1000),
            )
        # 3. The tail of a whole unit, then the ack (or the unfinished prompts back to the queue).
        self._record_tail(run)
        remaining = [k for k in todo if k not in run.finished]
        if remaining:  # a drain or a lost lease ended the unit early
            return self._end_unfinished(lease, remaining, rids=None)
        self._ack_now(lease, prompts_too_long=run.too_long)
        return True

    def _episode_unit(
        self, lease: Lease, unit_id: str, todo: dict[int, dict], driver: EpisodeDriver
    ) -> _EpisodeUnit:
        """`_run_episodes` step 1: the unit's G episodes per prompt, not yet begun."""
        G = self.cfg.rollout.samples_per_prompt
        has = bool(getattr(self.tokenizer, "chat_template", None))
        groups: dict[int, list[Episode]] = {}
        refused: list[BusWrite] = []
        for k, e in todo.items():
            ids = encode_prompt(self.tokenizer, self.cfg.rollout, e["prompt"])
            if (why := self._live.prompt_refused(len(ids))) is not None:
                refused.append(self._refuse(unit_id, e, why))  # its group fails, counted
                continue
            templated = uses_template(has, self.cfg.rollout, e["prompt"])
            groups[k] = [
                driver.episode(
                    f"{unit_id}-{k}-{j}-{lease.deliveries}", e["prompt"], ids, j, templated
                )
                for j in range(G)
            ]
        self._hand_over(refused)
        return _EpisodeUnit(
            unit_id,
            todo,
            driver,
            groups,
            eps=[ep for g in groups.values() for ep in g],
            where={ep.key: k for k, g in groups.items() for ep in g},
            t0=time.perf_counter(),
            envs=ThreadPoolExecutor(max_workers=1, thread_name_prefix="moerl-env"),
            finished=set(todo) - set(groups),
            too_long=len(refused),
        )

    def _drive_episodes(self, lease: Lease, run: _EpisodeUnit) -> None:
        """`_run_episodes` step 2: submit each episode's turns and step its environment until
        every episode ended, the engine and the environments are idle, or the unit must stop."""
        run.driver.begin(run.eps)
        for ep in run.eps:
            if not ep.done:
                self._submit_turn(run, ep)
        self._publish_done(run, list(run.groups))
        while self._live.unfinished() or run.pending:
            if self.drain.expired() or not self._still_held(lease):
                break
            if self._live.unfinished():
                turns = [(run.rids.pop(rid), comps[0]) for rid, comps in self._live.step()]
                if turns:
                    run.in_env.update(ep.key for ep, _ in turns)
                    run.pending.append((run.envs.submit(run.driver.advance, turns), turns))
            else:  # nothing to generate: wait for an environment
                wait([f for f, _ in run.pending], return_when=FIRST_COMPLETED)
            for item in [x for x in run.pending if x[0].done()]:
                run.pending.remove(item)
                f, turns = item
                run.in_env.difference_update(ep.key for ep, _ in turns)
                for ep in f.result():
                    self._submit_turn(run, ep)
                for ep, _ in turns:
                    if ep.done and ep.ended_s is None:
                        ep.ended_s = time.perf_counter() - run.t0
                self._publish_done(run, {run.where[ep.key] for ep, _ in turns})

    def _submit_turn(self, run: _EpisodeUnit, ep: Episode) -> None:
        """Submit `ep`'s next turn as its own seeded request."""
        k = run.where[ep.key]
        rid = f"{ep.key}-t{ep.turns}"
        seed = self._seed(run.unit_id, k)
        seed = None if seed is None else seed * 1031 + ep.sample_index * 67 + ep.turns
        self._live.submit(rid, ep.context, 1, seed=seed, max_tokens=run.driver.budget(ep))
        run.rids[rid] = ep

    def _publish_done(self, run: _EpisodeUnit, ks: Iterable[int]) -> None:
        """Publish the groups of `ks` whose G episodes have all ended (environments included)."""
        for k in ks:
            group = run.groups[k]
            if k not in run.finished and all(ep.done and ep.key not in run.in_env for ep in group):
                # close their environments, off the loop
                run.envs.submit(run.driver.finish, list(group))
                self._outbox.put(
                    self._samples_write(
                        run.unit_id, run.todo[k], [ep.sample(self.version) for ep in group]
                    )
                )
                run.finished.add(k)

    def _record_tail(self, run: _EpisodeUnit) -> None:
        """The tail of a unit whose groups were all published: its last episode against its
        median one."""
        ends = sorted(ep.ended_s if ep.ended_s is not None else 0.0 for ep in run.eps)
        if ends and len(run.finished) == len(run.todo):
            self._tail.add(ends)
            self.bus.heartbeat(
                self.name,
                ttl_s=10.0,
                unit_tail_last_s=self._tail.last_s / self._tail.units,
                unit_tail_median_s=self._tail.median_s / self._tail.units,
            )

    def _hand_over(self, writes: list[BusWrite]) -> None:
        """Give `writes`, if any, to the outbox in one hand-over (sent in one round trip)."""
        if writes:
            self._outbox.put(writes)

    def _group_write(self, unit_id: str, entry: dict, comps, prompt_ids: list[int]) -> BusWrite:
        """A finished single-turn group as a bus write (`RunBus.group_write`)."""
        mixed = sum(c.token_versions is not None for c in comps)
        if mixed:  # an in-flight weight update fell inside these responses
            self.bus.incr(samples_mixed_version=mixed)
        gid = group_id(unit_id, entry["k"], entry["prompt"]["id"])
        return self.bus.group_write(
            gid,
            group_samples(
                self.run_id,
                gid,
                entry["prompt"],
                prompt_ids,
                comps,
                self.version,
                self._live.routed_experts,
                self._shas,
            ),
        )

    def _samples_write(self, unit_id: str, entry: dict, samples: list[Sample]) -> BusWrite:
        gid = group_id(unit_id, entry["k"], entry["prompt"]["id"])
        dumped = [
            s.model_copy(
                update={
                    "sample_id": f"{self.run_id}/{gid}/{s.sample_index}",
                    "policy_shas": served_shas(self._shas, [s.policy_version]),
                }
            ).model_dump()
            for s in samples
        ]
        return self.bus.group_write(gid, dumped)

    # -- leases -------------------------------------------------------------------------
    def _hold(self, lease: Lease) -> None:
        with self._held_lock:
            self._held[lease.entry_id] = True

    def _release(self, lease: Lease) -> None:
        with self._held_lock:
            self._held.pop(lease.entry_id, None)

    def _held_ids(self) -> list[str]:
        with self._held_lock:
            return list(self._held)

    def _still_held(self, lease: Lease) -> bool:
        with self._held_lock:
            return self._held.get(lease.entry_id, False)

    def _refresh_leases(self) -> None:
        """Touch every held lease (only while it is still ours: `RunBus.touch`)."""
        with self._held_lock:
            ids = [e for e, ours in self._held.items() if ours]
        for eid in ids:
            if not self.bus.touch("units", self.name, eid):
                with self._held_lock:
                    if eid in self._held:
                        self._held[eid] = False

    # -- the loop -------------------------------------------------------------------------
    def _beat(self, stop: threading.Event) -> None:
        """Liveness, stats and lease refresh, from a thread: an engine load, a weight swap or a
        long unit must neither look like a dead worker nor let a held lease lapse. Leases are
        refreshed at a quarter of the visibility timeout (at most every 2 s)."""
        every = min(2.0, self.bus.visibility_ms / 4000)
        beat_at = 0.0
        while not stop.wait(every):
            try:
                self._refresh_leases()
                self._group_watch()
                if time.monotonic() - beat_at >= 2.0:
                    self.bus.heartbeat(
                        self.name,
                        ttl_s=10.0,
                        busy_s=self.busy_s,
                        wall_s=time.perf_counter() - self.t_start,
                        started_unix=self.started_unix,
                        version=float(self.version if self.version is not None else -1),
                        bus_writes=self._outbox.writes,
                        bus_round_trips=self._outbox.round_trips,
                    )
                    beat_at = time.monotonic()
            except Exception as err:  # noqa: BLE001 - liveness is advisory; the loop reports real failures
                log.warning("%s: heartbeat failed: %s", self.name, err)

    def run(self) -> int:
        self.bus.ensure_groups()
        # a predecessor of the same name (a restart) measured its own first group, not ours
        self.bus.forget_stats(self.name, "first_sample_s")
        if self._wire is not None:  # nor does a session name this one before its engine is up
            self._wire.sessions.withdraw(self.name)
        stop = threading.Event()
        beat = threading.Thread(
            target=self._beat, args=(stop,), name="moerl-heartbeat", daemon=True
        )
        self.bus.heartbeat(self.name, ttl_s=10.0)
        beat.start()
        code = 1
        try:
            done = self._loop()
            self._outbox.flush()  # every group and acknowledgement handed over is on the bus
            code = done
            return code
        finally:
            if self.gbus is not None:  # the followers stop their engine ranks
                try:
                    self.gbus.end(code)
                except Exception as err:  # noqa: BLE001 - followers also see the leader's beat end
                    log.warning("%s: could not tell the engine group it ended: %s", self.name, err)
            self._outbox.close()  # after a failure too: what was handed over is still written
            if self._wire is not None:  # no session names this engine any more
                try:
                    self._wire.withdraw()
                except Exception as err:  # noqa: BLE001 - its liveness key lapses anyway
                    log.warning("%s: could not withdraw from the wire: %s", self.name, err)
            stop.set()
            beat.join(timeout=5)
            # the final stats, so busy/idle fractions cover the whole life of the worker
            self.bus.heartbeat(
                self.name,
                ttl_s=1.0,
                busy_s=self.busy_s,
                wall_s=time.perf_counter() - self.t_start,
                bus_writes=self._outbox.writes,
                bus_round_trips=self._outbox.round_trips,
            )

    def _exit_code(self, watch: TrainerWatch) -> int | None:
        """Between units: 0 when the run is done (or abandoned: it fails through its trainer),
        EXIT_DRAINED when a drain was asked, else None (go on)."""
        if self.bus.done() or watch.abandoned():
            return 0
        if self._group_failure is not None:
            raise RuntimeError(f"{self.name}: {self._group_failure}")
        if self.drain.asked:
            self.bus.incr(drains=1)
            return EXIT_DRAINED
        return None

    def _loop(self) -> int:
        watch = TrainerWatch(self.bus, self.cfg.pipeline.trainer_lost_s)
        if not self.multi_turn:
            return self._stream(watch)
        # multi-turn: one unit at a time (its episodes already keep the engine busy between turns)
        while True:
            self._outbox.check()
            code = self._exit_code(watch)
            if code is not None:
                return code
            self._serve_latest()
            self._renew()
            if self.version is None:  # nothing servable yet (an early engine waits)
                time.sleep(0.2)
                continue
            lease = self.bus.lease_unit(self.name, block_ms=200, held=self._held_ids())
            if lease is None:
                continue
            # refreshed from now on by the heartbeat thread, through the swap below
            self._hold(lease)
            try:
                # a version registered while we waited for the lease: its units were issued for it
                self._serve_latest()
                if not self._run_episodes(lease):
                    self.bus.incr(drains=1)
                    return EXIT_DRAINED
            finally:
                self._release(lease)

    def close(self) -> None:
        self._outbox.close()
        # raised on the loop already, unless the loop failed first
        if self._outbox.error is not None:
            log.error("%s: the outbox's writes stopped at: %s", self.name, self._outbox.error)
        if self._fanout is not None:
            self._fanout.stop()
            self._fanout = None
        if self._env_pool is not None:
            self._env_pool.close()
            self._env_pool = None
        if self.engine is not None:
            self.engine.close()
            self.engine = None
        if self.version is not None:
            try:
                run_store(self.cfg.checkpoint, self.run_id).unpin(self.version, holder=self.holder)
            except Exception as err:  # noqa: BLE001 - an unpin left behind expires with its lease
                log.warning("%s: could not unpin version %s: %s", self.name, self.version, err)


def run_rollout_worker(cfg: RunConfig, run_id: str, worker: str) -> int:
    """Serve rollout until the run is done (0) or a SIGTERM drain (EXIT_DRAINED)."""
    from moerl.provenance import stage_start

    # a SIGTERM while the worker starts (a scale-down or a Spot notice right after it joined) is
    # kept and drains it as soon as it exists: it holds nothing yet, so it leaves at once (75)
    early: list[int] = []
    previous = signal.signal(signal.SIGTERM, lambda signum, frame: early.append(signum))
    w = None
    try:
        stage_start(cfg, worker, run_id)  # records where it runs; enforces `require:`
        if (
            cfg.valkey.url is None
        ):  # the launcher names the run's server (its own, or the cluster's)
            raise ConfigError("valkey.url is unset: a rollout worker joins a running bus")
        bus = RunBus(
            connect(cfg.valkey.url, cfg.valkey.reconnect_s, cfg.valkey.username),
            run_id,
            cfg.units.visibility_timeout_s,
            cfg.units.max_attempts,
        )
        w = RolloutWorker(cfg, run_id, worker, bus)
        w.record_run = True
        signal.signal(signal.SIGTERM, w.drain)
        if early:
            w.drain(signal.SIGTERM, None)
        return w.run()
    finally:
        signal.signal(signal.SIGTERM, previous)
        if w is not None:
            w.close()


def process_args(argv: list[str] | None, role: str = "") -> tuple[RunConfig, str, str]:
    """`--config FILE --run-id R --name N`, as a rollout pod's process starts: logging named
    after the worker (and `role`), the config read, the pod entered as the component does (the
    process's own scratch when pod-shaped, and in a sandbox given the cluster's Secrets, its
    pod's credentials and no others). Returns (config, run id, worker name)."""
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", required=True, help="the resolved run config as JSON")
    ap.add_argument("--run-id", required=True)
    ap.add_argument("--name", required=True, help="the worker (a group's: its leader's name)")
    a = ap.parse_args(argv)
    logging.basicConfig(
        level=logging.INFO, format=f"%(asctime)s {a.name}{role} %(levelname)s %(message)s"
    )
    text = Path(a.config).read_text()
    cfg = config_from_json(text)
    enter_pod("rollout_worker", text)
    return cfg, a.run_id, a.name


def main(argv: list[str] | None = None) -> int:
    """`python -m moerl.components.rollout.worker --config FILE --run-id R --name N` (the local
    launcher's entrypoint; on KFP the component calls `run_rollout_worker`)."""
    return run_rollout_worker(*process_args(argv))


if __name__ == "__main__":
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    sys.exit(main())
