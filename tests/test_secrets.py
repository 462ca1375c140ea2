"""Credentials in the MLflow URI never travel in the config: they leave `tracking.uri` for
MLflow's own environment variables before a pipeline is run or compiled, and reach the
server from there. (The end-to-end check, against a real `mlflow server`, is in
tests/test_e2e_pipeline.py.)"""

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
            body = json.dumps({"experiment": {"experiment_id": "1", "name": "e", "artifact_location": "/tmp/a",
                                              "lifecycle_stage": "active"}}).encode()
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
    assert seen and all(h == "Basic " + base64.b64encode(f"alice:{SECRET}".encode()).decode() for h in seen)


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


def test_an_error_naming_the_server_leaves_the_password_out(tmp_path):
    """`moerl run --resume` against an MLflow server that is not there: the one-line error
    names the server, without the password."""
    (tmp_path / "run.yaml").write_text(f"tracking: {{uri: '{URI.replace(':5000', ':9')}'}}\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith("MLFLOW_")}
    env["MLFLOW_HTTP_REQUEST_MAX_RETRIES"] = "0"
    proc = subprocess.run([sys.executable, "-m", "moerl.cli", "run", "run.yaml", "--resume", "0123abcd"],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 1, proc.stderr[-2000:]
    assert "no MLflow run '0123abcd' at http://127.0.0.1:9/mlflow" in proc.stderr
    assert "w0rd" not in proc.stdout + proc.stderr and "alice" not in proc.stdout + proc.stderr
