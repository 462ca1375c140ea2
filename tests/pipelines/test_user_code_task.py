"""The user's verifiers and environments never run in a task that holds the Valkey admin's
password or the launcher's token: `start_run` (which holds both in the async pipeline on EKS)
preflights everything but the user's code, and `check_user_code`, a task whose pod mounts no
Secret and no token, calls each verifier and environment once; every stage waits for it. Read
back from the compiled YAML (KFP and kfp-kubernetes protos), and called as the tasks call it."""

from __future__ import annotations

import json

import pytest
import yaml
from google.protobuf import json_format
from kfp.kubernetes import kubernetes_executor_config_pb2 as kpb
from kfp.pipeline_spec import pipeline_spec_pb2

from moerl.config import load_config, parse_config
from moerl.launch.podsecrets import LAUNCHER_TOKEN, pod_secret_env
from moerl.orchestrate.compile import compile_pipeline
from moerl.pipelines.eks import USER_CODE_STAGES, runs_user_code

CONFIG = "configs/tiny-moe-grpo.yaml"
IMAGES = {g: "ecr.example/moerl:1" for g in ("trainer", "rollout", "cpu", "buffer", "reward")}
# the run's own bookkeeping, before the check or however the run ends
BEFORE_CHECK = {"start-run", "check-user-code", "close-run"}


def _eks_cfg(mode: str, launch: str):
    data: dict = {
        "checkpoint": {"uri": "s3://moerl-runs/team"},
        "tracking": {"uri": "https://mlflow.moerl.svc:5000"},
        "pipeline": {"mode": mode, "iterations": 2},
        "task": {"environments": {"copy": "tests.support.hostile_environments:Counter"}},
        "cluster": {
            "launch": {"mode": launch},
            "groups": {g: {"image": img} for g, img in IMAGES.items()},
        },
    }
    if mode == "async":
        data["valkey"] = {"url": "redis://valkey.moerl.svc:6379/0", "username": "moerl"}
    return parse_config(data)


def _compiled(tmp_path, cfg):
    path = compile_pipeline(cfg, tmp_path / "p.yaml", target="eks")
    pipeline_doc, platform_doc = yaml.safe_load_all(path.read_text())
    spec = pipeline_spec_pb2.PipelineSpec()
    json_format.ParseDict(pipeline_doc, spec)  # rejects unknown fields
    execs = {}
    for label, doc in platform_doc["platforms"]["kubernetes"]["deploymentSpec"][
        "executors"
    ].items():
        msg = kpb.KubernetesExecutorConfig()
        json_format.ParseDict(doc, msg)  # rejects unknown fields
        execs[label] = msg
    return spec, pipeline_doc["deploymentSpec"]["executors"], execs


def _dags(spec) -> dict[str, dict[str, pipeline_spec_pb2.PipelineTaskSpec]]:
    """Every DAG's tasks by task key, by the DAG's component name ("" for the root)."""
    out = {"": dict(spec.root.dag.tasks)}
    for name, comp in spec.components.items():
        if comp.HasField("dag"):
            out[name] = dict(comp.dag.tasks)
    return out


def _waits_for_check(dags, spec) -> dict[str, bool]:
    """Task name -> whether it runs only after check-user-code: it or a DAG task that holds it
    (an ExitHandler's or a ParallelFor's) depends on the check, directly or through another."""
    parent: dict[str, tuple[str, str]] = {}  # a DAG component -> (its DAG, the task running it)
    for dag, tasks in dags.items():
        for key, t in tasks.items():
            if t.component_ref.name in dags:
                parent[t.component_ref.name] = (dag, key)

    def waits(dag: str, key: str, seen: frozenset = frozenset()) -> bool:
        t = dags[dag][key]
        if t.task_info.name == "check-user-code":
            return True
        if any(waits(dag, d, seen) for d in t.dependent_tasks):
            return True
        return dag in parent and dag not in seen and waits(*parent[dag], seen | {dag})

    return {
        t.task_info.name: waits(dag, key)
        for dag, tasks in dags.items()
        for key, t in tasks.items()
        if t.component_ref.name not in dags
    }


@pytest.mark.parametrize("mode", ["sync", "async"])
@pytest.mark.parametrize("launch", ["in_task", "kubernetes"])
def test_no_task_that_holds_the_admin_password_or_the_launcher_token_runs_user_code(
    tmp_path, mode, launch
):
    cfg = _eks_cfg(mode, launch)
    spec, containers, execs = _compiled(tmp_path, cfg)
    holders, user_code = set(), set()
    for label, kc in execs.items():
        stage = dict(kc.pod_metadata.labels)["moerl.ai/stage"].replace("-", "_")
        volumes = {v.secret_name for v in kc.secret_as_volume}
        admin = "moerl-valkey" in volumes  # cluster.valkey_secret: VALKEY_ADMIN_PASSWORD
        if admin or LAUNCHER_TOKEN in volumes:
            holders.add(stage)
        if runs_user_code(cfg, stage):
            user_code.add(stage)
        if stage == "check_user_code":  # no Secret, no token, no namespace or account names
            assert not kc.secret_as_volume and not kc.secret_as_env and not kc.field_path_as_env
            env = {e["name"] for e in containers[label]["container"].get("env", [])}
            assert not [e for e in env if e.endswith("_FILE") or e.startswith("MOERL_KUBE")], env
            assert pod_secret_env(cfg, stage, mode == "async") == {}
    # the async run's own Valkey user (start_run makes it, close_run deletes it); the launchers
    assert ("start_run" in holders) == (mode == "async")
    assert ("close_run" in holders) == (mode == "async" or launch == "kubernetes")
    assert not holders & user_code, holders & user_code
    # the stages that call verifiers (scoring) and environments (in-task rollout) are compiled,
    # and the check among them
    assert "check_user_code" in user_code and user_code <= USER_CODE_STAGES
    assert ("rollout" in user_code or "rollout_worker" in user_code) == (launch == "in_task")
    # every stage starts only after the check passed: its task, or the loop holding it, waits
    waits = _waits_for_check(_dags(spec), spec)
    stages = {n for n in waits if n not in BEFORE_CHECK}
    assert stages and all(waits[n] for n in stages), {n for n in stages if not waits[n]}
    assert not waits["start-run"] and not waits["close-run"]


def _local_cfg(tmp_path, verifier: str):
    data = tmp_path / "d.jsonl"
    data.write_text(
        json.dumps({"id": "c0", "task": "copy", "prompt": "copy 12=", "answer": "12"})
        + "\n"
        + json.dumps({"id": "l0", "task": "lookup", "prompt": "look", "answer": "x"})
        + "\n"
    )
    return load_config(
        CONFIG,
        [
            f"checkpoint.uri={tmp_path / 'ck'}",
            f"task.dataset={data}",
            f"reward.verifiers={json.dumps({'lookup': verifier})}",
            "reward.sandbox.isolation=none",
            f"tracking.uri=sqlite:///{tmp_path / 'mlflow.db'}",
        ],
    )


def test_start_run_calls_no_user_code_and_the_check_task_refuses_a_bad_verifier(tmp_path, capsys):
    """start_run's merge and preflight pass a config whose verifier cannot even be imported (it
    never calls it); the check task calls it and exits non-zero with one line naming the key. A
    working verifier passes both."""
    from moerl.config import config_to_json
    from moerl.pipelines.params import params_for
    from moerl.pipelines.start import merged_config, user_code_check

    bad = _local_cfg(tmp_path, "no_such_pkg.mod:fn")
    given = {p.name: None for p in params_for(bad)}
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    merged = merged_config(bad, given, [], "local", uri, "", {})
    assert merged.reward.verifiers == {"lookup": "no_such_pkg.mod:fn"}
    with pytest.raises(SystemExit) as exit_:
        user_code_check(config_to_json(merged))
    assert exit_.value.code not in (0, None)
    err = capsys.readouterr().err
    (line,) = [x for x in err.splitlines() if x.startswith("moerl: error:")]
    assert line.startswith("moerl: error: reward.verifiers.lookup: no_such_pkg.mod:fn cannot score")
    assert "No module named 'no_such_pkg'" in line
    good = _local_cfg(tmp_path, "tests.support.user_verifiers:by_meta")
    user_code_check(config_to_json(merged_config(good, given, [], "local", uri, "", {})))
    assert "verifiers and environments passed" in capsys.readouterr().out
