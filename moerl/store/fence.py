"""Fencing the writers of one store: version claims with an owner, an epoch and an expiry, and
the epoch that `latest.json` records.

Design, details and limitations: docs/weights.md#moerlstorefencepy.
"""

from __future__ import annotations

import json
import os
import secrets
import socket
from dataclasses import dataclass

from moerl.errors import CheckpointError

CLAIM = ".claim"  # versions/vNNNNNN/.claim


def new_owner() -> str:
    """Who writes: host, pid and a random token (a retried PUT finds its own claim by it)."""
    return f"{socket.gethostname()}/{os.getpid()}/{secrets.token_hex(4)}"


@dataclass(frozen=True)
class Claim:
    owner: str
    epoch: int | None
    expires_at: float  # UTC, POSIX seconds

    def to_json(self) -> str:
        return (
            json.dumps({"owner": self.owner, "epoch": self.epoch, "expires_at": self.expires_at})
            + "\n"
        )

    @classmethod
    def from_json(cls, text: str) -> Claim:
        """A claim; an empty or unreadable one (an older moerl wrote an empty `.claim`) is an
        expired claim of no epoch, which any writer may remove."""
        try:
            d = json.loads(text)
            return cls(
                str(d["owner"]),
                None if d.get("epoch") is None else int(d["epoch"]),
                float(d["expires_at"]),
            )
        except (ValueError, KeyError, TypeError):
            return cls("?", None, 0.0)

    def live(self, now: float) -> bool:
        return now < self.expires_at

    def removable_by(self, epoch: int | None, now: float) -> bool:
        """Whether a writer of `epoch` may remove this claim: it expired, or it is older."""
        return not self.live(now) or (
            epoch is not None and (self.epoch is None or self.epoch < epoch)
        )


def older(mine: int | None, theirs: int | None) -> bool:
    """Whether a writer of epoch `mine` is older than `theirs` (no epoch is never fenced)."""
    return mine is not None and theirs is not None and mine < theirs


def refused(
    what: str, uri: str, mine: int | None, theirs: int | None, holder: str = ""
) -> CheckpointError:
    return CheckpointError(
        f"{what} in {uri} refused: this writer's trainer epoch {mine} is older than epoch {theirs}"
        f"{f' ({holder})' if holder else ''}, which a newer trainer of this run wrote; this one "
        "was replaced and stops without writing"
    )
