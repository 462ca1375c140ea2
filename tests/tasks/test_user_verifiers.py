"""A user's verifiers: rows carry `meta` to them, `reward.verifiers`
picks one per task, plain or async, with or without `meta`; preflight calls each on one row of
its task in the sandbox, so a missing verifier, a bad import path, a wrong signature or one that
raises stops the run before any work, naming the key."""

import json

import pytest

from moerl.components.reward.stage import score
from moerl.config import RewardConfig, load_config
from moerl.errors import ConfigError
from moerl.records import MAX_META_BYTES, Prompt, Sample
from moerl.tasks.dataset import load_dataset

U = "tests.support.user_verifiers"
CONFIG = "configs/tiny-moe-grpo.yaml"


def _sample(task: str, text: str, answer: str, meta=None, i: int = 0) -> Sample:
    return Sample(
        prompt_id=f"p{i}",
        task=task,
        prompt="q",
        answer=answer,
        sample_index=i,
        prompt_token_ids=[1],
        response_token_ids=[2],
        response_logprobs=[-1.0],
        response_text=text,
        finish_reason="stop",
        policy_version=0,
        meta=meta,
    )


def test_a_row_carries_meta_up_to_its_cap():
    row = Prompt(
        id="a", task="lookup", prompt="q", answer="x", meta={"expected": "7", "cases": [1, 2]}
    )
    assert row.meta["cases"] == [1, 2]
    with pytest.raises(ValueError, match=rf"meta\n.*bytes as JSON; at most {MAX_META_BYTES}"):
        Prompt(id="a", task="t", prompt="q", answer="x", meta={"blob": "x" * MAX_META_BYTES})
    with pytest.raises(ValueError, match="meta"):
        Prompt.model_validate(
            {"id": "a", "task": "t", "prompt": "q", "answer": "x", "meta": [1, 2]}
        )


def test_each_task_is_scored_by_its_own_verifier_with_the_rows_meta():
    cfg = RewardConfig(verifiers={"lookup": f"{U}:by_meta", "echo": f"{U}:exact_async"})
    out = score(
        [
            _sample("copy", "12", "12"),  # the shipped default for copy: positional
            _sample("lookup", "7", "x", {"expected": "7"}, 1),  # right by meta, wrong by answer
            _sample("lookup", "x", "x", {"expected": "7"}, 2),
            _sample("echo", "hi", "hi", None, 3),
            _sample("echo", "ho", "hi", None, 4),
        ],
        cfg,
    )
    assert [s.reward for s in out] == [1.0, 1.0, 0.0, 1.0, 0.0]
    assert not any(s.reward_failed for s in out)
    assert out[1].meta == {"expected": "7"}  # carried into the scored sample


def test_a_task_without_a_verifier_fails_its_samples_but_is_refused_first_at_preflight(tmp_path):
    out = score([_sample("lookup", "7", "x")], RewardConfig())
    assert out[0].reward_failed and "reward.verifiers.lookup" in out[0].reward_error


def _dataset(tmp_path, rows):
    path = tmp_path / "d.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.mark.parametrize(
    "verifier, said",
    [
        (None, r"task 'lookup' has no verifier: set reward.verifiers.lookup"),
        (
            "no_such_pkg.mod:fn",
            r"reward.verifiers.lookup: no_such_pkg.mod:fn cannot score task 'lookup' .*"
            r"No module named 'no_such_pkg'",
        ),
        (
            f"{U}:three_required",
            r"reward.verifiers.lookup: .*takes neither \(response, answer, meta\) nor",
        ),
        (
            f"{U}:fails_on_gold",
            r"reward.verifiers.lookup: .* on row 'l0' with its own answer\): "
            r"RuntimeError: no parser for this answer format",
        ),
    ],
)
def test_preflight_refuses_a_verifier_that_cannot_score_naming_the_key(tmp_path, verifier, said):
    from moerl.preflight import preflight

    data = _dataset(
        tmp_path,
        [
            {"id": "c0", "task": "copy", "prompt": "copy 12=", "answer": "12"},
            {
                "id": "l0",
                "task": "lookup",
                "prompt": "look",
                "answer": "x",
                "meta": {"expected": "7"},
            },
        ],
    )
    sets = [f"checkpoint.uri={tmp_path / 'ck'}", f"task.dataset={data}"]
    if verifier:
        sets.append(f"reward.verifiers={json.dumps({'lookup': verifier})}")
    cfg = load_config(CONFIG, sets)
    with pytest.raises(ConfigError, match=said):
        preflight(cfg)
    good = load_config(
        CONFIG, sets[:2] + [f"reward.verifiers={json.dumps({'lookup': f'{U}:by_meta'})}"]
    )
    assert len(load_dataset(str(data), 0.0).rows) == 2
    preflight(good)  # the same dataset with a verifier that works


def test_a_bad_verifiers_entry_is_refused_at_load_naming_the_task():
    with pytest.raises(
        ConfigError, match=r"reward.verifiers.*lookup: 'rm -rf /' is neither a shipped verifier"
    ):
        load_config(CONFIG, ['reward.verifiers={"lookup": "rm -rf /"}'])


def test_the_example_package_passes_preflight_and_scores_by_meta(tmp_path, monkeypatch):
    """examples/my_tasks, as README runs it (PYTHONPATH=examples): its dataset's tasks each have
    a verifier that imports and scores in the sandbox; `any_of` accepts the reversed answer
    that its row's meta lists."""
    import sys
    from pathlib import Path

    from moerl.preflight import preflight

    examples = str(Path(__file__).resolve().parents[2] / "examples")
    # the sandbox's children get this import path
    monkeypatch.setattr(sys, "path", [examples, *sys.path])
    sets = [
        f"checkpoint.uri={tmp_path / 'ck'}",
        f"task.dataset={examples}/my_tasks/digits_any.jsonl",
        'reward.verifiers={"any_of": "my_tasks:any_of", "copy": "my_tasks:copy_async"}',
    ]
    cfg = load_config(CONFIG, sets)
    preflight(cfg)
    row = next(r for r in load_dataset(cfg.task.dataset, 0.0).rows if r.task == "any_of")
    out = score(
        [
            _sample("any_of", row.answer[::-1], row.answer, row.meta),
            _sample("copy", row.answer[::-1], row.answer, None, 1),
        ],
        cfg.reward,
    )
    assert [s.reward for s in out][0] == 1.0 and out[1].reward == float(
        row.answer[::-1] == row.answer
    )
