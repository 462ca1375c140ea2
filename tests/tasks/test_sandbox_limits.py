"""The sandbox's limits against a call's own processes, and one sample's code against the
others' scores (moerl/tasks/sandbox.py, sandbox_child.py, isolation.py, seccomp.py): real
processes and namespaces. Each attack runs in a batch beside honest samples; the attack's own
sample fails (counted), the honest scores are unchanged. Each attack succeeded on the pool that
served every call from one long-lived child."""

from __future__ import annotations

import time

import pytest

from moerl.tasks.environments import RESET, STEP
from moerl.tasks.sandbox import Limits, SandboxPool

A = "tests.support.sandbox_attacks"
HONEST = f"{A}:honest"


@pytest.fixture(scope="module")
def pool():
    with SandboxPool(Limits(timeout_s=20.0, memory_mb=500, workers=2)) as p:
        yield p


def _batch(pool, attack: str, args=("1", "")) -> tuple:
    calls = [
        (HONEST, ["0", ""]),
        (f"{A}:{attack}", list(args)),
        (HONEST, ["2", ""]),
        (HONEST, ["3", ""]),
    ]
    got = pool.run(calls)
    assert [o.value for i, o in enumerate(got) if i != 1] == [0.0, 2.0, 3.0], got
    return got[1]


def test_a_thread_that_writes_replies_later_fails_only_its_own_sample(pool):
    before = pool.forged_replies
    o = _batch(pool, "forges")
    assert o.kind == "crashed" and o.error.startswith("forged:"), o
    assert pool.forged_replies == before + 1
    again = pool.run([(HONEST, [str(i), ""]) for i in range(6)])  # nothing of it is left
    assert [x.value for x in again] == [float(i) for i in range(6)]


def test_the_reward_stage_counts_a_forged_reply():
    from moerl.components.reward.stage import reward_metrics, score
    from moerl.config import RewardConfig
    from tests.tasks.test_sandbox import _sample

    cfg = RewardConfig(verifier=f"{A}:forges", max_failed_fraction=1.0, sandbox={"workers": 2})
    scored = score([_sample(i, str(i), "x") for i in range(4)], cfg)
    m = reward_metrics(scored)
    assert m["reward/forged_samples"] == 4 and m["reward/error_samples"] == 0, m


def test_an_environment_that_patches_its_grader_changes_no_other_episode():
    keys = ["a", "b", "c"]
    row = {"id": "r", "task": "t", "prompt": "q", "answer": "42", "meta": None}
    with SandboxPool(Limits(timeout_s=10.0, workers=1)) as pool:
        pool.run(
            [(RESET, ["tests.support.hostile_environments:PatchesGrader", k, row]) for k in keys],
            keys=keys,
        )
        got = pool.run([(STEP, ["a", "patch"]), (STEP, ["b", "7"]), (STEP, ["c", "42"])], keys=keys)
    assert [o.value[1] for o in got] == [0.0, 0.0, 1.0], got


def test_four_children_of_300_mib_are_killed_together_over_memory_mb_500(pool):
    t0 = time.monotonic()
    o = _batch(pool, "forks_memory")
    assert o.kind == "memory" and "500 MiB" in o.error, o
    assert time.monotonic() - t0 < 8  # killed, not left to its 8 s sleep


def test_a_background_process_and_a_file_do_not_survive_into_the_next_call(pool):
    left = pool.run([(f"{A}:leaves_a_process", ["", ""])])[0]
    assert left.ok, left
    found = pool.run([(f"{A}:finds_a_process", ["", ""])])[0]
    assert found.value == [False, []], found


def test_120_mib_of_scratch_files_do_not_fit(pool):
    o = _batch(pool, "fills_scratch")
    assert o.kind == "error" and "No space left on device" in o.error, o


def test_a_nested_user_namespace_is_refused(pool):
    o = _batch(pool, "nested_namespace")
    assert o.kind == "error" and "Operation not permitted" in o.error, o
    assert "max_user_namespaces 0" in o.error, o


def test_a_fork_bomb_stops_at_the_pids_limit():
    # memory_mb high enough that the bomb meets its pids limit first (128 forks of a Python
    # process hold about 10 MiB each of copied pages)
    with SandboxPool(Limits(timeout_s=20.0, memory_mb=4096, workers=2)) as pool:
        o = _batch(pool, "fork_bomb")
    assert o.kind == "error" and "fork refused after" in o.error, o
    assert int(o.error.rsplit("after ", 1)[1].split()[0]) < 128, o


def test_a_verifier_whose_import_hangs_times_out_and_the_template_is_replaced():
    with SandboxPool(Limits(timeout_s=2.0, workers=2)) as pool:
        got = pool.run([("tests.support.hangs_at_import:verify", ["", ""]), (HONEST, ["1", ""])])
        # the call behind it in the wedged template fails too (a broken verifier's cost)
        assert got[0].kind == "timeout" and got[1].kind in ("timeout", "crashed"), got
        assert pool.run([(HONEST, ["5", ""])])[0].value == 5.0 and pool.started == 2


_POOL = """
import json, sys
from moerl.tasks.sandbox import Limits, SandboxPool
with SandboxPool(Limits(timeout_s=20.0, isolation=sys.argv[1])) as pool:
    [o] = pool.run([("tests.support.sandbox_attacks:reads", [sys.argv[2], ""])])
print(json.dumps([o.kind, o.value, o.error]))
"""
_POD_TOKEN = (
    "mount -t tmpfs pod /run && mkdir -p /run/secrets/kubernetes.io/serviceaccount && "
    'echo api-token > /run/secrets/kubernetes.io/serviceaccount/token && exec "$@"'
)


@pytest.mark.parametrize("isolation", ["none", "namespaces"])
def test_the_pods_service_account_token_is_hidden_from_an_isolated_call(isolation):
    """The stage runs where the pod's token is mounted (/var/run/secrets/kubernetes.io/...,
    made real in a mount namespace of its own); `none` reads it (the control)."""
    import json
    import subprocess
    import sys

    from tests.tasks.test_sandbox_isolation import _TWO_UIDS, ROOT

    token = "/var/run/secrets/kubernetes.io/serviceaccount/token"
    got = subprocess.run(
        [*_TWO_UIDS, "sh", "-c", _POD_TOKEN, "sh", sys.executable, "-c", _POOL, isolation, token],
        cwd=ROOT,
        env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(ROOT), "LANG": "C.UTF-8"},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert got.returncode == 0, got.stderr[-3000:]
    kind, value, error = json.loads(got.stdout.strip().splitlines()[-1])
    if isolation == "none":
        assert (kind, value) == ("ok", "api-token\n"), error
    else:
        assert kind == "error" and error.startswith("FileNotFoundError"), (kind, value, error)


def test_an_episode_that_forges_replies_fails_alone_and_is_counted():
    from moerl.components.rollout.engine import Completion
    from moerl.components.rollout.episodes import EpisodeDriver
    from moerl.config import load_config
    from moerl.models.tiny import build_tokenizer
    from tests.tasks.test_environments import CONFIG, _row

    env = "tests.support.hostile_environments"
    cfg = load_config(CONFIG, [f"task.environment={env}:Counter"])
    cfg.task.environments["bad"] = f"{env}:ForgesReplies"
    with SandboxPool(Limits(timeout_s=10.0, workers=2)) as pool:
        d = EpisodeDriver(cfg, build_tokenizer(), pool)
        rows = [_row(0) | {"task": "bad"}, _row(1) | {"task": "copy"}]
        eps = [d.episode(f"e{i}", r, [7, 8], 0, False) for i, r in enumerate(rows)]
        d.begin(eps)
        d.advance([(e, Completion([5], [-1.0], "x", "stop")) for e in eps])
        d.finish(eps)
        assert pool.forged_replies == 1
    assert eps[0].error and "forged:" in eps[0].error, eps[0].error
    assert eps[1].error is None and eps[1].observed[-1].startswith("1@"), eps[1]
    assert d.metrics(eps, 1.0)["env/forged_episodes"] == 1


def test_without_namespaces_a_calls_background_process_is_killed_at_its_end():
    with SandboxPool(Limits(timeout_s=10.0, isolation="none")) as pool:
        left = pool.run([(f"{A}:leaves_a_process", ["", ""])])[0]
        assert left.ok, left
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline and _alive(left.value):
            time.sleep(0.05)
        assert not _alive(left.value)


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False
