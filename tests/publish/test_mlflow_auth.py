"""MLflow behind its basic-auth app, as manifests/base/mlflow.yaml runs it: its init container's
script (run here as written there) makes the writer and the reader users from their Secrets'
files, then a real `mlflow server --app-name basic-auth` on 127.0.0.1 serves the same stores.
A run's tags, `moerl.final_checkpoint` (what warm starts read) among them, are rewritten only by
the writer's credential (the trainer's pods); a request without one is refused, and the reader's
(the rollout pods', `cluster.mlflow_reader_secret`) reads the run but cannot rewrite a tag. What
only the cluster shows: the Secrets mounted, the pod's network path, Postgres as the run store."""

from __future__ import annotations

import os
import secrets
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from mlflow.exceptions import MlflowException
from mlflow.tracking import MlflowClient

from moerl import tracking
from moerl.components.publish_checkpoint.stage import FINAL_CHECKPOINT_TAG
from moerl.config import parse_config
from moerl.launch.podsecrets import pod_secret_env
from tests.support.mlflow_server import mlflow_server

ROOT = Path(__file__).resolve().parents[2]
ADMIN = ("moerl-admin", secrets.token_hex(12))
WRITER = ("moerl-writer", secrets.token_hex(12))
READER = ("moerl-reader", secrets.token_hex(12))
URI = "s3://ckpt/runs/r1/versions/v000003"


def _deployment() -> dict:
    docs = yaml.safe_load_all((ROOT / "manifests/base/mlflow.yaml").read_text())
    return next(d for d in docs if d["kind"] == "Deployment")["spec"]["template"]["spec"]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    root = tmp_path_factory.mktemp("mlflow-auth")
    store = f"sqlite:///{root / 'mlflow.db'}"
    old = MlflowClient(store).create_experiment("made-before-auth")  # the writer gets EDIT on it
    for who, (user, password) in (("writer", WRITER), ("reader", READER)):
        (root / "secrets" / who).mkdir(parents=True)
        (root / "secrets" / who / "MLFLOW_TRACKING_USERNAME").write_text(user)
        (root / "secrets" / who / "MLFLOW_TRACKING_PASSWORD").write_text(password + "\n")
    [users] = _deployment()["initContainers"]
    env = {k: v for k, v in os.environ.items() if not k.startswith("MLFLOW_")}
    env |= {
        "AUTH_INI": str(root / "basic_auth.ini"),
        "AUTH_DB": str(root / "auth.db"),
        "SECRETS": str(root / "secrets"),
        "MLFLOW_BACKEND_STORE_URI": store,
    }
    subprocess.run([sys.executable, "-c", users["args"][0]], env=env, check=True, timeout=120)
    with mlflow_server(root, admin=ADMIN) as url:
        yield url, old


def _as(monkeypatch, who: tuple[str, str] | None) -> None:
    for k in ("MLFLOW_TRACKING_USERNAME", "MLFLOW_TRACKING_PASSWORD", "MLFLOW_TRACKING_AUTH"):
        monkeypatch.delenv(k, raising=False)
    if who is not None:
        monkeypatch.setenv("MLFLOW_TRACKING_USERNAME", who[0])
        monkeypatch.setenv("MLFLOW_TRACKING_PASSWORD", who[1])


def test_the_cluster_runs_mlflow_behind_auth_and_rollout_pods_get_the_reader():
    spec = _deployment()
    assert spec["containers"][0]["args"][:2] == ["--app-name", "basic-auth"]
    cfg = parse_config({})
    for stage in ("rollout_worker", "rollout"):
        assert pod_secret_env(cfg, stage, True)["MLFLOW_TRACKING_PASSWORD"].secret == (
            "moerl-mlflow-reader"
        )
    for stage in ("async_trainer", "init_policy", "start_run", "reward_scorer"):
        assert pod_secret_env(cfg, stage, True)["MLFLOW_TRACKING_PASSWORD"].secret == "moerl-mlflow"


def test_only_the_writers_credential_rewrites_a_runs_tags(server, monkeypatch, capsys):
    url, old = server
    _as(monkeypatch, WRITER)  # start_run and the trainer: the experiment's creator manages it
    client = MlflowClient(url)
    run_id = client.create_run(client.create_experiment("auth")).info.run_id
    tracking.set_tags(url, run_id, {FINAL_CHECKPOINT_TAG: URI})
    old_run = client.create_run(old).info.run_id  # EDIT from the init container

    _as(monkeypatch, None)  # any pod without a credential
    with pytest.raises(MlflowException, match="401|[Uu]nauthenticated|credentials"):
        MlflowClient(url).set_tag(run_id, FINAL_CHECKPOINT_TAG, "s3://evil/v000009")
    _as(monkeypatch, READER)  # a rollout pod: reads, cannot write
    reader = MlflowClient(url)
    assert reader.get_run(run_id).data.tags[FINAL_CHECKPOINT_TAG] == URI
    for rid in (run_id, old_run):
        with pytest.raises(MlflowException) as refused:
            tracking.set_tags(url, rid, {FINAL_CHECKPOINT_TAG: "s3://evil/v000009"})
        assert refused.value.error_code == "PERMISSION_DENIED"
    with pytest.raises(MlflowException, match="PERMISSION_DENIED|[Pp]ermission"):
        reader.log_metric(run_id, "reward/mean", 1e9)
    # what a rollout pod records itself (its engine's transport) goes to its log instead
    assert not tracking.set_tags_or_print(url, run_id, {"moerl.transport.net": "efa"}, "record")
    assert "record: not set on MLflow run" in capsys.readouterr().out

    _as(monkeypatch, WRITER)
    client = MlflowClient(url)
    run = client.get_run(run_id)
    assert run.data.tags[FINAL_CHECKPOINT_TAG] == URI and "reward/mean" not in run.data.metrics
    assert "moerl.transport.net" not in run.data.tags
    for rid in (run_id, old_run):
        client.set_tag(rid, FINAL_CHECKPOINT_TAG, URI.replace("v000003", "v000004"))
        assert client.get_run(rid).data.tags[FINAL_CHECKPOINT_TAG].endswith("v000004")
