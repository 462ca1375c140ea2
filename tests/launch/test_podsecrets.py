"""Each stage's pod gets exactly the credentials `moerl.launch.podsecrets.pod_secret_env` says, and
the cluster-shaped sandbox gives a task those and nothing of the test process's.

The real-parts test starts the cache server as the cluster runs it (a `weed mini` with a writer
and a Read/List reader identity, manifests/base/ckpt-cache.yaml) beside the durable S3 server,
and runs tasks as kfp.local does (a subprocess entering its pod through `enter_pod`): the first
task's preflight passes with the reader keys alone, a publisher writes with the writer's, and a
stage that holds no keys is refused by the cache server as `start_run` was on EKS."""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from moerl.config import config_to_json, parse_config
from moerl.launch.podsecrets import (
    RUN_SECRET,
    SANDBOX_SECRETS_ENV,
    SecretRef,
    pod_secret_env,
    run_secret_name,
    sandbox_secret_env,
)
from tests.support.sandbox import write_sandbox_secrets

ROOT = Path(__file__).resolve().parents[2]
CACHE = {"uri": "s3://moerl-cache/ckpt", "endpoint_url": "http://moerl-ckpt-cache.moerl.svc:8333"}
KEYS = {
    "WRITER_ACCESS_KEY_ID": "w-id",
    "WRITER_SECRET_ACCESS_KEY": "w-secret",
    "READER_ACCESS_KEY_ID": "r-id",
    "READER_SECRET_ACCESS_KEY": "r-secret",
}
# one Secret per cache-tier identity: a KFP task mounts a whole Secret (moerl.launch.podsecrets)
CLUSTER_SECRETS = {
    "moerl-ckpt-cache-writer": {k: v for k, v in KEYS.items() if k.startswith("WRITER_")},
    "moerl-ckpt-cache-reader": {k: v for k, v in KEYS.items() if k.startswith("READER_")},
    "moerl-mlflow": {"MLFLOW_TRACKING_USERNAME": "moerl", "MLFLOW_TRACKING_PASSWORD": "mlflow-pw"},
}
IRSA = {"AWS_ACCESS_KEY_ID": "durable-id", "AWS_SECRET_ACCESS_KEY": "durable-secret"}


def _cfg(**checkpoint):
    return parse_config(
        {"checkpoint": {"uri": "s3://moerl-runs/team", "cache_tier": CACHE, **checkpoint}}
    )


def test_pod_secret_env_gives_the_first_task_the_reader_publishers_the_writer_and_others_no_cache_keys():
    cfg = _cfg()
    mlflow = {
        k: SecretRef("moerl-mlflow", k, True)
        for k in ("MLFLOW_TRACKING_USERNAME", "MLFLOW_TRACKING_PASSWORD")
    }

    def cache(role: str) -> dict[str, SecretRef]:
        secret = f"moerl-ckpt-cache-{role.lower()}"
        return {
            "MOERL_CACHE_TIER_ACCESS_KEY_ID": SecretRef(secret, f"{role}_ACCESS_KEY_ID"),
            "MOERL_CACHE_TIER_SECRET_ACCESS_KEY": SecretRef(secret, f"{role}_SECRET_ACCESS_KEY"),
        }

    # start_run's preflight HeadBuckets the cache tier: the reader may, and may not write
    assert pod_secret_env(cfg, "start_run", False) == mlflow | cache("READER")
    assert pod_secret_env(cfg, "policy_update", False) == mlflow | cache("WRITER")
    assert pod_secret_env(cfg, "reward", False) == mlflow
    # async: start_run and close_run alone hold the Valkey admin's password (they make and delete
    # the run's own user); every other stage logs in as that user, from the run's own Secret
    cfg = cfg.model_copy(
        update={"valkey": cfg.valkey.model_copy(update={"url": "redis://moerl-valkey:6379/0"})}
    )
    admin = {"VALKEY_ADMIN_PASSWORD": SecretRef("moerl-valkey", "VALKEY_ADMIN_PASSWORD")}
    run_user = {k: SecretRef(RUN_SECRET, k) for k in ("VALKEY_USERNAME", "VALKEY_PASSWORD")}
    assert pod_secret_env(cfg, "start_run", True) == mlflow | admin | cache("READER")
    assert pod_secret_env(cfg, "close_run", True) == mlflow | admin
    # the rollout stages' MLflow credential reads only (cluster.mlflow_reader_secret)
    reader = {k: v._replace(secret="moerl-mlflow-reader") for k, v in mlflow.items()}
    assert pod_secret_env(cfg, "rollout_worker", True) == reader | run_user | cache("READER")
    assert pod_secret_env(cfg, "async_trainer", True) == mlflow | run_user | cache("WRITER")
    assert run_secret_name("0a1b" * 8) == "moerl-run-" + "0a1b" * 8
    # no cache tier: nobody gets its keys; a renamed credentials_env names the variables
    assert pod_secret_env(parse_config({}), "start_run", False) == mlflow
    renamed = _cfg(cache_tier={**CACHE, "credentials_env": "TEAM_CACHE"})
    assert set(pod_secret_env(renamed, "rollout", False)) == {
        *mlflow,
        "TEAM_CACHE_ACCESS_KEY_ID",
        "TEAM_CACHE_SECRET_ACCESS_KEY",
    }


def test_a_sandboxed_task_keeps_none_of_the_test_processs_credentials_and_gets_its_pods(tmp_path):
    cfg = _cfg(cache_tier={**CACHE, "credentials_env": "TEAM_CACHE"})
    path = write_sandbox_secrets(tmp_path / "secrets.json", CLUSTER_SECRETS, IRSA)
    assert (path.stat().st_mode & 0o777) == 0o600
    leaked = {
        "AWS_ACCESS_KEY_ID": "test-process",
        "AWS_PROFILE": "admin",
        "MLFLOW_TRACKING_PASSWORD": "leak",
        "MLFLOW_TRACKING_TOKEN": "leak",
        "VALKEY_PASSWORD": "leak",
        "VALKEY_PASSWORD_ADMIN": "leak",
        "MOERL_CACHE_TIER_ACCESS_KEY_ID": "leak",
        "TEAM_CACHE_ACCESS_KEY_ID": "leak",
        "TEAM_CACHE_SECRET_ACCESS_KEY": "leak",
    }
    environ = {
        "PATH": "/usr/bin",
        "MOERL_SANDBOX_ROOT": "/sandboxes",
        "VALKEY_PASSWORD_FILE": "/leak",
        **leaked,
    }

    def files(env: dict[str, str]) -> dict[str, str]:
        """The credentials the task holds, by variable: each a 0400 file in its own directory."""
        held = {}
        for var, path in env.items():
            if var.endswith("_FILE"):
                assert (
                    Path(path).is_relative_to(tmp_path / "pods")
                    and (Path(path).stat().st_mode & 0o777) == 0o400
                )
                held[var.removesuffix("_FILE")] = Path(path).read_text()
        return held

    reward = sandbox_secret_env(path, cfg, "reward", False, environ, tmp_path / "pods" / "reward")
    # what is left: the harmless variables, the service account's (IRSA's stand-in), and MLflow's
    # credentials as files, laid out as the pod's Secret volumes
    assert {k: v for k, v in reward.items() if not k.endswith("_FILE")} == {
        "PATH": "/usr/bin",
        "MOERL_SANDBOX_ROOT": "/sandboxes",
        **IRSA,
    }
    assert files(reward) == {
        "MLFLOW_TRACKING_USERNAME": "moerl",
        "MLFLOW_TRACKING_PASSWORD": "mlflow-pw",
    }
    assert reward["MLFLOW_TRACKING_PASSWORD_FILE"].endswith(
        "/moerl-mlflow/MLFLOW_TRACKING_PASSWORD"
    )
    first = sandbox_secret_env(path, cfg, "start_run", False, environ, tmp_path / "pods" / "first")
    held = files(first)
    assert (held["TEAM_CACHE_ACCESS_KEY_ID"], held["TEAM_CACHE_SECRET_ACCESS_KEY"]) == (
        "r-id",
        "r-secret",
    )
    assert (
        "leak" not in first.values()
        and "/leak" not in first.values()
        and "VALKEY_PASSWORD" not in held
    )
    assert "r-secret" not in first.values()  # the values are in the files only
    trainer = sandbox_secret_env(
        path, cfg, "async_trainer", True, environ, tmp_path / "pods" / "trainer"
    )
    assert files(trainer)["TEAM_CACHE_ACCESS_KEY_ID"] == "w-id"
    assert "VALKEY_PASSWORD_FILE" not in trainer  # no valkey.url: the run has no Valkey user


def test_a_missing_required_key_stops_the_task_and_a_readable_secrets_file_is_refused(tmp_path):
    cfg = _cfg()
    partial = write_sandbox_secrets(
        tmp_path / "partial.json", {"moerl-ckpt-cache": {"WRITER_ACCESS_KEY_ID": "w"}}
    )
    # MLflow's are optional
    assert sandbox_secret_env(partial, cfg, "reward", False, {}, tmp_path / "r") == {}
    with pytest.raises(
        RuntimeError,
        match=r"stage start_run: its pod needs key 'READER_ACCESS_KEY_ID' of the "
        r"Secret 'moerl-ckpt-cache-reader' for MOERL_CACHE_TIER_ACCESS_KEY_ID",
    ):
        sandbox_secret_env(partial, cfg, "start_run", False, {}, tmp_path / "s")
    partial.chmod(0o644)
    with pytest.raises(RuntimeError, match=r"lets others read the cluster's Secrets; chmod 600"):
        sandbox_secret_env(partial, cfg, "reward", False, {}, tmp_path / "r")


def test_every_component_names_its_own_stage_when_it_enters_its_pod():
    """`place` mounts Secrets under the component's name; the sandbox must look up the same one.
    The KFP components: each stage's component.py and the run's own tasks (pipelines/tracking.py)."""
    from moerl.pipelines.eks import STAGE_GROUP

    named = {}
    tasks = [*(ROOT / "components").glob("*/component.py"), ROOT / "pipelines" / "tracking.py"]
    for path in sorted(tasks):
        for fn in ast.parse(path.read_text()).body:
            if not isinstance(fn, ast.FunctionDef):
                continue
            calls = [
                n
                for n in ast.walk(fn)
                if isinstance(n, ast.Call) and getattr(n.func, "id", None) == "enter_pod"
            ]
            assert len(calls) == 1, f"{path}:{fn.name}"
            args = [
                a.value if isinstance(a, ast.Constant) else getattr(a, "id", None)
                for a in calls[0].args
            ]
            assert args == [fn.name, "config_json"], (
                f"{path}:{fn.name} calls enter_pod{tuple(args)}"
            )
            named[fn.name] = path
    assert set(named) == set(STAGE_GROUP)


# A task as kfp.local runs it: a process of its own that enters its pod first, then does what
# its stage does with the cache tier. Prints what it held and what the cache server allowed.
TASK = r"""
import json, os, sys
from moerl.launch.podenv import enter_pod
stage, cfg_json = sys.argv[1], open(sys.argv[2]).read()
enter_pod(stage, cfg_json)
from moerl.config import config_from_json
from moerl.errors import MoerlError
from moerl.preflight import _check_cache_tier
from moerl.store.runs import open_store
from moerl.store.tiers import cache_tier_store
cfg = config_from_json(cfg_json)
out = {"env": sorted(k for k in os.environ if k.startswith(("AWS_", "MOERL_CACHE_TIER_", "MLFLOW_TRACKING_")))
       + (["MOERL_SANDBOX_SECRETS"] if "MOERL_SANDBOX_SECRETS" in os.environ else [])}
try:
    _check_cache_tier(cfg)
    out["preflight"] = "ok"
except MoerlError as e:
    out["preflight"] = str(e)
open_store(cfg.checkpoint).check_access()  # the durable store: the service account's (IRSA) keys
try:
    cache_tier_store(cfg.checkpoint, "probe")._s3.put_object(Bucket="moerl-cache", Key="probe", Body=b"1")
    out["write"] = "ok"
except Exception as e:
    out["write"] = type(e).__name__ + ": " + str(e)
print(json.dumps(out))
"""


def test_the_first_task_passes_its_cache_tier_preflight_with_its_pods_reader_keys_alone(
    tmp_path, s3_server
):
    from tests.support.s3server import S3Process

    s3_server.client().create_bucket(Bucket="moerl-podsecrets")
    cache = S3Process(tmp_path / "cache-server", reader=True)
    server = cache.start()
    try:
        server.client().create_bucket(Bucket="moerl-cache")
        cfg = parse_config(
            {
                "checkpoint": {
                    "uri": "s3://moerl-podsecrets/runs",
                    "endpoint_url": s3_server.endpoint_url,
                    "region": "us-east-1",
                    "cache_tier": {
                        "uri": "s3://moerl-cache/ckpt",
                        "endpoint_url": server.endpoint_url,
                    },
                }
            }
        )
        (tmp_path / "cfg.json").write_text(config_to_json(cfg))
        reader_id, reader_secret = server.reader
        # the durable S3's: IRSA's stand-in
        secrets = write_sandbox_secrets(
            tmp_path / "secrets.json",
            {
                "moerl-ckpt-cache-writer": {
                    "WRITER_ACCESS_KEY_ID": server.access_key,
                    "WRITER_SECRET_ACCESS_KEY": server.secret_key,
                },
                "moerl-ckpt-cache-reader": {
                    "READER_ACCESS_KEY_ID": reader_id,
                    "READER_SECRET_ACCESS_KEY": reader_secret,
                },
            },
            {k: v for k, v in os.environ.items() if k.startswith("AWS_")},
        )
        # the test process holds the writer's keys, as the old harness gave them to every task:
        # a task must not inherit them
        env = {
            **os.environ,
            SANDBOX_SECRETS_ENV: str(secrets),
            "MOERL_SANDBOX_ROOT": str(tmp_path / "pods"),
            "MOERL_CACHE_TIER_ACCESS_KEY_ID": server.access_key,
            "MOERL_CACHE_TIER_SECRET_ACCESS_KEY": server.secret_key,
        }

        def task(stage: str) -> dict:
            done = subprocess.run(
                [sys.executable, "-c", TASK, stage, str(tmp_path / "cfg.json")],
                env=env,
                cwd=ROOT,
                capture_output=True,
                text=True,
                timeout=120,
            )
            assert done.returncode == 0, done.stderr[-3000:]
            return json.loads(done.stdout.strip().splitlines()[-1])

        first = task("start_run")
        assert first["preflight"] == "ok"
        assert "AccessDenied" in first["write"]  # the reader's keys, not the writer's
        # the children of a task never see the file
        assert "MOERL_SANDBOX_SECRETS" not in first["env"]
        # its keys as 0400 files in its own sandbox, never in its environment
        assert "MOERL_CACHE_TIER_ACCESS_KEY_ID_FILE" in first["env"]
        assert "MOERL_CACHE_TIER_ACCESS_KEY_ID" not in first["env"]
        publisher = task("policy_update")
        assert publisher["preflight"] == "ok" and publisher["write"] == "ok"
        # a stage whose pod gets no keys falls back to the AWS chain (the durable store's identity,
        # as IRSA on EKS) and is refused by the cache server: what start_run met on EKS
        keyless = task("log_iteration")
        assert not any(k.startswith("MOERL_CACHE_TIER_") for k in keyless["env"])
        assert (
            "access to bucket 'moerl-cache'" in keyless["preflight"]
            and "is denied" in keyless["preflight"]
        )
        for needle in (
            "holds no cache-tier keys",
            "Secret 'moerl-ckpt-cache-reader'",
            "READER_ACCESS_KEY_ID",
            "MOERL_CACHE_TIER_ACCESS_KEY_ID / MOERL_CACHE_TIER_SECRET_ACCESS_KEY",
        ):
            assert needle in keyless["preflight"], needle
    finally:
        cache.stop()


def test_a_task_that_does_not_name_its_stage_is_refused_when_the_cluster_secrets_are_given(
    tmp_path,
):
    secrets = write_sandbox_secrets(tmp_path / "secrets.json", CLUSTER_SECRETS, IRSA)
    done = subprocess.run(
        [sys.executable, "-c", "from moerl.launch.podenv import enter_pod; enter_pod()"],
        env={**os.environ, SANDBOX_SECRETS_ENV: str(secrets)},
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode != 0
    assert (
        "MOERL_SANDBOX_SECRETS is set, but this process did not say which stage it runs"
        in done.stderr
    )
