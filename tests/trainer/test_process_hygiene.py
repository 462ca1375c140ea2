"""No expert-parallel rank outlives its policy_update task: not on SIGKILL, SIGTERM or the rank
timeout, with either launcher. Real ranks (ep_train on the tiny MoE, gloo); the batch is a
FIFO nobody writes, so every rank blocks reading it, as a rank stuck in a collective would."""

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from moerl.config import parse_config
from moerl.models.tiny import build_tiny_model

TASK = """
import json, sys
from moerl.components.policy_update.trainer import run_policy_update
from moerl.config import parse_config
a = json.loads(sys.argv[1])
run_policy_update(parse_config(a["cfg"]), a["batch"], a["state_in"], a["state_out"], 0)
"""


@pytest.fixture(scope="module")
def state0(tmp_path_factory):
    root = tmp_path_factory.mktemp("hygiene-state0")
    build_tiny_model(parse_config({}).model.tiny, root)
    return root


def _mentioning(marker: str, exclude: int) -> list[int]:
    """Live processes whose command line names `marker` (zombies have none)."""
    found = []
    for d in os.listdir("/proc"):
        if d.isdigit() and int(d) not in (os.getpid(), exclude):
            try:
                cmd = open(f"/proc/{d}/cmdline", "rb").read()
            except OSError:
                continue
            if marker.encode() in cmd:
                found.append(int(d))
    return found


def _wait_for(pred, timeout_s: float, step: float = 0.2):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if value := pred():
            return value
        time.sleep(step)
    return pred()


@pytest.fixture
def blocked_task(state0, tmp_path):
    """Start a policy_update task whose ranks block forever; yield (task, marker, n_children).
    Whatever it leaves behind is killed by pid afterwards, so a failing run leaks nothing."""
    started = []

    def start(launcher: str):
        os.mkfifo(tmp_path / "batch.jsonl")
        cfg = {"trainer": {"parallelism": {"expert_parallel_size": 2, "launcher": launcher}}}
        arg = json.dumps(
            {
                "cfg": cfg,
                "batch": str(tmp_path / "batch.jsonl"),
                "state_in": str(state0),
                "state_out": str(tmp_path / "s1"),
            }
        )
        task = subprocess.Popen(
            [sys.executable, "-c", TASK, arg], stderr=subprocess.PIPE, text=True
        )
        started.append(task)
        n = 3 if launcher == "torchrun" else 2  # torchrun itself and 2 workers, or 2 ranks
        assert _wait_for(lambda: len(_mentioning(str(tmp_path), task.pid)) >= n, 180), (
            "the ranks never started"
        )
        time.sleep(2)  # let them get on with it (import torch, rendezvous, load the model)
        assert task.poll() is None
        return task, str(tmp_path)

    yield start
    for task in started:
        task.kill()
        task.wait()
        for pid in _mentioning(str(tmp_path), task.pid):
            os.kill(pid, signal.SIGKILL)


@pytest.mark.slow
@pytest.mark.parametrize("launcher", ["local", "torchrun"])
def test_sigkilled_task_leaves_no_rank_behind(blocked_task, launcher):
    task, marker = blocked_task(launcher)
    task.kill()
    task.wait()
    gone = _wait_for(lambda: not _mentioning(marker, task.pid), 5)
    assert gone, f"ranks alive 5 s after their task was SIGKILLed: {_mentioning(marker, task.pid)}"


@pytest.mark.slow
def test_sigterm_kills_every_rank_and_fails_the_task(blocked_task):
    task, marker = blocked_task("local")
    task.send_signal(signal.SIGTERM)
    _, err = task.communicate(timeout=30)
    assert task.returncode != 0
    assert "received SIGTERM; killed every rank of sharded training (local, 2 ranks" in err
    assert not _mentioning(marker, task.pid)  # gone before the task exited, not merely later


@pytest.mark.slow
def test_ranks_past_the_timeout_are_killed_with_a_clear_error(state0, tmp_path):
    from moerl.components.policy_update.launcher import run_expert_parallel
    from moerl.errors import TrainingError

    os.mkfifo(tmp_path / "batch.jsonl")
    cfg = parse_config({"trainer": {"parallelism": {"expert_parallel_size": 2}}})
    t0 = time.monotonic()
    with pytest.raises(
        TrainingError,
        match=r"\(local, 2 ranks: mesh dp 1 x ep 2, all_to_all\) did not finish within 4 s "
        r"\(the rank timeout\); killed every rank",
    ):
        run_expert_parallel(
            cfg, tmp_path / "batch.jsonl", state0, tmp_path / "s1", 0, rank_timeout_s=4
        )
    assert time.monotonic() - t0 < 30
    assert not _mentioning(str(tmp_path), -1)


def test_torchrun_picks_its_own_port_and_wraps_its_workers():
    from moerl.components.policy_update.launcher import torchrun_args

    args = torchrun_args(2, ["--iteration", "0"])
    assert "--standalone" in args and "--local-addr=127.0.0.1" in args
    assert not any(a.startswith(("--master-port", "--master_port", "--rdzv")) for a in args)
    assert args[args.index("--module") + 1 :] == [
        "moerl.launch.procs",
        "moerl.components.policy_update.ep_train",
        "--iteration",
        "0",
    ]


def test_wrapped_child_whose_parent_is_already_gone_exits_at_once():
    """The parent can die between fork and arming the death signal; the wrapper sees a parent
    other than the one named in MOERL_PARENT_PID and exits instead of running the module."""
    env = {**os.environ, "MOERL_PARENT_PID": "1"}
    proc = subprocess.run(
        [sys.executable, "-m", "moerl.launch.procs", "this_module_would_fail_to_import"],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 1 and "No module named" not in proc.stderr
    env["MOERL_PARENT_PID"] = str(os.getpid())
    proc = subprocess.run(
        [sys.executable, "-m", "moerl.launch.procs", "json.tool", "--help"],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0 and "usage:" in proc.stdout
