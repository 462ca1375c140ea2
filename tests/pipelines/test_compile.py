"""`moerl compile`: the same pipeline function, written as KFP IR YAML that kfp loads back."""

import subprocess
import sys

import yaml
from google.protobuf import json_format
from kfp.pipeline_spec import pipeline_spec_pb2

from moerl.config import parse_config
from moerl.orchestrate.compile import compile_pipeline


def test_cli_compile_writes_yaml_that_kfp_loads(tmp_path):
    out = tmp_path / "grpo.yaml"
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "moerl.cli",
            "compile",
            "configs/tiny-moe-grpo.yaml",
            "-o",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0, r.stderr
    from kfp import components

    loaded = components.load_component_from_file(str(out))
    assert loaded.name == "moerl-grpo"
    # the compiled config, the run id and provenance, then the run form (tests/pipelines/test_run_params.py)
    assert {"config_json", "run_id", "git_sha", "learning_rate", "dataset", "overrides"} <= set(
        loaded.component_spec.inputs
    )
    # the sync pipeline unrolls its iterations
    assert "versions" not in loaded.component_spec.inputs


def test_compiled_spec_unrolls_iterations_and_uses_the_configured_image(tmp_path):
    cfg = parse_config(
        {"pipeline": {"iterations": 3, "base_image": "registry.example/moerl-cpu:9.9"}}
    )
    out = compile_pipeline(cfg, tmp_path / "p.yaml")
    spec_dict = yaml.safe_load(out.read_text())
    spec = pipeline_spec_pb2.PipelineSpec()
    json_format.ParseDict(spec_dict, spec)  # rejects unknown fields
    root = spec.root.dag.tasks
    # the run inside an ExitHandler whose exit task closes the MLflow run however it ends
    assert {t.task_info.name for t in root.values()} == {"close-run", "moerl-run"}
    close = next(t for t in root.values() if t.task_info.name == "close-run")
    assert (
        close.trigger_policy.strategy
        == pipeline_spec_pb2.PipelineTaskSpec.TriggerPolicy.ALL_UPSTREAM_TASKS_COMPLETED
    )
    tasks = spec.components[
        next(t for t in root.values() if t.task_info.name == "moerl-run").component_ref.name
    ].dag.tasks
    # start, the user-code check, init, finish + 6 tasks (5 stages + log) per iteration: the
    # policy update publishes the version it trains, so no task passes the trainer's state on
    assert len(tasks) == 4 + 6 * 3
    by_name = {t.task_info.name: key for key, t in tasks.items()}
    # the user's code is called in a task of its own, after start_run; init (and so every
    # stage) waits for it
    assert list(tasks[by_name["check-user-code"]].dependent_tasks) == [by_name["start-run"]]
    assert by_name["check-user-code"] in tasks[by_name["init-policy-v0"]].dependent_tasks
    for stage in (
        "rollout",
        "reward",
        "buffer",
        "policy-update",
        "redistribute-weights",
    ):
        assert (
            sum(
                1
                for t in tasks.values()
                if t.component_ref.name == f"comp-{stage.replace('_', '-')}"
                or t.component_ref.name.startswith(f"comp-{stage}")
            )
            == 3
        ), stage
    images = {e["container"]["image"] for e in spec_dict["deploymentSpec"]["executors"].values()}
    assert images == {"registry.example/moerl-cpu:9.9"}
    assert all(not t.caching_options.enable_cache for t in tasks.values())
    # iteration 2's rollout serves what iteration 1's redistribution produced
    ro2 = next(t for name, t in tasks.items() if t.task_info.name == "rollout-2")
    src = ro2.inputs.parameters["policy_json"].task_output_parameter.producer_task
    assert tasks[src].task_info.name == "redistribute-weights-v2"
    # the default config travels as the pipeline's parameter, so the UI shows and edits it
    default = spec.root.input_definitions.parameters["config_json"].default_value.string_value
    assert parse_config(yaml.safe_load(default)).pipeline.iterations == 3
