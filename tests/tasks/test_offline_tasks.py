"""Real offline tasks (the moerl[tasks] extra): every reasoning-gym generator that
gives a gold answer scores it 1.0 and a wrong answer below 1.0 through the row's `meta` alone
(the verifier regenerates the item); math-verify agrees on a table of equivalent and
non-equivalent answers, also inside the sandboxed pool; `moerl tasks make` writes a dataset
that loads and passes preflight."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from moerl.config import load_config
from moerl.errors import ConfigError
from moerl.tasks.dataset import load_dataset

pytest.importorskip(
    "reasoning_gym", reason="the moerl[tasks] extra is not installed (make setup installs it)"
)
ROOT = Path(__file__).resolve().parents[2]
CONFIG = ROOT / "configs" / "tiny-moe-grpo.yaml"


def test_every_generator_with_a_gold_answer_scores_it_one_and_a_wrong_answer_less():
    from moerl.tasks.offline import generator_names, make_reasoning_gym, score_reasoning_gym

    names = generator_names()
    assert len(names) >= 100
    no_gold, needs_config, lenient, scored = [], [], [], 0
    for name in names:
        try:
            (row,) = make_reasoning_gym([name], seed=1, size=1)
        except ConfigError:  # `composite` mixes others: it needs its list of datasets
            needs_config.append(name)
            continue
        assert row.meta == {"generator": name, "seed": 1, "index": 0, "size": 1, "config": {}}
        if not row.answer:
            no_gold.append(name)
            continue
        assert score_reasoning_gym(row.answer, row.answer, row.meta) == 1.0, name
        if score_reasoning_gym("\u2205 not an answer", row.answer, row.meta) >= 1.0:
            lenient.append(name)
        scored += 1
    assert scored >= 95 and len(no_gold) <= 6 and needs_config == ["composite"], (
        no_gold,
        needs_config,
    )
    # found: a scorer that gives full marks to a non-answer (its gold is "False" and it checks
    # for "True"); named in docs/tasks.md, and no more than these
    assert lenient == ["game_of_life_halting"], lenient


def test_an_item_depends_only_on_name_seed_and_index():
    from moerl.tasks.offline import make_reasoning_gym

    small = make_reasoning_gym(["basic_arithmetic"], seed=4, size=3)
    big = make_reasoning_gym(["basic_arithmetic"], seed=4, size=30)
    assert [(r.prompt, r.answer) for r in small] == [(r.prompt, r.answer) for r in big[:3]]
    assert make_reasoning_gym(["basic_arithmetic"], seed=5, size=3)[0].prompt != small[0].prompt


@pytest.mark.parametrize(
    "gold, response, same",
    [
        ("29", "They ate 29 slices in total, so the answer is 29.", True),
        ("0.5", r"The answer is $\frac{1}{2}$", True),
        (r"\frac{3}{4}", "0.75", True),
        ("1000", "1,000", True),
        (r"\{1, 2\}", r"$\{2, 1\}$", True),
        ("29", "The answer is 28.", False),
        ("0.5", r"$\frac{1}{3}$", False),
        ("12", "no number here", False),
    ],
)
def test_math_verify_agrees_on_equivalent_answers_and_no_others(gold, response, same):
    from moerl.tasks.offline import score_math

    assert score_math(response, gold) == float(same)


def test_the_shipped_verifiers_run_in_the_sandbox_by_task():
    from moerl.components.reward.stage import score
    from moerl.config import RewardConfig
    from moerl.records import Sample
    from moerl.tasks.offline import make_reasoning_gym

    row = make_reasoning_gym(["gsm_symbolic"], seed=2, size=1)[0]
    samples = [
        Sample(
            prompt_id=row.id,
            task=task,
            prompt=row.prompt,
            answer=row.answer,
            sample_index=i,
            prompt_token_ids=[1],
            response_token_ids=[2],
            response_logprobs=[-1.0],
            response_text=text,
            finish_reason="stop",
            policy_version=0,
            meta=row.meta,
        )
        for i, (task, text) in enumerate(
            [
                ("reasoning_gym", row.answer),
                ("reasoning_gym", "-1"),
                ("math", f"so it is {row.answer}."),
                ("math", "-1"),
            ]
        )
    ]
    out = score(samples, RewardConfig())
    # gsm_symbolic gives 0.01 for a wrong number (a well-formed answer), math-verify 0
    assert [s.reward for s in out] == [1.0, 0.01, 1.0, 0.0] and not any(
        s.reward_failed for s in out
    ), out


def test_moerl_tasks_make_writes_a_dataset_that_passes_preflight(tmp_path):
    from moerl.preflight import preflight

    out = tmp_path / "gsm.jsonl"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "moerl.cli",
            "tasks",
            "make",
            "reasoning-gym",
            "--names",
            "gsm_symbolic,basic_arithmetic",
            "--seed",
            "3",
            "--size",
            "4",
            "--math",
            "-o",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    ds = load_dataset(str(out), 0.0)
    assert len(ds.rows) == 8 and {r.task for r in ds.rows} == {"math"} and ds.bad_rows == 0
    preflight(load_config(CONFIG, [f"checkpoint.uri={tmp_path / 'ck'}", f"task.dataset={out}"]))
    bad = subprocess.run(
        [
            sys.executable,
            "-m",
            "moerl.cli",
            "tasks",
            "make",
            "reasoning-gym",
            "--names",
            "gsm_symbolc",
            "-o",
            str(tmp_path / "x.jsonl"),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert (
        bad.returncode == 2 and "no reasoning-gym generator 'gsm_symbolc'; allowed:" in bad.stderr
    )
    assert not (tmp_path / "x.jsonl").exists()
    with pytest.raises(ConfigError, match=r"--config: reasoning-gym's basic_arithmetic refuses"):
        from moerl.tasks.offline import make_reasoning_gym

        make_reasoning_gym(
            ["basic_arithmetic"], 0, 2, config={"basic_arithmetic": {"no_such_field": 1}}
        )
    assert json.loads(out.read_text().splitlines()[0])["meta"]["generator"] == "gsm_symbolic"
