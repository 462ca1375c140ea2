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

    def _members(self, wanted: dict[str, int]) -> tuple[dict[str, int], int]:
        first, ranks = {}, 0
        for name, n in wanted.items():
            first[name], ranks = ranks, ranks + n
        return first, ranks

    def send(self, version: int) -> dict[str, float]:
        """One session for `version` (saved by the mesh just before); its metrics."""
        t0 = time.perf_counter()
        enrolled = self.sessions.enrolled()
        members = {n: r for n, (r, _) in enrolled.items()}
        first, ranks = self._members(members)
        metrics = {"weights/wire_engines": float(len(members)), "weights/wire_delivered": 0.0}
        if not members:
            log.warning("version %d: no engine enrolled for the wire; files only", version)
            self.bus.incr(weight_sessions_empty=1)
            return metrics
        timeout_s = self.cfg.rollout.weight_sync_timeout_s
        opened: list[WireSession] = []

        def open_session(addresses: list) -> None:
            opened.append(
                self.sessions.open(
                    self.epoch,
                    version,
                    addresses,
                    first,
                    time.time() + timeout_s,
                    nonces={n: nonce for n, (_, nonce) in enrolled.items()},
                )
            )

        mine = self.mesh.send_weights_all(
            version, wire_sha(self.epoch, version), self.epoch, ranks, open_session
        )
        metrics["weights/wire_send_s"] = time.perf_counter() - t0
        metrics["weights/wire_rank0_bytes"] = float(mine["sent"])
        if not opened:
            why = mine["error"] or "the session was not opened"
        else:
            delivered, why = outcome(opened[0], self.sessions.wait_reports(opened[0]))
            why = why if not delivered else ""
        metrics["weights/wire_to_serving_s"] = time.perf_counter() - t0
        if why:
            self.bus.incr(weight_sessions_failed=1)
            log.warning("version %d over the wire failed (%s); files take over", version, why)
            return metrics
        self.bus.incr(weight_sessions=1)
        self.last = opened[0]
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
        wanted = {n: ranks for n, (ranks, _) in asks.items()}
        if not wanted:
            return
        first, ranks = self._members(wanted)
        timeout_s = self.cfg.rollout.weight_sync_timeout_s
        opened: list[WireSession] = []

        def open_session(addresses: list) -> None:
            opened.append(
                self.sessions.open(
                    self.epoch,
                    last.version,
                    addresses,
                    first,
                    time.time() + timeout_s,
                    kind="catchup",
                    nonces={n: nonce for n, (_, nonce) in asks.items()},
                )
            )

        self.catchups += 1
        t0 = time.perf_counter()
        mine = self.mesh.send_weights_all(
            last.version, last.sha, self.epoch, ranks, open_session, catchup=self.catchups
        )
        why = mine["error"] or ("" if opened else "the catch-up was not opened")
        if not why:
            delivered, why = outcome(opened[0], self.sessions.wait_reports(opened[0]))
        self.sessions.answered(list(wanted))
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
