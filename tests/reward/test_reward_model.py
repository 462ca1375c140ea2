"""RLHF: preference data, the Bradley-Terry loss, the reward model's batching, scoring
failures, registration and lineage (components/reward_model, components/reward/stage.py).

The reward models here are real (the tiny Qwen3-MoE backbone with a one-logit head, built
from its seed); the MLflow stores are real (SQLite) and so is the checkpoint store (local).
"""

from __future__ import annotations

import json
import math

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from moerl.config import parse_config
from moerl.errors import CheckpointError, ConfigError, DataError
from moerl.records import PreferencePair, Sample


@pytest.fixture(scope="module")
def tiny_rm(tmp_path_factory):
    from moerl.components.reward_model.model import build_reward_model

    return build_reward_model(parse_config({}).model, tmp_path_factory.mktemp("rm") / "model")


def _sample(prompt="copy 1234=", text="1234", idx=0):
    return Sample(
        prompt_id="p0",
        task="copy",
        prompt=prompt,
        answer="1234",
        sample_index=idx,
        prompt_token_ids=[1],
        response_token_ids=[2],
        response_logprobs=[-1.0],
        response_text=text,
        finish_reason="stop",
        policy_version=0,
    )


# ---- the loss ----------------------------------------------------------------------------------


def test_bradley_terry_loss_against_hand_computed_values():
    from moerl.components.reward_model.model import bradley_terry_loss

    # -log σ(2 - 1) = log(1 + e^-1) = 0.3132617; -log σ(0 - 1) = log(1 + e) = 1.3132617
    got = bradley_terry_loss(torch.tensor([2.0, 0.0]), torch.tensor([1.0, 1.0]))
    assert got.item() == pytest.approx(
        (math.log(1 + math.exp(-1)) + math.log(1 + math.e)) / 2, abs=1e-6
    )
    assert got.item() == pytest.approx(0.8132617, abs=1e-6)
    assert bradley_terry_loss(torch.tensor([0.0]), torch.tensor([0.0])).item() == pytest.approx(
        math.log(2)
    )
    # finite for a huge margin either way (softplus form), and its gradient pushes chosen up
    c, r = torch.tensor([200.0, -200.0], requires_grad=True), torch.tensor([0.0, 0.0])
    loss = bradley_terry_loss(c, r)
    loss.backward()
    assert math.isfinite(loss.item()) and loss.item() == pytest.approx(100.0, rel=1e-6)
    assert (c.grad <= 0).all() and c.grad[1] == pytest.approx(-0.5)


# ---- the model ---------------------------------------------------------------------------------


def test_batched_scores_equal_one_by_one_scores(tiny_rm):
    from moerl.components.reward_model.model import RewardModel

    rm = RewardModel(tiny_rm)
    texts = [
        "copy 1234=1234",
        "copy 1234=9",
        "copy 55=",
        "copy 987654=987654321",
        "rev 12=21",
        "add 1+2=3",
        "copy 0=0",
    ]
    one = rm.score(texts, max_batch=1)
    for batch in (2, 3, 7):
        assert torch.allclose(
            torch.tensor(rm.score(texts, max_batch=batch)), torch.tensor(one), atol=1e-5
        ), batch
    assert len(set(round(v, 4) for v in one)) > 1  # not a constant: the texts differ


def test_a_failing_batch_marks_its_samples_failed_and_counts_them(tiny_rm):
    from moerl.components.reward.stage import ModelScorer, reward_metrics, run_reward, score
    from moerl.components.reward_model.model import RewardModel
    from moerl.records import ScoredSample, read_records, write_records

    cfg = parse_config(
        {"reward": {"kind": "mixed", "model": {"registered": "rm/1", "max_batch": 2}}}
    )
    scorer = ModelScorer(cfg, model=RewardModel(tiny_rm))
    too_long = "copy " + "1" * 80 + "="  # over the model's 64 positions: its batch fails
    samples = [
        _sample(idx=0),
        _sample(idx=1, text="12"),
        _sample(prompt=too_long, idx=2),
        _sample(idx=3, text="9"),
    ]
    scored = score(samples, cfg.reward, scorer)
    assert [s.reward_failed for s in scored] == [False, False, True, True]  # the whole third batch
    assert all(
        "reward model: ValueError" in s.reward_error and "max_position_embeddings" in s.reward_error
        for s in scored[2:]
    )
    assert all(s.reward == 0.0 for s in scored[2:]) and all(
        s.model_score is not None for s in scored[:2]
    )
    for s in scored[:2]:  # mixed: the weights of the verifier and the normalized model score
        sig = 1 / (1 + math.exp(-s.model_score))
        assert s.reward == pytest.approx(0.5 * s.rule_score + 0.5 * sig)
    m = reward_metrics(scored)
    assert m["reward/failed_samples"] == 2 and m["reward/model_failed_samples"] == 2
    assert m["reward/model_score_mean"] == pytest.approx(sum(s.model_score for s in scored[:2]) / 2)
    assert scorer.seconds > 0
    # past reward.max_failed_fraction the stage stops, naming the error
    write_records(tmp := tiny_rm.parent / "samples.jsonl", samples)
    tight = cfg.reward.model_copy(update={"max_failed_fraction": 0.25})
    with pytest.raises(DataError, match=r"2 of 4 samples failed .*reward model: ValueError"):
        run_reward(tight, tmp, tiny_rm.parent / "scored.jsonl", scorer)
    metrics = run_reward(cfg.reward, tmp, tiny_rm.parent / "scored.jsonl", scorer)
    assert (
        metrics["timing/reward/model_inference_s"] > 0
        and len(read_records(tiny_rm.parent / "scored.jsonl", ScoredSample)) == 4
    )


def test_kind_model_scores_with_the_normalized_model_score_only(tiny_rm):
    from moerl.components.reward.stage import ModelScorer, score
    from moerl.components.reward_model.model import RewardModel

    samples = [_sample(idx=i, text=t) for i, t in enumerate(["1234", "12", "99999", ""])]
    for how in ("sigmoid", "zscore", "none"):
        cfg = parse_config(
            {"reward": {"kind": "model", "model": {"registered": "rm/latest", "normalize": how}}}
        )
        scored = score(samples, cfg.reward, ModelScorer(cfg, model=RewardModel(tiny_rm)))
        raw = [s.model_score for s in scored]
        got = [s.reward for s in scored]
        if how == "sigmoid":
            assert got == pytest.approx([1 / (1 + math.exp(-v)) for v in raw])
        elif how == "zscore":
            assert sum(got) == pytest.approx(0.0, abs=1e-9) and sorted(got) == [
                g for _, g in sorted(zip(raw, got))
            ]
        else:
            assert got == pytest.approx(raw)
        assert all(s.rule_score is None for s in scored)


# ---- preference data ---------------------------------------------------------------------------


def test_the_shipped_preference_set_is_what_the_generator_makes_and_the_verifier_agrees():
    from moerl.tasks.preferences import builtin_pairs, load_preferences, split
    from moerl.tasks.verifiers import verifier_for

    shipped = load_preferences("builtin:prefs-digits", 0.0)
    assert shipped.bad_rows == 0 and shipped.rows == builtin_pairs()
    answers = {
        r.prompt: r.answer
        for r in __import__("moerl.tasks.dataset", fromlist=["x"])
        .load_dataset("builtin:digits-copy", 0.0)
        .rows
    }
    for p in shipped.rows:
        v = verifier_for("auto", "copy")
        assert v(p.chosen, answers[p.prompt]) >= v(p.rejected, answers[p.prompt]) + 0.4, p
    train, held = split(shipped.rows, 0.2, 0)
    assert (
        len(held) == 500 and len(train) == 2000 and not {p.id for p in train} & {p.id for p in held}
    )
    assert split(list(reversed(shipped.rows)), 0.2, 0) == (train, held)  # seeded, order-independent


def test_malformed_preference_rows_are_skipped_and_counted(tmp_path):
    from moerl.tasks.preferences import load_preferences

    good = [
        {"id": f"p{i}", "prompt": "copy 12=", "chosen": "12", "rejected": "1"} for i in range(20)
    ]
    lines = [json.dumps(r) for r in good] + [
        "not json",
        json.dumps({"id": "x", "prompt": "copy 1=", "chosen": "1"}),  # no rejected
        # no preference
        json.dumps({"id": "y", "prompt": "copy 1=", "chosen": "1", "rejected": "1"}),
        json.dumps({"id": "z", "prompt": "copy 1=", "chosen": "1\u0000", "rejected": "2"}),
        json.dumps({"id": "w", "prompt": "copy 1=", "chosen": "1", "rejected": "2", "extra": 1}),
    ]
    (tmp_path / "p.jsonl").write_text("\n".join(lines) + "\n\n")
    got = load_preferences(str(tmp_path / "p.jsonl"), 0.25)
    assert len(got.rows) == 20 and got.bad_rows == 5
    with pytest.raises(
        DataError, match=r"reward_model.data: 5 of 25 rows .* malformed .* first: line 21: not JSON"
    ):
        load_preferences(str(tmp_path / "p.jsonl"), 0.05)
    # Parquet: a null is a malformed row; a missing column fails the file
    rows = good[:9] + [{"id": "n", "prompt": "copy 1=", "chosen": None, "rejected": "2"}]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "p.parquet")
    got = load_preferences(str(tmp_path / "p.parquet"), 0.1)
    assert len(got.rows) == 9 and got.bad_rows == 1 and got.rows[0] == PreferencePair(**good[0])
    with pytest.raises(DataError, match=r"row 10: chosen: expected a string, got NoneType"):
        load_preferences(str(tmp_path / "p.parquet"), 0.0)
    pq.write_table(
        pa.Table.from_pylist([{"id": "a", "prompt": "b", "good": "c"}]), tmp_path / "q.parquet"
    )
    with pytest.raises(DataError, match=r"has no column\(s\) chosen, rejected"):
        load_preferences(str(tmp_path / "q.parquet"), 0.5)
    with pytest.raises(DataError, match="reward_model.data: file not found"):
        load_preferences(str(tmp_path / "none.jsonl"), 0.5)
    (tmp_path / "dup.jsonl").write_text(json.dumps(good[0]) + "\n" + json.dumps(good[0]) + "\n")
    with pytest.raises(DataError, match="id 'p0' appears more than once"):
        load_preferences(str(tmp_path / "dup.jsonl"), 0.5)


# ---- registration and lineage -------------------------------------------------------------------


def test_publish_registers_and_a_grpo_run_records_the_lineage(tiny_rm, tmp_path):
    from mlflow.tracking import MlflowClient

    from moerl import tracking
    from moerl.components.reward.stage import load_model_scorer
    from moerl.components.reward_model.stage import publish
    from moerl.registry import reward_model as registry
    from moerl.store.runs import run_store

    common = {
        "checkpoint": {"uri": str(tmp_path / "ckpt"), "cache_dir": str(tmp_path / "cache")},
        "tracking": {"uri": f"sqlite:///{tmp_path / 'mlflow.db'}"},
    }
    rm_cfg = parse_config(
        common
        | {"pipeline": {"kind": "reward_model"}, "reward_model": {"registry_name": "rm-test"}}
    )
    uri = tracking.resolve_uri(rm_cfg.tracking)
    rm_run = tracking.start_run(rm_cfg, uri, {})
    out = publish(rm_cfg, rm_run, tiny_rm, {"rm/eval_accuracy": 0.93, "rm/eval_pairs": 10})
    manifest = run_store(rm_cfg.checkpoint, rm_run).manifest(1)
    assert out == {
        "registered": "rm-test/1",
        "uri": f"{tmp_path / 'ckpt'}/runs/{rm_run}/versions/v000001",
        "manifest_sha256": manifest.sha256(),
        "version": "1",
    }
    assert manifest.meta["kind"] == "reward_model" and manifest.meta["eval_accuracy"] == "0.9300"
    assert MlflowClient(uri).get_run(rm_run).data.tags["reward_model.registered"] == "rm-test/1"

    grpo = parse_config(
        common | {"reward": {"kind": "model", "model": {"registered": "rm-test/latest"}}}
    )
    grpo_run = tracking.start_run(grpo, uri, {})
    scorer = load_model_scorer(grpo, grpo_run)
    tags = MlflowClient(uri).get_run(grpo_run).data.tags
    assert tags["reward_model.registered"] == "rm-test/1" and tags["reward_model.uri"] == out["uri"]
    assert (
        tags["reward_model.version"] == "1"
        and tags["reward_model.manifest_sha256"] == manifest.sha256()
    )
    assert tags["reward_model.run_id"] == rm_run and tags["reward_model.eval_accuracy"] == "0.9300"
    # the verified cache
    assert scorer.model.path.is_relative_to(tmp_path / "cache" / "reward-models" / rm_run)
    # a version that does not exist is refused, naming the key
    with pytest.raises(
        ConfigError, match="reward.model.registered: rm-test/7 is not in the model registry"
    ):
        registry.resolve(uri, grpo.reward.model.model_copy(update={"registered": "rm-test/7"}))
    with pytest.raises(ConfigError, match="no registered model 'nope'"):
        registry.resolve(uri, grpo.reward.model.model_copy(update={"registered": "nope/latest"}))
    # a published version whose manifest no longer matches the registry is refused
    info = registry.resolve(uri, grpo.reward.model)
    forged = registry.RegisteredRewardModel(**{**info.__dict__, "manifest_sha256": "0" * 64})
    with pytest.raises(CheckpointError, match="changed after it was registered"):
        registry.fetch(grpo.checkpoint, forged)


def test_reward_kind_needs_a_registered_model_and_the_rm_pipeline_is_not_async():
    with pytest.raises(ConfigError, match="kind model needs reward.model.registered"):
        parse_config({"reward": {"kind": "model"}})
    with pytest.raises(ConfigError, match="reward.model.registered: String should match pattern"):
        parse_config({"reward": {"kind": "mixed", "model": {"registered": "no-version"}}})
    with pytest.raises(ConfigError, match="kind mixed needs rules_weight"):
        parse_config(
            {
                "reward": {
                    "kind": "mixed",
                    "rules_weight": 0,
                    "model_weight": 0,
                    "model": {"registered": "rm/1"},
                }
            }
        )
