"""Each stage function on tiny inputs (no KFP, no engine): dataset, reward, buffer."""

import json
import time

import pytest

from moerl.components.buffer.stage import assemble, run_buffer
from moerl.components.reward.stage import run_reward, score
from moerl.config import BufferConfig, RewardConfig
from moerl.errors import DataError
from moerl.records import Prompt, Sample, ScoredSample, TrainSample, read_records, write_records
from moerl.tasks import verifiers
from moerl.tasks.dataset import load_dataset
from moerl.tasks.digits import generate, make_prompt


def _sample(pid="p0", idx=0, text="123", answer="123", task="copy", version=0):
    return Sample(
        prompt_id=pid,
        task=task,
        prompt=f"copy {answer}=",
        answer=answer,
        sample_index=idx,
        prompt_token_ids=[1, 2, 3],
        response_token_ids=[4, 5],
        response_logprobs=[-0.5, -0.25],
        response_text=text,
        finish_reason="stop",
        policy_version=version,
    )


# ---- dataset -------------------------------------------------------------------------------


def test_generated_tasks_have_correct_answers():
    import random

    rng = random.Random(3)
    for _ in range(50):
        p, a = make_prompt("add", rng, (1, 3))
        x, y = p.removeprefix("add ").removesuffix("=").split("+")
        assert int(a) == int(x) + int(y)
        p, a = make_prompt("reverse", rng, (2, 4))
        assert p.removeprefix("rev ").removesuffix("=")[::-1] == a


def test_builtin_dataset_loads_and_is_deterministic_per_iteration():
    ds = load_dataset("builtin:digits-copy", 0.0)
    assert ds.bad_rows == 0 and len(ds.rows) >= 1000
    b1, b2 = ds.batch(3, 16, seed=0), ds.batch(3, 16, seed=0)
    assert [p.id for p in b1] == [p.id for p in b2]
    assert [p.id for p in ds.batch(4, 16, seed=0)] != [p.id for p in b1]
    assert all(p.prompt == f"copy {p.answer}=" for p in b1)


def test_user_dataset_by_path_with_malformed_rows_skipped_and_counted(tmp_path):
    rows = [Prompt(id=f"r{i}", task="copy", prompt=f"copy {i}=", answer=str(i)) for i in range(40)]
    f = tmp_path / "d.jsonl"
    write_records(f, rows)
    with f.open("a") as fh:
        fh.write("{not json\n")
        fh.write(json.dumps({"id": "x", "task": "copy"}) + "\n")  # missing fields
    ds = load_dataset(str(f), max_bad_fraction=0.1)
    assert len(ds.rows) == 40 and ds.bad_rows == 2


def test_too_many_malformed_rows_fail_with_the_fraction_and_first_error(tmp_path):
    f = tmp_path / "d.jsonl"
    f.write_text('{"id": "a", "task": "copy", "prompt": "copy 1=", "answer": "1"}\n' + "oops\n" * 3)
    with pytest.raises(
        DataError, match=r"3 of 4 rows .* malformed .*task.max_bad_fraction.*line 2"
    ):
        load_dataset(str(f), max_bad_fraction=0.5)


def test_missing_dataset_names_the_field(tmp_path):
    with pytest.raises(DataError, match="task.dataset: file not found"):
        load_dataset(str(tmp_path / "none.jsonl"), 0.1)
    with pytest.raises(DataError, match="no builtin dataset 'nope'; builtin: .*digits-copy"):
        load_dataset("builtin:nope", 0.1)


def test_generate_is_seeded():
    assert generate(["copy", "add"], 10, seed=5) == generate(["copy", "add"], 10, seed=5)
    assert generate(["copy"], 10, seed=5) != generate(["copy"], 10, seed=6)


# ---- reward --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "resp, ans, expected",
    [
        ("1234", "1234", 1.0),
        ("1239", "1234", 0.75),
        ("12", "1234", 0.5),
        ("123456", "1234", 4 / 6),
        ("", "1234", 0.0),
        (" 1234 ", "1234", 1.0),
        ("4321", "1234", 0.0),
    ],
)
def test_positional_partial_credit(resp, ans, expected):
    assert verifiers.positional(resp, ans) == pytest.approx(expected)


def test_exact_verifier():
    assert verifiers.exact("12", "12") == 1.0 and verifiers.exact("13", "12") == 0.0


def test_raising_verifier_marks_sample_failed_and_is_counted():
    # runs in the sandboxed pool, like every verifier (tests/tasks/test_sandbox.py for the hostile ones)
    scored = score(
        [_sample(text="bad"), _sample(idx=1, text="123")],
        RewardConfig(verifier="tests.support.hostile_verifiers:raises"),
    )
    assert [s.reward for s in scored] == [0.0, 0.0]
    assert all(s.reward_failed and s.reward_error == "ValueError: cannot parse" for s in scored)


def test_unknown_task_under_auto_fails_the_sample_not_the_stage():
    scored = score([_sample(task="poetry")], RewardConfig())
    assert (
        scored[0].reward_failed
        and "has no verifier: set reward.verifiers.poetry" in scored[0].reward_error
    )


def test_reward_stage_fails_when_too_many_samples_fail(tmp_path):
    write_records(tmp_path / "s.jsonl", [_sample(task="poetry", idx=i) for i in range(3)])
    with pytest.raises(DataError, match="3 of 3 samples failed verification"):
        run_reward(
            RewardConfig(max_failed_fraction=0.5), tmp_path / "s.jsonl", tmp_path / "o.jsonl"
        )


def test_reward_stage_metrics_and_output(tmp_path):
    write_records(
        tmp_path / "s.jsonl",
        [_sample(text="123"), _sample(idx=1, text="129"), _sample(idx=2, text="")],
    )
    m = run_reward(RewardConfig(), tmp_path / "s.jsonl", tmp_path / "o.jsonl")
    out = read_records(tmp_path / "o.jsonl", ScoredSample)
    assert [round(s.reward, 4) for s in out] == [1.0, round(2 / 3, 4), 0.0]
    assert m["reward/mean"] == pytest.approx((1 + 2 / 3) / 3)
    assert m["reward/exact_fraction"] == pytest.approx(1 / 3)
    assert m["reward/failed_samples"] == 0.0 and m["timing/reward_s"] >= 0


# ---- buffer --------------------------------------------------------------------------------


def _scored(pid, rewards, version=0):
    return [
        ScoredSample(**_sample(pid=pid, idx=i, version=version).model_dump(), reward=r)
        for i, r in enumerate(rewards)
    ]


def test_buffer_drops_zero_variance_groups_and_counts_them():
    scored = _scored("a", [1.0, 0.0]) + _scored("b", [0.5, 0.5]) + _scored("c", [0.0, 0.0])
    batch, m = assemble(scored, BufferConfig(), trainer_version=0)
    assert m["buffer/groups"] == 3 and m["buffer/dropped_zero_variance_groups"] == 2
    assert len(batch) == 2
    # mean 0.5, sample std sqrt(0.5) (buffer.advantage_std defaults to sample, as verl and TRL)
    assert [round(s.advantage, 4) for s in batch] == [0.7071, -0.7071]


def test_buffer_keeps_zero_variance_groups_when_asked():
    batch, m = assemble(_scored("b", [0.5, 0.5]), BufferConfig(drop_zero_variance_groups=False), 0)
    assert len(batch) == 2 and all(s.advantage == 0.0 for s in batch)


def test_buffer_staleness_bound():
    scored = _scored("old", [1.0, 0.0], version=1) + _scored("new", [1.0, 0.0], version=3)
    batch, m = assemble(scored, BufferConfig(max_staleness=1), trainer_version=3)
    assert m["buffer/stale_samples"] == 2 and len(batch) == 2
    assert all(s.policy_version == 3 for s in batch)
    assert m["buffer/staleness_max"] == 2


def test_buffer_stage_writes_train_samples(tmp_path):
    write_records(tmp_path / "s.jsonl", _scored("a", [1.0, 0.0, 0.5]))
    m = run_buffer(BufferConfig(), tmp_path / "s.jsonl", 0, tmp_path / "b.jsonl")
    batch = read_records(tmp_path / "b.jsonl", TrainSample)
    assert len(batch) == 3 and m["buffer/batch_samples"] == 3
    assert sum(s.advantage for s in batch) == pytest.approx(0.0, abs=1e-9)
    assert batch[0].response_logprobs == [-0.5, -0.25]


def test_malformed_record_file_names_file_and_line(tmp_path):
    f = tmp_path / "s.jsonl"
    f.write_text(_sample().model_dump_json() + "\n" + '{"prompt_id": 1}\n')
    with pytest.raises(DataError, match=r"s.jsonl:2: not a valid Sample record"):
        read_records(f, Sample)


def test_a_group_that_takes_longer_than_reward_timeout_s_is_cut_off():
    """The async scorer's group deadline: each sample is under its own limit (the sandbox's),
    but the group as a whole runs past `reward.timeout_s`: it fails with a timeout error instead
    of stalling the run, the leases are refreshed while it waits, and the caller is told to restart."""
    from moerl.components.reward.worker import score_with_deadline

    samples = [_sample("p0", i, "12", "12").model_dump() for i in range(3)]
    cfg = RewardConfig(verifier="tests.support.hostile_verifiers:slow", timeout_s=0.5)
    t0, beats = time.monotonic(), []
    scored, n_failed, timed_out = score_with_deadline(
        samples, cfg, keepalive=lambda: beats.append(1), every_s=0.1
    )
    assert time.monotonic() - t0 < 5 and timed_out and n_failed == 3
    assert len(beats) >= 3  # the leases were refreshed while it waited
    assert all(s["reward_failed"] and "reward.timeout_s 0.5" in s["reward_error"] for s in scored)
    scored, n_failed, timed_out = score_with_deadline(samples[:2], RewardConfig(verifier="exact"))
    assert not timed_out and n_failed == 0 and [s["reward"] for s in scored] == [1.0, 1.0]
