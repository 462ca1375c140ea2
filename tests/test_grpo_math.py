"""GRPO advantages and loss against hand-computed cases."""

import math

import pytest
import torch

from moerl.components.buffer.advantage import group_advantages
from moerl.components.policy_update.loss import grpo_token_loss, token_logprobs_and_entropy


def test_advantage_normalized_by_group_std():
    adv, zero = group_advantages([1.0, 0.0, 0.0, 1.0], eps=1e-6)
    # mean 0.5, population std 0.5
    assert not zero
    assert adv == pytest.approx([0.5 / 0.500001, -0.5 / 0.500001, -0.5 / 0.500001, 0.5 / 0.500001])


def test_advantage_partial_credit_case():
    adv, _ = group_advantages([0.2, 0.0, 0.0, 0.0], eps=0.0)
    # mean 0.05, std sqrt((0.15^2 + 3*0.05^2)/4) = sqrt(0.0075)
    std = math.sqrt(0.0075)
    assert adv == pytest.approx([0.15 / std, -0.05 / std, -0.05 / std, -0.05 / std])
    assert sum(adv) == pytest.approx(0.0, abs=1e-9)


def test_dr_grpo_mean_only():
    adv, _ = group_advantages([1.0, 0.0, 0.0, 0.0], normalize_by_std=False)
    assert adv == pytest.approx([0.75, -0.25, -0.25, -0.25])


def test_zero_variance_group_is_flagged():
    adv, zero = group_advantages([0.3, 0.3, 0.3])
    assert zero and adv == pytest.approx([0.0, 0.0, 0.0])


def _loss(logp, old, eng, adv, mask, lo=0.2, hi=0.28, cap=2.0):
    logp = torch.tensor(logp, requires_grad=True)
    loss, stats = grpo_token_loss(logp, torch.tensor(old), torch.tensor(eng), torch.tensor(adv), torch.tensor(mask),
                                  lo, hi, cap)
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
