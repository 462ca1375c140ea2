"""The sync pipeline's update (`components/policy_update/update.py`) on a real checkpoint store:
version v in from the store, v+1 published with the trainer's state, a retry that returns the
published version instead of training twice, and a version of that number from another batch
refused."""

import pytest

from moerl import tracking
from moerl.components.policy_update.update import BATCH_LABEL, run_sync_update
from moerl.components.publish_checkpoint.stage import prepare_initial, run_publish
from moerl.config import parse_config
from moerl.errors import CheckpointError
from moerl.records import TrainSample, write_records
from moerl.store.runs import run_store


def _batch(n=8, shift=0):
    return [
        TrainSample(
            prompt_token_ids=[21, 22, 23, 5 + (i + shift) % 10],
            response_token_ids=[5 + (i + shift) % 10, 6, 1],
            response_logprobs=[-3.0, -3.1, -2.9],
            advantage=1.0 if i % 2 else -1.0,
            policy_version=0,
        )
        for i in range(n)
    ]


@pytest.fixture
def run(tmp_path):
    cfg = parse_config(
        {
            "checkpoint": {"uri": str(tmp_path / "ckpt")},
            "tracking": {"uri": f"sqlite:///{tmp_path / 'mlflow.db'}"},
            "trainer": {"optimizer": {"optimizer_steps_per_iteration": 2}},
        }
    )
    run_id = tracking.start_run(cfg, tracking.resolve_uri(cfg.tracking), {"moerl.mode": "t"})
    prepare_initial(cfg, tmp_path / "v0")
    policy0, _ = run_publish(cfg, run_id, tmp_path / "v0", 0)
    write_records(tmp_path / "batch.jsonl", _batch())
    return cfg, run_id, policy0, tmp_path


def test_the_update_reads_the_store_and_publishes_the_next_version_with_its_state(run):
    cfg, run_id, policy0, tmp_path = run
    done = run_sync_update(cfg, run_id, policy0, tmp_path / "batch.jsonl", 0)
    assert done is not None
    policy1, metrics = done
    store = run_store(cfg.checkpoint, run_id)
    assert policy1.version == 1 and store.latest() == 1
    assert policy1.manifest_sha256 == store.manifest(1).sha256()
    files = {f.path for f in store.manifest(1).files}
    # the trainer's state went with it, per rank; the engine weights in the rank's own file
    assert {"trainer/optimizer/.metadata", "trainer/model/.metadata", "trainer/state.json"} <= files
    assert any(p.startswith("model-r") for p in files) and "model.safetensors.index.json" in files
    assert metrics["train/steps"] == 2 and metrics["weights/version"] == 1
    assert metrics["timing/policy_update_s"] > 0 and metrics["timing/publish_checkpoint_s"] > 0
    assert "weights/already_published" not in metrics
    # the next update continues from it, Adam's state included
    write_records(tmp_path / "b2.jsonl", _batch(shift=3))
    policy2, m2 = run_sync_update(cfg, run_id, policy1, tmp_path / "b2.jsonl", 1)
    assert policy2.version == 2 and m2["train/steps"] == 2


def test_a_retry_returns_the_published_version_and_another_batch_is_refused(run):
    cfg, run_id, policy0, tmp_path = run
    first = run_sync_update(cfg, run_id, policy0, tmp_path / "batch.jsonl", 0)
    store = run_store(cfg.checkpoint, run_id)
    # the task killed after its publication and retried: the same version, not a second update
    again = run_sync_update(cfg, run_id, policy0, tmp_path / "batch.jsonl", 0)
    assert again[0] == first[0] and store.versions() == [0, 1]
    assert again[1]["weights/already_published"] == 1.0
    assert again[1]["train/loss"] == first[1]["train/loss"]  # the metrics its manifest kept
    # the published version untouched: the same manifest, labelled with the batch
    assert store.manifest(1).sha256() == first[0].manifest_sha256
    assert store.manifest(1).meta[BATCH_LABEL]
    # version 1 from another batch: this pipeline did not make that history
    write_records(tmp_path / "other.jsonl", _batch(shift=5))
    with pytest.raises(CheckpointError, match="version 1 already exists .* not trained on this"):
        run_sync_update(cfg, run_id, policy0, tmp_path / "other.jsonl", 0)
    assert store.versions() == [0, 1] and store.latest() == 1
