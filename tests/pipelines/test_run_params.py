"""The KFP run form (pipelines/params.py): typed run parameters with the config's values as
defaults and a description each, on every compiled pipeline; merged and validated by the first
task (pipelines/tracking.py:start_run). The kfp.local run with a changed form, and
a refused one, are in tests/pipelines/test_cluster_local.py (the shared EKS-target run)."""

from __future__ import annotations

import inspect
import json

import pytest
import yaml
from google.protobuf import json_format
from kfp.pipeline_spec import pipeline_spec_pb2

from moerl.config import config_to_json, parse_config
from moerl.errors import ConfigError
from moerl.orchestrate.compile import compile_pipeline
from moerl.pipelines.params import PARAMS, defaults, merge, params_for
from moerl.pipelines.tracking import start_run

VALKEY = "redis://valkey.moerl.svc:6379/0"
KFP_TYPES = {str: "STRING", int: "NUMBER_INTEGER", float: "NUMBER_DOUBLE"}


def _form(path) -> dict:
    spec = pipeline_spec_pb2.PipelineSpec()
    json_format.ParseDict(next(yaml.safe_load_all(path.read_text())), spec)
    return dict(spec.root.input_definitions.parameters)


@pytest.mark.parametrize(
    "kind,mode,expect",
    [
        (
            "grpo",
            "sync",
            {
                "model",
                "warm_start",
                "dataset",
                "learning_rate",
                "prompts_per_iteration",
                "samples_per_prompt",
                "reward_kind",
                "reward_model",
                "run_name",
            },
        ),
        (
            "grpo",
            "async",
            {
                "model",
                "warm_start",
                "dataset",
                "versions",
                "learning_rate",
                "prompts_per_iteration",
                "samples_per_prompt",
                "rollout_workers",
                "reward_scorers",
                "reward_kind",
                "reward_model",
                "run_name",
            },
        ),
        ("reward_model", "sync", {"model", "dataset", "epochs", "learning_rate", "run_name"}),
    ],
)
def test_every_compiled_pipeline_shows_the_typed_run_form_with_the_configs_defaults(
    tmp_path, kind, mode, expect
):
    cfg = parse_config(
        {
            "pipeline": {"kind": kind, "mode": mode, "iterations": 1, "versions": 7},
            "valkey": {"url": VALKEY},
            "trainer": {"optimizer": {"learning_rate": 3e-4}},
            "reward_model": {"epochs": 5, "learning_rate": 1e-3},
            "rollout": {"workers": 3},
            "reward": {"scorers": 2},
            "tracking": {"run_name": "nightly"},
        }
    )
    form = _form(compile_pipeline(cfg, tmp_path / "p.yaml"))
    assert set(form) == {"config_json", "run_id", "git_sha", "overrides"} | expect
    want = defaults(cfg)
    for name in expect:
        p = next(q for q in PARAMS if q.name == name)
        assert (
            pipeline_spec_pb2.ParameterType.ParameterTypeEnum.Name(form[name].parameter_type)
            == KFP_TYPES[p.type]
        )
        got = form[name].default_value
        value = got.string_value if p.type is str else got.number_value
        assert value == want[name], name
        assert form[name].description == p.describe(kind), name
    assert (
        want["learning_rate"] == (1e-3 if kind == "reward_model" else 3e-4)
        and want["run_name"] == "nightly"
    )
    if mode == "async":
        assert (
            want["versions"] == 7 and want["rollout_workers"] == 3 and want["reward_scorers"] == 2
        )
    assert form["overrides"].parameter_type == pipeline_spec_pb2.ParameterType.LIST
    assert "dotted.key=value" in form["overrides"].description
    assert all(form[k].description for k in ("config_json", "run_id", "git_sha"))
    # the compiled config stays the base: the run form only changes it per run
    assert (
        parse_config(json.loads(form["config_json"].default_value.string_value)).pipeline.kind
        == kind
    )


def test_start_run_takes_every_field_of_every_form_with_its_type():
    sig = inspect.signature(start_run)
    for p in PARAMS:
        assert p.name in sig.parameters, p.name
        assert sig.parameters[p.name].annotation is p.type, p.name
    assert "overrides" in sig.parameters


def test_fields_set_their_keys_and_overrides_come_after():
    base = parse_config({"pipeline": {"mode": "async", "versions": 4}, "valkey": {"url": VALKEY}})
    cfg = merge(
        base,
        {
            "learning_rate": 1e-3,
            "versions": 9,
            "rollout_workers": 5,
            "reward_scorers": 3,
            "dataset": "builtin:digits-reverse",
            "samples_per_prompt": 4,
            "run_name": "lr-sweep-1",
            "warm_start": "registry:moerl-policy@champion",
            "reward_kind": "rules",
            "model": "",
            "reward_model": "",
            "prompts_per_iteration": 16,
        },
        [
            "trainer.loss.clip_eps_high=0.3",
            "trainer.optimizer.learning_rate=5e-4",
            "rollout.temperature=0.7",
        ],
    )
    assert cfg.pipeline.versions == 9 and cfg.rollout.workers == 5 and cfg.reward.scorers == 3
    assert cfg.task.dataset == "builtin:digits-reverse" and cfg.rollout.samples_per_prompt == 4
    assert (
        cfg.tracking.run_name == "lr-sweep-1"
        and cfg.model.warm_start == "registry:moerl-policy@champion"
    )
    assert (
        cfg.model.path is None and cfg.reward.model is None and cfg.task.prompts_per_iteration == 16
    )
    assert cfg.trainer.loss.clip_eps_high == 0.3 and cfg.rollout.temperature == 0.7
    assert cfg.trainer.optimizer.learning_rate == 5e-4  # the override wins over the field
    # the defaults change nothing
    assert merge(base, defaults(base), []) == base


def test_the_reward_model_field_sets_the_registered_model_and_keeps_its_settings():
    base = parse_config(
        {"reward": {"kind": "model", "model": {"registered": "rm/1", "max_batch": 8}}}
    )
    cfg = merge(base, {"reward_model": "rm/latest", "reward_kind": "mixed"}, [])
    assert (
        cfg.reward.model.registered == "rm/latest"
        and cfg.reward.model.max_batch == 8
        and cfg.reward.kind == "mixed"
    )


@pytest.mark.parametrize(
    "values,overrides,names",
    [
        ({"learning_rate": -1.0}, [], "trainer.optimizer.learning_rate"),
        (
            {"learning_rate": "fast"},
            [],
            "learning_rate (trainer.optimizer.learning_rate): expected float",
        ),
        ({"samples_per_prompt": 1}, [], "rollout.samples_per_prompt"),
        ({"warm_start": "latest"}, [], "model.warm_start"),
        # sync: iterations are unrolled
        (
            {"versions": 3},
            [],
            "'versions': not a parameter of this pipeline",
        ),
        ({}, ["trainer.nope=1"], "trainer.nope: unknown key"),
        (
            {},
            ["trainer.optimizer.learning_rate"],
            "overrides: 'trainer.optimizer.learning_rate': expected dotted.key=value",
        ),
        ({}, ["pipeline.iterations=3"], "pipeline.iterations cannot change per run"),
        (
            {},
            ["cluster.groups.trainer.gpus=4"],
            "cluster.groups.trainer.gpus cannot change per run",
        ),
        ({}, ["tracking.experiment=other"], "tracking.experiment cannot change per run"),
        ({"reward_kind": "model", "reward_model": "rm/1"}, [], "reward.kind cannot change per run"),
    ],
)
def test_a_bad_field_or_override_is_one_line_naming_the_key(values, overrides, names):
    base = parse_config({"pipeline": {"iterations": 2}})
    with pytest.raises(ConfigError) as info:
        merge(base, values, overrides)
    assert names in str(info.value) and "\n" not in str(info.value)


def test_the_eks_target_checks_the_merged_config_is_cluster_safe():
    base = parse_config(
        {
            "checkpoint": {"uri": "s3://b/p"},
            "tracking": {"uri": "http://mlflow:5000"},
            "pipeline": {"base_image": "registry.example/moerl-cpu:0.1.0"},
        }
    )
    merge(base, {}, [], target="eks")
    with pytest.raises(
        ConfigError, match="task.dataset: '/data/prompts.jsonl' is a file on this machine"
    ):
        merge(base, {"dataset": "/data/prompts.jsonl"}, [], target="eks")
    assert (
        merge(base, {"dataset": "/data/prompts.jsonl"}, [], target="local").task.dataset
        == "/data/prompts.jsonl"
    )


def test_params_for_follows_the_pipeline():
    assert {p.name for p in params_for(parse_config({}))} >= {"learning_rate", "dataset"}
    assert "versions" not in {p.name for p in params_for(parse_config({}))}
    assert "epochs" in {
        p.name for p in params_for(parse_config({"pipeline": {"kind": "reward_model"}}))
    }


def test_start_run_refuses_a_bad_form_before_any_work_and_records_it(tmp_path, capsys, monkeypatch):
    """The first task itself (the component's function, as the task runs it): a bad field exits
    2 with one line, and the MLflow run it creates says why and is FAILED."""
    from mlflow.tracking import MlflowClient

    monkeypatch.chdir(tmp_path)
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    cfg = parse_config(
        {
            "tracking": {"uri": uri, "experiment": "form"},
            "checkpoint": {"uri": str(tmp_path / "ck")},
        }
    )
    with pytest.raises(SystemExit) as info:
        start_run(
            config_json=config_to_json(cfg),
            run_id="",
            git_sha="abc",
            kfp_run_id="kfp-1",
            **(defaults(cfg) | {"learning_rate": 2.0}),
            overrides=[],
        )
    assert info.value.code == 2
    err = [line for line in capsys.readouterr().err.splitlines() if line.startswith("moerl:")]
    assert err == [
        "moerl: error: run parameters: invalid config: trainer.optimizer.learning_rate: Input should be less than or "
        "equal to 1"
    ]
    client = MlflowClient(uri)
    (run,) = client.search_runs([client.get_experiment_by_name("form").experiment_id])
    assert run.info.status == "FAILED" and run.data.tags["moerl.error"] == err[0].removeprefix(
        "moerl: error: "
    )
    assert run.data.tags["moerl.kfp_run_id"] == "kfp-1"
    assert not (tmp_path / "ck").exists() or not any((tmp_path / "ck").rglob("manifest*"))

    # a good one: the merged config is the task's output, the changes tagged on the run
    out = start_run(
        config_json=config_to_json(cfg),
        run_id="",
        git_sha="abc",
        kfp_run_id="kfp-2",
        **(defaults(cfg) | {"learning_rate": 1e-3, "samples_per_prompt": 4}),
        overrides=["rollout.temperature=0.5"],
    )
    merged = parse_config(json.loads(out.config_json))
    assert merged.trainer.optimizer.learning_rate == 1e-3 and merged.rollout.temperature == 0.5
    assert out.worker_slots == list(range(merged.rollout.workers))
    run = client.get_run(out.run_id)
    assert (
        run.data.params["trainer.optimizer.learning_rate"] == "0.001"
        and run.data.params["rollout.samples_per_prompt"] == "4"
    )
    assert json.loads(run.data.tags["moerl.run_parameters"]) == {
        "trainer.optimizer.learning_rate": "0.001",
        "rollout.samples_per_prompt": "4",
        "rollout.temperature": "0.5",
    }
