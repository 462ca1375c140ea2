"""The fan-out's bookkeeping in Valkey: who holds which chunk of a version, the run's chunk token,
and the chunk counters; kept to O(peers) commands per look and a few batched writes per second.

Design, details and limitations: docs/weights.md#moerlstorefanoutpy.
"""

from __future__ import annotations

import logging
import secrets
import threading
import time
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from moerl.bus import RunBus

log = logging.getLogger(__name__)

HAVE_TTL_S = 24 * 3600
REFRESH_S = 0.5  # a fetch reads the peers' bitmaps at most this often
FLUSH_S = 0.25  # announcements and counters wait at most this long (while chunks keep arriving)
FLUSH_CHUNKS = 256  # ... or this many chunks
TOKEN_KEY = "fanout:token"


def set_bit(bits: bytearray, i: int) -> None:
    """Set bit `i` (MSB first within each byte, as Valkey's SETBIT/GETBIT number them)."""
    if len(bits) <= i // 8:
        bits.extend(bytes(i // 8 + 1 - len(bits)))
    bits[i // 8] |= 0x80 >> (i % 8)


def has_bit(bits: bytes, i: int) -> bool:
    return i // 8 < len(bits) and bool(bits[i // 8] & (0x80 >> (i % 8)))


def run_token(bus: RunBus, mine: str | None = None) -> str:
    """The run's chunk token: made by the first worker (SET NX), read by every other, so all the
    run's workers share it and no other run's do. It lives in the run's keys only: never in a
    URL, a log line or MLflow. `mine`: the token this worker holds, set again if Valkey lost it."""
    bus.r.set(bus.key(TOKEN_KEY), mine or secrets.token_urlsafe(32), nx=True)
    token = bus.r.get(bus.key(TOKEN_KEY))
    if not token:
        from moerl.errors import CheckpointError

        raise CheckpointError(
            "fan-out: the run's chunk token is missing from Valkey right after it was set"
        )
    return token


class Book:
    """One worker's announcements and counters, batched, and its reads of the peers' bitmaps.
    `clock`: the time source (the bench drives it on a virtual clock)."""

    def __init__(self, bus: RunBus, name: str, clock: Callable[[], float] = time.monotonic) -> None:
        self.bus, self.name, self.clock = bus, name, clock
        self._lock = threading.Lock()  # the in-memory state
        self._send = threading.Lock()  # one flush or withdrawal at a time, in order
        self._bits: dict[tuple[int, str], bytearray] = {}
        self._dirty: set[tuple[int, str]] = set()
        self._counts: dict[str, int] = {}
        self._noted = 0  # chunks announced since the last flush
        self._flushed_at = clock()
        self.flushes = 0

    def key(self, version: int, sha: str, peer: str) -> str:
        return self.bus.key(f"fanout:bits:{version}:{sha}:{peer}")

    def _call(self, fn):  # noqa: ANN001, ANN202 - through the bus's retrying client when it has one
        call = getattr(self.bus.r, "call", None)
        return call(fn) if call is not None else fn()

    @property
    def _raw(self):  # noqa: ANN202 - the plain client (pipelines are not retried command by command)
        return getattr(self.bus.r, "raw", self.bus.r)

    # -- writes ---------------------------------------------------------------------------
    def announce(self, version: int, sha: str, indices: Iterable[int]) -> None:
        with self._lock:
            bits = self._bits.setdefault((version, sha), bytearray())
            n = 0
            for i in indices:
                set_bit(bits, i)
                n += 1
            self._dirty.add((version, sha))
            self._noted += n

    def count(self, what: str, n: int = 1) -> None:
        with self._lock:
            self._counts[what] = self._counts.get(what, 0) + n

    def due(self) -> bool:
        with self._lock:
            if not (self._dirty or self._counts):
                return False
            return self._noted >= FLUSH_CHUNKS or self.clock() - self._flushed_at >= FLUSH_S

    def flush_if_due(self) -> None:
        if self.due():
            self.flush()

    def flush(self) -> None:
        """Send what was noted: one SET per bitmap that changed (pipelined) and one counter call.
        On failure what was taken is put back for the next flush, and the error raised."""
        with self._send:
            with self._lock:
                dirty = {k: bytes(self._bits[k]) for k in self._dirty if k in self._bits}
                counts = self._counts
                self._dirty, self._counts, self._noted, self._flushed_at = (
                    set(),
                    {},
                    0,
                    self.clock(),
                )
            try:
                if dirty:

                    def send() -> None:
                        pipe = self._raw.pipeline(transaction=False)
                        for (version, sha), bits in dirty.items():
                            pipe.set(self.key(version, sha, self.name), bits, ex=HAVE_TTL_S)
                        pipe.execute()

                    self._call(send)
                if counts:
                    self.bus.incr(**{f"fanout_chunks_{k}": v for k, v in counts.items()})
                self.flushes += 1
            except BaseException:
                with self._lock:
                    self._dirty |= {k for k in dirty if k in self._bits}
                    for k, v in counts.items():
                        self._counts[k] = self._counts.get(k, 0) + v
                raise

    def withdraw(self, version: int, sha: str) -> None:
        """Stop announcing a copy (its staging folder is gone): peers then never ask for it."""
        with self._send:
            with self._lock:
                self._bits.pop((version, sha), None)
                self._dirty.discard((version, sha))
            self.bus.r.delete(self.key(version, sha, self.name))

    # -- reads ----------------------------------------------------------------------------
    def read(self, version: int, sha: str, peers: list[str]) -> dict[str, bytes]:
        """Every peer's bitmap of one version, in one pipelined round trip (GET as bytes: the
        bus's client decodes replies as text)."""
        if not peers:
            return {}
        from valkey.client import NEVER_DECODE

        def send() -> list:
            pipe = self._raw.pipeline(transaction=False)
            for peer in peers:
                pipe.execute_command("GET", self.key(version, sha, peer), **{NEVER_DECODE: True})
            return pipe.execute()

        return {p: b for p, b in zip(peers, self._call(send)) if b}


class Holders:
    """Who holds which chunk of one version, as one fetch last read it: re-read at most every
    `REFRESH_S` (one thread reads; the others use what it read)."""

    def __init__(self, book: Book, version: int, sha: str, peers: list[str]) -> None:
        self.book, self.version, self.sha, self.peers = book, version, sha, list(peers)
        self.bad: set[str] = set()  # not asked again in this fetch (gone, corrupt, too slow)
        self._bits: dict[str, bytes] = {}
        self._at = float("-inf")
        self._lock = threading.Lock()
        self.refreshes = 0

    def _refresh_if_due(self) -> None:
        if self.book.clock() - self._at < REFRESH_S:
            return
        with self._lock:
            if self.book.clock() - self._at < REFRESH_S:  # another thread has just read them
                return
            self._bits = self.book.read(
                self.version, self.sha, [p for p in self.peers if p not in self.bad]
            )
            self._at = self.book.clock()
            self.refreshes += 1

    def of(self, i: int) -> list[str]:
        """The peers (not bad) whose bitmap has chunk `i`."""
        self._refresh_if_due()
        bits = self._bits
        return [p for p, b in bits.items() if p not in self.bad and has_bit(b, i)]
