"""Fan-out: the rollout engines of one run fetch a new version from each other, chunk by chunk.

One cache server feeding every rollout node is the next bottleneck (32 nodes x 470 GB per
version of Qwen3-235B-A22B). With `checkpoint.fanout`, each rollout worker runs a `Swarm`:

- it serves the chunks it holds, verified, over HTTP (uvicorn + one Starlette route:
  `GET /chunk/{version}/{index}`), on `MOERL_FANOUT_BIND` (127.0.0.1 by default; the pod's
  address on EKS, where a NetworkPolicy admits only the run's rollout pods), and announces
  itself in Valkey (`fanout:peers`, with its URL) and each chunk it holds
  (`fanout:have:<version>:<peer>`, a set of chunk indices);
- to fetch a version it takes the manifest from the cache tier (or S3), then every chunk in a
  rotated order (peer k of n starts at chunk k*K/n, so at first the peers pull disjoint parts
  from the tier), each from a peer that announced it when there is one, else from the cache
  tier, else from S3 (ranged reads). Every chunk is checked against the manifest's chunk
  sha256 before it is written or announced: a corrupt chunk from a peer is refused
  (`fanout_chunks_refused`) and fetched from the next source. The copy is renamed into the
  node cache, with its manifest and marker, only when every chunk has passed.

Peers come and go (Spot): a peer that does not answer is skipped for the rest of that fetch,
and a chunk nobody else holds comes from the tiers, so the fan-out needs no fixed group.
Time to serve one version of S bytes to N nodes, each with link bandwidth b, from a cache tier
of bandwidth B: about max(S/b, S/B) + N*c/b for chunk size c (the tier sends each chunk about
once, every node receives S and sends about S), against N*S/B through the cache tier alone
(`moerl bench weights` measures both; `moerl bench project` states both at the seed's scale).

Limitations: a chunk is fetched once per node even when two nodes race for it at the start
(at most one chunk each); the peers' announcements are not retracted when their node cache
prunes a version (a peer that no longer has it answers 404 and the next source is tried).
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
from moerl.store.manifest import MANIFEST, Manifest, version_dir
from moerl.store.nodecache import MARKER, exclusive, is_verified, lock_path

if TYPE_CHECKING:
    from moerl.bus import RunBus
    from moerl.store.tiers import Tiers

log = logging.getLogger(__name__)

HAVE_TTL_S = 24 * 3600
_TIMEOUT_S = 30.0


@dataclass
class _Copy:
    """A version this peer holds, whole or in part: where its files are, which chunks passed."""

    root: Path
    manifest: Manifest
    chunks: list[tuple[str, int, int]]  # (path, start, length) by chunk index
    held: set[int] = field(default_factory=set)


def chunk_plan(manifest: Manifest, exclude: tuple[str, ...] = ()) -> list[tuple[str, int, int, str]]:
    """Every chunk of the wanted files: (path, start, length, sha256), in manifest order."""
    if not manifest.chunk_size:
        raise CheckpointError(f"version {manifest.version} has no chunk hashes (published before checkpoint.chunk_mb "
                              "existed); the fan-out cannot check its chunks")
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

    def __init__(self, bus: RunBus, name: str, cfg: CheckpointConfig, bind: str = "127.0.0.1",
                 advertise: str | None = None, workers: int = 4) -> None:
        self.bus, self.name, self.cfg, self.workers = bus, name, cfg, workers
        self.copies: dict[int, _Copy] = {}
        self._lock = threading.Lock()
        self.counts = {"peer": 0, "tier": 0, "refused": 0}
        self._sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._sock.bind((bind, 0))
        self.url = f"http://{advertise or bind}:{self._sock.getsockname()[1]}"
        self._server = None
        self._thread: threading.Thread | None = None
        import requests

        self._http = requests.Session()

    @classmethod
    def start(cls, bus: RunBus, name: str, cfg: CheckpointConfig) -> Swarm:
        swarm = cls(bus, name, cfg, bind=os.environ.get("MOERL_FANOUT_BIND", "127.0.0.1"),
                    advertise=os.environ.get("MOERL_FANOUT_ADVERTISE") or None)
        swarm.serve()
        return swarm

    # -- serving --------------------------------------------------------------------------
    def serve(self) -> None:
        import uvicorn
        from starlette.applications import Starlette
        from starlette.responses import Response
        from starlette.routing import Route

        def chunk(request):  # noqa: ANN001, ANN202
            v, i = int(request.path_params["version"]), int(request.path_params["index"])
            data = self.read_held(v, i)
            return Response(status_code=404) if data is None else Response(data, media_type="application/octet-stream")

        app = Starlette(routes=[Route("/chunk/{version:int}/{index:int}", chunk)])
        config = uvicorn.Config(app, log_level="warning", access_log=False, lifespan="off")
        self._server = uvicorn.Server(config)
        self._sock.listen(64)
        self._thread = threading.Thread(target=self._server.run, kwargs={"sockets": [self._sock]},
                                        name="moerl-fanout", daemon=True)
        self._thread.start()
        deadline = time.monotonic() + 10
        while not self._server.started and time.monotonic() < deadline:
            time.sleep(0.02)
        self.bus.r.hset(self.bus.key("fanout:peers"), self.name, self.url)
        log.info("fan-out: %s serves chunks at %s", self.name, self.url)

    def read_held(self, version: int, index: int) -> bytes | None:
        with self._lock:
            copy = self.copies.get(version)
            if copy is None or index not in copy.held:
                return None
            path, start, length = copy.chunks[index]
            root = copy.root
        try:
            with open(root / path, "rb") as f:
                f.seek(start)
                return f.read(length)
        except OSError:  # pruned or renamed meanwhile
            return None

    def offer(self, version: int, path: Path, manifest: Manifest, exclude: tuple[str, ...] = ()) -> None:
        """Serve a verified copy this node got some other way (the cache tier, S3)."""
        if not manifest.chunk_size:
            return
        plan = chunk_plan(manifest, exclude)
        with self._lock:
            self.copies[version] = _Copy(Path(path), manifest, [(p, s, n) for p, s, n, _ in plan], set(range(len(plan))))
        self._announce(version, list(range(len(plan))))

    def _announce(self, version: int, indices: list[int]) -> None:
        key = self.bus.key(f"fanout:have:{version}:{self.name}")
        self.bus.r.sadd(key, *indices)
        self.bus.r.expire(key, HAVE_TTL_S)

    def stop(self) -> None:
        try:
            self.bus.r.hdel(self.bus.key("fanout:peers"), self.name)
        except Exception as err:  # noqa: BLE001 - its announcements expire anyway
            log.warning("fan-out: could not withdraw %s: %s", self.name, err)
        if self._server is not None:
            self._server.should_exit = True
        if self._thread is not None:
            self._thread.join(timeout=5)
        self._sock.close()

    # -- fetching -------------------------------------------------------------------------
    def _holders(self, version: int, peers: dict[str, str], bad: set[str]) -> dict[int, list[str]]:
        out: dict[int, list[str]] = {}
        for peer in peers:
            if peer == self.name or peer in bad:
                continue
            for i in self.bus.r.smembers(self.bus.key(f"fanout:have:{version}:{peer}")):
                out.setdefault(int(i), []).append(peer)
        return out

    def fetch(self, tiers: Tiers, version: int, dest: Path, exclude: tuple[str, ...] = (),
              expect_sha256: str | None = None) -> tuple[Path, int]:
        """`version` in `dest`, assembled from peers and tiers, every chunk verified; and how
        many of its chunks came from peers."""
        manifest = tiers.manifest(version)
        if expect_sha256 is not None and manifest.sha256() != expect_sha256:
            raise CheckpointError(f"version {version}: the tiers hold manifest {manifest.sha256()}, not {expect_sha256}")
        plan = chunk_plan(manifest, exclude)
        dest = Path(dest)
        dest.mkdir(parents=True, exist_ok=True)
        final = dest / version_dir(version)
        before = self.counts["peer"]
        with exclusive(lock_path(dest, version)):
            if not is_verified(final, manifest, exclude):
                self._assemble(tiers, version, manifest, plan, dest, final, exclude)
        self.offer(version, final, manifest, exclude)
        return final, self.counts["peer"] - before

    def _assemble(self, tiers: Tiers, version: int, manifest: Manifest, plan: list[tuple[str, int, int, str]],
                  dest: Path, final: Path, exclude: tuple[str, ...]) -> None:
        t0 = time.monotonic()
        tmp = dest / f".tmp-{version_dir(version)}-{uuid.uuid4().hex[:8]}"
        tmp.mkdir()
        try:
            for e in manifest.files:
                if not (exclude and e.path.startswith(exclude)):
                    (tmp / e.path).parent.mkdir(parents=True, exist_ok=True)
                    with open(tmp / e.path, "wb") as f:
                        f.truncate(e.size)
            with self._lock:  # serve what passed as it arrives: later peers pull from us mid-fetch
                self.copies[version] = _Copy(tmp, manifest, [(p, s, n) for p, s, n, _ in plan])
            peers = {k: v for k, v in self.bus.r.hgetall(self.bus.key("fanout:peers")).items()}
            names = sorted(set(peers) | {self.name})
            k, n = names.index(self.name), len(names)
            order = [(k * len(plan) // n + j) % len(plan) for j in range(len(plan))]
            bad: set[str] = set()
            dead_tiers: set[str] = set()  # a tier that failed is not asked again in this fetch
            state = {"holders": self._holders(version, peers, bad), "at": time.monotonic()}

            def one(i: int) -> None:
                path, start, length, sha = plan[i]
                # who holds what: refreshed twice a second, and before any chunk nobody held at the
                # last look goes to the tiers (a peer may have just fetched it)
                age = time.monotonic() - state["at"]
                if age > 0.5 or (i not in state["holders"] and age > 0.02):
                    state["holders"], state["at"] = self._holders(version, peers, bad), time.monotonic()
                data = None
                holders = [p for p in state["holders"].get(i, []) if p not in bad]
                random.shuffle(holders)
                for peer in holders:
                    got = self._from_peer(peers[peer], version, i)
                    if got is None:
                        bad.add(peer)  # gone (Spot) or pruned: not asked again in this fetch
                    elif hashlib.sha256(got).hexdigest() != sha:
                        self._count("refused")
                        log.warning("fan-out: chunk %d of version %d from %s is corrupt; refused", i, version, peer)
                        bad.add(peer)
                    else:
                        data = got
                        self._count("peer")
                        break
                if data is None:
                    data = self._from_tiers(tiers, version, path, start, length, sha, dead_tiers)
                    self._count("tier")
                fd = os.open(tmp / path, os.O_WRONLY)
                try:
                    os.pwrite(fd, data, start)
                finally:
                    os.close(fd)
                with self._lock:
                    self.copies[version].held.add(i)
                self._announce(version, [i])

            ex = ThreadPoolExecutor(max_workers=self.workers)
            try:
                list(ex.map(one, order))
            finally:
                ex.shutdown(wait=True, cancel_futures=True)
            (tmp / MANIFEST).write_text(manifest.to_json())
            (tmp / MARKER).write_text(manifest.sha256() + "".join(f"\nexclude={p}" for p in sorted(exclude)))
            with self._lock:
                if final.exists():
                    shutil.rmtree(final)
                os.replace(tmp, final)
                self.copies[version].root = final
        except BaseException:
            with self._lock:
                self.copies.pop(version, None)
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        log.info("fan-out: version %d assembled in %.2f s (%s)", version, time.monotonic() - t0, self.counts)

    def _count(self, what: str) -> None:
        with self._lock:
            self.counts[what] += 1
        self.bus.incr(**{f"fanout_chunks_{'peer' if what == 'peer' else 'tier' if what == 'tier' else 'refused'}": 1})

    def _from_peer(self, url: str, version: int, index: int) -> bytes | None:
        import requests

        try:
            r = self._http.get(f"{url}/chunk/{version}/{index}", timeout=_TIMEOUT_S)
        except requests.RequestException:
            return None
        return r.content if r.status_code == 200 else None

    @staticmethod
    def _from_tiers(tiers: Tiers, version: int, path: str, start: int, length: int, sha: str,
                    dead: set[str]) -> bytes:
        errors = []
        stores = [s for s in (tiers.cache, tiers.durable) if s is not None]
        for store in [s for s in stores if s.uri not in dead] or stores:
            try:
                data = store.read_chunk(version, path, start, length)
            except CheckpointError as e:
                errors.append(f"{store.uri}: {e}")
                if store is tiers.cache:
                    dead.add(store.uri)
                    log.warning("fan-out: the cache tier failed (%s); chunks of version %d come from %s", e,
                                version, tiers.durable.uri)
                continue
            if hashlib.sha256(data).hexdigest() == sha:
                return data
            errors.append(f"{store.uri}: a corrupt chunk")
        raise CheckpointError(f"chunk {path}@{start} of version {version}: no source serves it intact ({'; '.join(errors)})")
