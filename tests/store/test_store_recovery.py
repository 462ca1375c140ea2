"""Recovery of a store whose writer was killed mid-publish, against a local folder and real S3 (weed).

A child process publishes with its own store, patched to `os._exit(137)` at an exact step:
right after the manifest is written (S3: before its read-back check; local: still in the
staging folder), right after the version is committed (before `latest` moves), or after the
first file is copied. Then a fresh store recovers: a complete, verified version above `latest`
is adopted, anything else above `latest` is deleted, and the next publish works.
"""

from __future__ import annotations

import json
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from moerl.config import CheckpointConfig, RunConfig
from moerl.errors import CheckpointError
from moerl.store.runs import open_store
from tests.store.test_store import make_checkpoint, tree
from tests.support.objects import file_key
from tests.support.s3server import S3Server

_CHILD = r"""
import json, os, sys
from pathlib import Path
from moerl.config import CheckpointConfig
from moerl.store.runs import open_store
a = json.loads(sys.argv[1])
store, at = open_store(CheckpointConfig(**a["cfg"])), a["die"]
cls = type(store)
if at == "manifest_written":  # the manifest is stored; nothing after it ran
    write = cls._write_text
    def _write_text(self, key, text):
        write(self, key, text)
        if key.endswith("/manifest.json"):
            os._exit(137)
    cls._write_text = _write_text
elif at == "committed":  # the version is complete and verified; `latest` has not moved
    commit = cls._commit
    def _commit(self, stage, version):
        commit(self, stage, version)
        os._exit(137)
    cls._commit = _commit
elif at == "first_file":  # one data file copied, no manifest
    put = cls._put
    def _put(self, stage, rel, src):
        put(self, stage, rel, src)
        os._exit(137)
    cls._put = _put
store.publish(a["version"], Path(a["src"]))
"""


def _publish_and_die(cfg: CheckpointConfig, version: int, src: Path, die: str) -> None:
    args = {"cfg": cfg.model_dump(), "version": version, "src": str(src), "die": die}
    r = subprocess.run(
        [sys.executable, "-c", _CHILD, json.dumps(args)],
        capture_output=True,
        text=True,
        cwd=Path(__file__).parents[2],
        timeout=120,
    )
    assert r.returncode == 137, (
        f"the child did not die at {die!r}: rc {r.returncode}, {r.stderr[-2000:]}"
    )


@pytest.fixture(params=["local", "s3"])
def cfg(request: pytest.FixtureRequest, tmp_path: Path) -> CheckpointConfig:
    if request.param == "local":
        return CheckpointConfig(uri=str(tmp_path / "store"))
    server: S3Server = request.getfixturevalue("s3_server")
    bucket = f"moerl-recover-{uuid.uuid4().hex[:12]}"
    server.client().create_bucket(Bucket=bucket)
    return CheckpointConfig(
        uri=f"s3://{bucket}/runs/r1", endpoint_url=server.endpoint_url, region="us-east-1"
    )


def _killed_at(cfg: CheckpointConfig, tmp_path: Path, die: str):  # noqa: ANN202
    store = open_store(cfg)
    store.publish(1, make_checkpoint(tmp_path / "v1", seed=1))
    v2 = make_checkpoint(tmp_path / "v2", seed=2)
    _publish_and_die(cfg, 2, v2, die)
    return open_store(cfg), v2


def test_version_committed_before_latest_moved_is_adopted(
    cfg: CheckpointConfig, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    store, v2 = _killed_at(cfg, tmp_path, "committed")
    # the crash window: complete above latest
    assert store.latest() == 1 and store.versions() == [
        1,
        2,
    ]
    # what resume used to hit
    with pytest.raises(CheckpointError, match="version 2 already exists"):
        store.publish(2, v2)
    with caplog.at_level("WARNING", logger="moerl.store.base"):
        assert store.recover() == 2
    assert "version 2 was complete and verified but latest was 1" in caplog.text
    assert store.latest() == 2 and store.versions() == [1, 2]
    assert (
        json.loads(store._read_text("latest.json"))["manifest_sha256"] == store.manifest(2).sha256()
    )
    assert tree(store.fetch(2, tmp_path / "cache")).items() >= tree(v2).items()
    store.publish(3, make_checkpoint(tmp_path / "v3", seed=3))  # the lineage goes on
    assert store.recover() == 3 and store.versions() == [1, 2, 3]  # nothing to repair: a no-op


def test_killed_right_after_the_manifest_was_written(cfg: CheckpointConfig, tmp_path: Path) -> None:
    """S3: the manifest sits at its final key, never read back: it verifies, so it is adopted.
    Local: it sits in the staging folder, never renamed into place: that folder is deleted."""
    store, v2 = _killed_at(cfg, tmp_path, "manifest_written")
    s3 = cfg.uri.startswith("s3://")
    assert store.latest() == 1 and store.versions() == ([1, 2] if s3 else [1])
    assert store.recover() == (2 if s3 else 1)
    assert store.latest() == (2 if s3 else 1)
    # no staging left
    assert list(store._version_dirs()) == (["v000001", "v000002"] if s3 else ["v000001"])
    if s3:
        assert tree(store.fetch(2, tmp_path / "cache")).items() >= tree(v2).items()
    else:
        store.publish(2, v2)
    assert store.latest() == 2


def test_incomplete_version_above_latest_is_deleted(cfg: CheckpointConfig, tmp_path: Path) -> None:
    store, v2 = _killed_at(cfg, tmp_path, "first_file")
    assert store.latest() == 1 and store.versions() == [1]
    assert any(d != "v000001" for d in store._version_dirs())  # debris of version 2 is there
    assert store.recover() == 1
    assert list(store._version_dirs()) == ["v000001"] and store.latest() == 1
    store.publish(2, v2)
    assert store.versions() == [1, 2] and store.latest() == 2


def test_complete_but_unverifiable_version_above_latest_is_deleted(
    cfg: CheckpointConfig, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    store, v2 = _killed_at(cfg, tmp_path, "committed")
    store._delete([file_key(store, 2, "config.json")])  # an object the manifest lists is gone
    with caplog.at_level("WARNING", logger="moerl.store.base"):
        assert store.recover() == 1
    assert "deleting v000002, above latest 1: config.json of version 2" in caplog.text
    assert store.versions() == [1] and store._list("versions/v000002/") == []
    store.publish(2, v2)
    assert store.latest() == 2


def test_killed_while_publishing_version_0_then_recovered(
    cfg: CheckpointConfig, tmp_path: Path
) -> None:
    v0 = make_checkpoint(tmp_path / "v0")
    _publish_and_die(cfg, 0, v0, "committed")
    store = open_store(cfg)
    assert store.latest() is None and store.versions() == [0]
    assert store.recover() == 0 and store.latest() == 0


def test_resume_point_adopts_the_version_a_killed_publish_left(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`moerl run --resume` continues from the recovered version, not the stale `latest`."""
    from mlflow.tracking import MlflowClient

    from moerl.orchestrate.prepare import resume_point
    from moerl.store.runs import run_store

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    client = MlflowClient(uri)
    run_id = client.create_run(client.create_experiment("recover")).info.run_id
    run_cfg = RunConfig.model_validate({"checkpoint": {"uri": str(tmp_path / "ck")}})
    store = run_store(run_cfg.checkpoint, run_id)
    store.publish(0, make_checkpoint(tmp_path / "v0"))
    _publish_and_die(
        run_cfg.checkpoint.model_copy(update={"uri": store.uri}),
        1,
        make_checkpoint(tmp_path / "v1", seed=1),
        "committed",
    )
    assert store.latest() == 0
    assert resume_point(run_cfg, uri, run_id) == 1
    assert (
        "version 1 was published but `latest` still said 0; adopted it" in capsys.readouterr().out
    )
    assert store.latest() == 1
