"""A rollout worker's side of `rollout.weight_sync` collective (docs/weights.md, "Weights over the
wire"): the worker enrolls its engine in Valkey once it exists; a session that names it for a
version it does not serve is taken when the engine is idle (the worker stops leasing for it):
the engine joins the trainer ranks' groups, receives the version (vLLM's weight-transfer API,
redistribute_weights/collective.py) and reports its per-rank digests, or the failure. A worker
the session does not name (it enrolled after the session opened) stops leasing while it is more
than `buffer.max_staleness` versions behind the session, until the files reach it.
"""

from __future__ import annotations

import logging
import os
import signal
import time
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
    def __init__(self, bus: RunBus, name: str, max_staleness: int) -> None:
        self.sessions = WeightSessions(bus)
        self.name, self.max_staleness = name, max_staleness
        self.enrolled = False
        self._taken: tuple[int, int] | None = None  # (epoch, version) of the last session taken
        self._read_at = 0.0
        self._last: WireSession | None = None
        # version -> (its wire name, the per-rank digests it arrived with, whether this engine
        # checks it against its durable copy); the last few
        self.delivered: dict[int, tuple[str, tuple[str, ...], bool]] = {}
        self._verified: set[int] = set()

    def enroll(self, engine: RolloutEngine) -> None:
        """Say this worker's engine can take part (its weight-holding ranks); once."""
        if not self.enrolled:
            from moerl.components.redistribute_weights.collective import ranks_of

            self.sessions.enroll(self.name, ranks_of(engine.core))
            self.enrolled = True

    def withdraw(self) -> None:
        if self.enrolled:
            self.sessions.withdraw(self.name)
            self.enrolled = False

    def current(self, fresh: bool = False) -> WireSession | None:
        now = time.monotonic()
        if fresh or now - self._read_at > READ_EVERY_S:
            self._last, self._read_at = self.sessions.current(), now
        return self._last

    def waiting(self, version: int | None, epoch: int, fresh: bool = False) -> WireSession | None:
        """The live session that names this engine, not taken yet. Taken even for the version
        the engine serves (its group forms only with every member), never for an older one."""
        s = self.current(fresh)
        if s is None or s.first_rank(self.name) is None or self._taken == (s.epoch, s.version):
            return None
        if s.deadline < time.time():
            return None
        if version is not None and s.version < version and s.epoch <= epoch:
            return None
        return s

    def behind(self, version: int | None) -> bool:
        """Not named by the newest session, and further behind it than admission allows: what
        this engine would generate now is stale."""
        s = self.current()
        if s is None or s.first_rank(self.name) is not None:
            return False
        return version is None or s.version - version > self.max_staleness

    def take(self, engine: RolloutEngine, s: WireSession) -> SwapStats | None:
        """Join `s`'s groups and receive its version into the idle `engine`, then report. None
        on a failure (reported): the engine keeps its weights if the groups did not form, and
        is unlabelled (engine.version None) if the transfer failed part way."""
        from moerl.components.redistribute_weights.wire import GroupAddress

        self._taken = (s.epoch, s.version)
        t0 = time.perf_counter()
        first = s.first_rank(self.name)
        assert first is not None
        try:
            left = s.deadline - time.time()
            if left <= 0:
                raise TimeoutError(f"the session's deadline passed {-left:.1f} s ago")
            engine.join_weight_groups([GroupAddress(**g) for g in s.groups], first, left)
            _fault(self.name, s.version)
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
        names = sorted(s.members)  # one member per version checks it, in turn
        checks = names[s.version % len(names)] == self.name
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


def _fault(name: str, version: int) -> None:
    """Fault tests only: with MOERL_TEST_WIRE_FAULT "NAME:VERSION:SIGNAL:MARKER" set (several
    joined by ';'), worker NAME sends itself SIGNAL (TERM or KILL) once its engine joined the
    groups of VERSION's session, before the version arrives; once (the marker file)."""
    for spec in filter(None, os.environ.get(FAULT_ENV, "").split(";")):
        want, v, sig, marker = spec.split(":", 3)
        if (want, int(v)) != (name, version) or Path(marker).exists():
            continue
        Path(marker).write_text(f"{name} SIG{sig} mid-session of version {version}\n")
        log.error("test fault: %s sends itself SIG%s mid-session of version %d", name, sig, version)
        os.kill(os.getpid(), getattr(signal, f"SIG{sig}"))
