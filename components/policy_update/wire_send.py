"""The async trainer's side of `rollout.weight_sync` collective (docs/weights.md, "Weights over
the wire"): after each version is saved, one session per version. The engines present (enrolled
and alive in Valkey) are its members; every rank of the mesh sends its share to all of them at
once (`mesh.Leader.send_weights_all`), and the session is delivered when every member reported
success with the same per-rank digests. Then the version is servable for the engines (streamed:
its prompts are issued), ahead of its files; the publisher makes it durable behind, as always.
A session that fails costs only itself: the engines that failed are unlabelled and take the
version from files, which the servable pointer names once the publisher has them.
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

    def send(self, version: int) -> dict[str, float]:
        """One session for `version` (saved by the mesh just before); its metrics."""
        t0 = time.perf_counter()
        members = self.sessions.members()
        first, ranks = {}, 0
        for name, n in members.items():
            first[name], ranks = ranks, ranks + n
        metrics = {"weights/wire_engines": float(len(members)), "weights/wire_delivered": 0.0}
        if not members:
            log.warning("version %d: no engine enrolled for the wire; files only", version)
            self.bus.incr(weight_sessions_empty=1)
            return metrics
        timeout_s = self.cfg.rollout.weight_sync_timeout_s
        opened: list[WireSession] = []

        def open_session(addresses: list) -> None:
            opened.append(
                self.sessions.open(self.epoch, version, addresses, first, time.time() + timeout_s)
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
