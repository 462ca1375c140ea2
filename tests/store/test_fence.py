"""Fenced tier writes on a real S3 server (weed mini): claims with owner, epoch and expiry, the
epoch `latest` records, and every stored object checked by its SHA-256 (moerl/store/fence.py).

The races are staged with a hook in the first writer's upload (the same pattern as
tests/store/test_store.py's two-publisher test): the second writer runs, for real, against the
same bucket while the first is between two of its files."""

from __future__ import annotations

import os
import uuid
from pathlib import Path

import pytest

from moerl.config import CheckpointConfig
from moerl.errors import CheckpointError
from moerl.store.base import MANIFEST
from moerl.store.fence import CLAIM
from moerl.store.s3 import S3Store
from moerl.store.tiers import open_store
from tests.store.test_store import make_checkpoint, tree
from tests.support.objects import file_key

# the manifest's chunk size = the upload's part size: multipart objects are checkable
PART = 5 * 2**20


@pytest.fixture
def uri(s3_server) -> str:
    bucket = f"fence-{uuid.uuid4().hex[:10]}"
    s3_server.client().create_bucket(Bucket=bucket)
    return f"s3://{bucket}/runs/r1"


def _store(s3_server, uri: str) -> S3Store:
    cfg = CheckpointConfig(
        uri=uri,
        endpoint_url=s3_server.endpoint_url,
        region="us-east-1",
        multipart_chunk_mb=5,
        max_concurrency=2,
    )
    store = open_store(cfg)
    store._workers = 1  # files in order: the hook fires between two known files
    return store


def _same_sizes(d: Path, like: Path, seed: int) -> Path:
    """A second checkpoint with every file the size of `like`'s, other bytes (what a second
    trainer of the same model writes): sizes alone cannot tell the two apart."""
    for f in like.rglob("*"):
        if f.is_file():
            out = d / f.relative_to(like)
            out.parent.mkdir(parents=True, exist_ok=True)
            out.write_bytes(
                os.urandom(f.stat().st_size)
                if f.suffix in (".bin", ".safetensors")
                else f.read_bytes().replace(b"0", str(seed).encode()[:1])
            )
    return d


def test_every_stored_object_is_checked_by_its_sha256(s3_server, uri: str, tmp_path: Path) -> None:
    """weed returns the SHA-256 checksum the client sent: whole for one-part objects, composite
    over the parts for multipart ones, whose parts are the manifest's chunks."""
    store = _store(s3_server, uri)
    src = make_checkpoint(tmp_path / "a", seed=1, big_mib=12)  # big.bin: 3 parts of 5 MiB
    m = store.publish(1, src, exclusive=True, chunk_size=PART, epoch=1)
    assert store.hash_checked == len(m.files) == 4
    head = s3_server.client().head_object(
        Bucket=uri.split("/")[2],
        Key=f"runs/r1/{file_key(store, 1, 'big.bin')}",
        ChecksumMode="ENABLED",
    )
    assert head["ChecksumSHA256"].endswith("-3")  # multipart: checked through the chunk hashes


def test_an_object_replaced_by_another_writer_is_refused_by_its_hash(
    s3_server, uri: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A replaced writer's upload that began before it was fenced lands under this writer's
    version with the same size: the hash check refuses the version, `latest` stays where it was,
    and what the failed publish wrote is deleted."""
    a, b = _store(s3_server, uri), _store(s3_server, uri)
    src = make_checkpoint(tmp_path / "a", seed=1, big_mib=12)
    other = _same_sizes(tmp_path / "b", src, seed=2)
    a.publish(0, make_checkpoint(tmp_path / "v0"), epoch=1, exclusive=True)
    put = a._put

    def late_upload(stage: str, rel: str, path: Path) -> None:
        put(stage, rel, path)
        # the last file: big.bin is stored, then replaced
        if rel == "tokenizer/nested/tokenizer.json":
            b._part_size = (
                PART  # as a moerl writer uploads it: with its SHA-256, in chunk-sized parts
            )
            b._put(stage, "big.bin", other / "big.bin")

    monkeypatch.setattr(a, "_put", late_upload)
    with pytest.raises(
        CheckpointError, match="big.bin of version 1 .* does not hash to its manifest"
    ):
        a.publish(1, src, exclusive=True, chunk_size=PART, epoch=1)
    assert a.latest() == 0 and a.versions() == [0]
    assert a._list("versions/v000001/") == []  # the failed publish's objects and claim are gone


def test_an_older_epoch_is_refused_and_latest_never_names_a_mixed_manifest(
    s3_server, uri: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Trainer A (epoch 1) publishes version 1; while it is between two files, trainer B (epoch
    2, a retried task) recovers the store (removing A's claim and partial files) and publishes
    version 1 itself, files of the same sizes. A is refused at its next file, naming both
    epochs; `latest` names B's manifest and every byte under it is B's."""
    a, b = _store(s3_server, uri), _store(s3_server, uri)
    a.publish(0, make_checkpoint(tmp_path / "v0"), epoch=1, exclusive=True)
    src_a = make_checkpoint(tmp_path / "a", seed=1, big_mib=6)
    src_b = _same_sizes(tmp_path / "b", src_a, seed=2)
    put, seen = a._put, []

    def racing_put(stage: str, rel: str, path: Path) -> None:
        put(stage, rel, path)
        seen.append(rel)
        if len(seen) == 1:  # A stored its first file; B takes over
            assert b.recover(epoch=2) == 0
            assert b._list("versions/v000001/") == []  # A's older claim and its file removed
            b.publish(1, src_b, exclusive=True, chunk_size=PART, epoch=2)

    monkeypatch.setattr(a, "_put", racing_put)
    with pytest.raises(CheckpointError, match=r"epoch 1 is older than epoch 2"):
        a.publish(1, src_a, exclusive=True, chunk_size=PART, epoch=1)
    assert seen == ["big.bin"]  # refused before its second file
    assert a.latest() == 1 and a.latest_epoch() == 2 and a.read_claim(1).epoch == 2
    got = a.fetch(1, tmp_path / "check")  # every file verified against the manifest latest names
    assert {k: v for k, v in tree(got).items() if k not in (MANIFEST, ".moerl-verified")} == tree(
        src_b
    )
    # the older epoch can no longer move latest, nor claim any version
    with pytest.raises(CheckpointError, match=r"epoch 1 is older than epoch 2"):
        a.publish(2, src_a, exclusive=True, epoch=1)
    assert a.latest() == 1 and a._list("versions/v000002/") == []


def test_a_writer_older_than_a_live_claim_is_refused(
    s3_server, uri: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """B (epoch 2) holds version 1's claim and is uploading; A (epoch 1), which never saw a
    recovery, tries the same version: refused at the claim, before writing any file."""
    a, b = _store(s3_server, uri), _store(s3_server, uri)
    src = make_checkpoint(tmp_path / "a", seed=1)
    put, errors = b._put, []

    def racing_put(stage: str, rel: str, path: Path) -> None:
        if not errors:
            with pytest.raises(CheckpointError) as e:
                a.publish(1, src, exclusive=True, epoch=1)
            errors.append(str(e.value))
        put(stage, rel, path)

    monkeypatch.setattr(b, "_put", racing_put)
    b.publish(1, src, exclusive=True, epoch=2)
    assert "epoch 1 is older than epoch 2" in errors[0] and "claiming version 1" in errors[0]
    assert b.latest() == 1 and b.latest_epoch() == 2 and b.read_claim(1).epoch == 2


def test_recover_leaves_a_live_claim_of_the_same_or_a_newer_epoch_alone(
    s3_server, uri: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """X (epoch 5) is publishing version 1. A recovery by epoch 5 (another process of the same
    trainer) and one by epoch 4 (before it) leave its claim and files alone, and X completes. An expired
    claim is removed by any recovery."""
    x, other = _store(s3_server, uri), _store(s3_server, uri)
    src = make_checkpoint(tmp_path / "x", seed=1, big_mib=6)
    put, seen = x._put, []

    def recovered_meanwhile(stage: str, rel: str, path: Path) -> None:
        put(stage, rel, path)
        seen.append(rel)
        if len(seen) == 1:
            for epoch in (4, 5):  # (after 5, an epoch-4 recovery would itself be refused: fenced)
                assert other.recover(epoch=epoch) is None
                assert {k.rsplit("/", 1)[1] for k in other._list("versions/v000001/")} == {
                    CLAIM,
                    "big.bin",
                }

    monkeypatch.setattr(x, "_put", recovered_meanwhile)
    x.publish(1, src, exclusive=True, epoch=5)
    assert x.latest() == 1 and x.latest_epoch() == 5
    # a claim whose holder died: once it expired, a recovery of any epoch removes it and its files
    dead = _store(s3_server, uri)
    claim = dead._claim(2, 5, "dead-host/1/abcd")
    s3_server.client().put_object(
        Bucket=uri.split("/")[2], Key="runs/r1/versions/v000002/big.bin", Body=b"x"
    )
    assert other.recover(epoch=5) == 1 and other.read_claim(2) == claim  # live: left alone
    other.clock = lambda: claim.expires_at + 1
    assert other.recover(epoch=5) == 1 and other._list("versions/v000002/") == []


def test_a_folder_stores_latest_is_fenced_by_epoch_too(tmp_path: Path) -> None:
    """The folder backend stages each publish privately (no claims needed), but its `latest` is
    the same compare-and-set, under a lock file: an older epoch cannot move it."""
    from moerl.store.folder import LocalStore

    store = LocalStore(tmp_path / "store")
    src = make_checkpoint(tmp_path / "src", seed=1)
    store.publish(1, src, epoch=1, exclusive=True)
    assert store.recover(epoch=2) == 1 and store.latest_epoch() == 2  # a new trainer's fence
    with pytest.raises(CheckpointError, match=r"epoch 1 is older than epoch 2"):
        store.publish(2, src, epoch=1, exclusive=True)
    with pytest.raises(CheckpointError, match=r"epoch 1 is older than epoch 2"):
        store.recover(epoch=1)
    assert store.latest() == 1 and store.versions() == [1]
    store.publish(2, src, epoch=2, exclusive=True)
    # a writer without an epoch (the sync pipeline) is not fenced, keeps the epoch
    store.publish(3, src)
    assert store.latest() == 3 and store.latest_epoch() == 2
