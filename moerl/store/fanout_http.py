"""The fan-out's HTTP: a chunk server that admits only the run's token and serves file ranges a few
at a time, and a chunk fetch that a slow or hostile peer cannot hang or bloat.

Design, details and limitations: docs/weights.md#moerlstorefanoutpy.
"""

from __future__ import annotations

import asyncio
import hmac
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

PIECE = 1 << 20
CONNECT_S = 2.0
READ_S = 5.0  # at most this long for one socket read (the deadline is checked between reads)
MIN_RATE_BPS = 16 << 20  # a peer slower than this for a whole chunk is dropped from the fetch
SLACK_S = 5.0  # plus this much per chunk (a first byte, a busy peer's disk)


@dataclass(frozen=True)
class Limits:
    min_rate_bps: float = MIN_RATE_BPS
    slack_s: float = SLACK_S
    read_s: float = READ_S

    def deadline_s(self, length: int) -> float:
        return self.slack_s + length / self.min_rate_bps


async def _reply(send, status: int, headers: Sequence[tuple[bytes, bytes]] = ()) -> None:  # noqa: ANN001
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [(b"content-length", b"0"), *headers],
        }
    )
    await send({"type": "http.response.body", "body": b""})


class ChunkApp:
    """The chunk server's ASGI app. `locate(version, sha, index)`: (file, start, length) of a
    chunk this peer holds, verified, or None."""

    def __init__(
        self,
        token: str,
        locate: Callable[[int, str, int], tuple[Path, int, int] | None],
        max_serving: int = 8,
        limits: Limits = Limits(),
    ) -> None:
        self._expected = f"Bearer {token}".encode()
        self.locate, self.max_serving, self.limits = locate, max_serving, limits
        self.serving = 0  # chunks being sent now (one event loop: no lock needed)
        self.refused_busy = self.refused_auth = self.stalled = 0

    def set_token(self, token: str) -> None:
        """Admit `token` from now on (the run's, set again after a Valkey loss)."""
        self._expected = f"Bearer {token}".encode()

    async def __call__(self, scope, receive, send) -> None:  # noqa: ANN001
        if scope["type"] != "http":
            return
        parts = scope["path"].strip("/").split("/")
        if (
            scope["method"] != "GET"
            or len(parts) != 4
            or parts[0] != "chunk"
            or not (parts[1].isdigit() and parts[3].isdigit())
        ):
            return await _reply(send, 404)
        auth = dict(scope["headers"]).get(b"authorization")
        if not auth:
            self.refused_auth += 1
            return await _reply(send, 401, [(b"www-authenticate", b"Bearer")])
        if not hmac.compare_digest(auth, self._expected):
            self.refused_auth += 1
            return await _reply(send, 403)
        if self.serving >= self.max_serving:
            self.refused_busy += 1
            return await _reply(send, 503, [(b"retry-after", b"1")])
        self.serving += 1
        gone = asyncio.Event()  # the fetcher hung up (its deadline): stop reading the file for it

        async def watch() -> None:
            while (await receive())["type"] != "http.disconnect":
                pass
            gone.set()

        watcher = asyncio.ensure_future(watch())
        try:
            await self._send_chunk(send, gone, int(parts[1]), parts[2], int(parts[3]))
        finally:
            watcher.cancel()
            self.serving -= 1

    async def _send_chunk(
        self, send, gone: asyncio.Event, version: int, sha: str, index: int
    ) -> None:  # noqa: ANN001
        where = self.locate(version, sha, index)
        try:
            f = open(where[0], "rb") if where is not None else None  # noqa: SIM115 - closed below
        except OSError:  # pruned or renamed since
            f = None
        if f is None or where is None:  # where is None: f is too
            return await _reply(send, 404)
        _, start, length = where
        with f:
            await send(
                {
                    "type": "http.response.start",
                    "status": 200,
                    "headers": [
                        (b"content-type", b"application/octet-stream"),
                        (b"content-length", str(length).encode()),
                    ],
                }
            )
            f.seek(start)
            left = length
            try:
                # a reader that stops reading blocks the sends (uvicorn's flow control) for good:
                # the chunk gets the fetcher's own deadline, then the connection is dropped
                async with asyncio.timeout(self.limits.deadline_s(length)):
                    while left > 0 and not gone.is_set():
                        piece = await asyncio.to_thread(f.read, min(PIECE, left))
                        # the file shrank: end short; the fetcher refuses a short chunk
                        if not piece:
                            return
                        left -= len(piece)
                        await send(
                            {"type": "http.response.body", "body": piece, "more_body": left > 0}
                        )
            except TimeoutError:
                self.stalled += 1


# What a fetch from one peer came to (besides the bytes).
OK, ABSENT, BUSY, UNREACHABLE = "ok", "absent", "busy", "unreachable"
OVERSIZE, SHORT, SLOW = "oversize", "short", "slow"


def fetch_chunk(
    http,
    url: str,
    token: str,
    version: int,
    sha: str,
    index: int,
    length: int,  # noqa: ANN001
    limits: Limits = Limits(),
) -> tuple[str, bytes | None]:
    """(OK, the bytes: exactly `length` of them) or (why not, None): ABSENT (404), BUSY (503),
    UNREACHABLE (no answer, refused, any other status), OVERSIZE / SHORT (more or fewer bytes
    than the chunk has), SLOW (past the chunk's deadline)."""
    import requests
    import urllib3

    deadline = time.monotonic() + limits.deadline_s(length)
    try:
        r = http.get(
            f"{url}/chunk/{version}/{sha}/{index}",
            headers={"Authorization": f"Bearer {token}"},
            stream=True,
            timeout=(CONNECT_S, limits.read_s),
        )
    except requests.Timeout:
        return (SLOW if time.monotonic() > deadline else UNREACHABLE), None
    except requests.RequestException:
        return UNREACHABLE, None
    with r:  # an unread body closes the connection rather than returning it to the pool
        if r.status_code != 200:
            return {404: ABSENT, 503: BUSY}.get(r.status_code, UNREACHABLE), None
        declared = r.headers.get("content-length")
        if declared is not None:
            if not declared.isdigit():
                return OVERSIZE, None
            if int(declared) != length:
                return (OVERSIZE if int(declared) > length else SHORT), None
        buf = bytearray()
        try:
            while True:
                if time.monotonic() > deadline:
                    return SLOW, None
                # one socket read at most (at most read_s), never decompressed; one byte more
                # than the chunk is enough to know it is too long
                piece = r.raw.read1(min(PIECE, length + 1 - len(buf)), decode_content=False)
                if not piece:
                    break
                buf += piece
                if len(buf) > length:
                    return OVERSIZE, None
        except (urllib3.exceptions.ReadTimeoutError, TimeoutError):
            return SLOW, None
        except (urllib3.exceptions.HTTPError, OSError):
            return (SHORT if buf else UNREACHABLE), None
        return (OK, bytes(buf)) if len(buf) == length else (SHORT, None)
