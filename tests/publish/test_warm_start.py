"""Warm start (`model.warm_start: previous`): version 0 of a new run is the final checkpoint of
the newest FINISHED run in the experiment, fetched through the checkpoint store and verified.

Real parts: MLflow on a SQLite file, a local-folder checkpoint store, the tiny MoE built from a
seed, and the tracking module's own `start_run` / `finish_run` (which sets
`moerl.final_checkpoint`)."""

import hashlib
import shutil
import time
from pathlib import Path

import pytest

from moerl import tracking
from moerl.config import parse_config
from moerl.errors import CheckpointError
from moerl.store.runs import run_store, version_uri

PREV_SEED, COLD_SEED = 7, 0


def _hashes(root: Path) -> dict[str, str]:
    return {
        p.relative_to(root).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(root.rglob("*"))
        if p.is_file()
    }


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    """One MLflow database and one checkpoint folder for the module; each test its own experiment."""
    from moerl.models.tiny import build_tiny_model

    root = tmp_path_factory.mktemp("warm")
    cfg = parse_config({"model": {"tiny": {"seed": PREV_SEED}}})
    model = build_tiny_model(cfg.model.tiny, root / "prev-model")
    return {
        "root": root,
        "uri": f"sqlite:///{root / 'mlflow.db'}",
        "ck": root / "ck",
        "model": model,
    }


def _cfg(env, experiment, warm_start="previous", ck=None):
    return parse_config(
        {
            "model": {"warm_start": warm_start, "tiny": {"seed": COLD_SEED}},
            "checkpoint": {"uri": str(ck or env["ck"]), "cache_dir": str(env["root"] / "cache")},
            "tracking": {"uri": env["uri"], "experiment": experiment},
        }
    )


def _finished_run(env, cfg, tmp_path, status="FINISHED"):
    """A run that published version 0 (the model) and version 1 (the model + trainer/ state),
    then ended through `tracking.finish_run` with version 1 as its final checkpoint."""
    run_id = tracking.start_run(cfg, env["uri"], {})
    store = run_store(cfg.checkpoint, run_id)
    store.publish(0, env["model"])
    v1 = tmp_path / f"v1-{run_id}"
    shutil.copytree(env["model"], v1)
    (v1 / "trainer").mkdir()
    (v1 / "trainer" / "state.json").write_text('{"version": 1, "step": 2}\n')
    store.publish(1, v1)
    tracking.finish_run(
        env["uri"], run_id, version_uri(store, 1), tmp_path / f"work-{run_id}", status=status
    )
    time.sleep(0.02)  # distinct end times: "newest" is by end time
    return run_id, store


def _tags(env, run_id):
    from mlflow.tracking import MlflowClient

    return MlflowClient(env["uri"]).get_run(run_id).data.tags


def test_warm_start_lays_out_the_previous_final_checkpoint(env, tmp_path, capsys):
    from moerl.components.publish_checkpoint.stage import prepare_initial

    cfg = _cfg(env, "warm-ok")
    prev_id, store = _finished_run(env, cfg, tmp_path)
    current = tracking.start_run(cfg, env["uri"], {})
    state = prepare_initial(cfg, tmp_path / "state", run_id=current)

    expected = {k: v for k, v in _hashes(env["model"]).items()}
    # identical weights, config, tokenizer; no trainer/, no manifest
    assert _hashes(state) == expected
    assert not (state / "trainer").exists()
    assert store.manifest(1).files  # the version it came from is untouched
    tags = _tags(env, current)
    assert tags["moerl.warm_start.run_id"] == prev_id
    assert tags["moerl.warm_start.checkpoint"] == version_uri(store, 1)
    assert f"[moerl] warm start: version 0 is {version_uri(store, 1)}" in capsys.readouterr().out


def test_newest_finished_run_in_this_store_wins(env, tmp_path):
    from moerl.components.publish_checkpoint.stage import find_previous_checkpoint

    cfg = _cfg(env, "warm-newest")
    _finished_run(env, cfg, tmp_path)
    newest, _ = _finished_run(env, cfg, tmp_path)
    _finished_run(env, cfg, tmp_path, status="FAILED")  # newer, but not FINISHED
    running = tracking.start_run(cfg, env["uri"], {})  # newer still, never finished
    tracking.set_tags(
        env["uri"],
        running,
        {"moerl.final_checkpoint": version_uri(run_store(cfg.checkpoint, running), 0)},
    )
    other = _cfg(env, "warm-newest", ck=env["root"] / "other-store")
    _finished_run(env, other, tmp_path)  # newest FINISHED, but its checkpoint is in another store

    prev = find_previous_checkpoint(cfg, current_run_id="not-a-run")
    assert prev is not None and prev.run_id == newest and prev.version == 1
    # the current run itself is never its own warm start
    assert find_previous_checkpoint(cfg, current_run_id=newest).run_id != newest


def test_tampered_final_checkpoint_is_refused(env, tmp_path):
    from moerl.components.publish_checkpoint.stage import prepare_initial

    cfg = _cfg(env, "warm-tampered")
    prev_id, store = _finished_run(env, cfg, tmp_path)
    weights = Path(store.uri) / "versions" / "v000001" / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-1] ^= 0xFF  # same size, one bit pattern changed
    weights.write_bytes(bytes(data))
    current = tracking.start_run(cfg, env["uri"], {})
    with pytest.raises(
        CheckpointError, match=rf"final checkpoint .* of run {prev_id} cannot be used: .*corrupt"
    ):
        prepare_initial(cfg, tmp_path / "state", run_id=current)
    assert not any((tmp_path / "state").glob("*.safetensors"))  # nothing unverified was laid out
    assert "moerl.warm_start.run_id" not in _tags(env, current)


def test_missing_final_checkpoint_is_an_error_not_a_cold_start(env, tmp_path):
    from moerl.components.publish_checkpoint.stage import prepare_initial

    cfg = _cfg(env, "warm-missing")
    _, store = _finished_run(env, cfg, tmp_path)
    (Path(store.uri) / "versions" / "v000001" / "manifest.json").unlink()
    with pytest.raises(CheckpointError, match="not found"):
        prepare_initial(cfg, tmp_path / "state", run_id=tracking.start_run(cfg, env["uri"], {}))


def test_no_previous_run_starts_cold(env, tmp_path, capsys):
    from moerl.components.publish_checkpoint.stage import prepare_initial

    cfg = _cfg(env, "warm-none")
    current = tracking.start_run(cfg, env["uri"], {})
    state = prepare_initial(cfg, tmp_path / "state", run_id=current)
    cold = prepare_initial(_cfg(env, "warm-none", warm_start="none"), tmp_path / "cold")
    assert _hashes(state) == _hashes(cold)  # the tiny model from model.tiny.seed, as with `none`
    assert _hashes(state)["model.safetensors"] != _hashes(env["model"])["model.safetensors"]
    assert "no FINISHED run in experiment 'warm-none'" in capsys.readouterr().out
    assert "moerl.warm_start.run_id" not in _tags(env, current)


def test_warm_start_needs_the_current_run_id(env, tmp_path):
    from moerl.components.publish_checkpoint.stage import prepare_initial

    with pytest.raises(ValueError, match="needs run_id"):
        prepare_initial(_cfg(env, "warm-norun"), tmp_path / "state")


# End to end (init_policy in a pipeline, S3, an MLflow server): tests/pipelines/test_cluster_local.py warm-starts
# its second run from the first and compares the published weights.
