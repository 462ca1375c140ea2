"""The fan-out between engines on real parts: S3 tiers (`weed mini`), a real Valkey, real chunk
servers (uvicorn) and real hostile peers (small HTTP servers that send too much or trickle).
What is checked: peers serve each other and a corrupt chunk is refused; the chunk server admits
only the run's token; a peer's answer is cut at the chunk's length and deadline and the fetch
goes on from the next source; a saturated server answers 503 and is not dropped; the bookkeeping
is batched and one look at the peers is one round trip; launched rollout pods carry the labels
the fan-out's NetworkPolicy selects."""

from __future__ import annotations

import http.server
import logging
import os
import threading
import time
from pathlib import Path

import pytest
import requests
import yaml

from moerl.config import MAX_CHUNK_MB, CheckpointConfig, parse_config
from moerl.errors import ConfigError
from moerl.store import fanout_http as fh
from moerl.store.fanout import Swarm, chunk_plan
from moerl.store.fanout_book import REFRESH_S, Book, Holders, has_bit, run_token
from moerl.store.manifest import Manifest
from moerl.store.tiers import Tiers, run_tiers
from tests.store.test_store import make_checkpoint, tree
from tests.support.objects import file_key

CHUNK = 4096
MANIFESTS = Path(__file__).resolve().parents[2] / "manifests"


@pytest.fixture(scope="module")
def buckets(s3_server):
    client = s3_server.client()
    for b in ("fan-cache", "fan-durable"):
        try:
            client.create_bucket(Bucket=b)
        except client.exceptions.BucketAlreadyOwnedByYou:
            pass
    return s3_server


@pytest.fixture(scope="module")
def valkey(tmp_path_factory):
    from moerl.bus import EmbeddedValkey

    with EmbeddedValkey(tmp_path_factory.mktemp("valkey"), appendonly=False) as v:
        yield v


def _cfg(s3, tmp: Path) -> CheckpointConfig:
    return CheckpointConfig(
        uri=f"s3://fan-durable/{tmp.name}",
        endpoint_url=s3.endpoint_url,
        region="us-east-1",
        cache_dir=str(tmp / "node"),
        chunk_mb=1,
        fanout=True,
        cache_tier={"uri": f"s3://fan-cache/{tmp.name}", "endpoint_url": s3.endpoint_url},
    )


def _published(
    buckets, tmp: Path, n_chunks: int = 40
) -> tuple[CheckpointConfig, Tiers, Path, Manifest]:
    cfg = _cfg(buckets, tmp)
    tiers = run_tiers(cfg, "r1")
    tiers.chunk_size = CHUNK  # several chunks per file in these small checkpoints
    src = make_checkpoint(tmp / "src", seed=4)
    (src / "model.safetensors").write_bytes(os.urandom(n_chunks * CHUNK + 17))
    return cfg, tiers, src, tiers.publish(1, src, {})


def _bus(valkey, run: str):
    from moerl.bus import RunBus, connect

    return RunBus(connect(valkey.url, 5.0), run)


def _same(path: Path, src: Path, m: Manifest) -> None:
    assert tree(path)["model.safetensors"] == (src / "model.safetensors").read_bytes()
    assert Manifest.from_json((path / "manifest.json").read_text()).sha256() == m.sha256()


def test_peers_serve_each_other_and_refuse_a_corrupt_chunk(buckets, valkey, tmp_path: Path) -> None:
    cfg, tiers, src, m = _published(buckets, tmp_path)
    bus = _bus(valkey, f"fan-{tmp_path.name}")
    swarms = [Swarm(bus, f"rollout-{i}", cfg) for i in range(3)]
    for s in swarms:
        s.serve()
    try:
        # the first node has nobody to ask: every chunk from the tiers
        a, source = tiers.fetch(1, tmp_path / "n0", expect_sha256=m.sha256(), swarm=swarms[0])
        n_chunks = sum(len(f.chunks) for f in m.files)
        assert (
            source == "cache"
            and swarms[0].counts["cache"] == n_chunks > 40
            and swarms[0].counts["durable"] == 0
        )
        # the second: every chunk from the first (peers before the tiers)
        b, source = tiers.fetch(1, tmp_path / "n1", expect_sha256=m.sha256(), swarm=swarms[1])
        assert source == "peers"
        assert swarms[1].counts == {
            "peer": n_chunks,
            "cache": 0,
            "durable": 0,
            "refused": 0,
            "slow": 0,
        }
        # a peer whose copy went bad on disk: its chunk is refused by its hash, fetched elsewhere
        plan = chunk_plan(m)
        bad = next(
            i for i, c in enumerate(plan) if c[0] == "model.safetensors" and c[1] >= 5 * CHUNK
        )
        path, start, length, _ = plan[bad]
        with open(a / path, "r+b") as f:
            f.seek(start)
            f.write(bytes(x ^ 0xFF for x in f.read(length)))
            f.seek(start)
        swarms[
            1
        ].stop()  # and one that has gone away without a word (its liveness key has not expired)
        bus.r.hset(bus.key("fanout:peers"), "rollout-1", swarms[1].url)
        bus.r.set(bus.key("fanout:alive:rollout-1"), swarms[1].url)
        c, _ = tiers.fetch(1, tmp_path / "n2", expect_sha256=m.sha256(), swarm=swarms[2])
        # the bad chunk, then the tiers
        assert swarms[2].counts["refused"] >= 1 and swarms[2].counts["cache"] >= 1
        for path in (b, c):
            _same(path, src, m)
        assert int(bus.counters().get("fanout_chunks_refused", 0)) == swarms[2].counts["refused"]
        assert int(bus.counters().get("fanout_chunks_peer", 0)) == sum(
            s.counts["peer"] for s in swarms
        )
        # a peer whose liveness key lapsed (killed without a goodbye) is not asked at all
        bus.r.hset(bus.key("fanout:peers"), "ghost", "http://127.0.0.1:9")
        assert (
            "ghost" not in swarms[0]._present_peers() and "rollout-2" in swarms[0]._present_peers()
        )
    finally:
        for s in swarms:
            s.stop()


def test_the_chunk_server_admits_only_the_runs_token(
    buckets, valkey, tmp_path: Path, caplog
) -> None:
    caplog.set_level(logging.DEBUG)
    cfg, tiers, src, m = _published(buckets, tmp_path, n_chunks=3)
    bus = _bus(valkey, f"tok-{tmp_path.name}")
    mine, peer = Swarm(bus, "rollout-0", cfg), Swarm(bus, "rollout-1", cfg)
    other = Swarm(_bus(valkey, f"other-{tmp_path.name}"), "rollout-0", cfg)  # another run's worker
    for s in (mine, peer, other):
        s.serve()
    try:
        a, _ = tiers.fetch(1, tmp_path / "n0", expect_sha256=m.sha256(), swarm=mine)
        path, start, length, _ = chunk_plan(m)[0]
        url = f"{mine.url}/chunk/1/{m.sha256()}/0"
        assert requests.get(url, timeout=5).status_code == 401
        assert (
            requests.get(url, headers={"Authorization": "Bearer nope"}, timeout=5).status_code
            == 403
        )
        assert (
            requests.get(
                url, headers={"Authorization": f"Basic {mine.token}"}, timeout=5
            ).status_code
            == 403
        )
        # one per run, shared by its workers
        assert other.token != mine.token == peer.token == run_token(bus)
        assert (
            requests.get(
                url, headers={"Authorization": f"Bearer {other.token}"}, timeout=5
            ).status_code
            == 403
        )
        ok = requests.get(url, headers={"Authorization": f"Bearer {peer.token}"}, timeout=5)
        assert (
            ok.status_code == 200 and ok.content == (a / path).read_bytes()[start : start + length]
        )
        # another run's worker told about this one cannot fetch from it: every chunk from its tiers
        other.bus.r.hset(other.bus.key("fanout:peers"), "intruder-target", mine.url)
        other.bus.r.set(other.bus.key("fanout:alive:intruder-target"), mine.url)
        claims = Book(other.bus, "intruder-target")
        claims.announce(1, m.sha256(), range(len(chunk_plan(m))))
        claims.flush()
        refused = mine.app.refused_auth
        _, counts = other.fetch(tiers, 1, tmp_path / "n-other", expect_sha256=m.sha256())
        assert counts["peer"] == 0 and counts["cache"] == len(chunk_plan(m))
        # it asked, was refused, stopped asking
        assert 1 <= mine.app.refused_auth - refused <= other.workers
        # the token is in the run's Valkey keys only: not in a URL, the peer list or a log line
        published = bus.r.hgetall(bus.key("fanout:peers"))
        assert all(mine.token not in u for u in [mine.url, *published.values()])
        assert mine.token not in caplog.text and other.token not in caplog.text
    finally:
        for s in (mine, peer, other):
            s.stop()


class _Hostile(http.server.BaseHTTPRequestHandler):
    """A peer that answers every chunk request badly: `flood` sends 256 MiB with no
    Content-Length (far more than any socket buffer holds, so it can finish only if the fetcher
    reads it all); `trickle` promises the right length and sends a byte every 0.2 s. Each
    request records whether the fetcher hung up on it."""

    mode = "flood"
    requests_seen: list[str] = []
    hung_up: list[bool] = []

    def do_GET(self) -> None:  # noqa: N802 - http.server's name
        type(self).requests_seen.append(self.path)
        self.send_response(200)
        try:
            if self.mode == "flood":
                self.end_headers()
                block = os.urandom(1 << 16)
                for _ in range(4096):
                    self.wfile.write(block)
            else:
                self.send_header("Content-Length", str(CHUNK))
                self.end_headers()
                for _ in range(CHUNK):
                    self.wfile.write(b"x")
                    self.wfile.flush()
                    time.sleep(0.2)
            type(self).hung_up.append(False)
        except OSError:  # the fetcher hung up: what it should do
            type(self).hung_up.append(True)

    def log_message(self, *args) -> None:  # noqa: ANN002
        pass


@pytest.mark.parametrize("mode", ["flood", "trickle"])
def test_a_hostile_peer_is_cut_off_and_the_chunk_comes_from_the_next_source(
    buckets, valkey, tmp_path: Path, mode: str
) -> None:
    cfg, tiers, src, m = _published(buckets, tmp_path, n_chunks=12)
    bus = _bus(valkey, f"hostile-{mode}-{tmp_path.name}")
    handler = type("Handler", (_Hostile,), {"mode": mode, "requests_seen": [], "hung_up": []})
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_address[1]}"
    # it claims every chunk of the version
    bus.r.hset(bus.key("fanout:peers"), "hostile", url)
    bus.r.set(bus.key("fanout:alive:hostile"), url)
    n = len(chunk_plan(m))
    book = Book(bus, "hostile")
    book.announce(1, m.sha256(), range(n))
    book.flush()
    swarm = Swarm(
        bus, "rollout-0", cfg, limits=fh.Limits(min_rate_bps=1e12, slack_s=1.0, read_s=0.5)
    )
    swarm.serve()
    try:
        t0 = time.monotonic()
        path, source = tiers.fetch(1, tmp_path / "n0", expect_sha256=m.sha256(), swarm=swarm)
        took = time.monotonic() - t0
        _same(path, src, m)
        what = "refused" if mode == "flood" else "slow"
        # each of the fetch's threads may have asked it once before it was dropped; never again
        assert 1 <= swarm.counts[what] == len(handler.requests_seen) <= swarm.workers
        assert swarm.counts["cache"] == n and swarm.counts["peer"] == 0
        assert int(bus.counters().get(f"fanout_chunks_{what}", 0)) == swarm.counts[what]
        assert took < 10  # the trickle would take 4096 x 0.2 s = 14 min per chunk
        deadline = time.monotonic() + 10  # the handlers notice the hang-up at their next write
        while len(handler.hung_up) < len(handler.requests_seen) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert handler.hung_up == [True] * len(handler.requests_seen)  # never read to the end
    finally:
        swarm.stop()
        server.shutdown()
        server.server_close()


def test_a_saturated_chunk_server_answers_503_and_is_asked_again(
    buckets, valkey, tmp_path: Path
) -> None:
    cfg, tiers, src, m = _published(buckets, tmp_path, n_chunks=6)
    bus = _bus(valkey, f"busy-{tmp_path.name}")
    busy = Swarm(bus, "rollout-0", cfg, max_serving=0)  # every chunk request finds it saturated
    other = Swarm(bus, "rollout-1", cfg)
    for s in (busy, other):
        s.serve()
    try:
        tiers.fetch(1, tmp_path / "n0", expect_sha256=m.sha256(), swarm=busy)
        r = requests.get(
            f"{busy.url}/chunk/1/{m.sha256()}/0",
            headers={"Authorization": f"Bearer {busy.token}"},
            timeout=5,
        )
        assert r.status_code == 503
        path, source = tiers.fetch(1, tmp_path / "n1", expect_sha256=m.sha256(), swarm=other)
        _same(path, src, m)
        n = len(chunk_plan(m))
        # asked for every chunk (never dropped as refused or gone), and each came from the tiers
        assert busy.app.refused_busy == n + 1 and other.counts["cache"] == n
        assert other.counts["refused"] == other.counts["slow"] == 0
    finally:
        for s in (busy, other):
            s.stop()


def test_a_reader_that_hangs_up_or_stops_reading_frees_its_serving_slot(
    valkey, tmp_path: Path
) -> None:
    import socket

    from moerl.store.manifest import FileEntry, hash_file

    copy = tmp_path / "copy"
    copy.mkdir()
    big = copy / "model.bin"
    with open(big, "wb") as f:  # one 64 MiB chunk: far more than the sockets between us buffer
        f.truncate(64 << 20)
    size, whole, chunks = hash_file(big, 64 << 20)
    m = Manifest(
        7, (FileEntry("model.bin", size, whole, chunks),), "2026-12-06T00:00:00Z", {}, 64 << 20
    )
    bus = _bus(valkey, f"slot-{tmp_path.name}")
    swarm = Swarm(
        bus,
        "rollout-0",
        _cfg_local(tmp_path),
        max_serving=1,
        limits=fh.Limits(min_rate_bps=1e12, slack_s=30.0, read_s=0.5),
    )
    swarm.serve()
    swarm.offer(7, copy, m)
    host, port = swarm.url.removeprefix("http://").split(":")
    request = (
        f"GET /chunk/7/{m.sha256()}/0 HTTP/1.1\r\nHost: x\r\n"
        f"Authorization: Bearer {swarm.token}\r\n\r\n"
    ).encode()

    def reader() -> socket.socket:
        s = socket.socket()
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        s.connect((host, int(port)))
        s.sendall(request)
        assert s.recv(1024).startswith(b"HTTP/1.1 200")
        return s

    def until(cond, timeout: float = 5.0) -> bool:  # noqa: ANN001
        deadline = time.monotonic() + timeout
        while not cond() and time.monotonic() < deadline:
            time.sleep(0.02)
        return cond()

    try:
        s = reader()  # takes the only slot ...
        assert until(lambda: swarm.app.serving == 1)
        s.close()  # ... and hangs up mid-chunk: the slot is free long before the 30 s deadline
        assert until(lambda: swarm.app.serving == 0, 3.0) and swarm.app.stalled == 0
        swarm.app.limits = fh.Limits(min_rate_bps=1e12, slack_s=1.0)
        s = reader()  # takes it and stops reading: the server gives up at the chunk's deadline
        try:
            assert until(lambda: swarm.app.serving == 0, 5.0) and swarm.app.stalled == 1
        finally:
            s.close()
        r = requests.get(
            f"{swarm.url}/chunk/7/{m.sha256()}/0",
            headers={"Authorization": f"Bearer {swarm.token}"},
            timeout=30,
        )
        assert r.status_code == 200 and len(r.content) == 64 << 20 and swarm.app.refused_busy == 0
    finally:
        swarm.stop()


def _cfg_local(tmp: Path) -> CheckpointConfig:
    return CheckpointConfig(
        uri=str(tmp / "durable"), cache_dir=str(tmp / "node"), chunk_mb=64, fanout=True
    )


def test_a_failed_fetch_withdraws_what_it_announced(buckets, valkey, tmp_path: Path) -> None:
    from moerl.errors import CheckpointError

    cfg, tiers, src, m = _published(buckets, tmp_path, n_chunks=300)
    plan = chunk_plan(m)
    # after >= 256 good ones
    bad = max(i for i, c in enumerate(plan) if c[0] == "model.safetensors")
    assert bad >= 290
    _, start, length, _ = plan[bad]
    body = bytearray((src / "model.safetensors").read_bytes())
    body[start : start + length] = bytes(x ^ 0xFF for x in body[start : start + length])
    # no source serves that chunk intact
    for bucket, store in (("fan-cache", tiers.cache), ("fan-durable", tiers.durable)):
        assert store is not None
        buckets.client().put_object(
            Bucket=bucket,
            Key=f"{tmp_path.name}/runs/r1/{file_key(store, 1, 'model.safetensors')}",
            Body=bytes(body),
        )
    bus = _bus(valkey, f"withdraw-{tmp_path.name}")
    swarm = Swarm(bus, "rollout-0", cfg)
    swarm.serve()
    try:
        # (Tiers.fetch would go on
        with pytest.raises(CheckpointError, match="no source serves it intact"):
            swarm.fetch(tiers, 1, tmp_path / "n0", expect_sha256=m.sha256())  # to whole files)
        # its bitmap had been announced (256 chunks force a flush) ...
        assert swarm.book.flushes >= 1
        assert not bus.r.exists(swarm.book.key(1, m.sha256(), "rollout-0"))  # ... and is withdrawn
        assert (1, m.sha256()) not in swarm.copies and swarm.locate(1, m.sha256(), 0) is None
        assert not list((tmp_path / "n0").glob(".tmp-*"))
    finally:
        swarm.stop()
    # stop's last flush did not revive it
    assert not bus.r.exists(swarm.book.key(1, m.sha256(), "rollout-0"))


def test_announcements_are_batched_and_a_look_is_one_round_trip(valkey, tmp_path: Path) -> None:
    bus = _bus(valkey, f"book-{tmp_path.name}")
    now = [100.0]
    books = [Book(bus, f"p{i}", clock=lambda: now[0]) for i in range(5)]
    for i, b in enumerate(books):
        b.announce(3, "sha", [i, 10 + i])
        b.count("cache", 2)
    assert not books[0].due() and not bus.r.exists(books[0].key(3, "sha", "p0"))  # held back
    now[0] += 0.3
    for b in books:
        b.flush_if_due()
    assert int(bus.counters()["fanout_chunks_cache"]) == 10
    # SETBIT's numbering
    assert bus.r.execute_command("GETBIT", books[2].key(3, "sha", "p2"), 12) == 1
    admin = valkey_admin(valkey)
    c0 = admin.info("stats")["total_commands_processed"]
    look = Holders(books[0], 3, "sha", [f"p{i}" for i in range(1, 5)])
    assert look.of(12) == ["p2"] and look.of(11) == ["p1"] and look.of(0) == []
    # one GET per peer, and this INFO
    assert admin.info("stats")["total_commands_processed"] - c0 == 4 + 1
    # a peer's new chunk is seen at the next look, REFRESH_S later, not before
    books[3].announce(3, "sha", [0])
    books[3].flush()
    assert look.of(0) == []
    now[0] += REFRESH_S
    assert look.of(0) == ["p3"] and look.refreshes == 2
    look.bad.add("p3")
    assert look.of(0) == []
    books[3].withdraw(3, "sha")
    assert not bus.r.exists(books[3].key(3, "sha", "p3"))
    assert has_bit(b"\x80", 0) and not has_bit(b"\x80", 1) and not has_bit(b"", 7)


def valkey_admin(valkey):
    import valkey as vk

    return vk.Valkey.from_url(valkey.url)


def test_chunk_mb_is_capped() -> None:
    assert MAX_CHUNK_MB == 256 and CheckpointConfig(uri="/tmp/x", chunk_mb=256).chunk_mb == 256
    for bad in (0, 257, 4096):
        with pytest.raises(ConfigError, match=r"checkpoint\.chunk_mb: .*allowed: 1 to 256"):
            parse_config({"checkpoint": {"uri": "/tmp/x", "chunk_mb": bad}})


def _fanout_policy() -> dict:
    docs = [
        d for d in yaml.safe_load_all((MANIFESTS / "base" / "ckpt-cache.yaml").read_text()) if d
    ]
    (pol,) = [
        d
        for d in docs
        if d["kind"] == "NetworkPolicy" and d["metadata"]["name"] == "moerl-rollout-fanout"
    ]
    return pol


def test_launched_rollout_pods_match_the_fanout_network_policy() -> None:
    from moerl.launch import objects

    pol = _fanout_policy()
    selects = pol["spec"]["podSelector"]["matchLabels"]
    (rule,) = pol["spec"]["ingress"]
    admits = [p["podSelector"]["matchLabels"] for p in rule["from"]]
    cfg = parse_config(
        {
            "checkpoint": {"uri": "s3://moerl-ckpt/prod", "fanout": True},
            "pipeline": {"base_image": "registry.example/moerl:1", "mode": "async"},
            "cluster": {"launch": {"mode": "kubernetes", "rollout_nodes_per_worker": 2}},
        }
    )
    pod = objects.rollout_pod(cfg, "run1", "rollout-0", ["true"], [])
    group = objects.rollout_group(cfg, "run1", "rollout-1", ["true"], [])
    pod_labels = [pod["metadata"]["labels"]] + [
        j["template"]["spec"]["template"]["metadata"]["labels"]
        for j in group["spec"]["replicatedJobs"]
    ]
    for labels in pod_labels:
        assert selects.items() <= labels.items()  # served by the policy ...
        assert any(a.items() <= labels.items() for a in admits)  # ... and admitted to its peers
    # the trainer's pods are not rollout pods: the policy keeps them off the chunk servers
    tj = objects.trainjob(cfg, "run1", "moerl-policy-update-x", ["true"], [])
    tpod = tj["spec"]["runtimePatches"][0]["trainingRuntimeSpec"]["template"]["spec"][
        "replicatedJobs"
    ][0]["template"]["spec"]["template"]["metadata"]["labels"]
    assert not selects.items() <= tpod.items()


def test_a_copy_the_node_cache_pruned_is_forgotten_and_withdrawn(
    buckets, valkey, tmp_path: Path
) -> None:
    """Bounded state: a peer forgets (and stops announcing) a version its node cache pruned,
    at its next offer; before, `Swarm.copies` kept every version of the run."""
    import shutil

    from moerl.store.nodecache import prune_cache

    cfg, tiers, _, m = _published(buckets, tmp_path)
    bus = _bus(valkey, f"fan-{tmp_path.name}")
    swarm = Swarm(bus, "rollout-0", cfg)
    swarm.serve()
    try:
        final, _ = tiers.fetch(1, tmp_path / "n0", expect_sha256=m.sha256(), swarm=swarm)
        key = swarm.book.key(1, m.sha256(), "rollout-0")
        assert (1, m.sha256()) in swarm.copies and bus.r.exists(key)
        shutil.copytree(final, tmp_path / "n0" / "v000002")  # a newer copy, so version 1 is pruned
        assert prune_cache(tmp_path / "n0", keep=1) == [1]
        assert swarm.forget_pruned() == [(1, m.sha256())]
        assert swarm.copies == {} and not bus.r.exists(key)
        assert swarm.locate(1, m.sha256(), 0) is None
    finally:
        swarm.stop()
