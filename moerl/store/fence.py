"""Fencing the writers of one store: version claims with an owner, an epoch and an expiry, and
the epoch that `latest.json` records.

A run has one trainer at a time, and the bus gives each trainer a new, larger epoch
(`RunBus.claim_trainer`). A trainer that was replaced (a retried task while the first one still
runs) keeps publishing until something refuses it; in the store that is:

- **the claim** `versions/vNNNNNN/.claim`, written create-only before any file of the version:
  `{"owner", "epoch", "expires_at"}`. A writer whose epoch is older than the claim's is refused
  (`CheckpointError` naming both epochs). A claim of an older epoch, or one whose `expires_at`
  passed, may be removed by a newer writer (`recover`, or a publish that finds it); a live claim
  of the same or a newer epoch is never touched. A writer reads its claim back before each file
  and before its manifest, so one that was fenced stops within one file.
- **the `latest` pointer** records the epoch that moved it. A move is a compare-and-set on the
  object (S3: `If-Match` on its ETag, `If-None-Match: *` when absent; a folder: a lock file), so
  no writer of an older epoch can move it, even between another's read and write. `recover` of a
  new epoch writes its epoch into the pointer first (the version unchanged): from then on an
  older writer's move is refused, before the newer one deletes or rewrites anything.

Writers without an epoch (`None`: the sync pipeline, benchmarks, `--resume` while nothing runs)
take no part: they neither check nor raise the recorded epoch, as under the old contract of one
writer per store.

Limitations: expiry compares UTC wall clocks of different machines (the TTL, `checkpoint.
claim_ttl_s`, must dwarf their skew), and a claim is not renewed, so it must outlast the longest
publish of one version. A replaced writer's upload of one file that started before the newer
writer removed its claim can still land after the newer writer verified that file: the window is
one file's upload overlapping the newer trainer's whole training step plus its publish of the
same version, which the newer writer reaches only after training it.
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
