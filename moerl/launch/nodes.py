"""Which node of a multi-node trainer this process is, and how many nodes there are.

Design, details and limitations: docs/launch.md#moerllaunchnodespy.
"""

from __future__ import annotations

import ipaddress
import os
from collections.abc import Mapping
from dataclasses import dataclass

from moerl.errors import ConfigError

NNODES, NODE_RANK, MASTER_ADDR, MASTER_PORT = (
    "PET_NNODES",
    "PET_NODE_RANK",
    "PET_MASTER_ADDR",
    "PET_MASTER_PORT",
)


@dataclass(frozen=True)
class NodeGroup:
    rank: int
    size: int
    master_addr: str
    master_port: int

    @property
    def leader(self) -> bool:
        return self.rank == 0

    @property
    def loopback(self) -> bool:
        """Whether the nodes meet on this machine's loopback (the local simulation)."""
        try:
            return ipaddress.ip_address(self.master_addr).is_loopback
        except ValueError:
            return self.master_addr == "localhost"


def _int(env: Mapping[str, str], key: str) -> int:
    try:
        return int(env[key])
    except (KeyError, ValueError):
        raise ConfigError(
            f"{key}={env.get(key)!r}: the trainer's node group needs an integer; "
            f"Kubeflow Trainer sets {NNODES}, {NODE_RANK}, {MASTER_ADDR} and {MASTER_PORT}"
        ) from None


def node_group(env: Mapping[str, str] | None = None) -> NodeGroup | None:
    """This pod's place in a multi-node group, or None for a single node (PET_NNODES unset or 1)."""
    env = os.environ if env is None else env
    if env.get(NNODES, "").strip() in ("", "1"):
        return None
    size = _int(env, NNODES)
    if size < 1:
        raise ConfigError(f"{NNODES}={size}: a node group has at least one node")
    if size == 1:
        return None
    rank, port = _int(env, NODE_RANK), _int(env, MASTER_PORT)
    addr = env.get(MASTER_ADDR, "")
    if not 0 <= rank < size:
        raise ConfigError(f"{NODE_RANK}={rank} is outside 0..{size - 1} ({NNODES}={size})")
    if not addr or not 0 < port < 65536:
        raise ConfigError(
            f"{MASTER_ADDR}={addr!r}, {MASTER_PORT}={port}: node {rank} of {size} needs node 0's "
            "address and port"
        )
    return NodeGroup(rank, size, addr, port)
