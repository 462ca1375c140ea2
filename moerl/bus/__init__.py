"""The async mode's shared state in Valkey (docs/async.md): one run's work queue, experience
streams, version registry and counters (`run`), the hand-off scripts (`scripts`), the client and
the embedded server (`client`), and how a stage tells a lost trainer (`watch`)."""

from moerl.bus.client import PASSWORD_ENV, BusError, EmbeddedValkey, FencedError, Retrying, connect
from moerl.bus.run import (
    COUNTERS,
    DEAD,
    GENERATED,
    GROUPS,
    SCORED,
    TRAINER_BEACON,
    UNITS,
    BusWrite,
    Lease,
    Registered,
    RunBus,
    group_id,
)
from moerl.bus.watch import TrainerWatch, abandon_run

__all__ = [
    "COUNTERS",
    "DEAD",
    "GENERATED",
    "GROUPS",
    "PASSWORD_ENV",
    "SCORED",
    "TRAINER_BEACON",
    "UNITS",
    "BusError",
    "BusWrite",
    "EmbeddedValkey",
    "FencedError",
    "Lease",
    "Registered",
    "Retrying",
    "RunBus",
    "TrainerWatch",
    "abandon_run",
    "connect",
    "group_id",
]
