"""Contract tests for moerl.store.base, run against a local folder and a real S3 server (weed mini)."""

from __future__ import annotations

import hashlib
import json
import os
import socket
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest

from moerl.config import CheckpointConfig
from moerl.errors import CheckpointError
from moerl.store.base import (
    MANIFEST,
    CheckpointStore,
    FileEntry,
    HashingWriter,
    Manifest,
    copy_hashed,
    sha256_file,
)
from moerl.store.folder import LocalStore
from moerl.store.runs import open_store
from moerl.store.s3 import S3Store
from tests.support.objects import file_key
from tests.support.s3server import S3Server


@dataclass
class Case:
    """A store plus raw access to its objects, keyed relative to the store root."""

    store: CheckpointStore
    put_raw: Callable[[str, bytes], None]
    delete_raw: Callable[[str], None]
    etag: Callable[[str], str] | None = None  # S3 only


def _local_case(root: Path) -> Case:
    def put_raw(key: str, data: bytes) -> None:
        (root / key).parent.mkdir(parents=True, exist_ok=True)
        (root / key).write_bytes(data)

    return Case(LocalStore(root), put_raw, lambda key: (root / key).unlink())


def _s3_case(server: S3Server) -> Case:
    s3, bucket, prefix = server.client(), f"moerl-test-{uuid.uuid4().hex[:12]}", "runs/r1"
    s3.create_bucket(Bucket=bucket)
    cfg = CheckpointConfig(
        uri=f"s3://{bucket}/{prefix}",
        endpoint_url=server.endpoint_url,
        region="us-east-1",
        multipart_chunk_mb=5,
        max_concurrency=4,
    )
    return Case(
        open_store(cfg),
        lambda key, data: s3.put_object(Bucket=bucket, Key=f"{prefix}/{key}", Body=data),
        lambda key: s3.delete_object(Bucket=bucket, Key=f"{prefix}/{key}"),
        lambda key: s3.head_object(Bucket=bucket, Key=f"{prefix}/{key}")["ETag"],
    )


@pytest.fixture(params=["local", "s3"])
def case(request: pytest.FixtureRequest, tmp_path: Path) -> Case:
    if request.param == "local":
        return _local_case(tmp_path / "store")
    return _s3_case(request.getfixturevalue("s3_server"))


def make_checkpoint(d: Path, seed: int = 0, big_mib: int = 0) -> Path:
    """A fake HF checkpoint folder; `big_mib` adds a file large enough for multipart uploads."""
    d.mkdir(parents=True)
    (d / "config.json").write_text(json.dumps({"seed": seed, "model_type": "mixtral"}))
    (d / "model.safetensors").write_bytes(os.urandom(4096) + bytes([seed]))
    (d / "tokenizer" / "nested").mkdir(parents=True)
    (d / "tokenizer" / "nested" / "tokenizer.json").write_text(f'{{"v": {seed}}}')
    if big_mib:
        (d / "big.bin").write_bytes(os.urandom(big_mib * 1024 * 1024 + 123))
    return d


def tree(d: Path) -> dict[str, bytes]:
    return {
        p.relative_to(d).as_posix(): p.read_bytes() for p in sorted(d.rglob("*")) if p.is_file()
    }


def test_publish_fetch_roundtrip(case: Case, tmp_path: Path) -> None:
    src = make_checkpoint(tmp_path / "src", big_mib=11)  # > 2 chunks of 5 MiB: multipart on S3
    m = case.store.publish(1, src, meta={"git_sha": "abc123"})
    assert [f.path for f in m.files] == [
        "big.bin",
        "config.json",
        "model.safetensors",
        "tokenizer/nested/tokenizer.json",
    ]
    assert case.store.latest() == 1 and case.store.versions() == [1]
    assert case.store.manifest(1) == m and m.meta == {"git_sha": "abc123"}
    out = case.store.fetch(1, tmp_path / "cache")
    assert out == tmp_path / "cache" / "v000001"
    got = tree(out)
    assert Manifest.from_json(got.pop(MANIFEST).decode()) == m
    assert got.pop(".moerl-verified").decode() == m.sha256()
    assert got == tree(src)
    assert not [p for p in (tmp_path / "cache").iterdir() if p.name.startswith(".tmp-")]
    # on S3 each publish stores its files under its own object folder, which the manifest names
    assert bool(m.objects) == isinstance(case.store, S3Store)
    if case.etag:  # a multipart ETag ends in -<parts>: the 5 MiB chunk size reached boto3
        assert case.etag(file_key(case.store, 1, "big.bin")).strip('"').endswith("-3")


def test_latest_moves_only_on_success(case: Case, tmp_path: Path) -> None:
    assert case.store.latest() is None
    case.store.publish(1, make_checkpoint(tmp_path / "a", seed=1))
    bad = make_checkpoint(tmp_path / "b", seed=2)
    # Reading /proc/self/mem at offset 0 fails with EIO: a source file that breaks mid-publish.
    # It sorts last, so the other files are copied before it fails.
    (bad / "zz-broken.bin").symlink_to("/proc/self/mem")
    with pytest.raises(CheckpointError, match="zz-broken.bin"):
        case.store.publish(2, bad)
    assert case.store.latest() == 1
    assert case.store.versions() == [1]
    with pytest.raises(CheckpointError, match="version 2 not found"):
        case.store.manifest(2)
    if isinstance(case.store, LocalStore):
        assert sorted(p.name for p in (case.store.root / "versions").iterdir()) == ["v000001"]
    (bad / "zz-broken.bin").unlink()  # a retry of the same version succeeds over the debris
    case.store.publish(2, bad)
    assert case.store.latest() == 2
    fetched = case.store.fetch(2, tmp_path / "cache")
    assert (fetched / "model.safetensors").read_bytes() == (bad / "model.safetensors").read_bytes()


def test_duplicate_or_non_increasing_version_refused(case: Case, tmp_path: Path) -> None:
    src = make_checkpoint(tmp_path / "src")
    case.store.publish(1, src)
    case.store.publish(3, src)
    with pytest.raises(CheckpointError, match="version 3 already exists"):
        case.store.publish(3, src)
    with pytest.raises(CheckpointError, match="version 2 is not greater than latest version 3"):
        case.store.publish(2, src)
    assert case.store.latest() == 3 and case.store.versions() == [1, 3]


def test_versions_lists_complete_versions_only(case: Case, tmp_path: Path) -> None:
    case.store.publish(1, make_checkpoint(tmp_path / "a"))
    case.store.publish(2, make_checkpoint(tmp_path / "b"))
    case.put_raw("versions/v000003/model.safetensors", b"partial")  # no manifest
    case.put_raw("versions/.tmp-v000004-deadbeef/manifest.json", b"{}")  # a staging dir
    case.put_raw("versions/notaversion/manifest.json", b"{}")
    assert case.store.versions() == [1, 2]
    with pytest.raises(CheckpointError, match="version 3 not found"):
        case.store.fetch(3, tmp_path / "cache")
    case.store.publish(3, make_checkpoint(tmp_path / "c"))  # the incomplete one is replaced
    assert case.store.versions() == [1, 2, 3]
    assert "model.safetensors" in tree(case.store.fetch(3, tmp_path / "cache"))


@pytest.mark.parametrize("same_size", [True, False])
def test_corrupt_object_refused_at_fetch(case: Case, tmp_path: Path, same_size: bool) -> None:
    src = make_checkpoint(tmp_path / "src")
    m = case.store.publish(1, src)
    entry = next(f for f in m.files if f.path == "model.safetensors")
    bad = os.urandom(entry.size if same_size else entry.size + 7)
    case.put_raw(file_key(case.store, 1, "model.safetensors"), bad)
    actual = hashlib.sha256(bad).hexdigest()
    with pytest.raises(CheckpointError) as err:
        case.store.fetch(1, tmp_path / "cache")
    msg = str(err.value)
    assert "model.safetensors" in msg and entry.sha256 in msg and actual in msg
    assert not (tmp_path / "cache" / "v000001").exists()
    assert not list((tmp_path / "cache").glob(".tmp-*"))


def test_streaming_fetch_refuses_a_corrupt_multipart_object_and_never_shows_it(
    case: Case, tmp_path: Path
) -> None:
    """One flipped byte deep inside a multipart-sized object (right size, wrong bytes): the sha256
    computed while the parts stream in (concurrent ranged GETs on S3) does not match, so fetch
    refuses the version, and a watcher polling the cache during the fetch never sees the final
    path. Once the object is repaired, the same fetch succeeds."""
    src = make_checkpoint(tmp_path / "src", big_mib=21)  # 5 parts of 5 MiB on S3
    m = case.store.publish(1, src)
    entry = next(f for f in m.files if f.path == "big.bin")
    good = (src / "big.bin").read_bytes()
    bad = bytearray(good)
    bad[len(bad) // 2 + 12345] ^= 0xFF
    case.put_raw(file_key(case.store, 1, "big.bin"), bytes(bad))
    cache = tmp_path / "cache"
    final = cache / "v000001"
    seen: list[bool] = []
    stop = threading.Event()

    def watch() -> None:
        while not stop.is_set():
            if final.exists():
                seen.append(True)
            time.sleep(0.0005)

    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        with pytest.raises(CheckpointError) as err:
            case.store.fetch(1, cache)
    finally:
        stop.set()
        watcher.join()
    msg, actual = str(err.value), hashlib.sha256(bad).hexdigest()
    assert "big.bin" in msg and f"expected sha256 {entry.sha256} ({entry.size} bytes)" in msg
    # the streamed hash is of the bytes as received
    assert f"got sha256 {actual} ({entry.size} bytes)" in msg
    assert not seen and not final.exists() and not list(cache.glob(".tmp-*"))
    case.put_raw(file_key(case.store, 1, "big.bin"), good)
    assert tree(case.store.fetch(1, cache))["big.bin"] == good


def test_hashing_writer_and_copy_hashed(tmp_path: Path) -> None:
    data = os.urandom(3 * 1024 * 1024 + 17)
    with open(tmp_path / "w", "wb") as f:
        w = HashingWriter(f)
        for i in range(0, len(data), 1 << 20):
            assert w.write(data[i : i + (1 << 20)]) == len(data[i : i + (1 << 20)])
        assert not w.seekable()  # so s3transfer writes a ranged download in offset order
    assert w.hexdigest() == hashlib.sha256(data).hexdigest() and w.size == len(data)
    assert (tmp_path / "w").read_bytes() == data
    assert copy_hashed(tmp_path / "w", tmp_path / "c") == hashlib.sha256(data).hexdigest()
    assert (tmp_path / "c").read_bytes() == data
    (tmp_path / "empty").write_bytes(b"")
    assert copy_hashed(tmp_path / "empty", tmp_path / "e") == hashlib.sha256(b"").hexdigest()
    assert (tmp_path / "e").read_bytes() == b""


def test_verified_copy_is_reused(case: Case, tmp_path: Path) -> None:
    src = make_checkpoint(tmp_path / "src")
    case.store.publish(1, src)
    first = case.store.fetch(1, tmp_path / "cache")
    case.delete_raw(file_key(case.store, 1, "model.safetensors"))
    second = case.store.fetch(1, tmp_path / "cache")
    assert (
        second == first
        and (second / "model.safetensors").read_bytes() == (src / "model.safetensors").read_bytes()
    )
    with pytest.raises(CheckpointError, match="model.safetensors"):  # the object really is gone
        case.store.fetch(1, tmp_path / "other-cache")
    (first / "config.json").unlink()  # a damaged copy is not reused
    with pytest.raises(CheckpointError, match="model.safetensors"):
        case.store.fetch(1, tmp_path / "cache")


def test_bad_source_or_meta_refused(case: Case, tmp_path: Path) -> None:
    src = make_checkpoint(tmp_path / "src")
    with pytest.raises(CheckpointError, match="meta must map str to str"):
        case.store.publish(1, src, meta={"step": 3})  # type: ignore[dict-item]
    with pytest.raises(CheckpointError, match="is not a directory"):
        case.store.publish(1, tmp_path / "missing")
    (src / MANIFEST).write_text("{}")
    with pytest.raises(CheckpointError, match="reserves"):
        case.store.publish(1, src)
    assert case.store.latest() is None and case.store.versions() == []


def test_check_access_passes_on_a_usable_store(case: Case) -> None:
    case.store.check_access()
    assert case.store.versions() == []


def test_check_access_local_folder_cannot_be_created(tmp_path: Path) -> None:
    (tmp_path / "afile").write_text("x")
    store = LocalStore(tmp_path / "afile" / "store")
    with pytest.raises(CheckpointError, match="cannot create checkpoint folder"):
        store.check_access()


def test_check_access_missing_bucket(s3_server: S3Server) -> None:
    store = open_store(
        CheckpointConfig(uri="s3://moerl-no-such-bucket/p", endpoint_url=s3_server.endpoint_url)
    )
    with pytest.raises(CheckpointError, match="bucket 'moerl-no-such-bucket' does not exist"):
        store.check_access()


def test_wrong_credentials_rejected_without_leaking_them(
    s3_server: S3Server, monkeypatch: pytest.MonkeyPatch
) -> None:
    case = _s3_case(s3_server)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "moerlwrongkey")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "moerl-secret-must-not-leak")
    store = open_store(CheckpointConfig(uri=case.store.uri, endpoint_url=s3_server.endpoint_url))
    with pytest.raises(CheckpointError) as err:
        store.check_access()
    assert "denied" in str(err.value) and "moerl-secret-must-not-leak" not in str(err.value)
    with pytest.raises(CheckpointError) as err:
        store.versions()
    assert "moerl-secret-must-not-leak" not in str(err.value)


def test_unreachable_endpoint_fails_fast_with_clear_error(s3_server: S3Server) -> None:
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    store = open_store(CheckpointConfig(uri="s3://b/p", endpoint_url=f"http://127.0.0.1:{port}"))
    t0 = time.monotonic()
    with pytest.raises(CheckpointError, match=f"cannot reach S3 endpoint http://127.0.0.1:{port}"):
        store.check_access()
    assert time.monotonic() - t0 < 30


def test_manifest_json_roundtrip_and_unsafe_paths() -> None:
    m = Manifest(7, (FileEntry("a/b.json", 3, "0" * 64),), "2026-01-01T00:00:00+00:00", {"k": "v"})
    assert Manifest.from_json(m.to_json()) == m
    assert m.sha256() == Manifest.from_json(m.to_json()).sha256()
    assert m.sha256() != Manifest(8, m.files, m.created_at, m.meta).sha256()
    for bad in ("../x", "/etc/passwd"):
        text = m.to_json().replace("a/b.json", bad)
        with pytest.raises(CheckpointError, match="unsafe path"):
            Manifest.from_json(text)
    with pytest.raises(CheckpointError, match="malformed manifest"):
        Manifest.from_json('{"version": 1}')


def test_open_store_picks_backend(tmp_path: Path) -> None:
    assert isinstance(open_store(CheckpointConfig(uri=str(tmp_path / "c"))), LocalStore)
    s3 = open_store(
        CheckpointConfig(uri="s3://bkt/some/prefix/", endpoint_url="http://127.0.0.1:1")
    )
    assert isinstance(s3, S3Store) and (s3.bucket, s3.prefix) == ("bkt", "some/prefix")


def test_sha256_file(tmp_path: Path) -> None:
    (tmp_path / "f").write_bytes(b"abc")
    assert (
        sha256_file(tmp_path / "f")
        == "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad"
    )


def test_s3_server_binds_loopback_only(s3_server: S3Server) -> None:
    """Every TCP socket weed listens on is on 127.0.0.1 (weed binds 0.0.0.0 by default)."""
    inodes = {
        os.readlink(f"/proc/{s3_server.pid}/fd/{fd}")[8:-1]
        for fd in os.listdir(f"/proc/{s3_server.pid}/fd")
        if os.readlink(f"/proc/{s3_server.pid}/fd/{fd}").startswith("socket:[")
    }
    listening = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            f = line.split()
            if f[3] == "0A" and f[9] in inodes:  # 0A: LISTEN
                listening.append(f[1])
    assert listening, "found no listening sockets of weed"
    # 127.0.0.1, little-endian hex
    assert all(a.startswith("0100007F:") for a in listening), listening


def test_local_store_never_imports_boto3(tmp_path: Path) -> None:
    code = (
        "import sys; from pathlib import Path; from moerl.config import CheckpointConfig; "
        "from moerl.store.runs import open_store; s = open_store(CheckpointConfig(uri=sys.argv[1])); "
        "s.publish(1, Path(sys.argv[2])); s.fetch(1, Path(sys.argv[3])); "
        "print(sorted(m for m in sys.modules if m.split('.')[0] in ('boto3', 'botocore', 's3transfer')))"
    )
    out = subprocess.run(
        [
            sys.executable,
            "-c",
            code,
            str(tmp_path / "store"),
            str(make_checkpoint(tmp_path / "src")),
            str(tmp_path / "cache"),
        ],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert out.strip() == "[]"


def test_pins(case: Case, tmp_path: Path) -> None:
    src = make_checkpoint(tmp_path / "src")
    case.store.publish(1, src)
    case.store.publish(2, src)
    assert case.store.pinned() == set()
    case.store.pin(1, "engine-0")
    case.store.pin(1, "engine-1")
    assert case.store.pinned() == {1}
    case.store.pin(2, "engine-0")  # one pin per holder: moving on replaces it
    assert case.store.pinned() == {1, 2}
    case.store.unpin(1, "engine-0")  # engine-0 no longer pins 1: nothing happens
    assert case.store.pinned() == {1, 2}
    case.store.unpin(1, "engine-1")
    case.store.unpin(1, "never-pinned")
    assert case.store.pinned() == {2}
    with pytest.raises(CheckpointError, match="version 3 not found"):
        case.store.pin(3, "engine-0")
    with pytest.raises(CheckpointError, match="pin holder '../x' must be"):
        case.store.pin(2, "../x")
    assert case.store.pinned() == {2} and case.store.versions() == [1, 2]  # pins are not versions


def test_require_lineage(case: Case, tmp_path: Path) -> None:
    with pytest.raises(
        CheckpointError, match=f"no published versions under {case.store.uri}; check checkpoint.uri"
    ):
        case.store.require_lineage()
    case.store.publish(3, make_checkpoint(tmp_path / "src"))
    assert case.store.require_lineage() == 3


def test_retention_arguments_checked_before_publishing(case: Case, tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match="keep_last >= 1"):
        case.store.publish(1, make_checkpoint(tmp_path / "src"), retention=(0, 0))
    assert case.store.latest() is None and case.store.versions() == []


def test_fetch_can_leave_out_a_prefix_and_a_full_copy_serves_both(tmp_path):
    from moerl.store.folder import LocalStore

    src = tmp_path / "src"
    (src / "trainer").mkdir(parents=True)
    (src / "model.safetensors").write_bytes(b"w" * 100)
    (src / "trainer" / "optimizer.pt").write_bytes(b"o" * 300)
    store = LocalStore(tmp_path / "store")
    store.publish(1, src)
    part = store.fetch(1, tmp_path / "cache", exclude=("trainer/",))
    assert (part / "model.safetensors").is_file() and not (part / "trainer").exists()
    full = store.fetch(1, tmp_path / "cache")  # the partial copy does not serve a full request
    assert (full / "trainer" / "optimizer.pt").read_bytes() == b"o" * 300
    (tmp_path / "store" / "versions" / "v000001" / "model.safetensors").write_bytes(b"x" * 100)
    # the full verified copy is reused for the partial request: no re-download of the corrupted object
    assert store.fetch(1, tmp_path / "cache", exclude=("trainer/",)) == full


def test_two_publishers_of_one_version_never_mix_their_files(
    case: Case, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two trainers of one run publish version 1 at once: B starts after A's checks passed and
    while A uploads. Exactly one wins, the other fails with a clear error, and `latest` points
    at a manifest that matches every byte under it (S3: A's create-only claim stops B before it
    writes; folder: B's rename lands first and A's create-only rename is refused)."""
    a, b = make_checkpoint(tmp_path / "a", seed=1), make_checkpoint(tmp_path / "b", seed=2)
    store, put, fired, errors = case.store, case.store._put, threading.Lock(), []

    def racing_put(stage: str, rel: str, src: Path) -> None:
        if fired.acquire(blocking=False):  # once, in the middle of A's uploads
            try:
                store.publish(1, b, exclusive=True)
            except CheckpointError as e:
                errors.append(("b", str(e)))
        put(stage, rel, src)

    monkeypatch.setattr(store, "_put", racing_put)
    try:
        store.publish(1, a, exclusive=True)
    except CheckpointError as e:
        errors.append(("a", str(e)))
    monkeypatch.setattr(store, "_put", put)
    assert len(errors) == 1 and "another" in errors[0][1], errors
    winner = b if errors[0][0] == "a" else a
    assert store.latest() == 1 and store.versions() == [1]
    got = store.fetch(1, tmp_path / "cache")  # verifies every file against the manifest
    assert {k: v for k, v in tree(got).items() if k not in (MANIFEST, ".moerl-verified")} == tree(
        winner
    )


def test_fetch_file_fetches_one_verified_file_and_refuses_other_bytes(
    case: Case, tmp_path: Path
) -> None:
    """What a resumed trainer rank uses to read only its state shards: one file of a version,
    checked against its manifest entry; bytes that are not the manifest's are refused and never
    land at the destination."""
    src = make_checkpoint(tmp_path / "src")
    case.store.publish(1, src)
    dest = tmp_path / "one" / "tokenizer" / "nested" / "tokenizer.json"
    got = case.store.fetch_file(1, "tokenizer/nested/tokenizer.json", dest)
    assert (
        got == dest and dest.read_bytes() == (src / "tokenizer/nested/tokenizer.json").read_bytes()
    )
    assert sorted(p.name for p in (tmp_path / "one").rglob("*") if p.is_file()) == [
        "tokenizer.json"
    ]
    with pytest.raises(CheckpointError, match="has no file nothing.bin"):
        case.store.fetch_file(1, "nothing.bin", tmp_path / "x")
    # another writer's bytes under the key: refused by their sha256, nothing left behind
    case.put_raw(file_key(case.store, 1, "model.safetensors"), os.urandom(4097))
    with pytest.raises(CheckpointError, match="model.safetensors of version 1 .* sha256"):
        case.store.fetch_file(1, "model.safetensors", tmp_path / "two" / "model.safetensors")
    assert not any(p.is_file() for p in (tmp_path / "two").rglob("*"))
