"""Fault tests for moerl.store.base against a real S3 server (weed mini) and a local folder.

Killed uploads, unreachable or vanishing endpoints, truncated objects, wrong bucket or prefix,
retention with pins, and two processes fetching into one cache. Nothing here mocks S3; where a
test needs a failure at an exact step it breaks the store's own step, or the network.
"""

from __future__ import annotations

import hashlib
import json
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import pytest

from moerl.config import CheckpointConfig
from moerl.errors import CheckpointError
from moerl.store.folder import LocalStore
from moerl.store.runs import open_store
from tests.store.test_store import Case, _s3_case, case, make_checkpoint, tree  # noqa: F401 (case: a fixture)
from tests.support.objects import file_key, files_prefix
from tests.support.s3server import S3Server

# A child process that publishes or fetches with its own store.
# - publish, with copy_delay_s: local copies go 1 MiB at a time with a pause after each, so that the
#   parent can kill the child mid-copy reliably (an unthrottled 100 MB copy takes ~0.1 s here).
# - fetch: counts the GETs of data files (not manifest.json) with a boto3 event hook and slows each
#   one down, so that a second fetcher that did not wait for the first would overlap it.
_CHILD = r"""
import json, shutil, sys, time
from pathlib import Path
from moerl.config import CheckpointConfig
from moerl.store.runs import open_store
a = json.loads(sys.argv[1])
store = open_store(CheckpointConfig(**a["cfg"]))
if a["op"] == "publish":
    if a.get("copy_delay_s"):
        def slow_copyfile(src, dst, *args, **kwargs):
            with open(src, "rb") as fi, open(dst, "wb") as fo:
                while chunk := fi.read(1 << 20):
                    fo.write(chunk)
                    fo.flush()
                    time.sleep(a["copy_delay_s"])
            return dst
        shutil.copyfile = slow_copyfile
    store.publish(a["version"], Path(a["src"]))
else:
    gets = []
    def on_get(params, **kwargs):
        if not params["Key"].endswith("/manifest.json"):
            gets.append(params["Key"])
            time.sleep(a["get_delay_s"])
    store._s3.meta.events.register("before-parameter-build.s3.GetObject", on_get)
    Path(a["ready"]).touch()
    while not Path(a["go"]).exists():
        time.sleep(0.002)
    out = store.fetch(a["version"], Path(a["dest"]))
    print(json.dumps({"path": str(out), "gets": gets}))
"""


def _child(args: dict) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-c", _CHILD, json.dumps(args)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=Path(__file__).parents[2],
    )


def _wait_for(cond, timeout_s: float, what: str, proc: subprocess.Popen[str] | None = None) -> None:  # noqa: ANN001
    deadline = time.monotonic() + timeout_s
    while not cond():
        if proc is not None and proc.poll() is not None:
            pytest.fail(
                f"child exited ({proc.returncode}) before {what}: {proc.stderr.read()[-2000:]}"
            )
        if time.monotonic() > deadline:
            pytest.fail(f"timed out waiting for {what}")
        time.sleep(0.002)


def _kill(proc: subprocess.Popen[str]) -> None:
    assert proc.poll() is None, "the child finished before it was killed: the test proved nothing"
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=10)
    assert proc.returncode == -signal.SIGKILL


def _s3_cfg(
    server: S3Server, bucket: str, prefix: str = "runs/r1", **kw: object
) -> CheckpointConfig:
    return CheckpointConfig(
        uri=f"s3://{bucket}/{prefix}", endpoint_url=server.endpoint_url, region="us-east-1", **kw
    )


def _new_bucket(server: S3Server) -> str:
    bucket = f"moerl-fault-{uuid.uuid4().hex[:12]}"
    server.client().create_bucket(Bucket=bucket)
    return bucket


def test_s3_upload_killed_midway_leaves_latest_and_can_be_redone(
    s3_server: S3Server, tmp_path: Path
) -> None:
    s3, bucket = s3_server.client(), _new_bucket(s3_server)
    cfg = _s3_cfg(s3_server, bucket, multipart_chunk_mb=5, max_concurrency=1)
    store = open_store(cfg)
    v1 = make_checkpoint(tmp_path / "v1", seed=1)
    store.publish(1, v1)
    v2 = make_checkpoint(tmp_path / "v2", seed=2, big_mib=60)  # 13 parts of 5 MiB, one at a time
    child = _child({"op": "publish", "cfg": cfg.model_dump(), "version": 2, "src": str(v2)})

    def parts_uploaded() -> bool:  # at least one part of big.bin is stored: the upload is under way
        ups = s3.list_multipart_uploads(Bucket=bucket, Prefix="runs/r1/").get("Uploads", [])
        return any(
            s3.list_parts(Bucket=bucket, Key=u["Key"], UploadId=u["UploadId"]).get("Parts")
            for u in ups
        )

    _wait_for(parts_uploaded, 60, "the first uploaded part", child)
    _kill(child)
    ups = s3.list_multipart_uploads(Bucket=bucket, Prefix="runs/r1/").get("Uploads", [])
    # killed mid-upload, not after: big.bin, under this publish's own object folder
    assert len(ups) == 1 and re.fullmatch(
        r"runs/r1/versions/v000002/[0-9a-z]+/big\.bin", ups[0]["Key"]
    ), [u["Key"] for u in ups]
    fresh = open_store(cfg)
    assert fresh.latest() == 1 and fresh.versions() == [1]
    with pytest.raises(CheckpointError, match="version 2 not found"):
        fresh.fetch(2, tmp_path / "cache")
    assert tree(fresh.fetch(1, tmp_path / "cache")).items() >= tree(v1).items()
    fresh.publish(2, v2)
    assert fresh.latest() == 2 and fresh.versions() == [1, 2]
    got = tree(fresh.fetch(2, tmp_path / "cache"))
    assert (
        hashlib.sha256(got["big.bin"]).digest()
        == hashlib.sha256((v2 / "big.bin").read_bytes()).digest()
    )


def test_local_publish_killed_midway_leaves_latest(tmp_path: Path) -> None:
    root, cfg = tmp_path / "store", CheckpointConfig(uri=str(tmp_path / "store"))
    store = LocalStore(root)
    v1 = make_checkpoint(tmp_path / "v1", seed=1)
    store.publish(1, v1)
    v2 = make_checkpoint(tmp_path / "v2", seed=2, big_mib=64)
    child = _child(
        {
            "op": "publish",
            "cfg": cfg.model_dump(),
            "version": 2,
            "src": str(v2),
            "copy_delay_s": 0.02,
        }
    )

    def copying() -> bool:  # big.bin sorts first; bytes in its staged copy: the copy is under way
        return any(p.stat().st_size > 0 for p in (root / "versions").glob(".tmp-v000002-*/big.bin"))

    _wait_for(copying, 60, "the copy of big.bin", child)
    _kill(child)
    staged = next((root / "versions").glob(".tmp-v000002-*/big.bin"))
    assert 0 < staged.stat().st_size < (v2 / "big.bin").stat().st_size  # killed mid-copy
    names = sorted(p.name for p in (root / "versions").iterdir())  # "." sorts before "v"
    assert len(names) == 2 and names[0].startswith(".tmp-v000002-") and names[1] == "v000001"
    fresh = LocalStore(root)
    assert fresh.latest() == 1 and fresh.versions() == [1]
    assert tree(fresh.fetch(1, tmp_path / "cache")).items() >= tree(v1).items()
    fresh.publish(2, v2)
    assert fresh.latest() == 2 and fresh.versions() == [1, 2]
    assert fresh.apply_retention(keep_last=5, keep_every=0) == []
    # leftover gone
    assert sorted(p.name for p in (root / "versions").iterdir()) == [
        "v000001",
        "v000002",
    ]


def test_unreachable_endpoint_retries_then_fails_cleanly(
    s3_server: S3Server, tmp_path: Path
) -> None:
    with socket.socket() as s:  # a loopback port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    store = open_store(
        CheckpointConfig(uri="s3://b/p", endpoint_url=f"http://127.0.0.1:{port}", max_attempts=3)
    )
    sends: list[str] = []
    store._s3.meta.events.register("before-send.s3", lambda **kw: sends.append(kw["request"].url))
    src = make_checkpoint(tmp_path / "src")
    before = tree(src)
    t0 = time.monotonic()
    with pytest.raises(
        CheckpointError,
        match=rf"cannot reach S3 endpoint http://127.0.0.1:{port} after 3 attempts "
        r"while reading latest.json",
    ):
        store.publish(1, src)
    assert time.monotonic() - t0 < 30
    assert len(sends) == 3  # really retried: three HTTP attempts, then the error
    assert tree(src) == before and sorted(p.name for p in tmp_path.iterdir()) == ["src"]


class _CuttingProxy:
    """A loopback TCP proxy that cuts every connection, and stops listening, after `budget` bytes upstream."""

    def __init__(self, upstream: tuple[str, int], budget: int) -> None:
        self.upstream, self.budget, self.sent, self.cut = upstream, budget, 0, threading.Event()
        self._lock, self._socks = threading.Lock(), []
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port = self._listener.getsockname()[1]
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while not self.cut.is_set():
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            server = socket.create_connection(self.upstream)
            with self._lock:
                self._socks += [client, server]
            threading.Thread(target=self._pump, args=(client, server, True), daemon=True).start()
            threading.Thread(target=self._pump, args=(server, client, False), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket, upstream: bool) -> None:
        try:
            while data := src.recv(65536):
                dst.sendall(data)
                if upstream:
                    with self._lock:
                        self.sent += len(data)
                    if self.sent > self.budget:
                        self.close()
        except OSError:
            pass

    def close(self) -> None:
        self.cut.set()
        with self._lock:
            socks, self._socks = [self._listener, *self._socks], []
        for s in socks:
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            s.close()


def test_endpoint_lost_mid_publish_publishes_nothing(s3_server: S3Server, tmp_path: Path) -> None:
    bucket = _new_bucket(s3_server)
    direct = open_store(_s3_cfg(s3_server, bucket))
    direct.publish(1, make_checkpoint(tmp_path / "v1", seed=1))
    port = int(s3_server.endpoint_url.rsplit(":", 1)[1])
    # dies during the third 5 MiB part
    proxy = _CuttingProxy(("127.0.0.1", port), budget=12 * 1024 * 1024)
    try:
        cfg = _s3_cfg(s3_server, bucket, multipart_chunk_mb=5, max_concurrency=1, max_attempts=3)
        via_proxy = open_store(
            cfg.model_copy(update={"endpoint_url": f"http://127.0.0.1:{proxy.port}"})
        )
        t0 = time.monotonic()
        with pytest.raises(CheckpointError, match=r"after 3 attempts while uploading big.bin"):
            via_proxy.publish(2, make_checkpoint(tmp_path / "v2", seed=2, big_mib=30))
        assert proxy.cut.is_set() and time.monotonic() - t0 < 30
    finally:
        proxy.close()
    assert direct.latest() == 1 and direct.versions() == [1]
    assert direct._read_text("versions/v000002/manifest.json") is None


def test_truncated_object_refused_at_fetch(case: Case, tmp_path: Path) -> None:  # noqa: F811
    src = make_checkpoint(tmp_path / "src", big_mib=11)
    m = case.store.publish(1, src)
    entry = next(f for f in m.files if f.path == "big.bin")
    half = (src / "big.bin").read_bytes()[: entry.size // 2]
    case.put_raw(file_key(case.store, 1, "big.bin"), half)
    with pytest.raises(CheckpointError) as err:
        case.store.fetch(1, tmp_path / "cache")
    msg = str(err.value)
    assert "big.bin" in msg and "version 1" in msg
    assert f"expected sha256 {entry.sha256} ({entry.size} bytes)" in msg
    assert f"got sha256 {hashlib.sha256(half).hexdigest()} ({len(half)} bytes)" in msg
    assert not (tmp_path / "cache" / "v000001").exists()


def test_missing_bucket_and_wrong_prefix(s3_server: S3Server, tmp_path: Path) -> None:
    missing = open_store(_s3_cfg(s3_server, "moerl-fault-no-such-bucket"))
    with pytest.raises(
        CheckpointError, match="bucket 'moerl-fault-no-such-bucket' does not exist at http://127"
    ):
        missing.check_access()
    with pytest.raises(CheckpointError, match="moerl-fault-no-such-bucket"):
        missing.require_lineage()
    bucket = _new_bucket(s3_server)
    right = open_store(_s3_cfg(s3_server, bucket, prefix="runs/r1"))
    right.publish(4, make_checkpoint(tmp_path / "src"))
    assert right.require_lineage() == 4
    wrong = open_store(_s3_cfg(s3_server, bucket, prefix="runs/r2"))
    wrong.check_access()  # the bucket is fine; only the lineage is missing
    with pytest.raises(
        CheckpointError, match=f"no published versions under s3://{bucket}/runs/r2; check"
    ):
        wrong.require_lineage()


def test_retention_keeps_last_every_latest_and_pinned(case: Case, tmp_path: Path) -> None:  # noqa: F811
    """keep_last=2, keep_every=3, version 4 pinned by a live run, versions 1..7 (no 0):
    kept = newest two {6, 7} | multiples of 3 {3, 6} | latest {7} | pinned {4} = {3, 4, 6, 7}."""
    store, src = case.store, make_checkpoint(tmp_path / "src")
    for v in range(1, 8):
        store.publish(v, src, retention=(2, 3))
        if v == 4:
            store.pin(4, "engine-0")  # a rollout engine serves version 4
    assert store.versions() == [3, 4, 6, 7] and store.latest() == 7 and store.pinned() == {4}
    for gone in (1, 2, 5):
        with pytest.raises(CheckpointError, match=f"version {gone} not found"):
            store.fetch(gone, tmp_path / "cache")
        assert store._list(f"versions/v{gone:06d}/") == []  # no objects left behind
    assert store.apply_retention(2, 3, pinned={3}) == []  # a pin passed by the caller counts too
    store.unpin(4, "engine-0")
    assert store.pinned() == set() and store.apply_retention(2, 3) == [4]
    assert store.versions() == [3, 6, 7]
    assert "config.json" in tree(store.fetch(7, tmp_path / "cache"))


def test_retention_half_deleted_version_is_never_listed(
    case: Case,
    tmp_path: Path,  # noqa: F811
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    store, src = case.store, make_checkpoint(tmp_path / "src")
    for v in (1, 2, 3):
        store.publish(v, src)

    def crash(stage: str) -> None:  # the deleter dies after the manifest went, before the files
        raise CheckpointError(f"simulated crash deleting {stage}")

    monkeypatch.setattr(store, "_delete_stage", crash)
    with pytest.raises(CheckpointError, match="version 1: simulated crash"):
        store.apply_retention(keep_last=2, keep_every=0)
    assert store.versions() == [2, 3]
    assert store._list("versions/v000001/") != []  # its files are still there ...
    with pytest.raises(CheckpointError, match="version 1 not found"):  # ... but it is not a version
        store.fetch(1, tmp_path / "cache")
    monkeypatch.undo()
    assert store.apply_retention(keep_last=2, keep_every=0) == []  # nothing complete to delete ...
    assert store._list("versions/v000001/") == []  # ... but the leftover below latest is cleaned


def test_retention_failure_never_fails_publish(
    case: Case,
    tmp_path: Path,  # noqa: F811
    caplog: pytest.LogCaptureFixture,
) -> None:
    store, src = case.store, make_checkpoint(tmp_path / "src")
    store.publish(1, src)
    case.put_raw("pins/broken.json", b"not json")  # an unreadable pin: retention must not guess
    with caplog.at_level("WARNING", logger="moerl.store.base"):
        store.publish(2, src, retention=(1, 0))
    assert store.latest() == 2 and store.versions() == [1, 2]
    assert (
        "retention after publishing version 2" in caplog.text
        and "malformed pin pins/broken.json" in caplog.text
    )


def test_two_processes_fetch_one_version_download_once(s3_server: S3Server, tmp_path: Path) -> None:
    bucket = _new_bucket(s3_server)
    cfg = _s3_cfg(s3_server, bucket, max_concurrency=1)
    src = make_checkpoint(tmp_path / "src")
    published = open_store(cfg).publish(1, src)
    cache, n = tmp_path / "cache", 2
    args = [
        {
            "op": "fetch",
            "cfg": cfg.model_dump(),
            "version": 1,
            "dest": str(cache),
            "get_delay_s": 0.3,
            "ready": str(tmp_path / f"ready{i}"),
            "go": str(tmp_path / "go"),
        }
        for i in range(n)
    ]
    children = [_child(a) for a in args]
    try:
        for i, c in enumerate(children):
            _wait_for(lambda i=i: (tmp_path / f"ready{i}").exists(), 60, f"child {i} to start", c)
        (tmp_path / "go").touch()  # both fetch from here on
        outs = [c.communicate(timeout=60) for c in children]
    finally:
        for c in children:
            if c.poll() is None:
                c.kill()
    assert [c.returncode for c in children] == [0] * n, [err[-2000:] for _, err in outs]
    results = [json.loads(out) for out, _ in outs]
    assert {r["path"] for r in results} == {str(cache / "v000001")}
    got = tree(cache / "v000001")
    assert {k: v for k, v in got.items() if k in tree(src)} == tree(
        src
    ) and ".moerl-verified" in got
    gets = sorted(k for r in results for k in r["gets"])
    want = sorted(f"runs/r1/{files_prefix(published)}{p}" for p in tree(src))
    assert gets == want, f"each file must be downloaded exactly once in total, got {gets}"
    assert sorted(len(r["gets"]) for r in results) == [0, len(want)]  # one process did all the work
    assert (cache / ".v000001.lock").exists() and not list(cache.glob(".tmp-*"))
