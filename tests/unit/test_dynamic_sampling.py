"""Dynamic sampling (buffer.min_signal_groups, DAPO's filter_groups): the sync buffer keeps
exactly that many groups with signal, the async issuer keeps generating while filtered groups
eat into a version's batch, and the optimizer takes steps of one size whatever the batch."""

from __future__ import annotations

import pytest

from moerl.components.buffer.stage import assemble
from moerl.components.buffer.worker import prompts_to_issue
from moerl.components.policy_update.steps import optimizer_steps
from moerl.config import BufferConfig, parse_config
from moerl.errors import ConfigError
from moerl.records import ScoredSample


def _scored(prompt: str, rewards: list[float]) -> list[ScoredSample]:
    return [
        ScoredSample(
            prompt_id=prompt,
            task="copy",
            prompt="p",
            answer="1",
            sample_index=j,
            prompt_token_ids=[1],
            response_token_ids=[2],
            response_logprobs=[-1.0],
            response_text="x",
            finish_reason="stop",
            policy_version=0,
            reward=r,
        )
        for j, r in enumerate(rewards)
    ]


def test_the_sync_buffer_keeps_exactly_min_signal_groups_in_prompt_order():
    scored = (
        _scored("a", [1, 1])
        + _scored("b", [0, 1])
        + _scored("c", [0, 0])
        + _scored("d", [1, 0])
        + _scored("e", [0.5, 1])
    )
    batch, m = assemble(scored, BufferConfig(min_signal_groups=2), trainer_version=0)
    assert len(batch) == 4  # b and d, two samples each
    assert m["buffer/signal_groups"] == 2 and m["buffer/surplus_signal_groups"] == 1
    assert (
        m["buffer/signal_shortfall_groups"] == 0 and m["buffer/dropped_zero_variance_groups"] == 2
    )
    short, m = assemble(scored, BufferConfig(min_signal_groups=5), trainer_version=0)
    assert len(short) == 6 and m["buffer/signal_shortfall_groups"] == 2
    plain, m = assemble(scored, BufferConfig(), trainer_version=0)
    assert len(plain) == 6 and "buffer/signal_groups" not in m


def test_steps_have_one_size_whatever_the_batch():
    cfg = parse_config(
        {
            "buffer": {"min_signal_groups": 4},
            "task": {"prompts_per_iteration": 8},
            "rollout": {"samples_per_prompt": 8},
            "trainer": {"optimizer": {"optimizer_steps_per_iteration": 8}},
        }
    )
    assert optimizer_steps(cfg, 32) == 8  # a full batch: 4 groups x 8
    assert optimizer_steps(cfg, 16) == 4  # half a batch: half the steps, each of the same size
    assert optimizer_steps(cfg, 3) == 1  # at least one
    assert optimizer_steps(cfg, 64) == 8  # never more than configured
    assert (
        optimizer_steps(parse_config({}), 3)
        == parse_config({}).trainer.optimizer.optimizer_steps_per_iteration
    )


CFG = BufferConfig(min_signal_groups=4, high_watermark=1000, low_watermark=10)


def _issue(**kw):
    base = dict(
        used=0,
        in_flight=0,
        version=0,
        batch_prompts=8,
        versions=10,
        max_staleness=0,
        backlog=0,
        paused=False,
        cfg=CFG,
    )
    return prompts_to_issue(**{**base, **kw})[0]


def test_issuance_counts_signal_groups_and_scales_by_the_signal_rate():
    assert _issue() == 4  # nothing known yet: one version's signal groups
    # half the consumed groups had signal: twice as many prompts per version
    assert _issue(used=8, signal_used=4, version=1) == 8
    # the trainer holds 6 gathered groups of which 1 has signal, all still counted in flight: it
    # needs 3 more with signal, 6 more prompts at a rate of 1/2, so issuance must go on
    assert _issue(used=8, signal_used=4, version=1, in_flight=6, gathered=(6, 1)) == 6
    # without accounting for what the trainer holds this would have stalled the run
    assert _issue(used=8, signal_used=4, version=1, in_flight=6) < 6
    # a saturated policy (no signal at all) is bounded: at most 1 / 0.05 = 20 prompts per signal
    # group, and never more than the gather limit (8 x 4 groups) a version
    assert _issue(used=20, signal_used=0, version=0) == 12
    assert _issue(used=20, signal_used=1, version=0, max_staleness=3) == 108  # 4 x 32 - 20
    # (4 x 4 - 4) / 0.2 signal
    assert _issue(used=20, signal_used=4, version=0, max_staleness=3) == 60
    # never more than the run still needs
    assert _issue(used=80, signal_used=40, version=10, versions=10) == 0


def test_bad_dynamic_sampling_configs_are_refused_naming_the_key():
    with pytest.raises(ConfigError, match="min_signal_groups.*drop_zero_variance_groups"):
        parse_config({"buffer": {"min_signal_groups": 2, "drop_zero_variance_groups": False}})
    with pytest.raises(
        ConfigError, match="buffer.min_signal_groups .9. is more than task.prompts_per_iteration"
    ):
        parse_config({"buffer": {"min_signal_groups": 9}, "task": {"prompts_per_iteration": 8}})
    with pytest.raises(ConfigError, match="max_gather_groups"):
        parse_config({"buffer": {"max_gather_groups": 4}})
    assert (
        parse_config({"buffer": {"min_signal_groups": 2}}).buffer.resolved.max_gather_groups == 16
    )
