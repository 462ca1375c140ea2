"""The zygote (moerl/launch/zygote.py): stage processes forked from a process that imported
their modules once, each a process of its own, with its own environment, log, process group and
exit code, dying with the zygote."""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import pytest

from moerl.launch import procs
from moerl.launch.zygote import Zygote, ZygoteError

STAGE = "tests.support.zygote_stage"
PRELOAD = ["tests.support.zygote_preload", "tests.support.zygote_stage", "no_such_module_xyz"]


@pytest.fixture
def zygote(tmp_path):
    env = {**os.environ, "ZYGOTE_TEST_ZYGOTE_ONLY": "secret-of-the-zygote"}
    z = Zygote("test", PRELOAD, env, tmp_path / "zygote.log")
    yield z
    z.close()


def _env(**extra) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("ZYGOTE_TEST_")}
    return {**env, **extra}


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # a zombie is gone for every purpose here
    stat = Path(f"/proc/{pid}/stat")
    return stat.exists() and stat.read_text().split(") ", 1)[1][0] != "Z"


def test_children_are_processes_of_their_own(zygote, tmp_path):
    ready = zygote.ready()
    assert ready["loaded"][:2] == PRELOAD[:2]
    assert len(ready["missing"]) == 1 and "no_such_module_xyz" in ready["missing"][0]
    cpus = sorted(os.sched_getaffinity(0))
    a = zygote.spawn(
        STAGE,
        [str(tmp_path / "a.json"), "0"],
        _env(ZYGOTE_TEST_NAME="a", **{procs.CPUS_ENV: str(cpus[0])}),
        tmp_path / "a.log",
    )
    b = zygote.spawn(
        STAGE, [str(tmp_path / "b.json"), "3"], _env(ZYGOTE_TEST_NAME="b"), tmp_path / "b.log"
    )
    assert a.wait(timeout=30) == 0
    assert b.wait(timeout=30) == 3
    ia, ib = (json.loads((tmp_path / f"{n}.json").read_text()) for n in "ab")
    assert ia["pid"] == a.pid and ib["pid"] == b.pid and a.pid != b.pid
    assert ia["pgid"] == a.pid and ib["pgid"] == b.pid  # each its own group: kill_groups works
    assert ia["argv"] == [STAGE, str(tmp_path / "a.json"), "0"]
    # exactly the environment asked for: nothing of the zygote's own
    # (and what the preloaded modules set as they were imported, as a fresh import would)
    assert ia["env"] == {"ZYGOTE_TEST_NAME": "a", "ZYGOTE_TEST_SET_AT_IMPORT": "yes"}
    assert ib["env"] == {"ZYGOTE_TEST_NAME": "b", "ZYGOTE_TEST_SET_AT_IMPORT": "yes"}
    assert ia["cpus"] == [cpus[0]] and ib["cpus"] == cpus
    assert ia["preloaded"] and ib["preloaded"]  # imported once, in the zygote
    assert ia["random"] != ib["random"]  # not the zygote's generator state, shared
    assert (tmp_path / "a.log").read_text().startswith("stage says hello")


def test_a_failing_stage_exits_1_with_its_traceback(zygote, tmp_path):
    p = zygote.spawn(STAGE, [str(tmp_path / "x.json"), "0", "raise"], _env(), tmp_path / "x.log")
    assert p.wait(timeout=30) == 1
    assert "the stage broke on purpose" in (tmp_path / "x.log").read_text()


def test_kill_groups_and_close_stop_the_children(zygote, tmp_path):
    killed = zygote.spawn(
        STAGE, [str(tmp_path / "k.json"), "0", "sleep"], _env(), tmp_path / "k.log"
    )
    orphan = zygote.spawn(
        STAGE, [str(tmp_path / "o.json"), "0", "sleep"], _env(), tmp_path / "o.log"
    )
    for f in ("k.json", "o.json"):
        deadline = time.monotonic() + 30
        while not (tmp_path / f).exists() and time.monotonic() < deadline:
            time.sleep(0.05)
    assert killed.poll() is None
    procs.kill_groups([killed], grace_s=1.0)  # what LocalAsyncRun.stop does
    assert killed.returncode == -signal.SIGTERM
    assert _alive(orphan.pid)
    zygote.close()  # the run ends: what the zygote still runs dies with it
    deadline = time.monotonic() + 10
    while _alive(orphan.pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _alive(orphan.pid)
    assert orphan.poll() == -signal.SIGKILL


def test_a_dead_zygote_is_named(tmp_path):
    z = Zygote("doomed", ["tests.support.zygote_preload"], dict(os.environ), tmp_path / "z.log")
    try:
        z.proc.kill()
        with pytest.raises(ZygoteError, match=r"doomed zygote .*z\.log"):
            z.spawn(STAGE, [str(tmp_path / "n.json"), "0"], _env(), tmp_path / "n.log")
    finally:
        z.close()


def test_an_exited_child_is_never_signalled_and_a_bad_request_fails_alone(zygote, tmp_path):
    p = zygote.spawn(STAGE, [str(tmp_path / "e.json"), "0"], _env(), tmp_path / "e.log")
    assert p.wait(timeout=30) == 0
    p.send_signal(signal.SIGTERM)  # reaped already: its pid may be anyone's now; no error
    assert zygote.proc.stdin is not None
    with zygote._spawning:  # a request that does not parse, as a broken caller would send it
        zygote.proc.stdin.write(b"{not json\n")
        zygote.proc.stdin.flush()
    deadline = time.monotonic() + 10
    while not zygote._errors and time.monotonic() < deadline:
        time.sleep(0.02)
    assert zygote._errors and "JSONDecodeError" in zygote._errors[0]
    ok = zygote.spawn(STAGE, [str(tmp_path / "f.json"), "5"], _env(), tmp_path / "f.log")
    assert ok.wait(timeout=30) == 5  # the zygote serves on
