"""An engine over several nodes (an engine group): vLLM's wide expert parallelism, data-parallel
attention with the experts over every GPU of `cluster.launch.rollout_nodes_per_worker` nodes.

One group is one JobSet: node rank 0, the leader, runs the rollout worker and drives the whole
engine; nodes 1..N-1 (components/rollout/follower.py) run its other data-parallel ranks headless
and fetch every servable version into their own node cache. `GroupSpec.from_env` places a pod;
`GroupBus` is what the nodes tell each other through the run's Valkey, under keys of this
incarnation of the group (`MOERL_GROUP_ID`, new at every relaunch): which version each node
holds (the leader swaps only once all hold it), heartbeats, a drain any node asks for (a Spot
notice drains the whole group) and the leader's end.

Design and protocol: docs/async.md, "Engines across nodes".
"""

from __future__ import annotations

import os
import socket
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from moerl.errors import ConfigError

if TYPE_CHECKING:
    from moerl.bus import RunBus
    from moerl.config import RunConfig

ENV_NODE_RANK, ENV_GROUP_SIZE, ENV_LEADER, ENV_GROUP_ID = (
    "MOERL_NODE_RANK",
    "MOERL_GROUP_SIZE",
    "MOERL_LEADER_ADDRESS",
    "MOERL_GROUP_ID",
)
# the node cache root every engine rank of this node resolves a swap's version against: the
# leader names a version by its path under the cache root, each node reads its own copy
ENV_NODE_CACHE = "MOERL_NODE_CACHE"
ENV_POD_IP = "MOERL_POD_IP"  # the pod's own IP (downward API), set in a group's pods
NODE_TTL_S = 15.0  # a node's heartbeat lives this long; it beats every few seconds
KEY_TTL_S = 7 * 86400  # a group's other keys outlive any incarnation, then go


@dataclass(frozen=True)
class GroupSpec:
    """This node's place in its engine group."""

    rank: int  # 0: the leader
    size: int  # nodes in the group
    leader: str  # the leader's address (its pod's DNS name on EKS)
    group_id: str  # this incarnation of the group
    rpc_port: int  # vLLM's data-parallel RPC port on the leader
    own_ip: str = ""  # this pod's IP (the leader binds on it; its DNS name may lag)

    @property
    def is_leader(self) -> bool:
        return self.rank == 0

    @classmethod
    def from_env(cls, cfg: RunConfig, env: Mapping[str, str] | None = None) -> GroupSpec | None:
        """The group this process is a node of, from MOERL_GROUP_SIZE / MOERL_NODE_RANK /
        MOERL_LEADER_ADDRESS / MOERL_GROUP_ID; None when it runs an engine of its own (no
        group, or a group of one). Raises ConfigError for an environment that contradicts the
        config or itself."""
        env = os.environ if env is None else env
        raw = env.get(ENV_GROUP_SIZE, "")
        if not raw:
            return None
        try:
            size, rank = int(raw), int(env.get(ENV_NODE_RANK, ""))
        except ValueError:
            raise ConfigError(
                f"{ENV_GROUP_SIZE} {raw!r} / {ENV_NODE_RANK} {env.get(ENV_NODE_RANK)!r}: both must "
                "be integers (the group's JobSet sets them)"
            ) from None
        if size < 2:
            return None
        want = cfg.cluster.launch.rollout_nodes_per_worker
        if size != want:
            raise ConfigError(
                f"{ENV_GROUP_SIZE} {size} but cluster.launch.rollout_nodes_per_worker is {want}: "
                "the group was launched for another config"
            )
        if not 0 <= rank < size:
            raise ConfigError(f"{ENV_NODE_RANK} {rank}: allowed 0..{size - 1}")
        dp = cfg.rollout.data_parallel_size
        if dp % size:
            raise ConfigError(
                f"rollout.data_parallel_size {dp} over {size} nodes "
                "(cluster.launch.rollout_nodes_per_worker): every node runs the same number of "
                "data-parallel ranks; make it a multiple"
            )
        leader = env.get(ENV_LEADER, "")
        if not leader:
            raise ConfigError(f"{ENV_LEADER} is unset: the followers cannot find the leader")
        return cls(
            rank=rank,
            size=size,
            leader=leader,
            group_id=env.get(ENV_GROUP_ID) or leader,
            rpc_port=cfg.rollout.group_rpc_port,
            own_ip=env.get(ENV_POD_IP, ""),
        )

    def engine_kwargs(self, data_parallel_size: int) -> dict[str, Any]:
        """vLLM's multi-node data-parallel arguments for this node: its share of the DP ranks,
        the leader's address and RPC port, and (followers) the first DP rank it runs."""
        local = data_parallel_size // self.size
        kw: dict[str, Any] = {
            "data_parallel_size_local": local,
            "data_parallel_address": self.own_ip if self.is_leader and self.own_ip else self.leader,
            "data_parallel_rpc_port": self.rpc_port,
        }
        if not self.is_leader:
            kw["data_parallel_start_rank"] = self.rank * local
        return kw


class GroupBus:
    """The group's keys on the run's bus (see the module docstring)."""

    def __init__(self, bus: RunBus, worker: str, spec: GroupSpec):
        self.bus, self.worker, self.spec = bus, worker, spec
        self.r = bus.r

    def _key(self, name: str) -> str:
        return self.bus.key(f"group:{self.worker}:{self.spec.group_id}:{name}")

    # -- what each node holds -------------------------------------------------------------
    def report_holds(self, rank: int, version: int, sha: str) -> None:
        """Node `rank` holds (`version`, `sha`), verified, in its node cache (re-sent every beat,
        so a report a Valkey failover lost comes back)."""
        key = self._key(f"holds:{rank}")
        self.r.hset(
            key,
            mapping={
                "version": version,
                "sha": sha,
                "host": socket.gethostname(),
                "at": time.time(),
            },
        )
        self.r.expire(key, int(KEY_TTL_S))

    def set_target(self, version: int) -> None:
        """The version the leader swaps in or serves: the followers keep their copies of it and
        of anything newer (their node caches prune only older ones)."""
        self.r.set(self._key("target"), str(version), ex=int(KEY_TTL_S))

    def target(self) -> int | None:
        raw = self.r.get(self._key("target"))
        return None if raw is None else int(raw)

    def holds(self, rank: int) -> tuple[int, str] | None:
        raw = self.r.hgetall(self._key(f"holds:{rank}"))
        if not raw:
            return None
        return int(raw["version"]), raw["sha"]

    def missing(self, version: int, sha: str) -> list[int]:
        """The follower ranks that do not hold (`version`, `sha`) yet."""
        return [r for r in range(1, self.spec.size) if self.holds(r) != (version, sha)]

    # -- liveness ---------------------------------------------------------------------
    def beat(self, rank: int, ttl_s: float = NODE_TTL_S) -> None:
        self.r.set(self._key(f"alive:{rank}"), str(time.time()), px=int(ttl_s * 1000))

    def alive(self, rank: int) -> bool:
        return self.r.exists(self._key(f"alive:{rank}")) == 1

    def starting(self) -> None:
        """The leader builds its engine now: the followers start their engine ranks (vLLM's
        headless cores give up on a leader that does not answer within 5 minutes)."""
        self.r.set(self._key("starting"), str(time.time()), ex=int(KEY_TTL_S))

    def leader_starting(self) -> bool:
        return self.r.exists(self._key("starting")) == 1

    # -- drain and end ----------------------------------------------------------------
    def ask_drain(self, rank: int, reason: str) -> None:
        """Drain the whole group (the first reason stays)."""
        self.r.set(self._key("drain"), f"node {rank}: {reason}"[:500], nx=True, ex=int(KEY_TTL_S))

    def drain_asked(self) -> str | None:
        return self.r.get(self._key("drain"))

    def end(self, code: int) -> None:
        """The leader left with exit code `code`: the followers stop their engine ranks."""
        self.r.set(self._key("ended"), str(code), ex=int(KEY_TTL_S))

    def ended(self) -> int | None:
        raw = self.r.get(self._key("ended"))
        return None if raw is None else int(raw)
