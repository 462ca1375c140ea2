"""A rollout worker's side of `rollout.weight_sync` collective (docs/weights.md, "Weights over the
wire"): the worker enrolls its engine in Valkey once it exists; a session that names it for a
version it does not serve is taken when the engine is idle (the worker stops leasing for it):
the engine joins the trainer ranks' groups, receives the version (vLLM's weight-transfer API,
redistribute_weights/collective.py) and reports its per-rank digests, or the failure. A worker
that did not take the newest session (it started after it) asks for that version (a catch-up,
which the trainer sends from what it kept), for at most `rollout.weight_sync_timeout_s`, then
loads files; meanwhile it does not lease while more than `buffer.max_staleness` behind.
"""

from __future__ import annotations

import logging
import os
import signal
import time
import uuid
from pathlib import Path
from typing import TYPE_CHECKING

from moerl.bus import RunBus
from moerl.bus.weights import Report, WeightSessions, WireSession

if TYPE_CHECKING:
    from moerl.components.redistribute_weights.hotswap import SwapStats
    from moerl.components.rollout.engine import RolloutEngine

log = logging.getLogger(__name__)
READ_EVERY_S = 0.25  # the session key is read at most this often beside generation
FAULT_ENV = "MOERL_TEST_WIRE_FAULT"  # tests: "NAME:VERSION:SIGNAL:MARKER[;...]", see `_fault`


class WireReceiver:
    def __init__(
        self, bus: RunBus, name: str, max_staleness: int, timeout_s: float = 120.0
    ) -> None:
        self.sessions = WeightSessions(bus)
        self.name, self.max_staleness, self.timeout_s = name, max_staleness, timeout_s
        self.ranks = 0
        self.nonce = uuid.uuid4().hex  # this process's: a restart is another engine
        self._asked: tuple[int, int, float] | None = None  # (epoch, version, when) asked for
        self.enrolled = False
        # (kind, epoch, version, deadline) of the last session taken
        self._taken: tuple[str, int, int, float] | None = None
        self._read_at = 0.0
        self._last: WireSession | None = None
        self._catchup: WireSession | None = None
        self._delivered: tuple[int, int] | None = None  # (epoch, version) delivered last
        # version -> (its wire name, the per-rank digests it arrived with, whether this engine
        # checks it against its durable copy); the last few
        self.delivered: dict[int, tuple[str, tuple[str, ...], bool]] = {}
        self._verified: set[int] = set()

    def enroll(self, engine: RolloutEngine) -> None:
        """Say this worker's engine can take part (its weight-holding ranks); once."""
        if not self.enrolled:
            from moerl.components.redistribute_weights.collective import ranks_of

            self.ranks = ranks_of(engine.core)
            self.sessions.enroll(self.name, self.ranks, self.nonce)
            self.enrolled = True

    def withdraw(self) -> None:
        if self.enrolled:
            self.sessions.withdraw(self.name)
            self.enrolled = False

    def current(self, fresh: bool = False) -> WireSession | None:
        now = time.monotonic()
        if fresh or now - self._read_at > READ_EVERY_S:
            self._last, self._read_at = self.sessions.current(), now
            self._catchup = self.sessions.current("catchup") if self._asked else None
            self._delivered = self.sessions.delivered()
        return self._last

    def waiting(self, version: int | None, epoch: int, fresh: bool = False) -> WireSession | None:
        """The live session (or catch-up) that names this engine, not taken yet. Taken even
        for the version the engine serves (its group forms only with every member), never for
        an older one."""
        for s in (self.current(fresh), self._catchup):
            if s is None or s.deadline < time.time():
                continue
            if s.first_rank(self.name, self.nonce) is None:
                continue
            if self._taken == (s.kind, s.epoch, s.version, s.deadline):
                continue
            if version is not None and s.version < version and s.epoch <= epoch:
                continue
            return s
        return None

    def fleet_on_wire(self) -> bool:
        """Whether a version was delivered over the wire in this run already."""
        self.current(fresh=True)
        return self._delivered is not None

    def catching_up(self, version: int | None, epoch: int) -> bool:
        """Whether this engine waits for a catch-up: the newest delivered version is newer than
        it serves and it did not take its session; asked for once, waited on for at most the
        session timeout (then False: the caller loads files)."""
        self.current()
        d = self._delivered
        if d is None or not self.enrolled:
            return False
        (e, v) = d
        if version is not None and (v <= version or e < epoch):
            return False
        if self._taken is not None and (self._taken[1], self._taken[2]) >= (e, v):
            return False  # it took that session or a newer one and failed: files
        if self._asked is None or self._asked[:2] != (e, v):
            self.sessions.request(self.name, self.ranks, v, self.nonce)
            self._asked = (e, v, time.monotonic())
            log.info("%s: asking for version %d over the wire (a catch-up)", self.name, v)
        return time.monotonic() - self._asked[2] < self.timeout_s

    def behind(self, version: int | None) -> bool:
        """Not named by the newest session, and further behind it than admission allows: what
        this engine would generate now is stale."""
        s = self.current()
        if s is None or s.first_rank(self.name, self.nonce) is not None:
            return False
        return version is None or s.version - version > self.max_staleness

    def take(self, engine: RolloutEngine, s: WireSession) -> SwapStats | None:
        """Join `s`'s groups and receive its version into the idle `engine`, then report. None
        on a failure (reported): the engine keeps its weights if the groups did not form, and
        is unlabelled (engine.version None) if the transfer failed part way."""
        from moerl.components.redistribute_weights.wire import GroupAddress

        self._taken = (s.kind, s.epoch, s.version, s.deadline)
        t0 = time.perf_counter()
        first = s.first_rank(self.name, self.nonce)
        assert first is not None
        try:
            left = s.deadline - time.time()
            if left <= 0:
                raise TimeoutError(f"the session's deadline passed {-left:.1f} s ago")
            engine.join_weight_groups([GroupAddress(**g) for g in s.groups], first, left)
            _fault(self.name, s.version, after=False)
            stats = engine.receive_weights(
                s.version, s.sha, s.epoch, max(1.0, s.deadline - time.time())
            )
        except Exception as err:  # noqa: BLE001 - reported; the files take over
            log.warning(
                "%s: version %d over the wire failed (%s: %s); it comes from files",
                self.name,
                s.version,
                type(err).__name__,
                err,
            )
            rep = Report(False, [], time.perf_counter() - t0, f"{type(err).__name__}: {err}"[:500])
            self.sessions.report(s, self.name, rep)
            return None
        self.sessions.report(
            s, self.name, Report(True, list(stats.digests), time.perf_counter() - t0)
        )
        _fault(self.name, s.version, after=True)
        if self._asked is not None:  # served: a catch-up asked for is not wanted any more
            self.sessions.answered([self.name])
            self._asked = None
        names = sorted(s.members)  # one member per version checks it, in turn; a catch-up, each
        checks = s.kind == "catchup" or names[s.version % len(names)] == self.name
        self.delivered = {v: d for v, d in self.delivered.items() if v > s.version - 4}
        self.delivered[s.version] = (s.sha, tuple(stats.digests), checks)
        return stats

    def to_verify(self, version: int | None, sha: str | None, manifest_sha256: str) -> bool:
        """Whether this engine, serving `version` as it came over the wire, is the one to load
        its durable copy (named by `manifest_sha256`) and compare the digests, not yet done."""
        d = self.delivered.get(version) if version is not None else None
        return (
            d is not None
            and d[2]
            and sha == d[0]
            and manifest_sha256 != sha
            and version not in self._verified
        )

    def verified(self, version: int, digests: tuple[str, ...]) -> str:
        """Record the check of `version`; "" when the durable copy's digests are the wire's,
        else what differs."""
        self._verified = {v for v in self._verified if v > version - 4} | {version}
        wire = self.delivered[version][1]
        if digests == wire:
            return ""
        return (
            f"{self.name}: version {version} over the wire differs from its durable copy: "
            f"per-rank digests {list(wire)} over the wire, {list(digests)} from files"
        )


def _fault(name: str, version: int, after: bool) -> None:
    """Fault tests only: with MOERL_TEST_WIRE_FAULT "NAME:VERSION:SIGNAL:MARKER" set (several
    joined by ';'), worker NAME sends itself SIGNAL (TERM or KILL) once its engine joined the
    groups of VERSION's session, before the version arrives; KILL-AFTER: SIGKILL once it has
    reported the version (a worker lost between sessions). Once (the marker file)."""
    for spec in filter(None, os.environ.get(FAULT_ENV, "").split(";")):
        want, v, sig, marker = spec.split(":", 3)
        if (want, int(v)) != (name, version) or Path(marker).exists():
            continue
        if sig.endswith("-AFTER") != after:
            continue
        sig = sig.removesuffix("-AFTER")
        Path(marker).write_text(f"{name} SIG{sig} mid-session of version {version}\n")
        log.error(
            "test fault: %s sends itself SIG%s in the session of version %d", name, sig, version
        )
        os.kill(os.getpid(), getattr(signal, f"SIG{sig}"))
