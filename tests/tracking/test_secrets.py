"""Credentials in the MLflow URI never travel in the config: they leave `tracking.uri` for
MLflow's own environment variables before a pipeline is run or compiled, and reach the
server from there. (The end-to-end check, against a real `mlflow server`, is in
tests/pipelines/test_e2e_pipeline.py.)"""

import base64
import json
import os
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from moerl.config import config_to_json, parse_config
from moerl.tracking import split_credentials

SECRET = "p@ss:w0rd/x"  # percent-escaped in the URI below
URI = "http://alice:p%40ss%3Aw0rd%2Fx@127.0.0.1:5000/mlflow"


def test_http_credentials_move_to_mlflows_variables():
    cfg, env = split_credentials(parse_config({"tracking": {"uri": URI}}))
    assert cfg.tracking.uri == "http://127.0.0.1:5000/mlflow"
    assert env == {"MLFLOW_TRACKING_USERNAME": "alice", "MLFLOW_TRACKING_PASSWORD": SECRET}
    assert "alice" not in config_to_json(cfg) and "w0rd" not in config_to_json(cfg)


def test_a_database_uri_with_a_password_leaves_the_config_whole():
    db = "postgresql://bob:hunter2@db.internal:5432/mlflow"
    cfg, env = split_credentials(parse_config({"tracking": {"uri": db}}))
    assert cfg.tracking.uri is None and env == {"MLFLOW_TRACKING_URI": db}
    assert "hunter2" not in config_to_json(cfg)


@pytest.mark.parametrize("uri", [None, "http://127.0.0.1:5000", "sqlite:////tmp/a@b/mlflow.db"])
def test_a_uri_without_credentials_is_left_alone(uri):
    cfg = parse_config({"tracking": {"uri": uri}})
    assert split_credentials(cfg) == (cfg, {})


def test_the_credentials_reach_the_server_as_basic_auth(monkeypatch):
    """MLflow's client, given the clean URI and the variables, sends them on every request."""
    from mlflow.tracking import MlflowClient

    seen = []

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self):  # experiments/get-by-name
            seen.append(self.headers.get("Authorization"))
            body = json.dumps(
                {
                    "experiment": {
                        "experiment_id": "1",
                        "name": "e",
                        "artifact_location": "/tmp/a",
                        "lifecycle_stage": "active",
                    }
                }
            ).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        uri = f"http://alice:p%40ss%3Aw0rd%2Fx@127.0.0.1:{server.server_address[1]}"
        cfg, env = split_credentials(parse_config({"tracking": {"uri": uri}}))
        for k, v in env.items():
            monkeypatch.setenv(k, v)
        assert MlflowClient(cfg.tracking.uri).get_experiment_by_name("e").experiment_id == "1"
    finally:
        server.shutdown()
        server.server_close()
    assert seen and all(
        h == "Basic " + base64.b64encode(f"alice:{SECRET}".encode()).decode() for h in seen
    )


def test_compile_never_writes_the_credentials(tmp_path, capsys):
    from moerl.orchestrate.compile import compile_pipeline

    out = compile_pipeline(parse_config({"tracking": {"uri": URI}}), tmp_path / "grpo.yaml")
    text = out.read_text()
    assert "http://127.0.0.1:5000/mlflow" in text  # the pipeline still knows where MLflow is
    assert "alice" not in text and "w0rd" not in text
    err = capsys.readouterr().err
    assert "removed the credentials in tracking.uri" in err
    assert "MLFLOW_TRACKING_PASSWORD and MLFLOW_TRACKING_USERNAME from a Kubernetes Secret" in err


def test_config_show_redacts_the_password(tmp_path, capsys):
    from moerl.cli import main

    (tmp_path / "run.yaml").write_text(f"tracking: {{uri: '{URI}'}}\n")
    assert main(["config", "show", str(tmp_path / "run.yaml")]) == 0
    out = capsys.readouterr().out
    assert "uri: http://***@127.0.0.1:5000/mlflow" in out and "w0rd" not in out


@pytest.mark.slow  # `moerl run` as a process (refused before any work)
def test_an_error_naming_the_server_leaves_the_password_out(tmp_path):
    """`moerl run --resume` against an MLflow server that is not there: the one-line error
    names the server, without the password."""
    (tmp_path / "run.yaml").write_text(f"tracking: {{uri: '{URI.replace(':5000', ':9')}'}}\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith("MLFLOW_")}
    env["MLFLOW_HTTP_REQUEST_MAX_RETRIES"] = "0"
    proc = subprocess.run(
        [sys.executable, "-m", "moerl.cli", "run", "run.yaml", "--resume", "0123abcd"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 1, proc.stderr[-2000:]
    assert "no MLflow run '0123abcd' at http://127.0.0.1:9/mlflow" in proc.stderr
    assert "w0rd" not in proc.stdout + proc.stderr and "alice" not in proc.stdout + proc.stderr


# ---- credentials as files: moerl.secrets.read_secret --------------------------------------


def test_read_secret_prefers_the_file_and_refuses_one_others_may_read(tmp_path):
    from moerl.secrets import SecretFileError, read_secret, write_secret_file

    path = write_secret_file(tmp_path / "moerl-valkey" / "VALKEY_PASSWORD", "from-file\n")
    assert (path.stat().st_mode & 0o777) == 0o400 and (path.parent.stat().st_mode & 0o777) == 0o700
    env = {"VALKEY_PASSWORD_FILE": str(path), "VALKEY_PASSWORD": "from-env"}
    assert read_secret("VALKEY_PASSWORD", env) == "from-file"  # the file wins; one newline dropped
    # local runs
    assert read_secret("VALKEY_PASSWORD", {"VALKEY_PASSWORD": "from-env"}) == "from-env"
    assert read_secret("VALKEY_PASSWORD", {}) is None
    # an optional Secret the cluster lacks: Kubernetes mounts its volume empty
    assert (
        read_secret("VALKEY_PASSWORD", {"VALKEY_PASSWORD_FILE": str(tmp_path / "absent")}) is None
    )
    path.chmod(0o644)
    with pytest.raises(
        SecretFileError,
        match=rf"\$VALKEY_PASSWORD_FILE={path}: mode -rw-r--r-- lets other users "
        rf"read or write a credential this user owns; chmod 400 {path}",
    ):
        read_secret("VALKEY_PASSWORD", env)
    path.chmod(0o600)  # owner-only is fine
    assert read_secret("VALKEY_PASSWORD", env) == "from-file"
    with pytest.raises(SecretFileError, match="not a regular file"):
        read_secret("VALKEY_PASSWORD", {"VALKEY_PASSWORD_FILE": str(tmp_path)})


@pytest.mark.skipif(
    os.geteuid() != 0, reason="needs root to give the file another owner, as the kubelet does"
)
def test_a_secret_volumes_file_is_read_when_only_its_owner_may_change_it(tmp_path):
    """A Secret volume's files are the kubelet's (root), and a non-root stage reads them through
    its fsGroup (0440) or, where KFP mounts them, Kubernetes' default 0644: accepted; a file
    someone else could rewrite is not."""
    from moerl.secrets import SecretFileError, read_secret

    path = tmp_path / "key"
    path.write_text("v")
    os.chown(path, 65534, 65534)  # not this process's user
    env = {"K_FILE": str(path)}
    for mode in (0o440, 0o644):
        path.chmod(mode)
        assert read_secret("K", env) == "v"
    path.chmod(0o666)
    with pytest.raises(
        SecretFileError,
        match=r"lets users other than its owner \(uid 65534\) change the credential",
    ):
        read_secret("K", env)


MLFLOW_FROM_FILES = r"""
import json, os, sys
from moerl import tracking
client = tracking._client(sys.argv[1])
print(json.dumps({"id": client.get_experiment_by_name("e").experiment_id,
                  "environ": open("/proc/self/environ", "rb").read().decode(errors="replace"),
                  "env": dict(os.environ)}))
"""


def test_mlflow_credentials_from_files_reach_the_server_and_never_the_environment(tmp_path):
    """In a pod MLflow's basic-auth user and password are files (the Secret cluster.mlflow_secret);
    moerl reads them once and hands them to MLflow's requests in memory, never as variables."""
    from moerl.secrets import write_secret_file

    seen = []

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self):  # experiments/get-by-name
            seen.append(self.headers.get("Authorization"))
            body = json.dumps(
                {
                    "experiment": {
                        "experiment_id": "1",
                        "name": "e",
                        "artifact_location": "/tmp/a",
                        "lifecycle_stage": "active",
                    }
                }
            ).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    secret = tmp_path / "moerl-mlflow"
    env = {k: v for k, v in os.environ.items() if not k.startswith("MLFLOW_TRACKING_")}
    env |= {
        "MLFLOW_TRACKING_USERNAME_FILE": str(
            write_secret_file(secret / "MLFLOW_TRACKING_USERNAME", "alice")
        ),
        "MLFLOW_TRACKING_PASSWORD_FILE": str(
            write_secret_file(secret / "MLFLOW_TRACKING_PASSWORD", SECRET)
        ),
    }
    try:
        done = subprocess.run(
            [
                sys.executable,
                "-c",
                MLFLOW_FROM_FILES,
                f"http://127.0.0.1:{server.server_address[1]}",
            ],
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
        )
    finally:
        server.shutdown()
        server.server_close()
    assert done.returncode == 0, done.stderr[-2000:]
    out = json.loads(done.stdout.strip().splitlines()[-1])
    assert out["id"] == "1"
    assert seen and all(
        h == "Basic " + base64.b64encode(f"alice:{SECRET}".encode()).decode() for h in seen
    )
    # neither the process's environment (what its children inherit) nor /proc/<pid>/environ holds them
    assert SECRET not in json.dumps(out["env"]) and SECRET not in out["environ"]
    assert "MLFLOW_TRACKING_PASSWORD" not in out["env"]
