"""`moerl compile --target eks`: the cluster-safety refusals, and every task's pod settings, read
back from the compiled YAML through the KFP `PipelineSpec` and the kfp-kubernetes
`KubernetesExecutorConfig` protos (both reject unknown fields). Compile only: no cluster."""

from __future__ import annotations

import pytest
import yaml
from google.protobuf import json_format
from kfp.kubernetes import kubernetes_executor_config_pb2 as kpb
from kfp.pipeline_spec import pipeline_spec_pb2

from moerl.cli import main
from moerl.config import parse_config
from moerl.errors import ConfigError
from moerl.launch.podsecrets import RUN_SECRET
from moerl.orchestrate.compile import compile_pipeline
from moerl.pipelines.eks import ENGINE_STAGES, RETRYABLE_STAGES, STAGE_GROUP
from moerl.pipelines.grpo import COMPILED_SIZE_BUDGET, MAX_COMPILED_ITERATIONS
from moerl.pipelines.grpo_async import TRAINER_RETRIES

S3, MLFLOW, VALKEY = (
    "s3://moerl-runs/team",
    "https://mlflow.moerl.svc:5000",
    "redis://valkey.moerl.svc:6379/0",
)
IMAGES = {
    "trainer": "ecr.example/moerl-trainer:1",
    "rollout": "ecr.example/moerl-rollout:1",
    "cpu": "ecr.example/moerl-cpu:1",
    "buffer": "ecr.example/moerl-cpu:1",
    "reward": "ecr.example/moerl-trainer:1",
}


def _cfg(mode: str = "sync", **over) -> dict:
    data = {
        "checkpoint": {"uri": S3},
        "tracking": {"uri": MLFLOW},
        "pipeline": {"mode": mode, "iterations": 2},
        "cluster": {"groups": {g: {"image": img} for g, img in IMAGES.items()}},
    }
    if mode == "async":
        data["valkey"] = {"url": VALKEY, "username": "moerl"}
        data["rollout"] = {"workers": 2}
    for section, values in over.items():
        data.setdefault(section, {}).update(values)
    return data


def _compiled(
    tmp_path, data: dict, **kw
) -> tuple[pipeline_spec_pb2.PipelineSpec, dict, dict[str, kpb.KubernetesExecutorConfig]]:
    path = compile_pipeline(parse_config(data), tmp_path / "p.yaml", target="eks", **kw)
    pipeline_doc, platform_doc = yaml.safe_load_all(path.read_text())
    spec = pipeline_spec_pb2.PipelineSpec()
    json_format.ParseDict(pipeline_doc, spec)  # rejects unknown fields
    k8s = {}
    for name, cfg in platform_doc["platforms"]["kubernetes"]["deploymentSpec"]["executors"].items():
        msg = kpb.KubernetesExecutorConfig()
        json_format.ParseDict(cfg, msg)  # rejects unknown fields
        k8s[name] = msg
    return spec, pipeline_doc, k8s


def _tasks(spec: pipeline_spec_pb2.PipelineSpec) -> dict[str, pipeline_spec_pb2.PipelineTaskSpec]:
    tasks = dict(spec.root.dag.tasks)
    for comp in spec.components.values():
        if comp.HasField("dag"):
            tasks.update(comp.dag.tasks)
    return tasks


def _executor(spec, task: pipeline_spec_pb2.PipelineTaskSpec) -> str:
    return spec.components[task.component_ref.name].executor_label


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_every_task_gets_its_groups_image_placement_resources_scratch_secrets_and_timeout(
    tmp_path, mode
):
    data = _cfg(mode, tracking={"uri": MLFLOW.replace("https://", "https://alice:s3cr3t-pw@")})
    cfg = parse_config(data)
    spec, doc, k8s = _compiled(tmp_path, data)
    containers = doc["deploymentSpec"]["executors"]
    stages_seen = set()
    for task in _tasks(spec).values():
        if task.component_ref.name.startswith(("comp-exit-handler", "comp-for-loop")):
            continue
        stage = task.component_ref.name.removeprefix("comp-").replace("-", "_")
        stage = stage.rstrip("_0123456789") if stage not in STAGE_GROUP else stage
        stages_seen.add(stage)
        group_name = STAGE_GROUP[stage]
        group = getattr(cfg.cluster.groups, group_name)
        label = _executor(spec, task)
        c, kc = containers[label]["container"], k8s[label]
        assert c["image"] == IMAGES[group_name], stage
        assert c["resources"]["resourceCpuRequest"] == group.cpu, stage
        assert (
            c["resources"]["resourceMemoryRequest"]
            == c["resources"]["resourceMemoryLimit"]
            == group.memory
        )
        assert dict(kc.node_selector.labels) == {"moerl.ai/group": group_name}, stage
        assert [(t.key, t.operator, t.value, t.effect) for t in kc.tolerations] == [
            ("moerl.ai/group", "Equal", group_name, "NoSchedule")
        ], stage
        # async: every task lives as long as the run (cluster.async_timeout_s, 14 days by default)
        want = cfg.cluster.async_timeout_s if mode == "async" else group.timeout_s
        assert kc.active_deadline_seconds == want == cfg.cluster.timeout_s(group, mode), stage
        assert dict(kc.pod_metadata.labels)["moerl.ai/stage"] == stage.replace("_", "-")
        mounts = {m.mount_path: m for m in kc.empty_dir_mounts}
        # the GPU groups' scratch is sized for p5en's NVMe (RAID 0), the others' for a root volume
        scratch = "16Ti" if group_name in ("trainer", "rollout") else "200Gi"
        assert (
            mounts["/scratch"].size_limit == scratch == cfg.cluster.scratch_of(group)
            and {"name": "MOERL_SCRATCH", "value": "/scratch"} in c["env"]
        ), stage
        # an engine or a trainer in the task: GPUs, a memory-backed /dev/shm
        if stage in ENGINE_STAGES:
            assert (
                mounts["/dev/shm"].medium == "Memory" and mounts["/dev/shm"].size_limit == group.shm
            ), stage
            acc = c["resources"]["accelerator"]
            assert (acc["resourceType"], acc["resourceCount"]) == ("nvidia.com/gpu", "8"), stage
        else:
            assert "/dev/shm" not in mounts and "accelerator" not in c["resources"], stage
        # credentials: files of Secret volumes, only their paths in the environment (no secretKeyRef)
        assert not kc.secret_as_env and "MLFLOW_TRACKING_PASSWORD" not in {
            e["name"] for e in c.get("env", [])
        }
        secrets = {}
        for ref in _mounted(kc, c).values():
            secrets.setdefault(ref.secret, set()).add(ref.key)
        if stage == "check_user_code":  # the user's code: no credential at all
            assert not secrets and not kc.secret_as_volume and not kc.field_path_as_env, stage
            continue
        # MLflow: the rollout stages' pods read only (manifests/base/mlflow.yaml's reader)
        mlflow = "moerl-mlflow-reader" if stage in ("rollout", "rollout_worker") else "moerl-mlflow"
        assert secrets[mlflow] == {"MLFLOW_TRACKING_USERNAME", "MLFLOW_TRACKING_PASSWORD"}
        # async: the stages log in as the run's own Valkey user (its Secret, named by start_run);
        # only start_run and close_run hold the admin password that makes and deletes it
        admin = stage in ("start_run", "close_run")
        assert ("moerl-valkey" in secrets) == (mode == "async" and admin), stage
        assert secrets.get("moerl-valkey", {"VALKEY_ADMIN_PASSWORD"}) == {
            "VALKEY_ADMIN_PASSWORD"
        }, stage
        assert (RUN_SECRET in secrets) == (mode == "async" and not admin), stage
        assert not task.caching_options.enable_cache
        if mode == "async" and stage in ("rollout_worker", "reward_scorer"):
            assert task.retry_policy.max_retry_count == cfg.pipeline.worker_retries
            assert (
                task.retry_policy.backoff_max_duration.seconds == cfg.pipeline.retry_max_duration_s
            )
        # sync: pure functions of their inputs, redone after a lost pod
        elif stage in RETRYABLE_STAGES:
            assert task.retry_policy.max_retry_count == cfg.pipeline.task_retries == 2, stage
        else:  # must not repeat a publication or the run's bookkeeping
            assert task.retry_policy.max_retry_count == (
                TRAINER_RETRIES if stage == "async_trainer" else 0
            ), stage
    expected = {"start_run", "check_user_code", "close_run", "init_policy", "finish_run"} | (
        {"rollout_worker", "reward_scorer", "async_trainer"}
        if mode == "async"
        else {
            "rollout",
            "reward",
            "buffer",
            "policy_update",
            "redistribute_weights",
            "log_iteration",
        }
    )
    assert stages_seen == expected
    text = (tmp_path / "p.yaml").read_text()
    # credentials come from the Secret
    assert "s3cr3t-pw" not in text and "alice" not in text and MLFLOW in text


def test_the_exit_handler_closes_the_run_however_it_ends(tmp_path):
    spec, _, _ = _compiled(tmp_path, _cfg())
    root = spec.root.dag.tasks
    close = next(t for t in root.values() if t.task_info.name == "close-run")
    assert (
        close.trigger_policy.strategy
        == pipeline_spec_pb2.PipelineTaskSpec.TriggerPolicy.ALL_UPSTREAM_TASKS_COMPLETED
    )
    assert "status" in close.inputs.parameters  # the PipelineTaskFinalStatus of the run's body
    assert (
        close.inputs.parameters["kfp_run_id"].runtime_value.constant.string_value
        == "{{$.pipeline_job_uuid}}"
    )


def test_launched_gpu_stages_run_their_task_on_the_cpu_group(tmp_path):
    data = _cfg(
        cluster={
            "launch": {"mode": "kubernetes"},
            "groups": {g: {"image": img} for g, img in IMAGES.items()},
        }
    )
    spec, doc, k8s = _compiled(tmp_path, data)
    up = next(t for t in _tasks(spec).values() if t.task_info.name == "policy-update-v1")
    kc = k8s[_executor(spec, up)]
    assert dict(kc.node_selector.labels) == {"moerl.ai/group": "cpu"}
    assert "/dev/shm" not in {m.mount_path for m in kc.empty_dir_mounts}
    assert (
        "accelerator"
        not in doc["deploymentSpec"]["executors"][_executor(spec, up)]["container"]["resources"]
    )
    # it knows its namespace and service account (downward API): the workload's owner and account
    assert {(f.name, f.field_path) for f in kc.field_path_as_env} == {
        ("MOERL_POD_NAMESPACE", "metadata.namespace"),
        ("MOERL_SERVICE_ACCOUNT", "spec.serviceAccountName"),
    }
    # the exit task knows where to sweep what a dead launcher left behind
    close = next(t for t in _tasks(spec).values() if t.task_info.name == "close-run")
    assert "MOERL_POD_NAMESPACE" in {f.name for f in k8s[_executor(spec, close)].field_path_as_env}
    # the launcher waits as long as the trainer group's workload may run
    assert kc.active_deadline_seconds == parse_config(data).cluster.groups.trainer.timeout_s


@pytest.mark.parametrize(
    "key,value,needle",
    [
        ("checkpoint.uri", "checkpoints", "checkpoint.uri: 'checkpoints' is a local path"),
        (
            "checkpoint.cache_dir",
            "/var/cache/moerl",
            "checkpoint.cache_dir: '/var/cache/moerl' is outside the pod's scratch",
        ),
        ("model.path", "/home/me/model", "model.path: '/home/me/model' is a path on this machine"),
        (
            "task.dataset",
            "data/prompts.jsonl",
            "task.dataset: 'data/prompts.jsonl' is a file on this machine",
        ),
        (
            "tracking.uri",
            "sqlite:///mlflow.db",
            "tracking.uri: sqlite:///mlflow.db is not an MLflow server",
        ),
        (
            "tracking.uri",
            "file:///tmp/mlruns",
            "tracking.uri: file:///tmp/mlruns is not an MLflow server",
        ),
    ],
)
def test_a_local_path_or_file_tracking_is_refused_naming_the_key(
    tmp_path, capsys, key, value, needle
):
    out = tmp_path / "p.yaml"
    args = [
        "compile",
        "--target",
        "eks",
        "configs/tiny-moe-grpo.yaml",
        "-o",
        str(out),
        "--set",
        f"checkpoint.uri={S3}",
        "--set",
        f"tracking.uri={MLFLOW}",
        "--set",
        f"{key}={value}",
    ]
    if key == "model.path":
        (tmp_path / "model").mkdir()
    assert main(args) == 2
    err = capsys.readouterr().err
    assert needle in err and "Traceback" not in err
    assert not out.exists()


@pytest.mark.parametrize(
    "model,dataset",
    [
        ("s3://team-models/qwen3-30b-a3b/", "s3://team-data/prompts/"),
        ("hf://Qwen/Qwen3-30B-A3B@" + "0" * 40, "s3://team-data/prompts.parquet"),
    ],
)
def test_a_model_and_data_in_s3_or_a_hub_compile_for_eks(tmp_path, model, dataset):
    """The cluster-safety check refuses local paths only: a model staged in S3 or named by a
    hub commit, and a dataset in S3, compile (their contents are checked by the first task)."""
    out = compile_pipeline(
        parse_config(_cfg(model={"path": model}, task={"dataset": dataset})),
        tmp_path / "p.yaml",
        target="eks",
    )
    assert model in out.read_text() and dataset in out.read_text()


def test_cache_inside_the_scratch_is_allowed_and_async_needs_valkey(tmp_path):
    compile_pipeline(
        parse_config(_cfg(checkpoint={"uri": S3, "cache_dir": "/scratch/cache"})),
        tmp_path / "a.yaml",
        target="eks",
    )
    data = _cfg("async")
    del data["valkey"]
    with pytest.raises(ConfigError, match="valkey.url"):
        compile_pipeline(parse_config(data), tmp_path / "b.yaml", target="eks")
    data["valkey"] = {"url": VALKEY}  # no ACL user: the stages would be the server's admin
    with pytest.raises(ConfigError, match="valkey.username: unset.*set moerl"):
        compile_pipeline(parse_config(data), tmp_path / "c.yaml", target="eks")


def test_sync_size_at_the_cap_fits_and_past_it_is_refused(tmp_path):
    at_cap = compile_pipeline(
        parse_config(_cfg(pipeline={"iterations": MAX_COMPILED_ITERATIONS})),
        tmp_path / "cap.yaml",
        target="eks",
    )
    size = at_cap.stat().st_size
    assert size < COMPILED_SIZE_BUDGET, size
    with pytest.raises(ConfigError, match=r"capped at \d+ per run.*--mode async.*--resume RUN_ID"):
        compile_pipeline(
            parse_config(_cfg(pipeline={"iterations": MAX_COMPILED_ITERATIONS + 1})),
            tmp_path / "x.yaml",
            target="eks",
        )
    # a chained continuation past the cap compiles: it resumes the run from its version (two
    # iterations are enough to show it; each compiled iteration costs seconds under pytest)
    cont = compile_pipeline(
        parse_config(_cfg(pipeline={"iterations": MAX_COMPILED_ITERATIONS + 2})),
        tmp_path / "cont.yaml",
        target="eks",
        resume="abc123",
        start_iteration=MAX_COMPILED_ITERATIONS,
    )
    spec = pipeline_spec_pb2.PipelineSpec()
    json_format.ParseDict(next(yaml.safe_load_all(cont.read_text())), spec)
    names = {t.task_info.name for t in _tasks(spec).values()}
    assert f"resume-policy-v{MAX_COMPILED_ITERATIONS}" in names and "init-policy-v0" not in names
    assert spec.root.input_definitions.parameters["run_id"].default_value.string_value == "abc123"


def test_async_size_does_not_grow_with_versions_on_eks(tmp_path):
    small = (
        compile_pipeline(
            parse_config(_cfg("async", pipeline={"mode": "async", "versions": 3})),
            tmp_path / "a.yaml",
            target="eks",
        )
        .stat()
        .st_size
    )
    large = (
        compile_pipeline(
            parse_config(_cfg("async", pipeline={"mode": "async", "versions": 1_000_000})),
            tmp_path / "b.yaml",
            target="eks",
        )
        .stat()
        .st_size
    )
    # the number appears in the config's JSON and as the run form's `versions` default (each
    # twice: the header comment too), nowhere else
    assert 0 < large - small <= 4 * (len("1000000") - len("3"))


def test_a_workload_shape_moerl_cannot_run_yet_is_refused_at_compile(tmp_path):
    # 1 rank cannot span 2 nodes
    data = _cfg(cluster={"launch": {"mode": "kubernetes", "trainer_nodes": 2}})
    with pytest.raises(ConfigError, match="1 ranks do not split evenly over 2 nodes"):
        compile_pipeline(parse_config(data), tmp_path / "p.yaml", target="eks")
    data = _cfg(cluster={"launch": {"mode": "kubernetes", "rollout_nodes_per_worker": 2}})
    with pytest.raises(ConfigError, match="cluster.launch.rollout_nodes_per_worker 2"):
        compile_pipeline(parse_config(data), tmp_path / "p.yaml", target="eks")
    assert not (tmp_path / "p.yaml").exists()


def test_environments_in_launched_rollout_pods_compile_and_run_under_the_sandbox_profile(
    tmp_path,
):
    """Launched rollout pods whose environments run in the sandbox's namespaces get the Localhost
    seccomp profile moerl/sandbox.json (RuntimeDefault refuses unshare): no longer refused at
    compile; with isolation none, and for the trainer, RuntimeDefault."""
    from moerl.launch import objects

    env = {"environment": "moerl.tasks.tools:Lookup"}
    data = _cfg(cluster={"launch": {"mode": "kubernetes"}}, task=env)
    assert compile_pipeline(parse_config(data), tmp_path / "p.yaml", target="eks").exists()
    pod = objects.rollout_pod(parse_config(data), "run1", "rollout-0", ["python"], [])
    assert pod["spec"]["securityContext"]["seccompProfile"] == {
        "type": "Localhost",
        "localhostProfile": objects.SANDBOX_SECCOMP,
    }
    none = _cfg(
        cluster={"launch": {"mode": "kubernetes"}}, task={**env, "sandbox": {"isolation": "none"}}
    )
    pod = objects.rollout_pod(parse_config(none), "run1", "rollout-0", ["python"], [])
    assert pod["spec"]["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
    tj = objects.trainjob(parse_config(data), "run1", "tj", ["python"], [])
    (rjob,) = tj["spec"]["runtimePatches"][0]["trainingRuntimeSpec"]["template"]["spec"][
        "replicatedJobs"
    ]
    ps = rjob["template"]["spec"]["template"]["spec"]
    assert ps["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}


@pytest.mark.parametrize(
    "over,needle",
    [
        (
            {"cluster": {"groups": {g: {"image": None} for g in IMAGES}}},
            "pipeline.base_image: 'moerl-cpu:0.1.0' names no registry",
        ),
        (
            {"cluster": {"groups": {"trainer": {"image": "moerl-trainer:1"}}}},
            "cluster.groups.trainer.image: 'moerl-trainer:1' names no registry",
        ),
        (
            {
                "cluster": {
                    "groups": {
                        **{g: {"image": i} for g, i in IMAGES.items()},
                        "trainer": {"image": IMAGES["trainer"], "gpus": 0},
                    }
                },
                "trainer": {"parallelism": {"device": "cuda"}},
            },
            "cluster.groups.trainer.gpus: 0, but trainer.parallelism.device is cuda",
        ),
    ],
)
def test_images_without_a_registry_and_cuda_without_gpus_are_refused(tmp_path, over, needle):
    with pytest.raises(ConfigError, match=needle):
        compile_pipeline(parse_config(_cfg(**over)), tmp_path / "p.yaml", target="eks")


@pytest.mark.parametrize(
    "cluster,needle",
    [
        ({"groups": {"cpu": {"memory": "1.5Gi"}}}, "cluster.groups.cpu.memory"),
        ({"groups": {"cpu": {"cpu": "2G"}}}, "cluster.groups.cpu.cpu"),
        (
            {
                "groups": {
                    "cpu": {"tolerations": [{"key": "k", "operator": "Exists", "value": "v"}]}
                }
            },
            "value must be empty when operator is Exists",
        ),
        ({"scratch_dir": "/s3"}, "cluster.scratch_dir.*KFP's launcher"),
        ({"groups": {"cpu": {"timeout_s": 60}}}, "cluster.groups.cpu.timeout_s"),
    ],
)
def test_cluster_values_the_api_server_or_kfp_would_refuse_fail_at_load(cluster, needle):
    with pytest.raises(ConfigError, match=needle):
        parse_config({"cluster": cluster})


def test_the_cheap_setter_check_still_refuses_a_task_without_a_container_and_is_undone():
    """pipelines/grpo.py cheap_setter_checks: kfp's own check, without inspect.stack()."""
    from types import SimpleNamespace

    from kfp.dsl import pipeline_task

    from moerl.pipelines.grpo import cheap_setter_checks

    original = pipeline_task.PipelineTask.__dict__["_ensure_container_spec_exists"]
    no_container = SimpleNamespace(container_spec=None)
    with cheap_setter_checks():
        check = pipeline_task.PipelineTask._ensure_container_spec_exists
        assert check is not original

        def set_cpu_request(task):
            check(task)

        with pytest.raises(
            ValueError, match="set_cpu_request can only be used on single-step components"
        ):
            set_cpu_request(no_container)
        check(SimpleNamespace(container_spec=object()))  # a container: nothing to say
    assert pipeline_task.PipelineTask.__dict__["_ensure_container_spec_exists"] is original


def _placement(spec, doc, k8s, stage_prefix: str) -> tuple[str, str | None, dict]:
    """(group label, GPU count or None, env) of the first task whose component is `stage_prefix`."""
    for task in _tasks(spec).values():
        if task.component_ref.name.removeprefix("comp-").startswith(stage_prefix):
            label = _executor(spec, task)
            c = doc["deploymentSpec"]["executors"][label]["container"]
            acc = c["resources"].get("accelerator")
            return (
                dict(k8s[label].node_selector.labels)["moerl.ai/group"],
                acc and acc["resourceCount"],
                c,
            )
    raise AssertionError(f"no task {stage_prefix}")


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_reward_model_scoring_runs_on_its_own_gpu_group(tmp_path, mode):
    rm = {"kind": "mixed", "model": {"registered": "moerl-tiny-rm/3", "device": "cuda"}}
    stage = "reward-scorer" if mode == "async" else "reward"
    spec, doc, k8s = _compiled(tmp_path, _cfg(mode, reward=rm))
    assert _placement(spec, doc, k8s, stage)[:2] == ("reward", "1")
    spec, doc, k8s = _compiled(tmp_path, _cfg(mode))  # rules: the CPU group, no GPU
    assert _placement(spec, doc, k8s, stage)[:2] == ("cpu", None)


def test_the_reward_model_pipeline_compiles_for_eks(tmp_path):
    data = _cfg(pipeline={"kind": "reward_model", "name": "moerl-reward-model"})
    spec, doc, k8s = _compiled(tmp_path, data)
    names = {t.task_info.name for t in _tasks(spec).values()}
    assert {
        "start-run",
        "prepare-preferences",
        "train-reward-model",
        "evaluate-reward-model",
        "publish-reward-model",
        "finish-run",
        "close-run",
    } <= names
    assert _placement(spec, doc, k8s, "prepare-preferences")[:2] == ("cpu", None)
    assert _placement(spec, doc, k8s, "train-reward-model")[:2] == ("trainer", "8")
    assert _placement(spec, doc, k8s, "publish-reward-model")[:2] == ("buffer", None)
    # the same cluster-safety checks as GRPO
    with pytest.raises(ConfigError, match="checkpoint.uri"):
        compile_pipeline(
            parse_config({**data, "checkpoint": {"uri": "checkpoints"}}),
            tmp_path / "x.yaml",
            target="eks",
        )
    with pytest.raises(
        ConfigError, match="reward_model.data: '/home/me/prefs.jsonl' is a file on this machine"
    ):
        compile_pipeline(
            parse_config({**data, "reward_model": {"data": "/home/me/prefs.jsonl"}}),
            tmp_path / "x.yaml",
            target="eks",
        )
    gpu_less = _cfg(reward={"kind": "model", "model": {"registered": "rm/1", "device": "cuda"}})
    gpu_less["cluster"]["groups"]["reward"] = {"image": IMAGES["reward"], "gpus": 0}
    with pytest.raises(
        ConfigError, match="cluster.groups.reward.gpus: 0, but reward.model.device is cuda"
    ):
        compile_pipeline(parse_config(gpu_less), tmp_path / "x.yaml", target="eks")


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_the_cache_tier_gives_publishers_the_writer_and_engines_the_reader_identity(tmp_path, mode):
    """checkpoint.cache_tier on EKS: the stages that publish get the cache server's writer keys,
    the ones that read weights or check the bucket its reader keys (Read, List:
    manifests/base/ckpt-cache.yaml), the rest none; with checkpoint.fanout the async rollout workers advertise their pod IP."""
    ck = {
        "uri": S3,
        "cache_tier": {
            "uri": "s3://moerl-cache/ckpt",
            "endpoint_url": "http://moerl-ckpt-cache.moerl.svc:8333",
        },
    }
    if mode == "async":
        ck["fanout"] = True
    spec, doc, k8s = _compiled(tmp_path, _cfg(mode, checkpoint=ck))
    seen = {}
    for task in _tasks(spec).values():
        kc = k8s.get(_executor(spec, task))
        if kc is None:
            continue
        stage = dict(kc.pod_metadata.labels)["moerl.ai/stage"].replace("-", "_")
        mounted = _mounted(
            kc, doc["deploymentSpec"]["executors"][_executor(spec, task)]["container"]
        )
        # one Secret per identity: a whole Secret is mounted, so a reader's holds no writer's key
        keys = {
            var: ref.key
            for var, ref in mounted.items()
            if ref.secret.startswith("moerl-ckpt-cache")
            and ref.secret == f"moerl-ckpt-cache-{ref.key.split('_')[0].lower()}"
        }
        seen[stage] = keys
        fields = {f.name: f.field_path for f in kc.field_path_as_env}
        assert (fields.get("MOERL_FANOUT_ADVERTISE") == "status.podIP") == (
            stage == "rollout_worker"
        ), stage
    writer = {
        "MOERL_CACHE_TIER_ACCESS_KEY_ID": "WRITER_ACCESS_KEY_ID",
        "MOERL_CACHE_TIER_SECRET_ACCESS_KEY": "WRITER_SECRET_ACCESS_KEY",
    }
    reader = {k: v.replace("WRITER", "READER") for k, v in writer.items()}
    # start_run reads: its preflight checks the bucket (HeadBucket: the reader's Read, List allow it)
    # finish_run writes: it deletes the finished run's prefix from the cache tier (drop_cache_run)
    want = (
        {
            "start_run": reader,
            "init_policy": writer,
            "async_trainer": writer,
            "rollout_worker": reader,
            "finish_run": writer,
        }
        if mode == "async"
        else {
            "start_run": reader,
            "init_policy": writer,
            "policy_update": writer,  # it publishes the version it trains
            "rollout": reader,
            "redistribute_weights": reader,
            "finish_run": writer,
        }
    )
    assert {s: k for s, k in seen.items() if k} == want
    # reward, buffer, bookkeeping: no keys
    assert all(not k for s, k in seen.items() if s not in want)


def test_an_embedded_cache_tier_or_a_sync_fanout_is_not_cluster_safe(tmp_path):
    from moerl.errors import ConfigError

    ck = {"uri": S3, "cache_tier": {"uri": "s3://c/p", "endpoint_url": "embedded"}, "fanout": True}
    with pytest.raises(
        ConfigError, match=r"checkpoint.cache_tier.endpoint_url: 'embedded'.*checkpoint.fanout"
    ):
        _compiled(tmp_path, _cfg("sync", checkpoint=ck))


def _mounted(kc: kpb.KubernetesExecutorConfig, container: dict) -> dict:
    """What a compiled task's pod gets from Secrets: credential variable -> SecretRef, read back
    from its Secret volumes and the `<VAR>_FILE` paths in its environment. The run's own Secret,
    whose name is start_run's output `valkey_secret` (or a loop's copy of it), reads as RUN_SECRET."""
    from moerl.launch.podsecrets import LAUNCHER_TOKEN, SecretRef

    volumes = {}
    for v in kc.secret_as_volume:
        if v.secret_name == LAUNCHER_TOKEN:  # the launcher's API token, no credential file
            continue
        p = v.secret_name_parameter
        if p.HasField("task_output_parameter"):
            assert (
                p.task_output_parameter.producer_task,
                p.task_output_parameter.output_parameter_key,
            ) == ("start-run", "valkey_secret")
            name = RUN_SECRET
        elif p.component_input_parameter:
            assert p.component_input_parameter == "pipelinechannel--start-run-valkey_secret"
            name = RUN_SECRET
        else:
            name = p.runtime_value.constant.string_value
            assert v.secret_name == name and v.mount_path == f"/var/run/secrets/moerl/{name}"
        volumes[v.mount_path] = (name, v.optional)
    files = {}
    for e in container.get("env", []):
        if e["name"].endswith("_FILE"):
            mount, key = e["value"].rsplit("/", 1)
            name, optional = volumes[mount]
            files[e["name"].removesuffix("_FILE")] = SecretRef(name, key, optional)
    # none mounted for nothing
    assert {ref.path().rsplit("/", 1)[0] for ref in files.values()} == set(volumes)
    return files


def test_every_stages_pod_mounts_exactly_the_secrets_pod_secret_env_gives_it(tmp_path):
    """The one mapping the local cluster test's sandbox hands its tasks (moerl.launch.podsecrets)
    is what every compiled task of every pipeline mounts, and what a launched workload gets; the
    first task gets the cache server's reader keys, never the writer's."""
    from moerl.launch.podsecrets import pod_secret_env
    from moerl.launch.task import ASYNC_STAGES, launch_env
    from moerl.pipelines.eks import GPU_STAGES

    ck = {
        "uri": S3,
        "cache_tier": {
            "uri": "s3://moerl-cache/ckpt",
            "endpoint_url": "http://moerl-ckpt-cache.moerl.svc:8333",
        },
    }
    launched = {
        "launch": {"mode": "kubernetes"},
        "groups": {g: {"image": img} for g, img in IMAGES.items()},
    }
    cases = [
        ("sync", _cfg("sync", checkpoint=ck), False, {}),
        ("async", _cfg("async", checkpoint=ck), True, {}),
        ("resumed", _cfg("sync", checkpoint=ck), False, {"resume": "run-1", "start_iteration": 1}),
        (
            "reward-model",
            _cfg(pipeline={"kind": "reward_model", "name": "moerl-rm"}, checkpoint=ck),
            False,
            {},
        ),
        ("launched", _cfg("sync", checkpoint=ck, cluster=launched), False, {}),
    ]
    seen: set[str] = set()
    for name, data, async_mode, kw in cases:
        cfg = parse_config(data)
        (tmp_path / name).mkdir()
        spec, doc, k8s = _compiled(tmp_path / name, data, **kw)
        for task in _tasks(spec).values():
            kc = k8s.get(_executor(spec, task))
            if kc is None:  # the exit handler's and loops' groups: no pod
                continue
            stage = dict(kc.pod_metadata.labels)["moerl.ai/stage"].replace("-", "_")
            seen.add(stage)
            mounted = _mounted(
                kc, doc["deploymentSpec"]["executors"][_executor(spec, task)]["container"]
            )
            assert mounted == pod_secret_env(cfg, stage, async_mode), (name, stage)
            if stage == "start_run":
                assert {
                    ref.key for ref in mounted.values() if ref.secret.startswith("moerl-ckpt-cache")
                } == {"READER_ACCESS_KEY_ID", "READER_SECRET_ACCESS_KEY"}, name
        if name == "launched":  # the pods a launcher task starts: the same mapping, as files
            for stage in GPU_STAGES:
                env = launch_env(cfg, stage, environ={})
                assert not [e for e in env if "secretKeyRef" in e.get("valueFrom", {})], stage
                files = {e["name"]: e["value"] for e in env if e["name"].endswith("_FILE")}
                want = pod_secret_env(cfg, stage, stage in ASYNC_STAGES)
                assert files == {f"{var}_FILE": ref.path() for var, ref in want.items()}, stage
    assert seen == set(STAGE_GROUP)  # every stage was compiled and checked


def test_an_async_pipeline_without_the_valkey_admins_secret_is_refused(tmp_path):
    """Its first task makes the run's own Valkey user with the admin password of
    cluster.valkey_secret: without the Secret the run could not start, so compile says so."""
    data = _cfg("async")
    data["cluster"]["valkey_secret"] = None
    with pytest.raises(
        ConfigError,
        match=r"cluster.valkey_secret: null, but the async pipeline's first task makes "
        r"the run's own Valkey user",
    ):
        _compiled(tmp_path, data)
    # sync: fine
    _compiled(
        tmp_path, {**_cfg("sync"), "cluster": {**_cfg("sync")["cluster"], "valkey_secret": None}}
    )
