"""GRPO policy loss: PPO-clip with a truncated importance-sampling correction.

Legend: B = sequences in a minibatch, T = response tokens (padded), V = vocabulary. Per token:
logp (pi_theta, with grad), old_logp (pi_old, the trainer at the iteration's start), engine_logp
(mu, what the engine reported); adv_B is each sequence's group-relative advantage.

The formulas, their match with verl and TRL, the deviations from the GRPO paper, padding and
the variants: docs/async.md#componentspolicy_updatelosspy.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

LOG_RATIO_BOUND = 20.0  # exp(20) ~ 4.9e8: finite in fp32, far outside any clip range


@dataclass(frozen=True)
class LossStats:
    loss: float
    clip_fraction: float  # fraction of tokens where the clipped branch was taken
    tis_truncated_fraction: float  # fraction of tokens whose IS weight hit tis_cap
    mean_ratio: float
    dual_clip_fraction: float = 0.0  # fraction of tokens (A < 0) held at the clip_ratio_c bound


def _masked_exp(log_ratio_BT: torch.Tensor, real_BT: torch.Tensor) -> torch.Tensor:
    """exp of the log-ratio at real tokens, 1 at padding. The select comes before the exp so
    that neither the value nor the gradient of a padded position can be inf or NaN."""
    safe = torch.where(real_BT, log_ratio_BT, torch.zeros_like(log_ratio_BT))
    return torch.exp(safe.clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND))


IS_MODES = ("token_truncate", "token_mask", "sequence_truncate", "sequence_mask")
GSPO_LOG_RATIO_MAX = 10.0  # verl's clamp of the sequence log-ratio (compute_policy_loss_gspo)


@dataclass(frozen=True)
class ISWeights:
    """Rollout-correction weights of one batch (no grad) and what they did."""

    w_BT: torch.Tensor  # the weight of every token (1 at padding)
    hit_BT: torch.Tensor  # real tokens whose weight was truncated or masked
    truncated_fraction: float  # real tokens whose weight hit the cap (truncate modes)
    masked_fraction: float  # real tokens whose weight was set to 0 (mask modes)


def importance_weights(
    old_logp_BT: torch.Tensor,
    engine_logp_BT: torch.Tensor,
    mask_BT: torch.Tensor,
    mode: str = "token_truncate",
    cap: float = 2.0,
    lower: float | None = None,
) -> ISWeights:
    """The importance weight pi_old / mu of every token, as TRL's `vllm_importance_sampling_mode`
    names them (verl: `rollout_is: token | sequence`):

        token_truncate      w_t = min(rho_t, cap)                 rho_t = exp(old_t - engine_t)
        token_mask          w_t = rho_t, or 0 where rho_t > cap (or < lower)
        sequence_truncate   w_t = min(rho_seq, cap)               rho_seq = exp(sum_t (old_t - engine_t))
        sequence_mask       w_t = rho_seq, or 0 where rho_seq > cap (or < lower)

    `lower` (mask modes only; None = no lower bound) also masks the lower tail, as IcePop does
    with [alpha, beta]. Log-ratios are clamped to [-20, 20] before the exp (finite in fp32)."""
    if mode not in IS_MODES:
        raise ValueError(f"tis_mode must be one of {', '.join(IS_MODES)}; got {mode!r}")
    real = mask_BT.bool()
    log_r = torch.where(
        real, (old_logp_BT - engine_logp_BT).detach(), torch.zeros_like(old_logp_BT)
    )
    if mode.startswith("sequence"):
        log_r = log_r.sum(-1, keepdim=True).expand_as(log_r)
    rho = torch.exp(log_r.clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND))
    n = real.sum().clamp_min(1)
    if mode.endswith("truncate"):
        w = torch.clamp(rho, max=cap)
        hit = (rho > cap) & real
        truncated, masked = float(hit.sum() / n), 0.0
    else:
        drop = rho > cap
        if lower is not None:
            drop = drop | (rho < lower)
        w = torch.where(drop, torch.zeros_like(rho), rho)
        hit = drop & real
        truncated, masked = 0.0, float(hit.sum() / n)
    return ISWeights(torch.where(real, w, torch.ones_like(w)), hit, truncated, masked)


def policy_loss(
    logp_BT: torch.Tensor,
    old_logp_BT: torch.Tensor,
    is_w_BT: torch.Tensor,
    adv_B: torch.Tensor,
    mask_BT: torch.Tensor,
    clip_eps_low: float,
    clip_eps_high: float,
    kind: str = "ppo",
    agg: str = "token-mean",
    n_tokens: float | None = None,
    n_seqs: float | None = None,
    clip_ratio_c: float | None = None,
) -> tuple[torch.Tensor, LossStats]:
    """The clipped policy loss, times the rollout-correction weights `is_w_BT` (no grad).

    kind `ppo`: the token ratio r_t = exp(logp_t - old_t) (module docstring).
    kind `gspo` (Qwen's GSPO, arXiv 2507.18071, in its token form as verl's
    `compute_policy_loss_gspo`): every token of sequence i takes the ratio
        s_it = sg[s_i] * pi(y_t) / sg[pi(y_t)],   s_i = exp(mean_t(logp_t - old_t))
    (the log clamped above at 10), so the value and the clip are the sequence's geometric-mean
    ratio and the gradient is the sequence's mean token gradient; clip ranges are the caller's
    (GSPO's are about 3e-4 / 4e-4).

    agg `token-mean`: sum over real tokens / `n_tokens` (default: this batch's tokens).
    agg `seq-mean-token-mean`: each sequence's token mean, summed / `n_seqs` (default: this
    batch's sequences with a real token). Callers that cut a minibatch into micro-batches pass
    the minibatch's counts, so the pieces add up to the minibatch's loss."""
    if clip_ratio_c is not None and not clip_ratio_c > 1.0:
        raise ValueError(f"clip_ratio_c must be > 1 (or None), got {clip_ratio_c}")
    if kind not in ("ppo", "gspo"):
        raise ValueError(f"policy_loss must be ppo or gspo; got {kind!r}")
    if agg not in ("token-mean", "seq-mean-token-mean"):
        raise ValueError(f"loss_agg_mode must be token-mean or seq-mean-token-mean; got {agg!r}")
    real = mask_BT.bool()
    mask = real.to(logp_BT.dtype)
    n_tok = (
        mask.sum().clamp_min(1.0)
        if n_tokens is None
        else torch.tensor(float(max(n_tokens, 1.0)), device=logp_BT.device)
    )
    adv_BT = adv_B[:, None].to(logp_BT.dtype).expand_as(logp_BT)
    ratio = _ratio(logp_BT, old_logp_BT, real, kind)
    pg_unclipped = -adv_BT * ratio
    pg_clipped = -adv_BT * torch.clamp(ratio, 1.0 - clip_eps_low, 1.0 + clip_eps_high)
    pg = torch.maximum(pg_unclipped, pg_clipped)
    dual = torch.zeros_like(real)
    if clip_ratio_c is not None:
        bound = -adv_BT * clip_ratio_c
        negative = adv_BT < 0
        dual = negative & (pg > bound) & real
        pg = torch.where(negative, torch.minimum(pg, bound), pg)

    per_token = torch.where(real, is_w_BT.detach().to(pg.dtype) * pg, torch.zeros_like(pg))
    loss = _aggregate(per_token, mask, agg, n_tok, n_seqs)

    with torch.no_grad():
        took_clip = (pg_clipped > pg_unclipped) & real
        stats = LossStats(
            loss=float(loss.detach()),
            clip_fraction=float(took_clip.sum() / n_tok),
            tis_truncated_fraction=0.0,
            mean_ratio=float(torch.where(real, ratio, torch.zeros_like(ratio)).sum() / n_tok),
            dual_clip_fraction=float(dual.sum() / n_tok),
        )
    return loss, stats


def _ratio(
    logp_BT: torch.Tensor, old_logp_BT: torch.Tensor, real: torch.Tensor, kind: str
) -> torch.Tensor:
    """The ratio the clip applies to (`policy_loss`): per token (ppo), or the sequence's
    geometric mean carrying each token's gradient (gspo); 1 on padding."""
    if kind == "ppo":
        return _masked_exp(logp_BT - old_logp_BT, real)
    mask = real.to(logp_BT.dtype)
    safe_lp = torch.where(real, logp_BT, torch.zeros_like(logp_BT))
    safe_old = torch.where(real, old_logp_BT, torch.zeros_like(old_logp_BT))
    seq_len_B1 = mask.sum(-1, keepdim=True).clamp_min(1.0)
    seq_log_B1 = ((safe_lp - safe_old) * mask).sum(-1, keepdim=True) / seq_len_B1
    log_s = safe_lp - safe_lp.detach() + seq_log_B1.detach()
    return torch.where(real, torch.exp(log_s.clamp(max=GSPO_LOG_RATIO_MAX)), torch.ones_like(log_s))


def _aggregate(
    per_token_BT: torch.Tensor,
    mask_BT: torch.Tensor,
    agg: str,
    n_tok: torch.Tensor,
    n_seqs: float | None,
) -> torch.Tensor:
    """The loss from its per-token terms (`policy_loss`'s `agg`)."""
    if agg == "token-mean":
        return per_token_BT.sum() / n_tok
    has = mask_BT.sum(-1) > 0
    n_seq = (
        has.sum().clamp_min(1).to(per_token_BT.dtype)
        if n_seqs is None
        else torch.tensor(
            float(max(n_seqs, 1.0)), device=per_token_BT.device, dtype=per_token_BT.dtype
        )
    )
    return (per_token_BT.sum(-1) / mask_BT.sum(-1).clamp_min(1.0)).sum() / n_seq


def truncate_logits(x_BLV: torch.Tensor, top_k: int = -1, top_p: float = 1.0) -> torch.Tensor:
    """The sampling distribution vLLM draws from and reports `processed_logprobs` of: top-k
    first (keep every logit >= the k-th largest, so ties stay), then top-p on what is left
    (drop the smallest tokens while their cumulative probability is <= 1 - top_p, always
    keeping the largest). Dropped logits become -inf. top_k <= 0 and top_p == 1 are off."""
    vocab = x_BLV.shape[-1]
    if 0 < top_k < vocab:
        kth_BL1 = x_BLV.topk(top_k, dim=-1).values[..., -1:]
        x_BLV = x_BLV.masked_fill(x_BLV < kth_BL1, float("-inf"))
    if top_p < 1.0:
        sorted_BLV, order_BLV = x_BLV.sort(dim=-1, descending=False)
        cum_BLV = sorted_BLV.softmax(dim=-1).cumsum(dim=-1)
        drop_BLV = cum_BLV <= 1.0 - top_p
        drop_BLV[..., -1] = False  # at least one token
        x_BLV = x_BLV.scatter(-1, order_BLV, sorted_BLV.masked_fill(drop_BLV, float("-inf")))
    return x_BLV


def token_logprobs_and_entropy(
    logits_BLV: torch.Tensor,
    targets_BL: torch.Tensor,
    temperature: float = 1.0,
    top_k: int = -1,
    top_p: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """log p(target) and the entropy at each position, under the distribution the engine
    sampled from and reports logprobs of: logits scaled by 1/temperature, then truncated by
    top-k/top-p and renormalised (`truncate_logits`). A target outside the truncated set
    (possible only at a numerical tie with the engine) gets -inf, which the loss clamps."""
    x_BLV = truncate_logits(logits_BLV.float() / temperature, top_k, top_p)
    logp_BLV = torch.log_softmax(x_BLV, dim=-1)
    logp_BL = logp_BLV.gather(-1, targets_BL.unsqueeze(-1)).squeeze(-1)
    p_BLV = logp_BLV.exp()
    # -sum p log p over the support: log p is zeroed where p is 0 (a truncated token) before the
    # product, so a backward through the entropy (the chunked logprob's) never sees 0 * -inf
    entropy_BL = -(p_BLV * logp_BLV.masked_fill(p_BLV == 0, 0.0)).sum(-1)
    return logp_BL, entropy_BL
