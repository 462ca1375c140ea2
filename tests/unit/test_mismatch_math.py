"""Rollout correction (IS modes, metrics, geometric rejection) and the loss variants (GSPO,
seq-mean-token-mean), each against a peer's formula on seeded random float64 inputs.

The peer references below are transcribed from TRL (huggingface/trl, trl/trainer/grpo_trainer.py)
and verl (volcengine/verl, verl/trainer/ppo/core_algos.py and rollout_corr_helper.py). They mask
by multiplying, as the peers do, so they get clean inputs; moerl gets inf / NaN at padding.

verl divides every masked mean by `count + 1e-8` (verl_F.masked_mean, agg_loss); moerl divides by
the exact count (clamped to >= 1). The references take that guard as `eps`: tests compare at 1e-12
with eps=0 and once with verl's 1e-8 at a tolerance that covers it.
"""

import math

import pytest
import torch

from moerl.components.policy_update.correction import (
    CorrectionSums,
    correction_sums,
    finish,
    geometric_rejection,
)
from moerl.components.policy_update.loss import importance_weights, policy_loss

VERL_EPS = 1e-8
MODES = ("token_truncate", "token_mask", "sequence_truncate", "sequence_mask")
NAN, INF = float("nan"), float("inf")


def _batch(seed, b=16, t=24, lp_noise=0.8, eng_noise=0.3, empty_row=False):
    g = torch.Generator().manual_seed(seed)
    old = -torch.rand(b, t, generator=g, dtype=torch.float64) * 4
    logp = old + torch.randn(b, t, generator=g, dtype=torch.float64) * lp_noise
    engine = old + torch.randn(b, t, generator=g, dtype=torch.float64) * eng_noise
    adv = torch.randn(b, generator=g, dtype=torch.float64)
    lengths = torch.randint(1, t + 1, (b,), generator=g)
    if empty_row:
        lengths[b // 2] = 0
    mask = (torch.arange(t)[None, :] < lengths[:, None]).to(torch.float64)
    return old, logp, engine, adv, mask


def _pad(x, mask, value):
    return x.masked_fill(mask == 0, value)


def _ours(logp, old, w, adv, mask, lo, hi, garbage=True, **kw):
    """moerl's policy_loss and d loss / d logp; with garbage=True, NaN / -inf / NaN at padding."""
    if garbage:
        logp, old, w = _pad(logp, mask, NAN), _pad(old, mask, -INF), _pad(w, mask, NAN)
    lp = logp.clone().requires_grad_(True)
    loss, stats = policy_loss(lp, old, w, adv, mask, lo, hi, **kw)
    loss.backward()
    return loss, lp.grad, stats


# ---- peer references ------------------------------------------------------------------------


def _trl_is_ratio(old, sampling, mask, mode, clip_max, clip_min=None):
    """TRL GRPOTrainer._generate_and_score_completions, `vllm_importance_sampling_mode`
    (trl/trainer/grpo_trainer.py): diff = (old - sampling) * mask; sequence_*: diff.sum(-1, keepdim)
    -> (B, 1); ratio = exp(diff); *_truncate: clamp(ratio, min=clip_min, max=clip_max);
    *_mask: ratio set to 0 where ratio < clip_min or ratio > clip_max."""
    diff = (old - sampling) * mask
    if mode.startswith("sequence"):
        diff = diff.sum(-1, keepdim=True)
    ratio = torch.exp(diff)
    if mode.endswith("truncate"):
        return torch.clamp(ratio, min=clip_min, max=clip_max)
    lo = -math.inf if clip_min is None else clip_min
    return ratio.masked_fill((ratio < lo) | (ratio > clip_max), 0.0)


def _trl_loss(logp, old, adv_B, mask, is_ratio, lo, hi, level="token", loss_type="bnpo"):
    """TRL GRPOTrainer._compute_loss (grpo_trainer.py), beta 0, delta None: log_ratio = logp - old;
    importance_sampling_level token: log_w = log_ratio; sequence (GSPO): (log_ratio * mask).sum(-1)
    / mask.sum(-1).clamp(min=1) as (B, 1); coef_1 = exp(log_w); coef_2 = clamp(coef_1, 1-lo, 1+hi);
    per_token = -min(coef_1 A, coef_2 A) * importance_sampling_ratio; bnpo: sum(per_token * mask)
    / mask.sum().clamp(min=1); grpo: ((per_token * mask).sum(-1) / mask.sum(-1).clamp(min=1)).mean()."""
    log_ratio = logp - old
    if level == "token":
        log_w = log_ratio
    else:
        log_w = ((log_ratio * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).unsqueeze(-1)
    coef_1 = torch.exp(log_w)
    coef_2 = torch.clamp(coef_1, 1 - lo, 1 + hi)
    a = adv_B.unsqueeze(1)
    per_token = -torch.min(coef_1 * a, coef_2 * a) * is_ratio
    if loss_type == "bnpo":
        return (per_token * mask).sum() / mask.sum().clamp(min=1.0)
    return ((per_token * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).mean()


def _verl_masked_mean(x, mask, axis=None, eps=VERL_EPS):
    """verl verl/utils/torch_functional.py masked_mean: masked_sum / (mask.sum(axis) + 1e-8)."""
    return (torch.where(mask.bool(), x, 0.0) * mask).sum(axis) / (mask.sum(axis) + eps)


def _verl_agg_loss(
    loss_mat, mask, mode, eps=VERL_EPS, batch_num_tokens=None, global_batch_size=None
):
    """verl core_algos.agg_loss, dp_size 1: token-mean: masked_sum / batch_num_tokens (default
    mask.sum()); seq-mean-token-mean: seq_loss_i = sum_t(loss * mask) / (n_i + 1e-8), summed over
    sequences with n_i > 0, / global_batch_size (default: their count)."""
    if mode == "token-mean":
        n = mask.sum() if batch_num_tokens is None else batch_num_tokens
        return (loss_mat * mask).sum() / n
    n_i = mask.sum(-1)
    # eps=0 stands for an exact count; clamped to 1 so that an empty row is 0 / 1, not 0 / 0
    seq_losses = (loss_mat * mask).sum(-1) / (n_i + eps if eps else n_i.clamp(min=1.0))
    has = (n_i > 0).to(loss_mat.dtype)
    n = has.sum() if global_batch_size is None else global_batch_size
    return torch.where(has.bool(), seq_losses, 0.0).sum() / n  # verl_F.masked_sum: a select


def _verl_gspo(old, logp, adv_B, mask, lo, hi, is_w=None, eps=VERL_EPS, **counts):
    """verl core_algos.compute_policy_loss_gspo: seq_kl_i = sum_t((logp - old) * mask) / n_i.clamp(1);
    log s_it = logp - sg[logp] + sg[seq_kl_i], clamped above at 10; s = exp; pg = max(-A s,
    -A clamp(s, 1-lo, 1+hi)); times rollout_is_weights; agg_loss seq-mean-token-mean.
    Returns (loss, pg_clipfrac = masked_mean(pg2 > pg1))."""
    seq = ((logp - old) * mask).sum(-1) / mask.sum(-1).clamp(min=1)
    s = torch.exp(torch.clamp(logp - logp.detach() + seq.detach().unsqueeze(-1), max=10.0))
    a = adv_B[:, None]
    pg1, pg2 = -a * s, -a * torch.clamp(s, 1 - lo, 1 + hi)
    pg = torch.maximum(pg1, pg2)
    if is_w is not None:
        pg = pg * is_w
    clipfrac = _verl_masked_mean(torch.gt(pg2, pg1).double(), mask, eps=eps)
    return _verl_agg_loss(pg, mask, "seq-mean-token-mean", eps, **counts), clipfrac


def _verl_vanilla(old, logp, adv_B, mask, lo, hi, c, is_w, agg, eps=VERL_EPS, **counts):
    """verl core_algos.compute_policy_loss_vanilla: r = exp(clamp(logp - old, -20, 20));
    pg = max(-A r, -A clamp(r, 1-lo, 1+hi)); where A < 0: min(pg, -A c); times
    rollout_is_weights; agg_loss(loss_agg_mode)."""
    a = adv_B[:, None]
    r = torch.exp(torch.clamp(logp - old, -20.0, 20.0))
    clip1 = torch.maximum(-a * r, -a * torch.clamp(r, 1 - lo, 1 + hi))
    pg = torch.where(a < 0, torch.min(-a * c, clip1), clip1) * is_w
    return _verl_agg_loss(pg, mask, agg, eps, **counts)


def _verl_offpolicy_metrics(old, rollout, mask, eps=VERL_EPS):
    """verl rollout_corr_helper.compute_offpolicy_metrics: kl = masked_mean(rollout - old);
    lr = old - rollout; k3_kl = masked_mean(exp(lr) - lr - 1); chi2_token = masked_mean(
    exp(clamp(lr, +-20))^2) - 1; chi2_seq = mean over rows of exp(2 clamp(masked_sum_t lr, +-20)) - 1."""
    lr = old - rollout
    rho = torch.exp(torch.clamp(lr, -20.0, 20.0))
    seq = torch.clamp((torch.where(mask.bool(), lr, 0.0) * mask).sum(-1), -20.0, 20.0)
    return {
        "kl": _verl_masked_mean(rollout - old, mask, eps=eps).item(),
        "k3_kl": _verl_masked_mean(torch.exp(lr) - lr - 1, mask, eps=eps).item(),
        "chi2_token": (_verl_masked_mean(rho.square(), mask, eps=eps) - 1).item(),
        "chi2_seq": (torch.exp(2.0 * seq).mean() - 1.0).item(),
    }


def _verl_ess(old, rollout, mask, threshold, eps=VERL_EPS):
    """verl rollout_corr_helper.compute_is_metrics (rollout_is token), rollout_is_eff_sample_size:
    w = exp(clamp(lr, +-20)) * mask (compute_rollout_correction_weights, before truncation), clamped
    to [1/threshold, threshold]; 1 / masked_mean((w / (masked_mean(w) + 1e-8))^2)."""
    w = (torch.exp(torch.clamp(old - rollout, -20.0, 20.0)) * mask).clamp(
        min=1.0 / threshold, max=threshold
    )
    normalized = w / (_verl_masked_mean(w, mask, eps=eps) + eps)
    return 1.0 / _verl_masked_mean(normalized.square(), mask, eps=eps).item()


def _verl_geometric_keep(old, rollout, mask, upper, lower, eps=VERL_EPS):
    """verl rollout_corr_helper.compute_rollout_rejection_mask, rollout_rs="geometric" (as of
    7eb030e9, before the #4511 refactor): w_i = exp(clamp(masked_mean_t(old - rollout), +-20));
    keep where lower <= w_i <= upper."""
    w = torch.exp(
        torch.clamp(_verl_masked_mean(old - rollout, mask, axis=-1, eps=eps), -20.0, 20.0)
    )
    return (w >= lower) & (w <= upper)


# ---- importance-sampling modes --------------------------------------------------------------


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("seed", [0, 1])
def test_is_weights_and_loss_match_trl(mode, seed):
    old, logp, engine, adv, mask = _batch(seed)
    real = mask.bool()
    cap, lower = (2.0, 0.5) if mode.startswith("token") else (3.0, 0.2)
    ours = importance_weights(
        _pad(old, mask, -INF),
        _pad(engine, mask, INF),
        mask,
        mode,
        cap,
        lower if mode.endswith("mask") else None,
    )
    ref = _trl_is_ratio(
        old, engine, mask, mode, cap, lower if mode.endswith("mask") else None
    ).expand_as(old)
    assert torch.allclose(ours.w_BT[real], ref[real], rtol=1e-12, atol=0)
    assert bool((ours.w_BT[~real] == 1).all())
    raw = _trl_is_ratio(old, engine, mask, mode, math.inf).expand_as(old)
    hit = real & ((raw > cap) | ((raw < lower) & mode.endswith("mask")))
    assert 0 < hit.sum() < real.sum()  # both kinds of tokens occur
    assert torch.equal(ours.hit_BT, hit)
    frac = (hit.sum() / real.sum()).item()
    assert (ours.truncated_fraction, ours.masked_fraction) == pytest.approx(
        (frac, 0.0) if mode.endswith("truncate") else (0.0, frac), abs=1e-15
    )
    if mode.endswith("truncate"):
        # documented deviation: moerl's `lower` acts in the mask modes only (config refuses it
        # elsewhere); TRL's clip_min would also clamp truncate-mode ratios from below
        with_lower = importance_weights(old, engine, mask, mode, cap, lower)
        assert torch.equal(with_lower.w_BT, ours.w_BT)
    # the loss with these weights: TRL's bnpo (token-level PPO clip times the IS ratio)
    loss, grad, _ = _ours(logp, old, ours.w_BT, adv, mask, 0.2, 0.28)
    ref_lp = logp.clone().requires_grad_(True)
    ref_loss = _trl_loss(
        ref_lp,
        old,
        adv,
        mask,
        _trl_is_ratio(old, engine, mask, mode, cap, lower if mode.endswith("mask") else None),
        0.2,
        0.28,
    )
    ref_loss.backward()
    assert loss.item() == pytest.approx(ref_loss.item(), rel=1e-12, abs=1e-12)
    assert torch.allclose(grad, ref_lp.grad, rtol=1e-10, atol=1e-12)


# ---- GSPO and seq-mean-token-mean -----------------------------------------------------------


def _gspo_batch(seed, empty_row=False):
    # small per-token noise: sequence log-ratios around +-3e-4, so that the GSPO clip range
    # (3e-4 / 4e-4) sends some sequences to the clipped branch and leaves others inside it
    return _batch(seed, lp_noise=1.5e-3, eng_noise=0.3, empty_row=empty_row)


@pytest.mark.parametrize("seed,empty_row", [(0, False), (1, False), (2, True)])
def test_gspo_matches_verl(seed, empty_row):
    old, logp, engine, adv, mask = _gspo_batch(seed, empty_row)
    ones = torch.ones_like(old)
    loss, grad, stats = _ours(
        logp, old, ones, adv, mask, 3e-4, 4e-4, kind="gspo", agg="seq-mean-token-mean"
    )
    ref_lp = logp.clone().requires_grad_(True)
    ref, clipfrac = _verl_gspo(old, ref_lp, adv, mask, 3e-4, 4e-4, eps=0.0)
    ref.backward()
    assert loss.item() == pytest.approx(ref.item(), rel=1e-12, abs=1e-12)
    assert torch.allclose(grad, ref_lp.grad, rtol=1e-10, atol=1e-13)
    assert stats.clip_fraction == pytest.approx(clipfrac.item(), abs=1e-12)
    # both branches: clipped sequences get no gradient, the others get their mean token gradient
    rows = mask.sum(-1) > 0
    clipped = (grad.abs().sum(-1) == 0) & rows
    assert 0 < clipped.sum() < rows.sum()
    assert 0 < clipfrac < 1
    # verl's own 1e-8 count guard moves the loss by ~1e-8 relative, nothing else
    assert loss.item() == pytest.approx(
        _verl_gspo(old, logp, adv, mask, 3e-4, 4e-4)[0].item(), rel=1e-7
    )


def test_gspo_sequence_log_ratio_is_clamped_at_10_as_verl():
    old, logp, _, adv, mask = _gspo_batch(6)
    logp[1] = old[1] + 12.0  # sequence log-ratio 12, past verl's clamp at 10
    adv[1] = -1.0  # the unclipped branch wins: the loss holds exp(10), with no gradient
    loss, grad, _ = _ours(
        logp,
        old,
        torch.ones_like(old),
        adv,
        mask,
        3e-4,
        4e-4,
        kind="gspo",
        agg="seq-mean-token-mean",
    )
    ref_lp = logp.clone().requires_grad_(True)
    ref, _ = _verl_gspo(old, ref_lp, adv, mask, 3e-4, 4e-4, eps=0.0)
    ref.backward()
    assert loss.item() == pytest.approx(ref.item(), rel=1e-12) and loss.item() > math.exp(10) / len(
        adv
    )
    assert torch.allclose(grad, ref_lp.grad, rtol=1e-10, atol=1e-13) and bool((grad[1] == 0).all())


@pytest.mark.parametrize("seed", [0, 1])
def test_gspo_matches_trl_sequence_level(seed):
    # every row has a token: TRL's .mean() counts all
    old, logp, engine, adv, mask = _gspo_batch(seed)
    loss, grad, _ = _ours(
        logp,
        old,
        torch.ones_like(old),
        adv,
        mask,
        3e-4,
        4e-4,
        kind="gspo",
        agg="seq-mean-token-mean",
    )
    ref_lp = logp.clone().requires_grad_(True)
    ref = _trl_loss(ref_lp, old, adv, mask, 1.0, 3e-4, 4e-4, level="sequence", loss_type="grpo")
    ref.backward()
    assert loss.item() == pytest.approx(ref.item(), rel=1e-12, abs=1e-12)
    assert torch.allclose(grad, ref_lp.grad, rtol=1e-10, atol=1e-13)


@pytest.mark.parametrize("mode", MODES)
def test_gspo_with_is_weights_matches_verl(mode):
    old, logp, engine, adv, mask = _gspo_batch(3)
    w = importance_weights(old, engine, mask, mode, 2.0)
    assert w.truncated_fraction + w.masked_fraction > 0
    loss, grad, _ = _ours(
        logp, old, w.w_BT, adv, mask, 3e-4, 4e-4, kind="gspo", agg="seq-mean-token-mean"
    )
    ref_lp = logp.clone().requires_grad_(True)
    ref, _ = _verl_gspo(
        old,
        ref_lp,
        adv,
        mask,
        3e-4,
        4e-4,
        is_w=_trl_is_ratio(old, engine, mask, mode, 2.0),
        eps=0.0,
    )
    ref.backward()
    assert loss.item() == pytest.approx(ref.item(), rel=1e-12, abs=1e-12)
    assert torch.allclose(grad, ref_lp.grad, rtol=1e-10, atol=1e-13)


@pytest.mark.parametrize("seed", [0, 1])
def test_ppo_seq_mean_token_mean_matches_verl_and_trl(seed):
    old, logp, engine, adv, mask = _batch(seed)
    w = importance_weights(old, engine, mask, "token_truncate", 2.0).w_BT
    # verl: vanilla PPO with the dual clip, seq-mean-token-mean (also with an empty row)
    for m in (mask, mask.clone().index_fill_(0, torch.tensor([3]), 0.0)):
        loss, grad, _ = _ours(
            logp, old, w, adv, m, 0.2, 0.28, agg="seq-mean-token-mean", clip_ratio_c=3.0
        )
        ref_lp = logp.clone().requires_grad_(True)
        ref = _verl_vanilla(old, ref_lp, adv, m, 0.2, 0.28, 3.0, w, "seq-mean-token-mean", eps=0.0)
        ref.backward()
        assert loss.item() == pytest.approx(ref.item(), rel=1e-12, abs=1e-12)
        assert torch.allclose(grad, ref_lp.grad, rtol=1e-10, atol=1e-12)
    # TRL: loss_type "grpo" is seq-mean-token-mean with no dual clip; and its mean is exact
    loss, grad, _ = _ours(logp, old, w, adv, mask, 0.2, 0.28, agg="seq-mean-token-mean")
    ref_lp = logp.clone().requires_grad_(True)
    ref = _trl_loss(
        ref_lp,
        old,
        adv,
        mask,
        torch.clamp(torch.exp(old - engine), max=2.0),
        0.2,
        0.28,
        loss_type="grpo",
    )
    ref.backward()
    assert loss.item() == pytest.approx(ref.item(), rel=1e-12, abs=1e-12)
    assert torch.allclose(grad, ref_lp.grad, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize(
    "kind,agg",
    [
        ("ppo", "token-mean"),
        ("ppo", "seq-mean-token-mean"),
        ("gspo", "seq-mean-token-mean"),
        ("gspo", "token-mean"),
    ],
)
def test_micro_batches_add_up_to_the_minibatch(kind, agg):
    old, logp, engine, adv, mask = (
        _gspo_batch(4, empty_row=True) if kind == "gspo" else _batch(4, empty_row=True)
    )
    lo, hi = (3e-4, 4e-4) if kind == "gspo" else (0.2, 0.28)
    w = importance_weights(
        old, engine, mask, "sequence_truncate" if kind == "gspo" else "token_truncate", 2.0
    ).w_BT
    whole, whole_grad, _ = _ours(logp, old, w, adv, mask, lo, hi, kind=kind, agg=agg)
    n_tokens, n_seqs = mask.sum().item(), (mask.sum(-1) > 0).sum().item()
    assert n_seqs < mask.shape[0]  # the empty row counts for nothing
    parts, grads = [], []
    for rows in (slice(0, 5), slice(5, None)):
        p, g, _ = _ours(
            logp[rows],
            old[rows],
            w[rows],
            adv[rows],
            mask[rows],
            lo,
            hi,
            kind=kind,
            agg=agg,
            n_tokens=n_tokens,
            n_seqs=n_seqs,
        )
        parts.append(p.item())
        grads.append(g)
    assert sum(parts) == pytest.approx(whole.item(), rel=1e-12, abs=1e-12)
    assert torch.allclose(torch.cat(grads), whole_grad, rtol=1e-12, atol=1e-15)
    # verl's agg_loss given the minibatch's counts (batch_num_tokens / global_batch_size) gives
    # each piece the same value (verl's gspo always aggregates seq-mean-token-mean)
    if kind == "ppo" or agg == "seq-mean-token-mean":
        counts = (
            {"batch_num_tokens": n_tokens} if agg == "token-mean" else {"global_batch_size": n_seqs}
        )
        r = slice(0, 5)
        ref = (
            _verl_vanilla(old[r], logp[r], adv[r], mask[r], lo, hi, 1e9, w[r], agg, 0.0, **counts)
            if kind == "ppo"
            else _verl_gspo(old[r], logp[r], adv[r], mask[r], lo, hi, w[r], 0.0, **counts)[0]
        )
        assert parts[0] == pytest.approx(ref.item(), rel=1e-12, abs=1e-12)


@pytest.mark.parametrize(
    "kind,agg",
    [("ppo", "token-mean"), ("ppo", "seq-mean-token-mean"), ("gspo", "seq-mean-token-mean")],
)
def test_padding_garbage_never_leaks(kind, agg):
    old, logp, engine, adv, mask = (
        _gspo_batch(5, empty_row=True) if kind == "gspo" else _batch(5, empty_row=True)
    )
    lo, hi = (3e-4, 4e-4) if kind == "gspo" else (0.2, 0.28)
    for mode in MODES:
        w_clean = importance_weights(
            old, engine, mask, mode, 2.0, 0.5 if mode.endswith("mask") else None
        )
        w_dirty = importance_weights(
            _pad(old, mask, NAN),
            _pad(engine, mask, -INF),
            mask,
            mode,
            2.0,
            0.5 if mode.endswith("mask") else None,
        )
        assert torch.equal(w_clean.w_BT, w_dirty.w_BT) and torch.equal(
            w_clean.hit_BT, w_dirty.hit_BT
        )
        clean, clean_grad, clean_stats = _ours(
            logp,
            old,
            w_clean.w_BT,
            adv,
            mask,
            lo,
            hi,
            garbage=False,
            kind=kind,
            agg=agg,
            n_tokens=None,
        )
        dirty, dirty_grad, dirty_stats = _ours(
            logp, old, w_dirty.w_BT, adv, mask, lo, hi, kind=kind, agg=agg
        )
        assert math.isfinite(dirty.item()) and bool(torch.isfinite(dirty_grad).all())
        assert dirty.item() == clean.item() and torch.equal(dirty_grad, clean_grad)
        assert bool((dirty_grad[mask == 0] == 0).all())
        assert dirty_stats == clean_stats


# ---- rollout-correction metrics -------------------------------------------------------------


def _corr_batch(seed, b=24, t=20):
    old, _, engine, _, mask = _batch(seed, b=b, t=t, eng_noise=0.6)
    own = torch.rand(b, generator=torch.Generator().manual_seed(seed + 100)) < 0.6
    return old, engine, mask, own


def _metrics(old, engine, mask, own):
    return finish(correction_sums(_pad(old, mask, -INF), _pad(engine, mask, NAN), mask, own))


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_correction_metrics_match_verl(seed):
    old, engine, mask, own = _corr_batch(seed)
    ours = _metrics(old, engine, mask, own)
    for eps, rel in ((0.0, 1e-12), (VERL_EPS, 1e-7)):
        ref = _verl_offpolicy_metrics(old, engine, mask, eps)
        for key, value in ref.items():
            assert ours[f"rollout_corr/{key}"] == pytest.approx(value, rel=rel, abs=1e-12), key
        # ESS: moerl's is over the raw ratios; verl clamps them to [1/threshold, threshold] first,
        # so the two agree where the threshold does not bind (a deliberate difference)
        assert ours["rollout_corr/is_ess"] == pytest.approx(
            _verl_ess(old, engine, mask, 1e6, eps), rel=rel
        )
    assert ours["rollout_corr/k3_kl"] > 0 and 0 < ours["rollout_corr/is_ess"] < 1
    # a token outside pi_old's support (-inf) counts as padding
    hole = old.clone()
    hole[0, 0] = -INF
    holed_mask = mask.clone()
    holed_mask[0, 0] = 0.0
    assert _metrics(hole, engine, mask, own) == pytest.approx(
        _metrics(old, engine, holed_mask, own), rel=1e-12
    )


def test_extreme_metrics_match_direct_computation():
    old, engine, mask, own = _corr_batch(7)
    m = _metrics(old, engine, mask, own)
    r = (old - engine)[mask.bool()]
    rho = r.exp()
    assert m["rollout_corr/tokens"] == r.numel()
    assert m["rollout_corr/log_ratio_abs_max"] == pytest.approx(r.abs().max().item(), rel=1e-15)
    assert m["rollout_corr/log_ratio_abs_mean"] == pytest.approx(r.abs().mean().item(), rel=1e-12)
    assert m["rollout_corr/ratio_max"] == pytest.approx(rho.max().item(), rel=1e-15)
    assert m["rollout_corr/ratio_min"] == pytest.approx(rho.min().item(), rel=1e-15)
    high, low = (rho > 2.0).double().mean().item(), (rho < 0.5).double().mean().item()
    assert high > 0 and low > 0
    assert m["rollout_corr/extreme_high_fraction"] == pytest.approx(high, abs=1e-15)
    assert m["rollout_corr/extreme_low_fraction"] == pytest.approx(low, abs=1e-15)
    assert m["rollout_corr/extreme_fraction"] == pytest.approx(high + low, abs=1e-15)


def test_own_and_stale_splits_are_the_metrics_of_their_rows():
    old, engine, mask, own = _corr_batch(8)
    assert 0 < own.sum() < own.numel()
    m = _metrics(old, engine, mask, own)
    for split, rows in (("own", own), ("stale", ~own)):
        alone = _metrics(
            old[rows], engine[rows], mask[rows], torch.ones(int(rows.sum()), dtype=torch.bool)
        )
        for key, value in alone.items():
            if key.count("/") == 1 and key != "rollout_corr/stale_token_fraction":
                assert m[key.replace("rollout_corr/", f"rollout_corr/{split}/")] == pytest.approx(
                    value, rel=1e-12
                )
        ref = _verl_offpolicy_metrics(old[rows], engine[rows], mask[rows], eps=0.0)
        assert m[f"rollout_corr/{split}/chi2_seq"] == pytest.approx(ref["chi2_seq"], rel=1e-12)
    assert m["rollout_corr/stale_token_fraction"] == pytest.approx(
        (mask[~own].sum() / mask.sum()).item()
    )
    # an all-own batch logs no stale metrics beyond the token count
    m = _metrics(old, engine, mask, torch.ones_like(own))
    assert m["rollout_corr/stale/tokens"] == 0 and "rollout_corr/stale/kl" not in m
    assert m["rollout_corr/stale_token_fraction"] == 0.0


def test_sums_over_row_shards_reduce_to_the_whole_batch():
    """What the all-reduce does across expert-parallel ranks: sums add, maxes max."""
    old, engine, mask, own = _corr_batch(9)
    shards = [
        correction_sums(old[r], engine[r], mask[r], own[r]) for r in (slice(0, 10), slice(10, None))
    ]
    flats = [s.flat() for s in shards]
    reduced = CorrectionSums.from_flat(
        flats[0][0] + flats[1][0], torch.maximum(flats[0][1], flats[1][1])
    )
    assert finish(reduced) == pytest.approx(
        finish(correction_sums(old, engine, mask, own)), rel=1e-12
    )


def test_chi2_seq_clamp_matches_verl_at_large_sequence_ratios():
    # 30 tokens of log-ratio 1: the sequence sum (30) is past verl's bound (20) on both sides
    old = torch.zeros(2, 30, dtype=torch.float64)
    engine = torch.stack([-torch.ones(30), torch.full((30,), 0.01)]).double()
    mask = torch.ones_like(old)
    ours = _metrics(old, engine, mask, torch.ones(2, dtype=torch.bool))
    assert ours["rollout_corr/chi2_seq"] == pytest.approx(
        _verl_offpolicy_metrics(old, engine, mask, 0.0)["chi2_seq"], rel=1e-12
    )


# ---- geometric rejection --------------------------------------------------------------------


@pytest.mark.parametrize("upper,lower", [(1.1, 1 / 1.1), (1.2, 0.95)])
def test_geometric_rejection_matches_verl(upper, lower):
    old, engine, mask, _ = _corr_batch(10, b=64)
    mask[5] = 0.0  # a row without tokens is kept
    hole = old.clone()
    hole[6, 0] = -INF  # out of support: left out of the mean
    holed_mask = mask.clone()
    holed_mask[6, 0] = 0.0
    drop = geometric_rejection(_pad(hole, mask, NAN), _pad(engine, mask, INF), mask, upper, lower)
    # with verl's 1e-8: the empty row's mean is 0
    keep = _verl_geometric_keep(old, engine, holed_mask, upper, lower)
    assert 0 < drop.sum() < drop.numel()
    assert torch.equal(drop, ~keep)
    assert not drop[5]
    if math.isclose(upper * lower, 1.0):
        # verl after #4511 spells it rollout_rs=seq_mean_k1 with bounds on mean_t(-r) = log(mu/pi_old):
        # the reciprocal of the geometric ratio, so the same sequences for symmetric bounds only
        k1 = _verl_masked_mean(engine - old, holed_mask, axis=-1)
        assert torch.equal(drop, ~((k1 >= math.log(lower)) & (k1 <= math.log(upper))))
