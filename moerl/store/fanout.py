"""Fan-out: the rollout engines of one run fetch a new version from each other, chunk by chunk.

Design, details and limitations: docs/weights.md#moerlstorefanoutpy.
"""

from __future__ import annotations

import hashlib
import logging
import os
import random
import shutil
import socket
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from moerl.config import CheckpointConfig
from moerl.errors import CheckpointError
from moerl.store import fanout_http as fh
from moerl.store.fanout_book import FLUSH_S, Book, Holders, run_token
from moerl.store.manifest import MANIFEST, Manifest, version_dir
from moerl.store.nodecache import MARKER, exclusive, is_verified, lock_path, vouch

if TYPE_CHECKING:
    import uvicorn

    from moerl.bus import RunBus
    from moerl.store.tiers import Tiers

log = logging.getLogger(__name__)

ALIVE_TTL_S = 15.0
MAX_SERVING = 8  # chunks one peer sends at once; more requests get 503 and go elsewhere


@dataclass
class _Copy:
    """A version this peer holds, whole or in part: where its files are, which chunks passed."""

    root: Path
    manifest: Manifest
    chunks: list[tuple[str, int, int]]  # (path, start, length) by chunk index
    held: set[int] = field(default_factory=set)


def chunk_plan(
    manifest: Manifest, exclude: tuple[str, ...] = ()
) -> list[tuple[str, int, int, str]]:
    """Every chunk of the wanted files: (path, start, length, sha256), in manifest order."""
    if not manifest.chunk_size:
        raise CheckpointError(
            f"version {manifest.version} has no chunk hashes (published before checkpoint.chunk_mb "
            "existed); the fan-out cannot check its chunks"
        )
    out = []
    for e in manifest.files:
        if exclude and e.path.startswith(exclude):
            continue
        for i, sha in enumerate(e.chunks):
            start = i * manifest.chunk_size
            out.append((e.path, start, min(manifest.chunk_size, e.size - start), sha))
    return out


class Swarm:
    """One rollout worker's side of the fan-out: a chunk server and a fetcher."""

    def __init__(
        self,
        bus: RunBus,
        name: str,
        cfg: CheckpointConfig,
        bind: str = "127.0.0.1",
        advertise: str | None = None,
        workers: int = 4,
        max_serving: int = MAX_SERVING,
        limits: fh.Limits | None = None,
    ) -> None:
        self.bus, self.name, self.cfg, self.workers = bus, name, cfg, workers
        self.limits = limits or fh.Limits()
        self.copies: dict[
            tuple[int, str], _Copy
        ] = {}  # (version, manifest sha256) -> what it holds
        self._lock = threading.Lock()
        self.counts = {"peer": 0, "cache": 0, "durable": 0, "refused": 0, "slow": 0}
        self.book = Book(bus, name)
        self.token = run_token(bus)  # never logged, never in a URL
        self.app = fh.ChunkApp(self.token, self.locate, max_serving, self.limits)
        self._stop = threading.Event()
        self._sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._sock.bind((bind, 0))
        self.url = f"http://{advertise or bind}:{self._sock.getsockname()[1]}"
        self._server: uvicorn.Server | None = None
        self._thread: threading.Thread | None = None
        import requests

        self._http = requests.Session()

    @classmethod
    def start(cls, bus: RunBus, name: str, cfg: CheckpointConfig) -> Swarm:
        swarm = cls(
            bus,
            name,
            cfg,
            bind=os.environ.get("MOERL_FANOUT_BIND", "127.0.0.1"),
            advertise=os.environ.get("MOERL_FANOUT_ADVERTISE") or None,
        )
        swarm.serve()
        return swarm

    # -- serving --------------------------------------------------------------------------
    def serve(self) -> None:
        import uvicorn

        # limit_concurrency: connections and requests together, past which uvicorn answers 503
        # itself (the peers' pooled keep-alive connections stay well below it)
        config = uvicorn.Config(
            self.app, log_level="warning", access_log=False, lifespan="off", limit_concurrency=256
        )
        server = self._server = uvicorn.Server(config)
        self._sock.listen(64)
        self._thread = threading.Thread(
            target=server.run,
            kwargs={"sockets": [self._sock]},
            name="moerl-fanout",
            daemon=True,
        )
        self._thread.start()
        deadline = time.monotonic() + 10
        while not server.started and time.monotonic() < deadline:
            time.sleep(0.02)
        self.bus.r.hset(self.bus.key("fanout:peers"), self.name, self.url)
        self._alive()
        threading.Thread(target=self._keep_alive, name="moerl-fanout-alive", daemon=True).start()
        threading.Thread(target=self._flusher, name="moerl-fanout-flush", daemon=True).start()
        log.info("fan-out: %s serves chunks at %s", self.name, self.url)

    def _alive(self) -> None:
        self.bus.r.set(
            self.bus.key(f"fanout:alive:{self.name}"), self.url, px=int(ALIVE_TTL_S * 1000)
        )

    def _keep_alive(self) -> None:
        while not self._stop.wait(ALIVE_TTL_S / 3):
            try:
                self._alive()
                self.rejoin()
            except Exception as err:  # noqa: BLE001 - Valkey away for a moment: peers skip us meanwhile
                log.warning("fan-out: could not refresh %s: %s", self.name, err)

    def rejoin(self) -> None:
        """After Valkey lost the run's keys (a flush, a restart without its append-only file):
        put the run's chunk token back (this worker's, unless a worker started since set one,
        which this one then takes up) and this peer's address, so old and new workers agree
        again within ALIVE_TTL_S / 3 without a restart."""
        token = run_token(self.bus, self.token)
        if token != self.token:
            log.warning(
                "fan-out: %s takes up the run's chunk token set after a Valkey loss", self.name
            )
            self.token = token
            self.app.set_token(token)
        self.bus.r.hset(self.bus.key("fanout:peers"), self.name, self.url)

    def _flusher(self) -> None:
        """Announcements and counters reach Valkey within FLUSH_S even while every fetch thread
        waits on a slow source (the fetch path flushes too, as chunks pass)."""
        while not self._stop.wait(FLUSH_S):
            try:
                self.book.flush_if_due()
            except Exception as err:  # noqa: BLE001 - kept for the next flush
                log.warning("fan-out: could not flush %s's announcements: %s", self.name, err)

    def locate(self, version: int, sha: str, index: int) -> tuple[Path, int, int] | None:
        """Where a chunk this peer holds, verified, lies: (file, start, length); else None."""
        with self._lock:
            copy = self.copies.get((version, sha))
            if copy is None or index not in copy.held:
                return None
            path, start, length = copy.chunks[index]
            return copy.root / path, start, length

    def forget_pruned(self) -> list[tuple[int, str]]:
        """Stop serving (and withdraw the announcements of) every whole copy whose folder the
        node cache pruned: bounded state, and peers stop asking for what is gone. Copies still
        being assembled stay. Returns what was forgotten."""
        with self._lock:
            gone = [
                key
                for key, c in self.copies.items()
                if len(c.held) == len(c.chunks) and not (c.root / MANIFEST).exists()
            ]
            for key in gone:
                self.copies.pop(key)
        for version, sha in gone:
            try:
                self.book.withdraw(version, sha)
            except Exception as err:  # noqa: BLE001 - its bitmap expires anyway; peers get 404s meanwhile
                log.warning("fan-out: could not withdraw pruned version %d: %s", version, err)
        return gone

    def offer(
        self, version: int, path: Path, manifest: Manifest, exclude: tuple[str, ...] = ()
    ) -> None:
        """Serve a verified copy this node got some other way (the cache tier, S3)."""
        self.forget_pruned()
        if not manifest.chunk_size:
            return
        plan = chunk_plan(manifest, exclude)
        sha = manifest.sha256()
        with self._lock:
            self.copies[(version, sha)] = _Copy(
                Path(path), manifest, [(p, s, n) for p, s, n, _ in plan], set(range(len(plan)))
            )
        self.book.announce(version, sha, range(len(plan)))
        self.book.flush()

    def stop(self) -> None:
        self._stop.set()
        try:
            self.book.flush()
            self.bus.r.hdel(self.bus.key("fanout:peers"), self.name)
            self.bus.r.delete(self.bus.key(f"fanout:alive:{self.name}"))
        except Exception as err:  # noqa: BLE001 - its announcements expire anyway
            log.warning("fan-out: could not withdraw %s: %s", self.name, err)
        if self._server is not None:
            self._server.should_exit = True
        if self._thread is not None:
            self._thread.join(timeout=5)
        self._sock.close()
        self._http.close()

    # -- fetching -------------------------------------------------------------------------
    def _present_peers(self) -> dict[str, str]:
        """Peers whose liveness key is fresh (a SIGKILLed one drops out within ALIVE_TTL_S)."""
        peers = self.bus.r.hgetall(self.bus.key("fanout:peers"))
        names = [p for p in peers if p != self.name]
        alive = self.bus.r.mget([self.bus.key(f"fanout:alive:{p}") for p in names]) if names else []
        return {p: peers[p] for p, a in zip(names, alive) if a}

    def fetch(
        self,
        tiers: Tiers,
        version: int,
        dest: Path,
        exclude: tuple[str, ...] = (),
        expect_sha256: str | None = None,
    ) -> tuple[Path, dict[str, int]]:
        """`version` in `dest`, assembled from peers and tiers, every chunk verified; and how
        many of its chunks came from each source (none: a verified copy was already here)."""
        manifest = tiers.manifest(version)
        if expect_sha256 is not None and manifest.sha256() != expect_sha256:
            raise CheckpointError(
                f"version {version}: the tiers hold manifest {manifest.sha256()}, not {expect_sha256}"
            )
        plan = chunk_plan(manifest, exclude)
        dest = Path(dest)
        dest.mkdir(parents=True, exist_ok=True)
        final = dest / version_dir(version)
        before = dict(self.counts)
        with exclusive(lock_path(dest, version)):
            if not is_verified(final, manifest, exclude):
                self._assemble(tiers, version, manifest, plan, dest, final, exclude)
        self.offer(version, final, manifest, exclude)
        return final, {k: self.counts[k] - before[k] for k in ("peer", "cache", "durable")}

    def _assemble(
        self,
        tiers: Tiers,
        version: int,
        manifest: Manifest,
        plan: list[tuple[str, int, int, str]],
        dest: Path,
        final: Path,
        exclude: tuple[str, ...],
    ) -> None:
        t0 = time.monotonic()
        tmp = dest / f".tmp-{version_dir(version)}-{uuid.uuid4().hex[:8]}"
        tmp.mkdir()
        sha = manifest.sha256()
        try:
            for e in manifest.files:
                if not (exclude and e.path.startswith(exclude)):
                    (tmp / e.path).parent.mkdir(parents=True, exist_ok=True)
                    with open(tmp / e.path, "wb") as f:
                        f.truncate(e.size)
            with self._lock:  # serve what passed as it arrives: later peers pull from us mid-fetch
                self.copies[(version, sha)] = _Copy(
                    tmp, manifest, [(p, s, n) for p, s, n, _ in plan]
                )
            peers = self._present_peers()
            names = sorted(set(peers) | {self.name})
            k, n = names.index(self.name), len(names)
            order = [(k * len(plan) // n + j) % len(plan) for j in range(len(plan))]
            holders = Holders(self.book, version, sha, sorted(peers))
            dead_tiers: set[str] = set()  # a tier that failed is not asked again in this fetch

            def one(i: int) -> None:
                path, start, length, chunk_sha = plan[i]
                data = self._from_peers(peers, holders, version, sha, i, length, chunk_sha)
                if data is None:
                    data, source = self._from_tiers(
                        tiers, version, path, start, length, chunk_sha, dead_tiers, manifest.objects
                    )
                    self._count(source)
                fd = os.open(tmp / path, os.O_WRONLY)
                try:
                    os.pwrite(fd, data, start)
                finally:
                    os.close(fd)
                with self._lock:
                    self.copies[(version, sha)].held.add(i)
                self.book.announce(version, sha, [i])
                self.book.flush_if_due()

            ex = ThreadPoolExecutor(max_workers=self.workers)
            try:
                list(ex.map(one, order))
            finally:
                ex.shutdown(wait=True, cancel_futures=True)
            self.book.flush()  # every chunk announced and counted before the copy is declared whole
            (tmp / MANIFEST).write_text(manifest.to_json())
            (tmp / MARKER).write_text(sha + "".join(f"\nexclude={p}" for p in sorted(exclude)))
            with self._lock:
                if final.exists():
                    shutil.rmtree(final)
                os.replace(tmp, final)
                vouch(final, manifest, exclude)
                self.copies[(version, sha)].root = final
        except BaseException:
            with self._lock:
                self.copies.pop((version, sha), None)
            try:  # what it announced is gone with the staging folder
                self.book.withdraw(version, sha)
            except Exception as err:  # noqa: BLE001 - peers then get 404s and go elsewhere
                log.warning("fan-out: could not withdraw version %d: %s", version, err)
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        log.info(
            "fan-out: version %d assembled in %.2f s (%s; %d looks at the peers)",
            version,
            time.monotonic() - t0,
            self.counts,
            holders.refreshes,
        )

    def _from_peers(
        self,
        peers: dict[str, str],
        holders: Holders,
        version: int,
        sha: str,
        i: int,
        length: int,
        chunk_sha: str,
    ) -> bytes | None:
        """Chunk `i` from a peer that holds it, checked; None: no peer could give it intact."""
        candidates = holders.of(i)
        random.shuffle(candidates)
        for peer in candidates:
            if peer in holders.bad:  # another thread dropped it meanwhile
                continue
            status, got = fh.fetch_chunk(
                self._http, peers[peer], self.token, version, sha, i, length, self.limits
            )
            if status == fh.OK:
                assert got is not None  # OK comes with the chunk
                if hashlib.sha256(got).hexdigest() == chunk_sha:
                    self._count("peer")
                    return got
                status = "corrupt"
            if status in (fh.ABSENT, fh.BUSY):
                continue  # pruned that version, or saturated: the next holder, or the tiers
            holders.bad.add(peer)  # not asked again in this fetch
            if status == fh.UNREACHABLE:
                continue  # gone (Spot)
            self._count("slow" if status == fh.SLOW else "refused")
            log.warning(
                "fan-out: chunk %d of version %d from %s refused (%s)", i, version, peer, status
            )
        return None

    def _count(self, what: str) -> None:
        with self._lock:
            self.counts[what] += 1
        self.book.count(what)

    @staticmethod
    def _from_tiers(
        tiers: Tiers,
        version: int,
        path: str,
        start: int,
        length: int,
        sha: str,
        dead: set[str],
        objects: str = "",
    ) -> tuple[bytes, str]:
        errors = []
        stores = [s for s in (tiers.cache, tiers.durable) if s is not None]
        for store in [s for s in stores if s.uri not in dead] or stores:
            try:
                data = store.read_chunk(version, path, start, length, objects)
            except CheckpointError as e:
                errors.append(f"{store.uri}: {e}")
                if store is tiers.cache:
                    dead.add(store.uri)
                    log.warning(
                        "fan-out: the cache tier failed (%s); chunks of version %d come from %s",
                        e,
                        version,
                        tiers.durable.uri,
                    )
                continue
            if hashlib.sha256(data).hexdigest() == sha:
                return data, "cache" if store is tiers.cache else "durable"
            errors.append(f"{store.uri}: a corrupt chunk")
        raise CheckpointError(
            f"chunk {path}@{start} of version {version}: no source serves it intact ({'; '.join(errors)})"
        )
