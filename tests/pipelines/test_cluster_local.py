"""The local proof of cluster-safety: the EKS-target sync pipeline on kfp.local, every task in its
own empty working directory, scratch, cache and HOME (`MOERL_SANDBOX_ROOT`, moerl/launch/podenv.py),
sharing nothing but real servers on 127.0.0.1: S3 (`weed mini`), the checkpoint cache tier (a
second `weed mini`, as the buffer group's SeaweedFS, with its writer and Read/List reader
identities), an MLflow tracking server (`mlflow server`), and torch's compile cache (why:
tests/support/sandbox.py). Every task holds only the credentials its pod gets on EKS: the cluster's
Secrets are a file (`MOERL_SANDBOX_SECRETS`), and each task, entering its pod, drops every
credential it inherited and takes its own stage's keys from it, as 0400 files in its own sandbox
(`moerl.launch.podsecrets`: never as variables, as on EKS, where they are Secret volumes); the
durable S3 keys stand in for the service account's IRSA role, which every pod has. (With the
keys in this process's environment instead, every task held the writer's keys, and a first task
that got none on EKS passed here.) It must complete and learn, and
registers its final version in the MLflow server's model registry. A second run, warm-started
from that version once it is made champion (as scheduled retraining does), requires a GPU its rollout node
does not have (`require.gpu`): the rollout fails at its start, is retried
(`pipeline.task_retries`), then the exit handler marks the MLflow run FAILED, and `latest`
stays on version 0. The learning run's typed run parameters and overrides (the KFP run form)
set what makes it learn; a third run, whose form has a bad value, is refused by its first task.

kfp.local ignores the kfp-kubernetes settings (node selectors, volumes, Secrets); those are
checked on the compiled YAML in tests/pipelines/test_compile_eks.py, which also checks that the Secrets
each task mounts are the ones the sandbox gives it here."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import pytest

from moerl.config import parse_config
from tests.support.mlflow_server import mlflow_server
from tests.support.sandbox import sandboxed

BUCKET = "moerl-cluster"
SOURCES = "team-sources"  # the user's model and data (manifests/iam/moerl-s3-sources.json)
MODEL_URI, DATA_URI = f"s3://{SOURCES}/models/tiny-qwen3/", f"s3://{SOURCES}/data/digits-copy.jsonl"
REGISTRY = {"registry_name": "moerl-policy"}
ITERATIONS = 4
PREFIX = "team-a"
# the learning run's run form (pipelines/params.py): a typed field, an override, the run's name
OK_PARAMS = {
    "learning_rate": 2e-3,
    "overrides": ["trainer.loss.clip_eps_high=3.0"],
    "run_name": "cluster-ok",
}


def _cluster_cfg(s3, url: str, **over):
    # measured with the one-process floor (`moerl bench modes --arms floor --iterations 4`):
    # reward/mean 0.034, 0.052, 0.101, 0.222 at these settings; 256 prompts stay under 0.09
    data = {
        "task": {"prompts_per_iteration": 512},
        "rollout": {"samples_per_prompt": 8, "max_new_tokens": 6},
        "trainer": {
            "optimizer": {"optimizer_steps_per_iteration": 64, "learning_rate": 2e-3},
            "loss": {"clip_eps_high": 3.0},
        },
        "checkpoint": {
            "uri": f"s3://{BUCKET}/{PREFIX}",
            "endpoint_url": s3.endpoint_url,
            "region": "us-east-1",
            "cache_dir": ".moerl/cache",
        },
        "tracking": {"uri": url, "experiment": "cluster-local"},
        # kfp.local runs every task in this venv; the image matters only on the cluster
        "pipeline": {"iterations": ITERATIONS, "base_image": "registry.example/moerl-cpu:0.1.0"},
    }
    for section, values in over.items():
        data.setdefault(section, {}).update(values)
    return parse_config(data)


def _run_sandboxed(cfg, root: Path, secrets: Path, **params) -> Exception | None:
    """Run the EKS-target pipeline on kfp.local from an empty cwd, every task sandboxed under
    root/sandboxes with only its pod's credentials from `secrets`, with the run form's `params`;
    returns the error kfp.local raised, if any."""
    from kfp import local

    from moerl.config import config_to_json
    from moerl.pipelines.eks import check_cluster_safe
    from moerl.pipelines.grpo import build_pipeline

    check_cluster_safe(cfg)
    pipeline = build_pipeline(cfg, git_sha="cluster-test", target="eks")
    launch_dir = root / "launch"
    launch_dir.mkdir()
    old = Path.cwd()
    try:
        with sandboxed(root / "sandboxes", secrets):
            os.chdir(launch_dir)
            local.init(
                runner=local.SubprocessRunner(use_venv=False),
                pipeline_root=str(root / "kfp-artifacts"),
                raise_on_error=True,
            )
            pipeline(config_json=config_to_json(cfg), run_id="", **params)
        return None
    except RuntimeError as err:
        return err
    finally:
        os.chdir(old)


@pytest.fixture(scope="module")
def cluster_run(s3_server, tmp_path_factory):
    import boto3

    from tests.support.s3server import S3Process
    from tests.support.sandbox import write_sandbox_secrets

    root = tmp_path_factory.mktemp("cluster")
    boto3.client("s3", endpoint_url=s3_server.endpoint_url).create_bucket(Bucket=BUCKET)
    _stage_sources(s3_server, root / "staged")
    # the checkpoint cache tier: a second S3 server (the buffer group's SeaweedFS) with the
    # cluster's two identities; their keys reach only the tasks whose pods mount them
    cache = S3Process(root / "cache-server", reader=True)
    cache_server = cache.start()
    cache_server.client().create_bucket(Bucket="moerl-cache")
    reader_id, reader_secret = cache_server.reader
    secrets = write_sandbox_secrets(
        root / "cluster-secrets.json",
        {
            # one Secret per identity, as the cluster holds them (a task mounts a whole Secret)
            "moerl-ckpt-cache-writer": {
                "WRITER_ACCESS_KEY_ID": cache_server.access_key,
                "WRITER_SECRET_ACCESS_KEY": cache_server.secret_key,
            },
            "moerl-ckpt-cache-reader": {
                "READER_ACCESS_KEY_ID": reader_id,
                "READER_SECRET_ACCESS_KEY": reader_secret,
            },
            # cluster.mlflow_secret: `mlflow server` ignores basic auth, so these only have to arrive
            "moerl-mlflow": {
                "MLFLOW_TRACKING_USERNAME": "moerl",
                "MLFLOW_TRACKING_PASSWORD": "cluster-local",
            },
        },
        # IRSA's stand-in: every pod's service account reaches the durable S3 (its keys here)
        service_account_env={k: v for k, v in os.environ.items() if k.startswith("AWS_")},
    )
    cache_tier = {
        "cache_tier": {"uri": "s3://moerl-cache/ckpt", "endpoint_url": cache_server.endpoint_url}
    }
    with mlflow_server(root) as url:
        ok_root, bad_root = root / "ok", root / "bad"
        ok_root.mkdir()
        bad_root.mkdir()
        try:  # it registers its final version in the MLflow server's model registry. Compiled with
            # settings that do not learn in 4 iterations; its run form sets the ones that do
            ok_cfg = _cluster_cfg(
                s3_server,
                url,
                checkpoint=cache_tier,
                tracking=REGISTRY,
                trainer={"optimizer": {"learning_rate": 1e-4}, "loss": {"clip_eps_high": 0.28}},
                model={"path": MODEL_URI},  # the user's model and prompts, staged in S3
                task={"dataset": DATA_URI},
            )
            ok_err = _run_sandboxed(ok_cfg, ok_root, secrets, **OK_PARAMS)
        finally:
            cache.stop()
        # an operator promotes that version to champion; a scheduled run of the config starts from
        # it (`registry:moerl-policy@champion`), requiring a GPU this node lacks: the first rollout
        # fails at its start (twice: one retry), after version 0 was published
        from mlflow.tracking import MlflowClient

        from moerl.orchestrate.schedule import scheduled_config

        if ok_err is None:
            MlflowClient(url).set_registered_model_alias("moerl-policy", "champion", "1")
        bad_cfg = scheduled_config(
            _cluster_cfg(
                s3_server,
                url,
                require={"gpu": True},
                tracking=REGISTRY,
                task={"prompts_per_iteration": 8},
                pipeline={"task_retries": 1},
            )
        )
        bad_err = _run_sandboxed(bad_cfg, bad_root, secrets)
        # a run form with a bad value: refused by the first task (its own experiment, so the
        # runs above stay two)
        refused_root = root / "refused"
        refused_root.mkdir()
        refused_err = _run_sandboxed(
            _cluster_cfg(s3_server, url, tracking={"experiment": "cluster-local-refused"}),
            refused_root,
            secrets,
            learning_rate=-1.0,
        )
        yield {
            "root": root,
            "url": url,
            "ok_err": ok_err,
            "bad_err": bad_err,
            "refused_err": refused_err,
            "s3": s3_server,
            "cache": cache,
        }


def _stage_sources(s3, root: Path) -> None:
    """A user's model and prompts, staged in S3 as README's "bring your model" says: the tiny
    Qwen3-MoE (the embedded default's weights) and the default task's rows as one JSONL object
    (the same rows in the same order, so the run learns as the default does)."""
    from importlib import resources

    from moerl.models.tiny import build_tiny_model

    client = s3.client()
    client.create_bucket(Bucket=SOURCES)
    model = build_tiny_model(parse_config({}).model.tiny, root / "model")
    for f in model.iterdir():
        client.upload_file(str(f), SOURCES, f"models/tiny-qwen3/{f.name}")
    rows = resources.files("moerl.tasks.data").joinpath("digits-copy.jsonl").read_bytes()
    client.put_object(Bucket=SOURCES, Key="data/digits-copy.jsonl", Body=rows)


def _runs(url: str):
    """(client, the learning run, the failing run)."""
    from mlflow.tracking import MlflowClient

    client = MlflowClient(url)
    exp = client.get_experiment_by_name("cluster-local")
    runs = client.search_runs([exp.experiment_id], order_by=["attributes.start_time ASC"])
    assert len(runs) == 2
    ok, bad = sorted(runs, key=lambda r: r.data.params["require.gpu"])  # False, True
    return client, ok, bad


def _store(cluster_run, run_id):
    from moerl.store.runs import run_store

    return run_store(_cluster_cfg(cluster_run["s3"], cluster_run["url"]).checkpoint, run_id)


@pytest.mark.slow
def test_the_eks_pipeline_completes_and_learns_with_tasks_sharing_only_servers(cluster_run):
    assert cluster_run["ok_err"] is None, str(cluster_run["ok_err"])[-3000:]
    client, ok, _ = _runs(cluster_run["url"])
    assert ok.info.status == "FINISHED"
    assert ok.data.tags["moerl.kfp_run_id"]  # how the exit task finds the run
    hist = sorted(
        (m.step, m.value) for m in client.get_metric_history(ok.info.run_id, "reward/mean")
    )
    assert [s for s, _ in hist] == list(range(ITERATIONS))
    first, last = hist[0][1], max(v for _, v in hist[-2:])
    assert last > first + 0.1, hist  # it learns
    # the versions retention keeps are in S3 (0 and the newest checkpoint.keep_last), `latest`
    # on the last one
    store = _store(cluster_run, ok.info.run_id)
    keep = _cluster_cfg(cluster_run["s3"], cluster_run["url"]).checkpoint.keep_last
    assert (
        store.versions() == [0, *range(ITERATIONS + 1 - keep, ITERATIONS + 1)]
        and store.latest() == ITERATIONS
    )
    assert ok.data.tags["moerl.final_checkpoint"].startswith(f"s3://{BUCKET}/{PREFIX}/")
    # version 0 is the user's model from S3, imported once by init_policy: streamed into the
    # cache tier (another server), copied server-side into the durable store, byte for byte
    assert ok.data.tags["moerl.model.source"] == MODEL_URI
    assert ok.data.tags["moerl.model.import_routes"] == "stream=1; copy=1"  # cache, durable
    staged = cluster_run["root"] / "staged" / "model"
    v0 = {f.path: f.sha256 for f in store.manifest(0).files}
    assert v0 == {f.name: hashlib.sha256(f.read_bytes()).hexdigest() for f in staged.iterdir()}
    # every version went through the cache tier first (servable, then durable under the same
    # manifest), and every redistribution read it from there, none from S3
    for key in ("weights/cache_tier", "weights/fetched_from_cache"):
        assert [
            v
            for _, v in sorted(
                (m.step, m.value) for m in client.get_metric_history(ok.info.run_id, key)
            )
        ] == [1.0] * ITERATIONS, key
    assert all(
        m.value == 0.0
        for m in client.get_metric_history(ok.info.run_id, "weights/fetched_from_durable")
    )


@pytest.mark.slow
def test_every_task_ran_in_its_own_empty_sandbox(cluster_run):
    root = cluster_run["root"] / "ok"
    tasks = sorted((root / "sandboxes").iterdir())
    # close, start, the user-code check, init, finish + 6 per iteration (policy_update publishes
    # the version it trains): one fresh directory each
    assert len(tasks) == 5 + 6 * ITERATIONS
    # nothing was written where the pipeline was launched, and no task kept a local store or a
    # SQLite tracking file: checkpoints and tracking went to the servers
    assert list((root / "launch").iterdir()) == []
    names = {p.name for p in (root / "sandboxes").rglob("*")}
    assert "mlflow.db" not in names and "checkpoints" not in names and "mlruns" not in names
    # the rollout tasks fetched their version into their own scratch cache (each from S3, none
    # from another task's cache)
    cached = [t for t in tasks if (t / ".moerl" / "cache").is_dir()]
    assert len(cached) >= ITERATIONS
    homes = {t / "home" for t in tasks}
    assert all(h.is_dir() for h in homes) and len(homes) == len(tasks)


@pytest.mark.slow
def test_a_failed_run_is_retried_then_marked_failed_by_the_exit_handler(cluster_run):
    assert cluster_run["bad_err"] is not None
    client, _, bad = _runs(cluster_run["url"])
    assert bad.info.status == "FAILED"  # not left RUNNING
    assert bad.data.tags["moerl.status"] == "failed"
    assert (
        "rollout" in bad.data.tags["moerl.error"] or "exit-handler" in bad.data.tags["moerl.error"]
    )
    # what the failing stage found, recorded
    assert bad.data.tags["runtime.rollout.cuda_available"] == "false"
    # published state untouched: version 0 only, `latest` on it
    store = _store(cluster_run, bad.info.run_id)
    assert store.versions() == [0] and store.latest() == 0
    # close, start, the user-code check, init, and the rollout twice (one retry)
    assert len(list((cluster_run["root"] / "bad" / "sandboxes").iterdir())) == 4 + 2


@pytest.mark.slow
def test_the_second_run_warm_started_from_the_first_runs_final_checkpoint(cluster_run):
    """Through the model registry: the first run registered its final version (an S3 store: the
    registry's source is the version's URI), an operator made it champion, and the scheduled run
    started from `registry:moerl-policy@champion`."""
    client, ok, bad = _runs(cluster_run["url"])
    assert bad.data.params["model.warm_start"] == "registry:moerl-policy@champion"
    assert ok.data.tags["moerl.registered_policy"] == "moerl-policy/1"
    mv = client.get_model_version_by_alias("moerl-policy", "champion")
    assert mv.source == ok.data.tags["moerl.final_checkpoint"] == mv.tags["moerl.version_uri"]
    assert (
        mv.tags["moerl.manifest_sha256"]
        == _store(cluster_run, ok.info.run_id).manifest(ITERATIONS).sha256()
    )
    assert float(mv.tags["moerl.final_reward"]) == pytest.approx(
        ok.data.metrics["reward/mean"], abs=1e-6
    )
    assert bad.data.tags["moerl.warm_start.registered"] == "moerl-policy/1"
    (ds,) = [i.dataset for i in ok.inputs.dataset_inputs]
    assert (ds.name, ds.source_type, json.loads(ds.source)["uri"]) == (
        "digits-copy.jsonl",
        "s3",
        DATA_URI,
    )
    assert bad.data.tags["moerl.warm_start.run_id"] == ok.info.run_id
    assert bad.data.tags["moerl.warm_start.checkpoint"] == ok.data.tags["moerl.final_checkpoint"]
    final = {
        f.path: f.sha256 for f in _store(cluster_run, ok.info.run_id).manifest(ITERATIONS).files
    }
    v0 = {f.path: f.sha256 for f in _store(cluster_run, bad.info.run_id).manifest(0).files}
    # the engine weights, whatever files hold them (the mesh's: one per rank, and the index)
    weights = {p for p in final if p.endswith(".safetensors") and "/" not in p}
    assert weights and {p: v0.get(p) for p in weights} == {p: final[p] for p in weights}
    assert not any(p.startswith("trainer/") for p in v0)  # a new run starts a new optimizer


@pytest.mark.slow
def test_the_run_forms_parameters_and_overrides_are_what_the_run_ran(cluster_run):
    _, ok, _ = _runs(cluster_run["url"])
    params = ok.data.params
    assert (
        params["trainer.optimizer.learning_rate"] == "0.002"
        and params["trainer.loss.clip_eps_high"] == "3.0"
    )
    assert ok.info.run_name == "cluster-ok"
    changed = json.loads(ok.data.tags["moerl.run_parameters"])
    assert changed == {
        "trainer.optimizer.learning_rate": "0.002",
        "trainer.loss.clip_eps_high": "3.0",
        "tracking.run_name": "cluster-ok",
    }


@pytest.mark.slow
def test_a_bad_run_parameter_fails_the_first_task_naming_the_key_and_publishes_nothing(cluster_run):
    from mlflow.tracking import MlflowClient

    err = cluster_run["refused_err"]
    assert err is not None and "start-run" in str(err)
    client = MlflowClient(cluster_run["url"])
    exp = client.get_experiment_by_name("cluster-local-refused")
    (run,) = client.search_runs([exp.experiment_id])
    assert run.info.status == "FAILED"
    assert run.data.tags["moerl.error"].startswith(
        "run parameters: invalid config: trainer.optimizer.learning_rate: "
    )
    assert "\n" not in run.data.tags["moerl.error"]  # one line, as the CLI prints it
    assert _store(cluster_run, run.info.run_id).versions() == []  # nothing published
    # close and start only: no stage ran
    assert len(list((cluster_run["root"] / "refused" / "sandboxes").iterdir())) == 2
