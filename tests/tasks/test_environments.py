"""Multi-turn environments: the sandboxed pool keeps each episode's environment in
a process of its own and routes its calls there; a hung step is cut off and loses only its episode;
preflight makes and steps each environment on one row, so a bad import path, a factory that
fails, a missing method or a wrong return stops the run before any work, naming the key; the
shipped tool environments (lookup, calculator); the mask that keeps environment tokens out of the loss."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import pytest
import torch

from moerl.config import load_config
from moerl.errors import ConfigError
from moerl.tasks.environments import CLOSE, LOST, RESET, STEP
from moerl.tasks.sandbox import Limits, SandboxPool

H = "tests.support.hostile_environments"
ROOT = Path(__file__).resolve().parents[2]
CONFIG = ROOT / "configs" / "tiny-moe-grpo.yaml"


def _row(i: int, **meta) -> dict:
    return {"id": f"r{i}", "task": "t", "prompt": "q", "answer": "a", "meta": meta or None}


def test_each_episode_has_a_process_of_its_own_and_a_hung_step_loses_only_its_own():
    keys = [f"e{i}" for i in range(6)]
    with SandboxPool(Limits(timeout_s=1.0, memory_mb=512, workers=2)) as pool:
        got = pool.run(
            [
                (RESET, [f"{H}:HangsOnSlow", k, _row(i, slow=int(i == 0))])
                for i, k in enumerate(keys)
            ],
            keys=keys,
        )
        assert [o.value for o in got] == [f"<r{i}>" for i in range(6)]
        assert set(pool.procs) == set(keys)  # one process per episode
        t0 = time.monotonic()
        steps = pool.run([(STEP, [k, "x"]) for k in keys], keys=keys)
        assert time.monotonic() - t0 < 1.0 + 1.5  # cut off at the timeout
        assert steps[0].kind == "timeout", steps
        assert all(o.ok for o in steps[1:]), steps  # no other episode lost its state
        # a later call of the killed episode finds no state: it fails, naming the lost key
        lost = pool.run([(STEP, ["e0", "x"])], keys=["e0"])[0]
        assert lost.kind == "error" and LOST in lost.error, lost
        alive = keys[1:]
        # the state lives in the process: each episode counts its own steps, in its own process
        got = [pool.run([(STEP, [k, "x"]) for k in alive], keys=alive) for _ in range(2)]
        assert [o.value[0].split("@")[0] for o in got[-1]] == ["3"] * len(alive)
        assert all(len({o.value[0].split("@")[1] for o in col}) == 1 for col in zip(*got))
        closed = pool.run([(CLOSE, [[k]]) for k in keys], keys=keys)
        pool.release(keys)
        assert sum(o.value for o in closed) == len(alive) and not pool.procs


def test_calls_with_one_key_run_in_order_even_from_one_batch():
    with SandboxPool(Limits(timeout_s=10.0, workers=3)) as pool:
        calls = [(RESET, [f"{H}:Counter", "k", _row(0)])] + [(STEP, ["k", "x"])] * 3
        got = pool.run(calls, keys=["k"] * 4)
    assert [o.value[0].split("@")[0] if isinstance(o.value, list) else o.value for o in got] == [
        "<r0>",
        "1",
        "2",
        "3",
    ]
    assert got[3].value[1:] == [1.0, True]


def test_an_environment_sees_no_credentials(monkeypatch):
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "s3cr3t")
    monkeypatch.setenv("VALKEY_PASSWORD", "pw")
    monkeypatch.setenv("MOERL_VALKEY_URL", "redis://:pw@127.0.0.1:1/0")
    with SandboxPool(Limits(timeout_s=10.0)) as pool:
        got = pool.run(
            [(RESET, [f"{H}:ReadsSecrets", "k", _row(0)]), (STEP, ["k", "x"])], keys=["k", "k"]
        )
    assert got[1].value[0] == "none", got


def test_the_lookup_store_answers_the_models_query_and_rewards_both_halves():
    from moerl.tasks.tools import Lookup, generate

    row = generate(1, seed=5)[0].model_dump()
    key, value = row["meta"]["key"], row["meta"]["value"]
    env = Lookup()
    assert env.reset(row) is None and row["prompt"] == f"do {key}=" and row["answer"] == value
    assert env.step(key) == (f" {value}=", 0.5, False)
    assert env.step(value) == (None, 0.5, True)
    env.reset(row)
    wrong = key[:-1] + str((int(key[-1]) + 1) % 10)
    obs, r1, _ = env.step(wrong)  # an unknown key: no value to copy, the answer cannot be right
    assert obs == " err=" and r1 == 0.5 * 2 / 3
    assert env.step("err")[1] < 0.5
    with pytest.raises(ValueError, match="a lookup row's meta holds the strings key and value"):
        Lookup().reset({"id": "x", "meta": {"key": 1}})


@pytest.mark.parametrize(
    "text, reply, reward",
    [
        ("Each box holds <calc>12*(3+4)</calc> apples", "<result>84</result>", None),
        ("<calc>7/2</calc>", "<result>3.5</result>", None),
        ("<calc>2**999</calc>", "<result>error: ValueError</result>", None),
        ("<calc>__import__('os').system('id')</calc>", "<result>error: ValueError</result>", None),
        ("<calc>1/0</calc>", "<result>error: ZeroDivisionError</result>", None),
        ("So they ate 1,234 in all.", None, 1.0),
        ("The answer is 1233.", None, 0.0),
        ("no idea", None, 0.0),
    ],
)
def test_the_calculator_runs_calls_without_eval_and_scores_the_final_answer(
    text, reply, reward, monkeypatch
):
    monkeypatch.syspath_prepend(str(ROOT / "examples"))  # as a user's package: examples/my_tasks
    from my_tasks.calculator import Calculator

    env = Calculator()
    env.reset({"id": "g", "answer": "1234"})
    obs, got, done = env.step(text)
    assert (obs, got, done) == (reply, reward, reply is None)


def _dataset(tmp_path, rows) -> Path:
    path = tmp_path / "d.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.mark.parametrize(
    "factory, said",
    [
        (
            "no_such_pkg.envs:Env",
            r"task.environments.guess: no_such_pkg.envs:Env cannot run task 'guess' .*reset: "
            r"ModuleNotFoundError: No module named 'no_such_pkg'",
        ),
        (f"{H}:RaisesOnReset", r"task.environments.guess: .*reset: RuntimeError: no such puzzle"),
        (f"{H}:NoStep", r"task.environments.guess: .*without a step\(\) method"),
        (
            f"{H}:BadStep",
            r"task.environments.guess: .*step: TypeError: BadStep.step returned \('obs', 1.0\); allowed",
        ),
        (
            f"{H}:StringReward",
            r"task.environments.guess: .*returned the reward '1'; allowed: a finite number",
        ),
        (f"{H}:NOT_A_FACTORY", r"task.environments.guess: .*is a int, not a function"),
    ],
)
def test_preflight_refuses_an_environment_that_cannot_run_naming_the_key(tmp_path, factory, said):
    from moerl.preflight import preflight

    data = _dataset(
        tmp_path,
        [
            {"id": "c0", "task": "copy", "prompt": "copy 12=", "answer": "12"},
            {
                "id": "g0",
                "task": "guess",
                "prompt": "do 0-99=",
                "answer": "7",
                "meta": {"secret": 7},
            },
        ],
    )
    sets = [f"checkpoint.uri={tmp_path / 'ck'}", f"task.dataset={data}"]
    cfg = load_config(CONFIG, sets + [f"task.environments={json.dumps({'guess': factory})}"])
    with pytest.raises(ConfigError, match=said):
        preflight(cfg)


def test_preflight_passes_the_example_environment_and_refuses_an_unknown_task(
    tmp_path, monkeypatch
):
    from moerl.preflight import preflight

    examples = str(ROOT / "examples")
    # the sandbox's children get this import path
    monkeypatch.setattr(sys, "path", [examples, *sys.path])
    sets = [f"checkpoint.uri={tmp_path / 'ck'}", f"task.dataset={examples}/my_tasks/guess.jsonl"]
    preflight(
        load_config(CONFIG, sets + ['task.environments={"guess": "my_tasks.guess:GuessNumber"}'])
    )
    with pytest.raises(ConfigError, match=r"task.environments: no dataset row has task 'gess'"):
        preflight(
            load_config(CONFIG, sets + ['task.environments={"gess": "my_tasks.guess:GuessNumber"}'])
        )


@pytest.mark.slow  # `moerl run` as a process (refused before any work)
def test_a_bad_environment_path_is_refused_at_load_and_the_cli_exits_2(tmp_path):
    import subprocess

    with pytest.raises(ConfigError, match=r"task.environment.*'rm -rf /' is not an import path"):
        load_config(CONFIG, ["task.environment=rm -rf /"])
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "moerl.cli",
            "run",
            str(CONFIG),
            "--set",
            f"checkpoint.uri={tmp_path / 'ck'}",
            "--set",
            f"task.environment={H}:NoStep",
        ],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert (
        "task.environment: tests.support.hostile_environments:NoStep cannot run task 'copy'"
        in proc.stderr
    )
    assert "Traceback" not in proc.stderr and not (tmp_path / "ck").exists()  # nothing published


def test_environment_tokens_are_masked_out_of_the_loss_and_get_no_gradient(tmp_path):
    from transformers import AutoModelForCausalLM

    from moerl.components.policy_update.steps import sequence_logprobs
    from moerl.components.policy_update.trainer import pack
    from moerl.models.tiny import build_tiny_model
    from moerl.records import TrainSample
    from tests.support.oracles import grpo_token_loss

    cfg = load_config(CONFIG)
    model = AutoModelForCausalLM.from_pretrained(build_tiny_model(cfg.model.tiny, tmp_path / "m"))
    mask = [1, 1, 0, 0, 0, 1, 1]  # turn 1, an observation of 3 tokens, turn 2
    s = TrainSample(
        prompt_token_ids=[20, 21, 22],
        response_token_ids=[5, 6, 7, 8, 9, 10, 11],
        response_logprobs=[-2.0, -2.0, 0.0, 0.0, 0.0, -2.0, -2.0],
        advantage=1.0,
        policy_version=0,
        response_mask=mask,
    )
    p = pack([s, s.model_copy(update={"advantage": -1.0})], 0)
    assert p.mask_NL1[0, 2:9].tolist() == [float(m) for m in mask]
    logp, _ = sequence_logprobs(model, p, torch.arange(2), temperature=1.0)
    logp.retain_grad()
    loss, _ = grpo_token_loss(
        logp, logp.detach(), p.engine_logp_NL1, p.adv_N, p.mask_NL1, 0.2, 0.28, 2.0
    )
    loss.backward()
    g = logp.grad[0, 2:9]
    assert torch.all(g[[2, 3, 4]] == 0) and torch.all(g[[0, 1, 5, 6]] != 0), g
    # garbage engine logprobs on environment tokens change nothing
    bad = p.engine_logp_NL1.clone()
    bad[:, 4:7] = -50.0
    again, _ = grpo_token_loss(
        logp.detach(), logp.detach(), bad, p.adv_N, p.mask_NL1, 0.2, 0.28, 2.0
    )
    assert torch.equal(again, loss.detach())


@pytest.mark.parametrize("env", ["SteadyHangsOnSlow", "HangsOnSlow"])
def test_a_hung_episode_fails_alone_and_its_neighbours_need_no_replay(env):
    """Each episode has a process of its own: a hung step kills only its episode's, so its
    neighbours go on (deterministic or not) and nothing is replayed."""
    from moerl.components.rollout.engine import Completion
    from moerl.components.rollout.episodes import EpisodeDriver
    from moerl.models.tiny import build_tokenizer

    cfg = load_config(CONFIG, [f"task.environment={H}:{env}", "task.max_turns=5"])
    tok = build_tokenizer()
    with SandboxPool(Limits(timeout_s=1.0, memory_mb=512, workers=2)) as pool:
        d = EpisodeDriver(cfg, tok, pool)
        eps = [
            d.episode(f"e{i}", _row(i, slow=2 * (i == 0)) | {"task": "copy"}, [7, 8], 0, False)
            for i in range(4)
        ]
        d.begin(eps)
        live = eps
        for turn in range(3):
            live = d.advance([(e, Completion([5 + turn], [-1.0], str(turn), "stop")) for e in live])
        d.finish(eps)
        assert not pool.procs  # every episode's process ended with it
    assert eps[0].error.startswith(f"{H}:{env}.step: timeout:") and d.timeouts == 1
    for e in eps[1:]:
        s = e.sample(0)
        assert (
            e.error is None and s.env_reward == 1.0 and s.turns == 3 and s.finish_reason == "stop"
        ), e
    assert d.replays == 0


def test_the_reward_stage_uses_the_environments_reward_fails_a_failed_episode_and_scores_the_last_message():
    from moerl.components.reward.stage import reward_metrics, score
    from moerl.config import RewardConfig
    from moerl.records import Sample

    def ep(i, **kw):
        return Sample(
            prompt_id="p",
            task="copy",
            prompt="copy 12=",
            answer="12",
            sample_index=i,
            prompt_token_ids=[1],
            response_token_ids=[2, 3, 4],
            response_logprobs=[-1.0, 0.0, -1.0],
            response_text="x 9=12",
            finish_reason="stop",
            policy_version=0,
            response_mask=[1, 0, 1],
            turns=2,
            **kw,
        )

    out = score(
        [
            ep(0, env_reward=0.25, final_response="12"),  # the environment's reward wins
            ep(1, final_response="12"),  # no reward from it: the verifier scores the last message
            ep(2, final_response="13"),
            ep(
                3,
                env_error="tests.support.hostile_environments:HangsOnSlow.step: timeout: killed",
                final_response="12",
            ),
        ],
        RewardConfig(),
    )
    assert [s.reward for s in out[:3]] == [0.25, 1.0, 0.5] and not any(
        s.reward_failed for s in out[:3]
    )
    assert out[3].reward_failed and out[3].reward_error.startswith("environment: ")
    m = reward_metrics(out)
    assert (
        m["reward/failed_samples"],
        m["reward/env_failed_samples"],
        m["reward/error_samples"],
    ) == (1, 1, 0)
    with pytest.raises(ValueError, match="response_mask must hold one 0 or 1 per response token"):
        Sample.model_validate(ep(4).model_dump() | {"response_mask": [1, 0]})
