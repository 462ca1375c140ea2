"""A user's model from S3 or a hub (`model.path`, moerl/models/source.py), on the real S3 server
(`weed mini`) and a SQLite MLflow: a tiny Qwen3-MoE and a tiny Mixtral, sharded with an index,
checked by preflight from their small files and ranged header reads, imported once into
version 0 (server-side copies on the same S3, streamed into a folder store), byte for byte,
verified and tagged; refusals name model.path and the key; a source rewritten during the
import publishes nothing. The hub path runs against a local mirror (an HF cache filled
beforehand, HF_HUB_OFFLINE=1), never a download."""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import pytest

from moerl.config import parse_config
from moerl.errors import ConfigError
from moerl.store.runs import run_store

ARCHS = ("qwen3_moe", "mixtral")


def _sha(p: Path) -> str:
    return hashlib.sha256(p.read_bytes()).hexdigest()


def _shard(model_dir: Path) -> None:
    """Split model.safetensors into two shards with an index, as large checkpoints come."""
    from safetensors.torch import load_file, save_file

    tensors = load_file(model_dir / "model.safetensors")
    (model_dir / "model.safetensors").unlink()
    names = sorted(tensors)
    half = len(names) // 2
    weight_map = {}
    for i, part in enumerate((names[:half], names[half:])):
        fname = f"model-{i + 1:05d}-of-00002.safetensors"
        save_file({n: tensors[n].contiguous() for n in part}, model_dir / fname)
        weight_map.update(dict.fromkeys(part, fname))
    (model_dir / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {}, "weight_map": weight_map})
    )


@pytest.fixture(scope="module")
def models(s3_server, tmp_path_factory):
    """Each architecture's tiny model, sharded, locally and under s3://moerl-models/<arch>/."""
    from moerl.models.tiny import build_tiny_model

    root = tmp_path_factory.mktemp("models")
    client = s3_server.client()
    client.create_bucket(Bucket="moerl-models")
    client.create_bucket(Bucket="moerl-ckpt")
    out = {}
    for arch in ARCHS:
        d = build_tiny_model(
            parse_config({"model": {"tiny": {"architecture": arch}}}).model.tiny, root / arch
        )
        _shard(d)
        for f in d.iterdir():
            client.upload_file(str(f), "moerl-models", f"{arch}/{f.name}")
        # another format's weights beside them (a cloned repo's): neither fetched nor imported
        client.put_object(Bucket="moerl-models", Key=f"{arch}/pytorch_model.bin", Body=b"\0" * 4096)
        out[arch] = d
    return out


def _cfg(s3, tmp_path: Path, path: str, ckpt: str | None = None):
    return parse_config(
        {
            "model": {"path": path},
            "checkpoint": {
                "uri": ckpt or f"s3://moerl-ckpt/{tmp_path.name}",
                "endpoint_url": s3.endpoint_url,
                "region": "us-east-1",
                "cache_dir": str(tmp_path / "cache"),
            },
            "tracking": {"uri": f"sqlite:///{tmp_path / 'mlflow.db'}", "experiment": "sources"},
        }
    )


def _run(cfg) -> str:
    from mlflow.tracking import MlflowClient

    client = MlflowClient(cfg.tracking.uri)
    exp = client.create_experiment(cfg.tracking.experiment)
    return client.create_run(exp).info.run_id


@pytest.mark.parametrize("arch", ARCHS)
def test_an_s3_model_is_checked_then_imported_once_into_version_0_byte_for_byte(
    s3_server, models, tmp_path, arch
):
    from mlflow.tracking import MlflowClient

    from moerl.components.publish_checkpoint.stage import model_skeleton, publish_initial
    from moerl.models.policy import load_policy
    from moerl.models.source import check_model

    cfg = _cfg(s3_server, tmp_path, f"s3://moerl-models/{arch}/")
    assert check_model(cfg.model.path, cfg.checkpoint) == arch
    run_id = _run(cfg)
    state = tmp_path / "state"
    policy, metrics = publish_initial(cfg, run_id, state)
    # the weights went server-side into the store, never through this process's disk
    assert not list(state.glob("*.safetensors"))
    assert metrics["import/server_side_copies"] == 2 and metrics["import/streamed"] == 0
    store = run_store(cfg.checkpoint, run_id)
    manifest = store.manifest(0)
    assert manifest.sha256() == policy.manifest_sha256 and store.latest() == 0
    src = models[arch]
    assert {e.path: e.sha256 for e in manifest.files} == {f.name: _sha(f) for f in src.iterdir()}
    # the store verified each copy by its SHA-256 checksum (multipart copies: composite)
    got = store.fetch(0, tmp_path / "fetched")
    assert {f.name: _sha(got / f.name) for f in src.iterdir()} == {
        f.name: _sha(f) for f in src.iterdir()
    }
    model, _ = load_policy(got)  # what the trainer loads
    assert model.config.model_type == arch
    tags = MlflowClient(cfg.tracking.uri).get_run(run_id).data.tags
    assert tags["moerl.model.source"] == cfg.model.path
    assert tags["moerl.model.model_type"] == arch
    assert tags["moerl.model.v0_manifest_sha256"] == policy.manifest_sha256
    assert len(tags["moerl.model.etags_sha256"]) == 64
    assert tags["moerl.model.ignored_files"] == "pytorch_model.bin"
    assert tags["moerl.model.import_routes"] == "copy=2"  # one store, two weight files
    # the engines' skeleton: the small files of the source, no weights
    skel = model_skeleton(cfg, tmp_path / "skeleton")
    assert (skel / "config.json").read_bytes() == (src / "config.json").read_bytes()
    assert not list(skel.glob("*.safetensors"))


def test_into_a_folder_store_the_weights_stream_and_verify(s3_server, models, tmp_path):
    from moerl.components.publish_checkpoint.stage import publish_initial

    cfg = _cfg(s3_server, tmp_path, "s3://moerl-models/qwen3_moe", ckpt=str(tmp_path / "ckpt"))
    run_id = _run(cfg)
    _, metrics = publish_initial(cfg, run_id, tmp_path / "state")
    assert metrics["import/streamed"] == 2 and metrics["import/server_side_copies"] == 0
    m = run_store(cfg.checkpoint, run_id).manifest(0)
    assert {e.path: e.sha256 for e in m.files} == {
        f.name: _sha(f) for f in models["qwen3_moe"].iterdir()
    }


def test_a_shard_rewritten_during_the_import_publishes_nothing(s3_server, models, tmp_path):
    from moerl.components.publish_checkpoint import stage
    from moerl.models.source import ModelImport, S3Model
    from moerl.store.sources import SourceChanged

    client = s3_server.client()
    src = models["qwen3_moe"]
    for f in src.iterdir():
        client.upload_file(str(f), "moerl-models", f"changing/{f.name}")
    cfg = _cfg(s3_server, tmp_path, "s3://moerl-models/changing/")
    model = S3Model(cfg.model.path, cfg.checkpoint)  # listed: the ETags the import will demand
    client.put_object(
        Bucket="moerl-models", Key=f"changing/{model.weights[1]}", Body=b"rewritten" * 100
    )
    state = tmp_path / "state"
    state.mkdir()
    model.fetch_small(state)
    run_id = _run(cfg)
    with pytest.raises(SourceChanged, match=f"model.path: .*changing/{model.weights[1]} changed"):
        stage.run_publish(cfg, run_id, state, 0, parts=ModelImport(model))
    store = run_store(cfg.checkpoint, run_id)
    assert store.latest() is None and store.versions() == []


def _bad(client, prefix: str, src: Path, **replace: bytes) -> str:
    for f in src.iterdir():
        client.put_object(
            Bucket="moerl-models",
            Key=f"{prefix}/{f.name}",
            Body=replace.get(f.name, f.read_bytes()),
        )
    return f"s3://moerl-models/{prefix}/"


def test_refusals_name_model_path_and_the_key(s3_server, models, tmp_path):
    from moerl.models.source import check_model

    client = s3_server.client()
    src = models["qwen3_moe"]
    ck = _cfg(s3_server, tmp_path, "s3://moerl-models/none/").checkpoint
    conf = json.loads((src / "config.json").read_text())
    shard = sorted(src.glob("*.safetensors"))[0]
    cases = {
        "s3://moerl-models/missing/": r"model.path: s3://moerl-models/missing/ holds no objects",
        "s3://no-such-bucket-x/m/": r"model.path: listing s3://no-such-bucket-x/m/: no such",
        _bad(
            client,
            "llama",
            src,
            **{"config.json": json.dumps({**conf, "model_type": "llama"}).encode()},
        ): (
            r"model.path: model_type 'llama' is not supported; allowed: .* \(in s3://moerl-models/llama/config.json\)"
        ),
        _bad(
            client,
            "othervocab",
            src,
            **{"config.json": json.dumps({**conf, "vocab_size": conf["vocab_size"] + 64}).encode()},
        ): (
            r"model.path: tensor (model.embed_tokens|lm_head).weight in s3://moerl-models/othervocab/model-"
            r".* has shape \[\d+, \d+\], but s3://moerl-models/othervocab/config.json gives"
        ),
        _bad(client, "truncated", src, **{shard.name: shard.read_bytes()[:-100]}): (
            rf"model.path: s3://moerl-models/truncated/{shard.name} is truncated"
        ),
        "hf://Qwen/Qwen3-30B-A3B": r"model.path: 'hf://Qwen/Qwen3-30B-A3B' needs a pinned revision",
        "hf://Qwen/Qwen3-30B-A3B@main": r"needs a pinned revision: .*\(got 'main'\)",
    }
    client.put_object(
        Bucket="moerl-models", Key="noconfig/model.safetensors", Body=shard.read_bytes()
    )
    cases["s3://moerl-models/noconfig/"] = (
        r"model.path: s3://moerl-models/noconfig/ is not a HF checkpoint \(no config.json"
    )
    for spec, needle in cases.items():
        with pytest.raises(ConfigError, match=needle):
            check_model(spec, ck)


def test_a_hub_model_from_a_mirrored_cache_is_imported_at_its_commit(
    s3_server, models, tmp_path, monkeypatch
):
    from moerl.components.publish_checkpoint.stage import publish_initial
    from moerl.models.source import check_model

    commit = "0123456789abcdef0123456789abcdef01234567"
    snap = tmp_path / "hub" / "models--tiny-org--tiny-moe" / "snapshots" / commit
    shutil.copytree(models["mixtral"], snap)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    cfg = _cfg(s3_server, tmp_path, f"hf://tiny-org/tiny-moe@{commit}")
    assert check_model(cfg.model.path, cfg.checkpoint) == "mixtral"
    run_id = _run(cfg)
    publish_initial(cfg, run_id, tmp_path / "state")
    m = run_store(cfg.checkpoint, run_id).manifest(0)
    assert {e.path: e.sha256 for e in m.files} == {f.name: _sha(f) for f in snap.iterdir()}
    other = _cfg(s3_server, tmp_path, f"hf://tiny-org/tiny-moe@{'f' * 40}")
    with pytest.raises(
        ConfigError, match="model.path: cannot get hf://tiny-org/tiny-moe@f+ from the hub"
    ):
        check_model(other.model.path, other.checkpoint)


def test_a_file_larger_than_a_part_is_copied_in_parts_and_checked_by_its_checksum(
    s3_server, tmp_path
):
    """S3Store.copy_in past one part: UploadPartCopy in the manifest's chunk size, each part
    with its SHA-256, so the store checks the copy against the chunk hashes read from the
    source; a copy of other bytes fails that check."""
    import os

    from moerl.store.manifest import BlockHasher, FileEntry
    from moerl.store.s3 import S3Store

    data = os.urandom(12 << 20)
    client = s3_server.client()
    client.put_object(Bucket="moerl-models", Key="big/w.safetensors", Body=data)
    etag = client.head_object(Bucket="moerl-models", Key="big/w.safetensors")["ETag"]
    ck = _cfg(s3_server, tmp_path, "s3://moerl-models/big/").checkpoint
    store = S3Store(ck)
    assert store.same_service(ck.endpoint_url)
    store._part_size = 5 << 20
    route = store.copy_in(
        "stage-x", "w.safetensors", "moerl-models", "big/w.safetensors", len(data), etag
    )
    assert route == "multipart copy"
    h = BlockHasher(5 << 20)
    h.update(data)
    entry = FileEntry("w.safetensors", *h.result())
    assert store._stored("stage-x", entry, 5 << 20) == (len(data), True)
    other = BlockHasher(5 << 20)
    other.update(data[:-1] + b"x")
    assert (
        store._stored("stage-x", FileEntry("w.safetensors", *other.result()), 5 << 20)[1] is False
    )


@pytest.mark.slow  # `moerl run` as a process (refused before any work)
def test_moerl_run_refuses_a_missing_s3_model_in_one_line_before_any_work(
    s3_server, models, tmp_path
):
    import subprocess
    import sys

    root = Path(__file__).resolve().parents[2]
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "moerl.cli",
            "run",
            str(root / "configs" / "tiny-moe-grpo.yaml"),
            "--set",
            "model.path=s3://moerl-models/not-staged/",
            "--set",
            f"checkpoint.endpoint_url={s3_server.endpoint_url}",
            "--set",
            "checkpoint.region=us-east-1",
        ],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-2000:]
    err = proc.stderr.strip().splitlines()
    assert err[-1].startswith(
        "moerl: error: model.path: s3://moerl-models/not-staged/ holds no objects"
    )
    assert "Traceback" not in proc.stderr
    assert not (tmp_path / "checkpoints").exists()  # nothing published


def test_a_read_that_breaks_off_resumes_at_its_byte_under_the_same_etag(
    s3_server, models, tmp_path
):
    """A connection that breaks mid-body (a read timeout on the real server's stream, injected
    after the first block) resumes with a Range from the byte reached, If-Match unchanged."""
    from botocore.exceptions import ReadTimeoutError

    from moerl.models.source import S3Model

    cfg = _cfg(s3_server, tmp_path, "s3://moerl-models/qwen3_moe/")
    model = S3Model(cfg.model.path, cfg.checkpoint)
    rel = model.weights[0]
    client, calls = model.source._s3, []
    real = client.get_object

    class Breaks:
        def __init__(self, body):
            self.body, self.reads = body, 0

        def read(self, n):
            self.reads += 1
            if self.reads == 2:
                raise ReadTimeoutError(endpoint_url=s3_server.endpoint_url)
            return self.body.read(n)

    def get_object(**kw):
        calls.append(kw)
        out = real(**kw)
        if len(calls) == 1:
            out["Body"] = Breaks(out["Body"])
        return out

    client.get_object = get_object
    got = b"".join(model.source.stream(model.objects[rel], chunk=64 << 10))
    assert got == (models["qwen3_moe"] / rel).read_bytes()
    assert len(calls) == 2 and calls[1]["Range"] == f"bytes={64 << 10}-"
    assert calls[0]["IfMatch"] == calls[1]["IfMatch"] == model.objects[rel].etag


def test_an_import_larger_than_the_cache_tier_goes_to_the_durable_store_first(
    s3_server, models, tmp_path
):
    """The cache tier's size check counts the imported weights (the version's parts), not only
    the small files in the state folder: a model it cannot hold skips it, counted."""
    from moerl.components.publish_checkpoint.stage import publish_initial

    s3_server.client().create_bucket(Bucket="moerl-cache-x")
    base = _cfg(s3_server, tmp_path, "s3://moerl-models/qwen3_moe/")
    weights = sum(f.stat().st_size for f in models["qwen3_moe"].glob("*.safetensors"))
    ck = base.checkpoint.model_copy(
        update={
            "cache_tier": base.checkpoint.cache_tier.model_copy(
                update={
                    "uri": f"s3://moerl-cache-x/{tmp_path.name}",
                    "endpoint_url": s3_server.endpoint_url,
                    # room for the small files many times over, not for keep_last + 1 models
                    "capacity_gb": weights / 2**30,
                }
            )
        }
    )
    cfg = base.model_copy(update={"checkpoint": ck})
    _, metrics = publish_initial(cfg, _run(cfg), tmp_path / "state")
    assert metrics["weights/cache_tier_too_small"] == 1.0 and metrics["weights/cache_tier"] == 0.0
    assert s3_server.client().list_objects_v2(Bucket="moerl-cache-x").get("KeyCount", 0) == 0
