"""The sandboxed execution pool (moerl/tasks/sandbox.py) and the reward stage on it: real child
processes, each hostile verifier cut off, counted, and the pool still scoring afterwards."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from moerl.components.reward.stage import reward_metrics, run_reward, score
from moerl.config import RewardConfig, load_config
from moerl.errors import ConfigError
from moerl.records import Sample, ScoredSample, read_records, write_records
from moerl.tasks.sandbox import Limits, SandboxPool, check_target

H = "tests.support.hostile_verifiers"
CONFIG = os.path.join(
    os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
    "configs",
    "tiny-moe-grpo.yaml",
)


def _sample(idx=0, text="123", answer="123"):
    return Sample(
        prompt_id="p0",
        task="copy",
        prompt=f"copy {answer}=",
        answer=answer,
        sample_index=idx,
        prompt_token_ids=[1, 2, 3],
        response_token_ids=[4, 5],
        response_logprobs=[-0.5, -0.25],
        response_text=text,
        finish_reason="stop",
        policy_version=0,
    )


@pytest.fixture(scope="module")
def pool():
    with SandboxPool(Limits(timeout_s=1.0, memory_mb=512, workers=2)) as p:
        yield p


def test_each_hostile_verifier_is_cut_off_and_the_pool_goes_on(pool):
    calls = [
        (f"{H}:{n}", ["12", "12"])
        for n in ("sleeps", "spins", "allocates", "dies", "raises", "prints")
    ]
    calls.append(("moerl.tasks.verifiers:positional", ["12", "12"]))
    t0 = time.monotonic()
    got = pool.run(calls)
    took = time.monotonic() - t0
    assert [o.kind for o in got] == [
        "timeout",
        "timeout",
        "memory",
        "crashed",
        "error",
        "ok",
        "ok",
    ], got
    assert took < 10  # two timeouts of 1 s on two workers, plus restarts
    assert "1 s" in got[0].error and "512 MiB" in got[2].error and "SIGKILL" in got[3].error
    assert got[4].error == "ValueError: cannot parse"
    assert got[5].value == 0.25 and got[6].value == 1.0  # a print did not corrupt the replies
    again = pool.run([("moerl.tasks.verifiers:exact", ["12", "12"])] * 20)
    assert [o.value for o in again] == [1.0] * 20
    assert pool.procs == {} and pool.started == 1  # one template, never replaced


def test_a_verifier_sees_no_credentials_and_works_in_a_scratch_directory_of_its_own(
    pool, monkeypatch
):
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "s3cr3t")
    monkeypatch.setenv("MLFLOW_TRACKING_PASSWORD", "pw")
    monkeypatch.setenv("MOERL_VALKEY_URL", "redis://:pw@127.0.0.1:1/0")
    with SandboxPool(Limits(timeout_s=10.0)) as fresh:  # children start with this environment
        seen = fresh.run([(f"{H}:environment", ["", ""])])[0].value
    env = seen["env"]
    assert not {k for k in env if k.startswith(("AWS", "MLFLOW", "MOERL"))}, sorted(env)
    assert "s3cr3t" not in repr(env) and "pw@" not in repr(env)
    assert env["HOME"] == env["TMPDIR"] == seen["cwd"] and "moerl-sandbox-" in seen["cwd"]
    assert not os.path.exists(seen["cwd"])  # removed with the child


def test_a_child_exits_when_its_parent_is_killed(tmp_path):
    """A scorer SIGKILLed mid-call leaves no verifier process behind."""
    script = tmp_path / "parent.py"
    script.write_text(
        textwrap.dedent(f"""
        import sys, threading
        from moerl.tasks.sandbox import SandboxPool, Limits
        pool = SandboxPool(Limits(timeout_s=600))
        threading.Thread(target=lambda: pool.run([("{H}:sleeps", ["", ""])]), daemon=True).start()
        import time
        while not pool.template: time.sleep(0.05)
        print(pool.template.proc.pid, flush=True)
        time.sleep(600)
    """)
    )
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    parent = subprocess.Popen(
        [sys.executable, str(script)],
        stdout=subprocess.PIPE,
        text=True,
        cwd=root,
        env={**os.environ, "PYTHONPATH": root},
    )
    try:
        child = int(parent.stdout.readline())
        os.kill(parent.pid, signal.SIGKILL)
        parent.wait()
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and _alive(child):
            time.sleep(0.1)
        assert not _alive(child)
    finally:
        parent.kill()


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def test_the_reward_stage_fails_and_counts_cut_off_samples_and_scores_the_rest(tmp_path):
    cfg = RewardConfig(
        verifier=f"{H}:by_response",
        max_failed_fraction=0.9,
        sandbox={"sample_timeout_s": 1.0, "memory_mb": 512, "workers": 2},
    )
    texts = ["1 hangs", "2 spins", "3 allocates", "456", "457"]
    write_records(tmp_path / "s.jsonl", [_sample(i, t, "456") for i, t in enumerate(texts)])
    m = run_reward(cfg, tmp_path / "s.jsonl", tmp_path / "o.jsonl")
    out = read_records(tmp_path / "o.jsonl", ScoredSample)
    assert [s.reward_failed for s in out] == [True, True, True, False, False]
    assert out[0].reward_error.startswith("timeout:") and out[2].reward_error.startswith("memory:")
    assert [s.reward for s in out[3:]] == [1.0, pytest.approx(2 / 3)]
    assert (
        m["reward/timeout_samples"],
        m["reward/memory_samples"],
        m["reward/failed_samples"],
    ) == (2, 1, 3)
    assert m["reward/error_samples"] == 0 and m["reward/env_failed_samples"] == 0


def test_a_verifier_that_returns_no_number_or_raises_fails_its_sample():
    cfg = RewardConfig(verifier=f"{H}:not_a_number")
    assert "not a finite number" in score([_sample()], cfg)[0].reward_error
    got = score([_sample()], RewardConfig(verifier=f"{H}:raises"))[0]
    assert got.reward_failed and got.reward_error == "ValueError: cannot parse"
    m = reward_metrics([got])
    assert m["reward/failed_samples"] == 1 and m["reward/timeout_samples"] == 0


def test_a_verifier_by_import_path_is_checked_in_the_sandbox_before_any_work(tmp_path):
    from moerl.preflight import preflight

    assert check_target(f"{H}:by_response", 2) == ""
    assert "too many positional arguments" in check_target(f"{H}:takes_one", 2)
    assert "No module named" in check_target("no_such_pkg.mod:fn", 2)
    base = [f"checkpoint.uri={tmp_path / 'ck'}"]
    for bad, said in (
        ("no_such_pkg.mod:fn", "No module named 'no_such_pkg'"),
        (f"{H}:nope", "has no attribute 'nope'"),
        (f"{H}:takes_one", "positional arguments"),
    ):
        cfg = load_config(CONFIG, base + [f"reward.verifier={bad}"])
        with pytest.raises(ConfigError, match=rf"reward.verifier: .*{said}"):
            preflight(cfg)
    with pytest.raises(
        ConfigError, match="reward.verifier.*import path of the form package.module:function"
    ):
        load_config(CONFIG, ["reward.verifier=rm -rf /"])


def test_a_group_deadline_below_what_its_samples_may_take_is_refused():
    with pytest.raises(ConfigError, match=r"reward.timeout_s \(30 s\) is below .* 40 s"):
        load_config(CONFIG, ["reward.timeout_s=30", "reward.sandbox.sample_timeout_s=5"])
    load_config(
        CONFIG,
        ["reward.timeout_s=30", "reward.sandbox.sample_timeout_s=5", "reward.sandbox.workers=2"],
    )
