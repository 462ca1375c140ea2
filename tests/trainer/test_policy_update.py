"""The GRPO update every stage runs (the one-rank mesh) on a real tiny Qwen3-MoE: steps, skipped
non-finite steps, state round trip, and equality with the single-process reference."""

import json
import math
from pathlib import Path

import pytest
import torch

from moerl.components.policy_update.trainer import Counters, pack, run_policy_update
from moerl.config import parse_config
from moerl.errors import TrainingError
from moerl.models.tiny import build_tiny_model
from moerl.records import TrainSample, write_records
from tests.support.oracles import reference_policy_update
from tests.support.weights import read_weights

CFG = parse_config(
    {"trainer": {"optimizer": {"optimizer_steps_per_iteration": 4, "learning_rate": 0.01}}}
)


@pytest.fixture(scope="module")
def state0(tmp_path_factory):
    root = tmp_path_factory.mktemp("state0")
    build_tiny_model(CFG.model.tiny, root)
    return root


def _batch(n=8, bad=()):
    out = []
    for i in range(n):
        lp = [float("nan")] * 3 if i in bad else [-3.0, -3.1, -2.9]
        out.append(
            TrainSample(
                prompt_token_ids=[21, 22, 23, 5 + i % 10],
                response_token_ids=[5 + i % 10, 6, 1],
                response_logprobs=lp,
                advantage=1.0 if i % 2 else -1.0,
                policy_version=0,
            )
        )
    return out


def test_pack_aligns_targets_with_response_positions():
    p = pack(
        _batch(2)
        + [
            TrainSample(
                prompt_token_ids=[21, 22],
                response_token_ids=[7],
                response_logprobs=[-1.5],
                advantage=0.5,
                policy_version=0,
            )
        ],
        pad_id=0,
    )
    assert p.input_ids_NL.shape == (3, 7)
    # sample 2: prompt of 2, one response token predicted at position 1
    assert p.mask_NL1[2].tolist() == [0, 1, 0, 0, 0, 0]
    assert p.targets_NL1[2, 1].item() == 7 and p.engine_logp_NL1[2, 1].item() == -1.5
    # sample 0: prompt of 4, 3 response tokens predicted at positions 3, 4, 5
    assert p.mask_NL1[0].tolist() == [0, 0, 0, 1, 1, 1]
    assert p.targets_NL1[0, 3:].tolist() == [5, 6, 1]


def test_pack_and_the_correction_split_take_each_tokens_version():
    from moerl.components.policy_update.steps import prepare_correction

    crossed = TrainSample(
        prompt_token_ids=[21, 22],
        response_token_ids=[5, 6, 1],
        response_logprobs=[-3.0] * 3,
        advantage=1.0,
        policy_version=3,
        token_versions=[(0, 3), (2, 4)],
    )
    p = pack([crossed, _batch(1)[0].model_copy(update={"policy_version": 4})], pad_id=0)
    assert p.version_NL1[0].tolist() == [-1, 3, 3, 4, -1, -1] and p.version_NL1[1].tolist() == [
        -1,
        -1,
        -1,
        4,
        4,
        4,
    ]
    _, m = prepare_correction(p, p.engine_logp_NL1.clone(), CFG, trainer_version=4)
    # the trainer's own version sampled one token of the first response and all three of the second
    assert m["rollout_corr/own/tokens"] == 4 and m["rollout_corr/stale/tokens"] == 2


def _update(tmp_path, batch, state_in, name="s1", iteration=0):
    """The production update (the one-rank mesh, `ep_train`) on `batch`."""
    write_records(tmp_path / f"{name}.jsonl", batch)
    return run_policy_update(CFG, tmp_path / f"{name}.jsonl", state_in, tmp_path / name, iteration)


def _counters(state: Path) -> Counters:
    return Counters(**json.loads((state / "trainer" / "state.json").read_text()))


def test_steps_change_weights_and_report_metrics(state0, tmp_path):
    m = _update(tmp_path, _batch(), state0)
    assert m["train/steps"] == 4 and m["train/skipped_steps"] == 0
    assert _counters(tmp_path / "s1").step == 4
    assert all(
        math.isfinite(m[k])
        for k in ("train/loss", "train/entropy", "train/grad_norm", "train/clip_fraction")
    )
    assert m["train/entropy"] > 0
    before, after = read_weights(state0), read_weights(tmp_path / "s1")
    assert set(before) == set(after)
    changed = sum(not torch.equal(before[k], after[k]) for k in before)
    assert changed > len(before) // 2


def test_the_stage_trains_like_the_single_process_reference(state0, tmp_path):
    """The one-rank mesh (what every stage runs) against `train_on_batch` without a mesh."""
    m = _update(tmp_path, _batch(), state0)
    write_records(tmp_path / "r.jsonl", _batch())
    ref = reference_policy_update(CFG, tmp_path / "r.jsonl", state0, tmp_path / "ref", 0)
    assert {k for k in ref if k.startswith("train/")} <= set(m)
    for k in ("train/loss", "train/grad_norm", "train/logprob_mismatch", "train/entropy"):
        assert m[k] == pytest.approx(ref[k], rel=1e-4, abs=1e-6), k
    # the same weights, relative to how far they moved (test_ep_equivalence's tolerance: Adam
    # turns float32 summation-order noise in near-zero gradients into lr-sized steps)
    w0, w, w_ref = (
        read_weights(state0),
        read_weights(tmp_path / "s1"),
        read_weights(tmp_path / "ref"),
    )
    assert set(w) == set(w_ref)
    for name, a in w_ref.items():
        delta, gap = float((a - w0[name]).norm()), float((w[name] - a).norm())
        assert gap <= 0.05 * delta + 1e-6, (name, gap, delta)


def _in_memory(state_in, batch, out):
    """The one-rank mesh's update on a batch no record file could hold (NaN logprobs)."""
    from moerl.components.policy_update.ep_train import Session, one_rank, run_version

    with one_rank(CFG):
        return run_version(CFG, Session.load(CFG, state_in), batch, 0, out)


def test_non_finite_loss_skips_the_step_and_counts_it(state0, tmp_path):
    m = _in_memory(state0, _batch(bad={3}), tmp_path / "s1")
    assert m["train/skipped_steps"] == 1 and m["train/steps"] == 3
    # the bad step touched nothing
    assert all(torch.isfinite(t).all() for t in read_weights(tmp_path / "s1").values())
    assert _counters(tmp_path / "s1").skipped_total == 1


def test_consecutive_non_finite_steps_fail_the_run(state0, tmp_path):
    with pytest.raises(TrainingError, match="3 optimizer steps in a row had a non-finite loss"):
        _in_memory(state0, _batch(bad=set(range(8))), tmp_path / "s1")
    assert not (tmp_path / "s1" / "trainer" / "state.json").exists()  # no version was written


def test_state_round_trip_carries_optimizer_and_counters(state0, tmp_path):
    from moerl.components.policy_update.ep_train import Session, one_rank

    m = _update(tmp_path, _batch(), state0)
    assert m["train/steps"] == 4 and m["timing/policy_update_s"] > 0
    s1 = tmp_path / "s1"
    # every rank's own files (here one), the index, the tokenizer; the state per rank (DCP)
    assert (s1 / "model.safetensors.index.json").is_file() and list(s1.glob("model-r*.safetensors"))
    assert (s1 / "tokenizer.json").is_file()
    assert (s1 / "trainer" / "optimizer" / ".metadata").is_file()
    assert (s1 / "trainer" / "model" / ".metadata").is_file()
    assert _counters(s1) == Counters(step=4, version=1, consecutive_skipped=0, skipped_total=0)
    with one_rank(CFG):
        session = Session.load(CFG, s1)
        assert len(session.opt.state_dict()["state"]) > 0  # Adam moments came back
        assert session.counters.version == 1
    # an empty batch still yields the next version, unchanged
    m = _update(tmp_path, [], s1, "s2", iteration=1)
    assert m["train/empty_batch"] == 1.0
    w1, w2 = read_weights(s1), read_weights(tmp_path / "s2")
    assert all(torch.equal(w1[k], w2[k]) for k in w1)
    assert _counters(tmp_path / "s2").version == 2


def test_model_path_takes_a_local_mixtral_checkpoint(tmp_path):
    from moerl.components.publish_checkpoint.stage import prepare_initial

    src = build_tiny_model(
        parse_config({"model": {"tiny": {"architecture": "mixtral"}}}).model.tiny, tmp_path / "mx"
    )
    cfg = parse_config(
        {
            "model": {"path": str(src)},
            "trainer": {"optimizer": {"optimizer_steps_per_iteration": 2}},
        }
    )
    prepare_initial(cfg, tmp_path / "s0")
    assert (tmp_path / "s0" / "config.json").read_text() == (src / "config.json").read_text()
    write_records(tmp_path / "b.jsonl", _batch())
    m = run_policy_update(cfg, tmp_path / "b.jsonl", tmp_path / "s0", tmp_path / "s1", iteration=0)
    assert m["train/steps"] == 2
    assert '"model_type": "mixtral"' in (tmp_path / "s1" / "config.json").read_text()


def test_model_path_that_is_not_a_moe_checkpoint_names_the_field(tmp_path):
    from moerl.errors import ConfigError
    from moerl.models.policy import check_checkpoint

    with pytest.raises(ConfigError, match=r"model.path: .* \(no config.json\)"):
        check_checkpoint(tmp_path)
    (tmp_path / "config.json").write_text('{"model_type": "llama"}')
    with pytest.raises(
        ConfigError,
        match="model_type 'llama' is not supported; allowed: qwen3_moe, mixtral, qwen2_moe, olmoe",
    ):
        check_checkpoint(tmp_path)


def test_expert_parallel_ranks_that_fail_give_one_clear_error(state0, tmp_path):
    cfg = parse_config({"trainer": {"parallelism": {"expert_parallel_size": 2}}})
    with pytest.raises(
        TrainingError,
        match=r"sharded training \(local, 2 ranks: mesh dp 1 x ep 2, all_to_all\) exited with",
    ):
        run_policy_update(
            cfg, tmp_path / "no-such-batch.jsonl", state0, tmp_path / "s1", iteration=0
        )
