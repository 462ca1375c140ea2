"""Pins as leases: what a pin file holds, and when it stops protecting its version.

Design, details and limitations: docs/weights.md#the-store-as-a-user-sees-it.
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import TYPE_CHECKING

from moerl.errors import CheckpointError

_HOLDER = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")


@dataclass(frozen=True)
class Lease:
    version: int
    holder: str
    pinned_at: float  # POSIX seconds, UTC
    expires_at: float

    def live(self, now: float) -> bool:
        return now < self.expires_at

    def to_json(self) -> str:
        return (
            json.dumps(
                {
                    "version": self.version,
                    "holder": self.holder,
                    "pinned_at": iso_utc(self.pinned_at),
                    "expires_at": iso_utc(self.expires_at),
                }
            )
            + "\n"
        )


def new_lease(
    version: int, holder: str, now: float, ttl_s: float, pinned_at: float | None = None
) -> Lease:
    if not ttl_s > 0:
        raise CheckpointError(
            f"a pin's TTL must be > 0 seconds, got {ttl_s!r}; fix checkpoint.pin_ttl_s"
        )
    return Lease(version, holder, now if pinned_at is None else pinned_at, now + ttl_s)


def pin_key(holder: str) -> str:
    if not _HOLDER.match(holder):
        raise CheckpointError(
            f"pin holder {holder!r} must be letters, digits, '.', '_' or '-' (at most 128)"
        )
    return f"pins/{holder}.json"


def parse_lease(key: str, text: str, default_ttl_s: float) -> Lease:
    """The lease in pin file `key`; a pin without `expires_at` lasts `default_ttl_s` from `pinned_at`."""
    try:
        d = json.loads(text)
        pinned_at = _seconds(d["pinned_at"])
        expires_at = _seconds(d["expires_at"]) if "expires_at" in d else pinned_at + default_ttl_s
        return Lease(int(d["version"]), str(d.get("holder", key)), pinned_at, expires_at)
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        raise CheckpointError(f"malformed pin {key} ({e!r}); delete it or pin again") from e


def iso_utc(t: float) -> str:
    return datetime.fromtimestamp(t, UTC).isoformat(timespec="milliseconds")


def _seconds(iso: str) -> float:
    t = datetime.fromisoformat(iso)
    if t.tzinfo is None:
        raise ValueError(f"time {iso!r} has no UTC offset")
    return t.timestamp()


class PinLeases:
    """The pin API of `moerl.store.base.CheckpointStore`, which supplies the object primitives."""

    uri: str
    pin_ttl_s: float = 3600.0  # open_store sets checkpoint.pin_ttl_s
    clock: Callable[[], float] = time.time  # UTC wall time, POSIX seconds; tests inject their own

    if TYPE_CHECKING:  # supplied by CheckpointStore

        def manifest(self, version: int) -> object: ...
        def _read_text(self, key: str) -> str | None: ...
        def _write_text(self, key: str, text: str) -> None: ...
        def _list(self, prefix: str) -> list[str]: ...
        def _delete(self, keys: list[str]) -> None: ...

    def pin(
        self, version: int, holder: str, ttl_s: float | None = None, published: bool = True
    ) -> None:
        """Lease `version` to `holder` for `ttl_s` seconds (default `pin_ttl_s`): retention keeps
        it while the lease lives. One pin per holder: a new pin replaces the holder's old one.
        `published=False`: the version may not be here yet (servable from the cache tier, its
        durable copy still being written); the pin then protects it from the moment it lands."""
        key = pin_key(holder)
        lease = new_lease(version, holder, self.clock(), self.pin_ttl_s if ttl_s is None else ttl_s)
        if published:
            self.manifest(version)  # refuse to pin what does not exist
        self._write_text(key, lease.to_json())

    def renew(self, holder: str, ttl_s: float | None = None) -> int:
        """Extend `holder`'s live lease to `ttl_s` seconds from now; return the version it pins.
        A missing or expired lease is refused: retention may already have deleted its version."""
        key, now = pin_key(holder), self.clock()
        text = self._read_text(key)
        if text is None:
            raise CheckpointError(
                f"pin holder {holder!r} holds no pin in {self.uri}; pin the version again"
            )
        old = parse_lease(key, text, self.pin_ttl_s)
        if not old.live(now):
            raise CheckpointError(
                f"the pin of {holder!r} on version {old.version} in {self.uri} expired at "
                f"{iso_utc(old.expires_at)}; its version may be gone: pin it again"
            )
        lease = new_lease(
            old.version, holder, now, self.pin_ttl_s if ttl_s is None else ttl_s, old.pinned_at
        )
        self._write_text(key, lease.to_json())
        return old.version

    def unpin(self, version: int, holder: str) -> None:
        """Drop `holder`'s pin if it still pins `version` (a newer pin of the holder stays)."""
        key = pin_key(holder)
        text = self._read_text(key)
        if text is not None and parse_lease(key, text, self.pin_ttl_s).version == version:
            self._delete([key])

    def pinned(self) -> set[int]:
        """Every version a live lease pins (an expired one protects nothing)."""
        now = self.clock()
        return {lease.version for _, _, lease in self._leases() if lease.live(now)}

    def _leases(self) -> list[tuple[str, str, Lease]]:
        keys = [k for k in self._list("pins/") if k.endswith(".json")]
        return [
            (k, text, parse_lease(k, text, self.pin_ttl_s))
            for k in keys
            if (text := self._read_text(k)) is not None
        ]

    def _drop_expired(self, leases: list[tuple[str, str, Lease]], now: float) -> list[str]:
        """Delete the pin files of expired leases that still read as they did (not pinned again since)."""
        dropped = []
        for key, text, lease in leases:
            if not lease.live(now) and self._read_text(key) == text:
                self._delete([key])
                dropped.append(key)
        return dropped
