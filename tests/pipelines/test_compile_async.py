"""`moerl compile --mode async`: the async pipeline's IR (graph, retries, fan-out, size that does
not grow with the number of versions), its `valkey.url` requirement, and the config's `modes:`
overlay. Compile only: no engine, no Valkey."""

import pytest
import yaml
from google.protobuf import json_format
from kfp.pipeline_spec import pipeline_spec_pb2

from moerl.cli import main
from moerl.config import load_config, parse_config
from moerl.errors import ConfigError
from moerl.orchestrate.compile import compile_pipeline

VALKEY = "redis://valkey.moerl.svc:6379/0"


def _cfg(**pipeline):
    return parse_config(
        {
            "pipeline": {"mode": "async", **pipeline},
            "valkey": {"url": VALKEY},
            "rollout": {"workers": 3},
            "reward": {"scorers": 2},
        }
    )


def _spec(path) -> tuple[pipeline_spec_pb2.PipelineSpec, dict]:
    spec_dict = yaml.safe_load(path.read_text())
    spec = pipeline_spec_pb2.PipelineSpec()
    json_format.ParseDict(spec_dict, spec)  # rejects unknown fields
    return spec, spec_dict


def _all_tasks(
    spec: pipeline_spec_pb2.PipelineSpec,
) -> dict[str, pipeline_spec_pb2.PipelineTaskSpec]:
    """Every task of the root DAG and of the ParallelFor bodies, by task name."""
    tasks = dict(spec.root.dag.tasks)
    for comp in spec.components.values():
        if comp.HasField("dag"):
            tasks.update(comp.dag.tasks)
    return tasks


def test_async_pipeline_compiles_to_the_concurrent_graph(tmp_path):
    spec, spec_dict = _spec(compile_pipeline(_cfg(), tmp_path / "a.yaml"))
    top = spec.root.dag.tasks
    # the run in an ExitHandler
    assert {t.task_info.name for t in top.values()} == {
        "close-run",
        "moerl-run",
    }
    root = spec.components[
        next(t for t in top.values() if t.task_info.name == "moerl-run").component_ref.name
    ].dag.tasks
    assert {t.task_info.name for t in root.values()} == {
        "start-run",
        "check-user-code",
        "init-policy-v0",
        "rollout-workers",
        "reward-scorers",
        "trainer",
        "finish-run",
    }
    by_name = {t.task_info.name: key for key, t in root.items()}
    init = by_name["init-policy-v0"]
    # the user's code is called once each in a task of its own, after start_run; no stage
    # starts before it passes (the loops' bodies wait for it: tests/pipelines/test_user_code_task.py)
    check = by_name["check-user-code"]
    assert list(root[check].dependent_tasks) == [by_name["start-run"]]
    assert check in root[init].dependent_tasks
    # the three long-lived stages do not wait for each other; the workers and scorers start
    # beside version 0's publication (their engines start on dummy weights), the trainer after it
    for stage in ("rollout-workers", "reward-scorers", "trainer"):
        deps = set(root[by_name[stage]].dependent_tasks)
        assert (init in deps) == (stage == "trainer"), stage
        assert by_name["start-run"] in deps or stage == "trainer", stage
        assert not deps & {by_name[s] for s in ("rollout-workers", "reward-scorers", "trainer")}, (
            stage
        )
    # a failing init_policy stops the stages that started beside it (it marks the run failed)
    assert root[init].inputs.parameters["stages_beside"].runtime_value.constant.bool_value is True
    assert set(root[by_name["finish-run"]].dependent_tasks) >= {by_name["trainer"]}
    fin_policy = root[by_name["finish-run"]].inputs.parameters["policy_json"].task_output_parameter
    assert fin_policy.producer_task == by_name["trainer"]
    tasks = _all_tasks(spec)
    assert all(
        not t.caching_options.enable_cache
        for t in tasks.values()
        if not t.HasField("parameter_iterator")
    )
    inner = (
        {t.task_info.name for t in tasks.values()}
        - {t.task_info.name for t in root.values()}
        - {t.task_info.name for t in top.values()}
    )
    assert inner == {"rollout-worker", "reward-scorer"}
    default = spec.root.input_definitions.parameters["config_json"].default_value.string_value
    assert parse_config(yaml.safe_load(default)).pipeline.mode == "async"
    assert {e["container"]["image"] for e in spec_dict["deploymentSpec"]["executors"].values()} == {
        "moerl-cpu:0.1.0"
    }


def test_compiled_size_does_not_depend_on_versions(tmp_path):
    small = compile_pipeline(_cfg(versions=3), tmp_path / "v3.yaml").read_text()
    large = compile_pipeline(_cfg(versions=100000), tmp_path / "v100000.yaml").read_text()
    # only the digits of `versions` differ: in the embedded config default and as the run form's
    # `versions` default (each twice: the header comment too)
    assert 0 < len(large) - len(small) <= 4 * (len("100000") - len("3"))
    assert (
        small.replace('"versions":3,', '"versions":100000,')
        .replace("versions: int [Default: 3.0]", "versions: int [Default: 100000.0]")
        .replace(
            "versions:\n        defaultValue: 3.0", "versions:\n        defaultValue: 100000.0"
        )
        == large
    )


def test_rollout_workers_and_scorers_retry_far_past_kfps_one_hour_default(tmp_path):
    cfg = _cfg(worker_retries=42, retry_max_duration_s=14 * 24 * 3600)
    spec, _ = _spec(compile_pipeline(cfg, tmp_path / "a.yaml"))
    tasks = {t.task_info.name: t for t in _all_tasks(spec).values()}
    for name in ("rollout-worker", "reward-scorer"):
        policy = tasks[name].retry_policy
        assert policy.max_retry_count == 42, name
        assert policy.backoff_max_duration.seconds == 14 * 24 * 3600 > 100 * 3600, name
        assert policy.backoff_duration.seconds == 10 and policy.backoff_factor == 1.0, name
    trainer = tasks["trainer"].retry_policy
    assert (
        0 < trainer.max_retry_count < 42 and trainer.backoff_max_duration.seconds == 14 * 24 * 3600
    )
    # a task that must not repeat (it would publish version 0 again) has none
    assert tasks["init-policy-v0"].retry_policy.max_retry_count == 0


def test_parallel_for_runs_every_worker_slot_at_once(tmp_path):
    cfg = parse_config(
        {
            "pipeline": {"mode": "async"},
            "valkey": {"url": VALKEY},
            "rollout": {"workers": 5},
            "reward": {"scorers": 2},
        }
    )
    spec, _ = _spec(compile_pipeline(cfg, tmp_path / "a.yaml"))
    loops = {
        t.task_info.name: t for t in _all_tasks(spec).values() if t.HasField("parameter_iterator")
    }
    # the slots come from start_run (the run's merged config: the run form's rollout_workers and
    # reward_scorers), with no parallelism limit, so none waits for another to end
    for name, output in (("rollout-workers", "worker_slots"), ("reward-scorers", "scorer_slots")):
        loop = loops[name]
        assert loop.iterator_policy.parallelism_limit == 0, name
        source = loop.inputs.parameters[
            loop.parameter_iterator.items.input_parameter
        ].task_output_parameter
        assert source.output_parameter_key == output and source.producer_task == "start-run", name
    form = spec.root.input_definitions.parameters
    assert form["rollout_workers"].default_value.number_value == 5
    assert form["reward_scorers"].default_value.number_value == 2


def test_cli_compile_async_without_valkey_url_is_a_config_error(tmp_path, capsys):
    out = tmp_path / "a.yaml"
    code = main(["compile", "--mode", "async", "configs/tiny-moe-grpo.yaml", "-o", str(out)])
    assert code == 2
    err = capsys.readouterr().err
    assert "valkey.url" in err and "moerl run --mode async" in err
    assert not out.exists()
    # with it, the same command writes the async pipeline
    assert (
        main(
            [
                "compile",
                "--mode",
                "async",
                "configs/tiny-moe-grpo.yaml",
                "--set",
                f"valkey.url={VALKEY}",
                "-o",
                str(out),
            ]
        )
        == 0
    )
    spec, _ = _spec(out)
    assert "trainer" in {t.task_info.name for t in _all_tasks(spec).values()}


def test_async_compile_never_writes_the_tracking_credentials(tmp_path, capsys):
    uri = "http://alice:s3cr3t@127.0.0.1:5000/mlflow"
    cfg = parse_config(
        {"pipeline": {"mode": "async"}, "valkey": {"url": VALKEY}, "tracking": {"uri": uri}}
    )
    text = compile_pipeline(cfg, tmp_path / "a.yaml").read_text()
    assert "http://127.0.0.1:5000/mlflow" in text and "alice" not in text and "s3cr3t" not in text
    assert (
        "MLFLOW_TRACKING_PASSWORD and MLFLOW_TRACKING_USERNAME from a Kubernetes Secret"
        in capsys.readouterr().err
    )


def test_modes_block_applies_to_its_mode_only(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text(
        "trainer: {loss: {clip_eps_high: 3.0}}\n"
        "modes:\n  async:\n    trainer: {loss: {clip_eps_high: 0.28}}\n"
    )
    assert load_config(path, mode="async").trainer.loss.clip_eps_high == 0.28
    assert load_config(path, mode="async").pipeline.mode == "async"
    assert load_config(path, mode="sync").trainer.loss.clip_eps_high == 3.0
    # the file's pipeline.mode, default sync
    assert load_config(path).trainer.loss.clip_eps_high == 3.0
    with pytest.raises(ConfigError, match="mode"):
        load_config(path, mode="turbo")
    bad = tmp_path / "bad.yaml"
    bad.write_text("modes:\n  turbo:\n    trainer: {loss: {clip_eps_high: 0.28}}\n")
    with pytest.raises(ConfigError, match="modes"):
        load_config(bad)
