"""A fenced writer's upload still in flight when the version changes hands (S3, weed mini): it
lands in that writer's own object folder (`Manifest.objects`), never on a key the new writer's
manifest names, so the new version stays whole and verified. Before object folders, such an
upload replaced the new version's file under the same key, and the version was lost (refused
by its hash at every read)."""

from __future__ import annotations

import uuid
from pathlib import Path

import pytest

from moerl.errors import CheckpointError
from moerl.store.base import MANIFEST
from moerl.store.manifest import files_dir, version_dir
from tests.store.test_fence import PART, _same_sizes, _store
from tests.store.test_store import make_checkpoint, tree


@pytest.fixture
def uri(s3_server) -> str:
    bucket = f"late-{uuid.uuid4().hex[:10]}"
    s3_server.client().create_bucket(Bucket=bucket)
    return f"s3://{bucket}/runs/r1"


def test_a_fenced_writers_late_upload_cannot_touch_the_new_version(
    s3_server, uri: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    a, b = _store(s3_server, uri), _store(s3_server, uri)
    a.publish(0, make_checkpoint(tmp_path / "v0"), epoch=1, exclusive=True)
    src_a = make_checkpoint(tmp_path / "a", seed=1, big_mib=6)
    src_b = _same_sizes(tmp_path / "b", src_a, seed=2)
    put, in_flight = a._put, []

    def racing_put(stage: str, rel: str, path: Path) -> None:
        if not in_flight:  # A's first upload is on the wire while B takes the version over
            in_flight.append((stage, rel, path))
            assert b.recover(epoch=2) == 0
            b.publish(1, src_b, exclusive=True, chunk_size=PART, epoch=2)
            put(stage, rel, path)  # ... and lands only now, after B's version is published
            return
        put(stage, rel, path)

    monkeypatch.setattr(a, "_put", racing_put)
    with pytest.raises(CheckpointError, match=r"epoch 1 is older than epoch 2"):
        a.publish(1, src_a, exclusive=True, chunk_size=PART, epoch=1)
    ((stage, rel, _),) = in_flight
    m = b.manifest(1)
    # the late object sits in A's folder, which B's manifest does not name
    assert m.objects and stage != files_dir(version_dir(1), m.objects)
    assert a._size(stage, rel) is not None  # it did land
    # B's version is whole: every object matches its manifest by hash, and reads back as B's
    b._verify_stored(version_dir(1), m)
    assert b.hash_checked == len(m.files)
    got = b.fetch(1, tmp_path / "check")
    assert {k: v for k, v in tree(got).items() if k not in (MANIFEST, ".moerl-verified")} == tree(
        src_b
    )
    assert b.latest() == 1 and b.latest_epoch() == 2
    # retention, which deletes a version by its prefix, takes the stray object with it
    b.publish(2, make_checkpoint(tmp_path / "v2", seed=3), exclusive=True, epoch=2)
    b.publish(3, make_checkpoint(tmp_path / "v3", seed=4), exclusive=True, epoch=2)
    assert 1 in b.apply_retention(keep_last=1, keep_every=0)
    assert b._list(f"versions/{version_dir(1)}/") == []


def test_every_publish_writes_its_own_object_folder(s3_server, uri: str, tmp_path: Path) -> None:
    """Two publishes never share a file key: each manifest names its own folder."""
    store = _store(s3_server, uri)
    m1 = store.publish(1, make_checkpoint(tmp_path / "v1", seed=1))
    m2 = store.publish(2, make_checkpoint(tmp_path / "v2", seed=2))
    assert m1.objects and m2.objects and m1.objects != m2.objects
    keys = store._list(f"versions/{version_dir(1)}/")
    assert sorted(keys) == sorted(
        [f"versions/{version_dir(1)}/{MANIFEST}"]
        + [f"versions/{version_dir(1)}/{m1.objects}/{f.path}" for f in m1.files]
    )
