"""GRPO advantages and loss: hand-computed cases, and verl / TRL reference formulas on seeded
random inputs.

The two references below are written from the peers' documented formulas (verl:
`compute_grpo_outcome_advantage`, `compute_policy_loss_vanilla` with TIS and token-mean
`agg_loss`; TRL: GRPOTrainer's group advantages and its dapo/bnpo loss with
`vllm_importance_sampling_correction`). They mask by multiplying, as the peers do, so they are
fed finite inputs; moerl's loss is fed the same inputs with garbage (inf / NaN) at padding.
"""

import math
import random

import pytest
import torch

from moerl.components.buffer.advantage import group_advantages
from moerl.components.policy_update.loss import LossStats, token_logprobs_and_entropy
from tests.support.oracles import grpo_token_loss


def test_advantage_divides_by_the_sample_std_by_default():
    adv, zero = group_advantages([1.0, 0.0, 0.0, 1.0], eps=1e-6)
    # mean 0.5; sample std sqrt((4 * 0.25) / 3) = sqrt(1/3)  (population would be 0.5)
    sd = math.sqrt(1 / 3)
    assert not zero
    assert adv == pytest.approx(
        [0.5 / (sd + 1e-6), -0.5 / (sd + 1e-6), -0.5 / (sd + 1e-6), 0.5 / (sd + 1e-6)]
    )


def test_advantage_population_std_on_request():
    adv, zero = group_advantages([1.0, 0.0, 0.0, 1.0], eps=1e-6, std="population")
    # mean 0.5, population std 0.5
    assert not zero
    assert adv == pytest.approx([0.5 / 0.500001, -0.5 / 0.500001, -0.5 / 0.500001, 0.5 / 0.500001])


def test_advantage_partial_credit_case():
    adv, _ = group_advantages([0.2, 0.0, 0.0, 0.0], eps=0.0, std="population")
    # mean 0.05, std sqrt((0.15^2 + 3*0.05^2)/4) = sqrt(0.0075)
    std = math.sqrt(0.0075)
    assert adv == pytest.approx([0.15 / std, -0.05 / std, -0.05 / std, -0.05 / std])
    assert sum(adv) == pytest.approx(0.0, abs=1e-9)
    adv, _ = group_advantages([0.2, 0.0, 0.0, 0.0], eps=0.0)
    std = math.sqrt(0.03 / 3)  # the same squares over G - 1
    assert adv == pytest.approx([0.15 / std, -0.05 / std, -0.05 / std, -0.05 / std])


def test_single_sample_group_is_zero_variance_under_both_estimators():
    for kind in ("sample", "population"):
        assert group_advantages([0.7], std=kind) == ([0.0], True)
    with pytest.raises(ValueError, match="std must be"):
        group_advantages([0.0, 1.0], std="unbiased")


def _verl_grpo_advantages(rewards: list[float], eps: float = 1e-6) -> list[float]:
    """verl compute_grpo_outcome_advantage for one group (G > 1): torch.mean, torch.std
    (unbiased), (r - mean) / (std + eps)."""
    r = torch.tensor(rewards, dtype=torch.float64)
    return ((r - r.mean()) / (torch.std(r) + eps)).tolist()


def _trl_grpo_advantages(rewards: list[float]) -> list[float]:
    """TRL GRPOTrainer, scale_rewards="group": (r - group mean) / (group .std(dim) + 1e-4),
    with the group viewed as one row of (-1, num_generations)."""
    r = torch.tensor(rewards, dtype=torch.float64).view(1, -1)
    return (
        ((r - r.mean(dim=1, keepdim=True)) / (r.std(dim=1, keepdim=True) + 1e-4)).flatten().tolist()
    )


def _random_groups(n: int, seed: int) -> list[list[float]]:
    rng = random.Random(seed)
    groups = []
    for i in range(n):
        g = rng.randint(2, 16)
        if i % 3 == 0:  # binary rewards, as an exact-match verifier gives
            groups.append([float(rng.random() < 0.3) for _ in range(g)])
        else:  # partial credit
            groups.append([round(rng.random(), 3) for _ in range(g)])
    return groups


def test_advantages_match_verl_and_trl_on_random_groups():
    groups = _random_groups(200, seed=7)
    assert any(len(set(g)) == 1 for g in groups) and any(len(set(g)) > 1 for g in groups)
    for rewards in groups:
        ours, zero = group_advantages(rewards, eps=1e-6)
        assert ours == pytest.approx(_verl_grpo_advantages(rewards), abs=1e-9)
        assert zero == (len(set(rewards)) == 1)
        ours_trl, _ = group_advantages(rewards, eps=1e-4)
        assert ours_trl == pytest.approx(_trl_grpo_advantages(rewards), abs=1e-9)


def test_buffer_stage_applies_the_configured_std():
    from moerl.components.buffer.stage import assemble
    from moerl.config import BufferConfig
    from moerl.records import ScoredSample

    def sample(i: int, reward: float) -> ScoredSample:
        return ScoredSample(
            prompt_id="p",
            task="copy",
            prompt="copy 1=",
            answer="1",
            sample_index=i,
            prompt_token_ids=[1],
            response_token_ids=[2],
            response_logprobs=[-0.1],
            response_text="1",
            finish_reason="stop",
            policy_version=0,
            reward=reward,
        )

    scored = [sample(i, r) for i, r in enumerate([1.0, 0.0, 0.0, 0.0])]
    default, _ = assemble(scored, BufferConfig(), trainer_version=0)
    assert [s.advantage for s in default] == pytest.approx(
        _verl_grpo_advantages([1.0, 0.0, 0.0, 0.0])
    )
    pop, _ = assemble(scored, BufferConfig(advantage_std="population"), trainer_version=0)
    # mean 0.25, population std sqrt(0.1875)
    assert pop[0].advantage == pytest.approx(0.75 / (math.sqrt(0.1875) + 1e-6))


def test_dr_grpo_mean_only():
    adv, _ = group_advantages([1.0, 0.0, 0.0, 0.0], normalize_by_std=False)
    assert adv == pytest.approx([0.75, -0.25, -0.25, -0.25])


def test_zero_variance_group_is_flagged():
    adv, zero = group_advantages([0.3, 0.3, 0.3])
    assert zero and adv == pytest.approx([0.0, 0.0, 0.0])


def _loss(logp, old, eng, adv, mask, lo=0.2, hi=0.28, cap=2.0, c=None):
    logp = torch.tensor(logp, requires_grad=True)
    extra = {} if c is None else {"clip_ratio_c": c}
    loss, stats = grpo_token_loss(
        logp,
        torch.tensor(old),
        torch.tensor(eng),
        torch.tensor(adv),
        torch.tensor(mask),
        lo,
        hi,
        cap,
        **extra,
    )
    loss.backward()
    return loss.item(), logp.grad, stats


def test_on_policy_loss_is_minus_token_mean_advantage():
    lp = [[-1.0, -2.0], [-0.5, -3.0]]
    loss, grad, stats = _loss(lp, lp, lp, [1.0, -1.0], [[1.0, 1.0], [1.0, 0.0]])
    # tokens: (A=1), (A=1), (A=-1); the padded one is masked out. Token-level mean over 3.
    assert loss == pytest.approx(-(1 + 1 - 1) / 3)
    # d loss / d logp = -A / n_tokens where ratio = 1; zero on the masked token
    assert grad.flatten().tolist() == pytest.approx([-1 / 3, -1 / 3, 1 / 3, 0.0])
    assert stats.clip_fraction == 0.0


def test_positive_advantage_clipped_above_one_plus_eps_high():
    old = [[0.0]]
    loss, grad, stats = _loss([[math.log(1.5)]], old, old, [1.0], [[1.0]])
    assert loss == pytest.approx(-1.28)
    assert grad.item() == 0.0  # clipped branch carries no gradient
    assert stats.clip_fraction == 1.0


def test_negative_advantage_clipped_below_one_minus_eps_low():
    old = [[0.0]]
    loss, grad, stats = _loss([[math.log(0.5)]], old, old, [-1.0], [[1.0]])
    assert loss == pytest.approx(0.8)
    assert grad.item() == 0.0
    assert stats.clip_fraction == 1.0


def test_inside_the_clip_range_the_ratio_is_used():
    old = [[0.0]]
    loss, grad, _ = _loss([[math.log(1.1)]], old, old, [2.0], [[1.0]])
    assert loss == pytest.approx(-2.2)
    assert grad.item() == pytest.approx(-2.2)  # d(-r*A)/dlogp = -r*A


def test_truncated_importance_weight_against_engine_logprobs():
    lp = [[-1.0]]
    # trainer says exp(-1), engine said exp(-1 - ln 3): weight 3, truncated at cap 2
    loss, grad, stats = _loss(lp, lp, [[-1.0 - math.log(3.0)]], [1.0], [[1.0]])
    assert loss == pytest.approx(-2.0)
    assert grad.item() == pytest.approx(-2.0)
    assert stats.tis_truncated_fraction == 1.0
    # under the cap the weight is the plain ratio
    loss, _, stats = _loss(lp, lp, [[-1.0 - math.log(1.5)]], [1.0], [[1.0]])
    assert loss == pytest.approx(-1.5)
    assert stats.tis_truncated_fraction == 0.0


def test_nan_logprob_gives_non_finite_loss():
    loss, _, _ = _loss([[float("nan")]], [[0.0]], [[0.0]], [1.0], [[1.0]])
    assert not math.isfinite(loss)


def test_token_logprobs_and_entropy_uniform_and_temperature():
    logits = torch.zeros(1, 2, 5)
    logp, ent = token_logprobs_and_entropy(logits, torch.tensor([[0, 3]]))
    assert logp.flatten().tolist() == pytest.approx([-math.log(5)] * 2)
    assert ent.flatten().tolist() == pytest.approx([math.log(5)] * 2)
    logits = torch.tensor([[[2.0, 0.0]]])
    logp, _ = token_logprobs_and_entropy(logits, torch.tensor([[0]]), temperature=2.0)
    assert logp.item() == pytest.approx(1.0 - math.log(math.e + 1.0))  # softmax([1, 0])[0]


def test_dual_clip_bounds_a_negative_advantage_token_at_clip_ratio_c():
    old = [[0.0]]
    # A = -1, ratio 5: PPO-clip gives max(5, 1.28) = 5; the dual clip holds it at 3 |A|
    loss, grad, stats = _loss([[math.log(5.0)]], old, old, [-1.0], [[1.0]], c=3.0)
    assert loss == pytest.approx(3.0)
    assert grad.item() == 0.0  # the bound is a constant: no gradient through that token
    assert stats.dual_clip_fraction == 1.0
    # without the bound the same token costs 5 and pushes its logprob down
    loss, grad, stats = _loss([[math.log(5.0)]], old, old, [-1.0], [[1.0]])
    assert loss == pytest.approx(5.0) and grad.item() == pytest.approx(5.0)
    assert stats.dual_clip_fraction == 0.0
    # below the bound, and for positive advantages, the dual clip changes nothing
    loss, _, stats = _loss([[math.log(2.0)]], old, old, [-1.0], [[1.0]], c=3.0)
    assert loss == pytest.approx(2.0) and stats.dual_clip_fraction == 0.0
    loss, _, stats = _loss([[math.log(5.0)]], old, old, [1.0], [[1.0]], c=3.0)
    assert loss == pytest.approx(-1.28) and stats.dual_clip_fraction == 0.0
    with pytest.raises(ValueError, match="clip_ratio_c must be > 1"):
        _loss([[0.0]], old, old, [1.0], [[1.0]], c=1.0)


def test_loss_stats_keep_a_default_for_the_new_field():
    assert (
        LossStats(
            loss=0.0, clip_fraction=0.0, tis_truncated_fraction=0.0, mean_ratio=1.0
        ).dual_clip_fraction
        == 0.0
    )


def test_non_finite_logprobs_at_padding_do_not_reach_the_loss():
    # row 0: two real tokens; row 1: one real token, then padding whose logprobs are garbage
    # (NaN from the trainer, -inf as the start-of-iteration value, +inf from the engine)
    nan, inf = float("nan"), float("inf")
    logp = [[-1.0, -2.0], [-0.5, nan]]
    old = [[-1.0, -2.0], [-0.5, -inf]]
    eng = [[-1.0, -2.0], [-0.5, inf]]
    loss, grad, stats = _loss(logp, old, eng, [1.0, -1.0], [[1.0, 1.0], [1.0, 0.0]])
    assert loss == pytest.approx(-(1 + 1 - 1) / 3)
    assert grad.flatten().tolist() == pytest.approx([-1 / 3, -1 / 3, 1 / 3, 0.0])
    assert all(
        math.isfinite(v)
        for v in (
            stats.loss,
            stats.clip_fraction,
            stats.mean_ratio,
            stats.tis_truncated_fraction,
            stats.dual_clip_fraction,
        )
    )
    assert stats.mean_ratio == pytest.approx(1.0)


def test_log_ratio_is_clamped_before_exp():
    old = [[0.0]]
    # log-ratio 100: exp overflows fp32 to inf. Clamped to 20, the loss stays finite.
    loss, grad, stats = _loss([[100.0]], old, old, [-1.0], [[1.0]])
    assert loss == pytest.approx(math.exp(20.0), rel=1e-5)
    assert grad.item() == 0.0 and math.isfinite(stats.mean_ratio)
    # for a positive advantage the clipped branch wins; its gradient must be 0, not 0 * inf
    loss, grad, _ = _loss([[100.0]], old, old, [1.0], [[1.0]])
    assert loss == pytest.approx(-1.28) and grad.item() == 0.0
    # the IS weight too: an engine logprob of -inf gives the cap, not inf * 0
    loss, _, stats = _loss([[0.0]], old, [[-float("inf")]], [1.0], [[1.0]])
    assert loss == pytest.approx(-2.0) and stats.tis_truncated_fraction == 1.0


def _verl_loss(old, logp, adv_BT, mask, rollout, lo, hi, c, cap):
    """verl compute_policy_loss_vanilla + TIS + agg_loss("token-mean"), from its documented
    formula: ratio = exp(clamp(logp - old, -20, 20)); pg1 = -A r; pg2 = -A clip(r, 1-lo, 1+hi);
    pg = max(pg1, pg2); where A < 0: min(pg, -A c); times min(exp(old - rollout), cap);
    masked mean over tokens. Returns (loss, clipfrac, clipfrac_lower)."""
    ratio = torch.exp(torch.clamp(logp - old, -20.0, 20.0))
    pg1 = -adv_BT * ratio
    pg2 = -adv_BT * torch.clamp(ratio, 1 - lo, 1 + hi)
    clip1 = torch.maximum(pg1, pg2)
    pg3 = -adv_BT * c
    clip2 = torch.min(pg3, clip1)
    pg = torch.where(adv_BT < 0, clip2, clip1)
    pg = pg * torch.clamp(torch.exp(old - rollout), max=cap)

    def masked_mean(x):
        return (x * mask).sum() / mask.sum()

    return (
        masked_mean(pg),
        masked_mean(torch.gt(pg2, pg1).float()),
        masked_mean(torch.gt(clip1, pg3).float() * (adv_BT < 0).float()),
    )


def _trl_loss(old, logp, adv_BT, mask, sampling, lo, hi, cap):
    """TRL GRPOTrainer loss, token-level importance sampling, no delta, beta 0, loss_type bnpo
    (= dapo on one process): coef_1 = exp(logp - old); coef_2 = clamp(coef_1, 1-lo, 1+hi);
    per_token = -min(coef_1 A, coef_2 A) * min(exp(old - sampling), cap);
    sum(per_token * mask) / mask.sum()."""
    coef_1 = torch.exp(logp - old)
    coef_2 = torch.clamp(coef_1, 1 - lo, 1 + hi)
    per_token = -torch.min(coef_1 * adv_BT, coef_2 * adv_BT)
    per_token = per_token * torch.clamp(torch.exp(old - sampling), max=cap)
    return (per_token * mask).sum() / mask.sum().clamp(min=1.0)


def _random_batch(seed: int, b: int = 16, t: int = 24):
    g = torch.Generator().manual_seed(seed)
    old = -torch.rand(b, t, generator=g, dtype=torch.float64) * 4
    # spreads wide enough to take every branch: clip low/high, dual clip, TIS cap
    logp = old + torch.randn(b, t, generator=g, dtype=torch.float64) * 0.8
    engine = old + torch.randn(b, t, generator=g, dtype=torch.float64) * 0.6
    adv = torch.randn(b, generator=g, dtype=torch.float64)
    lengths = torch.randint(1, t + 1, (b,), generator=g)
    mask = (torch.arange(t)[None, :] < lengths[:, None]).to(torch.float64)
    return old, logp, engine, adv, mask


def _ours_on_garbage_padding(old, logp, engine, adv, mask, c, lo=0.2, hi=0.28, cap=2.0):
    """moerl's loss and gradient, with inf / NaN written into every padded position."""
    pad = mask == 0
    lp = logp.clone().masked_fill(pad, float("nan")).requires_grad_(True)
    extra = {} if c is None else {"clip_ratio_c": c}
    loss, stats = grpo_token_loss(
        lp,
        old.masked_fill(pad, -float("inf")),
        engine.masked_fill(pad, float("inf")),
        adv,
        mask,
        lo,
        hi,
        cap,
        **extra,
    )
    loss.backward()
    return loss, lp.grad, stats


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_loss_matches_verl_on_random_inputs(seed):
    old, logp, engine, adv, mask = _random_batch(seed)
    ours, our_grad, stats = _ours_on_garbage_padding(old, logp, engine, adv, mask, c=3.0)
    ref_lp = logp.clone().requires_grad_(True)
    ref, clipfrac, clipfrac_lower = _verl_loss(
        old, ref_lp, adv[:, None].expand_as(logp), mask, engine, 0.2, 0.28, 3.0, 2.0
    )
    ref.backward()
    assert clipfrac_lower > 0 and 0 < clipfrac < 1  # the inputs exercise the dual clip and PPO clip
    assert ours.item() == pytest.approx(ref.item(), rel=1e-12, abs=1e-12)
    assert torch.allclose(our_grad, ref_lp.grad, rtol=1e-10, atol=1e-12)
    assert stats.clip_fraction == pytest.approx(clipfrac.item())
    assert stats.dual_clip_fraction == pytest.approx(clipfrac_lower.item())
    assert stats.tis_truncated_fraction == pytest.approx(
        (((torch.exp(old - engine) > 2.0).double() * mask).sum() / mask.sum()).item()
    )


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_loss_matches_trl_on_random_inputs(seed):
    old, logp, engine, adv, mask = _random_batch(seed)
    ours, our_grad, _ = _ours_on_garbage_padding(old, logp, engine, adv, mask, c=None)
    ref_lp = logp.clone().requires_grad_(True)
    ref = _trl_loss(old, ref_lp, adv[:, None].expand_as(logp), mask, engine, 0.2, 0.28, 2.0)
    ref.backward()
    assert ours.item() == pytest.approx(ref.item(), rel=1e-12, abs=1e-12)
    assert torch.allclose(our_grad, ref_lp.grad, rtol=1e-10, atol=1e-12)
    # and the dual clip is what separates the two peers on these inputs
    with_c, _, _ = _ours_on_garbage_padding(old, logp, engine, adv, mask, c=3.0)
    assert with_c.item() < ours.item()
