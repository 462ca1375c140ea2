"""The async trainer's side of `rollout.weight_sync` collective (docs/weights.md, "Weights over
the wire"): after each version is saved, one session per version. The engines present (enrolled
and alive in Valkey) are its members; every rank of the mesh sends its share to all of them at
once (`mesh.Leader.send_weights_all`), and the session is delivered when every member reported
success with the same per-rank digests. Then the version is servable for the engines (streamed:
its prompts are issued), ahead of its files; the publisher makes it durable behind, as always.
A session that fails costs only itself: the engines that failed are unlabelled and take the
version from files, which the servable pointer names once the publisher has them.

Catch-ups (`serve_catchups`, from the gather's loop): an engine that started after the newest
delivered session asks for its version; every mesh rank sends the share it kept of that session
(host memory, the serving dtype), the version the fleet serves, which the trainer's live
weights have moved past.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

from moerl.bus import RunBus
from moerl.bus.weights import WeightSessions, WireSession, outcome, wire_sha
from moerl.components.policy_update.gather import TrainerState
from moerl.config import RunConfig

if TYPE_CHECKING:
    from moerl.components.policy_update.mesh import Leader

log = logging.getLogger(__name__)


class WireSender:
    def __init__(
        self, cfg: RunConfig, bus: RunBus, mesh: Leader, epoch: int, state: TrainerState
    ) -> None:
        self.cfg, self.bus, self.mesh, self.epoch, self.state = cfg, bus, mesh, epoch, state
        self.sessions = WeightSessions(bus)
        self.last: WireSession | None = None  # the newest session delivered
        self.catchups = 0
        self._looked_at = 0.0

    def _run(
        self,
        version: int,
        sha: str,
        engines: dict[str, tuple[int, str]],
        kind: str = "session",
        catchup: int = 0,
    ) -> tuple[WireSession | None, dict]:
        """Every mesh rank sends `version` to `engines` (name -> (ranks, nonce)), each given its
        first rank in name order; the session (None if it was not opened) and rank 0's result."""
        first, ranks = {}, 0
        for name, (n, _) in engines.items():
            first[name], ranks = ranks, ranks + n
        deadline_s = self.cfg.rollout.weight_sync_timeout_s
        opened: list[WireSession] = []

        def open_session(addresses: list) -> None:
            opened.append(
                self.sessions.open(
                    self.epoch,
                    version,
                    addresses,
                    first,
                    time.time() + deadline_s,
                    kind=kind,
                    nonces={n: nonce for n, (_, nonce) in engines.items()},
                )
            )

        mine = self.mesh.send_weights_all(
            version, sha, self.epoch, ranks, open_session, catchup=catchup
        )
        return (opened[0] if opened else None), mine

    def send(self, version: int) -> dict[str, float]:
        """One session for `version` (saved by the mesh just before); its metrics."""
        t0 = time.perf_counter()
        members = self.sessions.enrolled()
        metrics = {"weights/wire_engines": float(len(members)), "weights/wire_delivered": 0.0}
        if not members:
            log.warning("version %d: no engine enrolled for the wire; files only", version)
            self.bus.incr(weight_sessions_empty=1)
            return metrics
        session, mine = self._run(version, wire_sha(self.epoch, version), members)
        metrics["weights/wire_send_s"] = time.perf_counter() - t0
        metrics["weights/wire_rank0_bytes"] = float(mine["sent"])
        if session is None:
            why = mine["error"] or "the session was not opened"
        else:
            _, why = outcome(session, self.sessions.wait_reports(session))
        metrics["weights/wire_to_serving_s"] = time.perf_counter() - t0
        if why or session is None:
            self.bus.incr(weight_sessions_failed=1)
            log.warning("version %d over the wire failed (%s); files take over", version, why)
            return metrics
        self.bus.incr(weight_sessions=1)
        self.last = session
        self.sessions.set_delivered(self.last)
        metrics["weights/wire_delivered"] = 1.0
        # what a sample generated on it says its version was, until the manifest adds its own
        self.state.known.setdefault(version, frozenset({wire_sha(self.epoch, version)}))
        if self.cfg.resolved.stream:  # its prompts now: every engine serves it
            self.state.version = max(self.state.version, version)
        log.info(
            "version %d over the wire to %d engines in %.2f s",
            version,
            len(members),
            metrics["weights/wire_to_serving_s"],
        )
        return metrics

    def serve_catchups(self, every_s: float = 0.1) -> None:
        """Send the newest delivered version to the engines that asked for it (enrolled and
        alive), at most every `every_s`; a failure is counted, never raised."""
        now = time.monotonic()
        if self.last is None or now - self._looked_at < every_s:
            return
        self._looked_at = now
        last = self.last
        requests = self.sessions.requests()  # one read; the engines only when one asks
        if not requests:
            return
        enrolled = self.sessions.enrolled()
        # an engine enrolled now, asking as that process (its nonce), for the version kept
        asks = {
            n: (ranks, nonce)
            for n, (ranks, v, nonce) in requests.items()
            if v == last.version and enrolled.get(n, (0, None))[1] == nonce
        }
        wanted = list(asks)
        if not wanted:
            return
        self.catchups += 1
        t0 = time.perf_counter()
        session, mine = self._run(last.version, last.sha, asks, "catchup", self.catchups)
        why = mine["error"] or ("" if session else "the catch-up was not opened")
        if not why and session is not None:
            _, why = outcome(session, self.sessions.wait_reports(session))
        self.sessions.answered(wanted)
        if why:
            self.bus.incr(weight_catchups_failed=1)
            log.warning("catch-up of version %d failed (%s); files", last.version, why)
            return
        self.bus.incr(weight_catchups=len(wanted))
        log.info(
            "version %d to %s over the wire (a catch-up) in %.2f s",
            last.version,
            ", ".join(wanted),
            time.perf_counter() - t0,
        )
