"""GRPO policy loss: PPO-clip with a truncated importance-sampling correction.

Legend: B = sequences in a minibatch, T = response tokens (padded), V = vocabulary.

Inputs per token (mask_BT marks real response tokens):
    logp_BT        log pi_theta(a_t)        current trainer policy (has grad)
    old_logp_BT    log pi_old(a_t)          trainer policy at the start of the iteration (no grad)
    engine_logp_BT log mu(a_t)              what the rollout engine reported (behavior policy)
    adv_B          group-relative advantage of each sequence

    ratio_t = exp(logp - old_logp)
    w_t     = min(exp(old_logp - engine_logp), tis_cap)            (no grad)
    loss_t  = -w_t * min(ratio_t * A, clip(ratio_t, 1 - eps_low, 1 + eps_high) * A)
    loss    = sum_t(loss_t * mask) / sum_t(mask)                    (token-level, DAPO)

How this deviates from the GRPO paper: (1) no KL term to a reference model (the tiny run
starts from random weights, so there is no reference worth staying near); (2) token-level
aggregation instead of per-sequence mean; (3) asymmetric clip ("clip-higher"); (4) the
behavior policy is the engine, not the trainer: the PPO ratio is taken against the
trainer's own start-of-iteration logprobs (the proximal policy), and the engine/trainer
numeric mismatch is corrected by the truncated importance weight w_t (decoupled PPO /
truncated IS as in verl's TIS). At the first step ratio = 1, so the gradient is exactly
w_t * A * grad log pi: the importance-corrected policy gradient against the engine's samples.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class LossStats:
    loss: float
    clip_fraction: float  # fraction of tokens where the clipped branch was taken
    tis_truncated_fraction: float  # fraction of tokens whose IS weight hit tis_cap
    mean_ratio: float


def grpo_token_loss(
    logp_BT: torch.Tensor,
    old_logp_BT: torch.Tensor,
    engine_logp_BT: torch.Tensor,
    adv_B: torch.Tensor,
    mask_BT: torch.Tensor,
    clip_eps_low: float,
    clip_eps_high: float,
    tis_cap: float,
    n_tokens: float | None = None,
) -> tuple[torch.Tensor, LossStats]:
    """`n_tokens`: the normalizer; default the tokens in this minibatch. Expert-parallel ranks
    pass the token count of the whole (global) minibatch, so their losses sum to the loss."""
    mask = mask_BT.to(logp_BT.dtype)
    n_tokens = mask.sum().clamp_min(1.0) if n_tokens is None else torch.tensor(float(max(n_tokens, 1.0)))
    adv_BT = adv_B[:, None].expand_as(logp_BT)

    ratio = torch.exp(logp_BT - old_logp_BT)
    unclipped = ratio * adv_BT
    clipped = torch.clamp(ratio, 1.0 - clip_eps_low, 1.0 + clip_eps_high) * adv_BT
    surrogate = torch.minimum(unclipped, clipped)

    raw_w = torch.exp(old_logp_BT - engine_logp_BT).detach()
    w = torch.clamp(raw_w, max=tis_cap)
    loss = -(w * surrogate * mask).sum() / n_tokens

    with torch.no_grad():
        took_clip = (clipped < unclipped) & mask.bool()
        stats = LossStats(
            loss=float(loss.detach()),
            clip_fraction=float(took_clip.sum() / n_tokens),
            tis_truncated_fraction=float(((raw_w > tis_cap) & mask.bool()).sum() / n_tokens),
            mean_ratio=float((ratio * mask).sum() / n_tokens),
        )
    return loss, stats


def token_logprobs_and_entropy(logits_BLV: torch.Tensor, targets_BL: torch.Tensor,
                               temperature: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """log p(target) and the entropy at each position, from logits scaled by 1/temperature
    (the engine reports logprobs of the temperature-scaled distribution)."""
    logp_BLV = torch.log_softmax(logits_BLV.float() / temperature, dim=-1)
    logp_BL = logp_BLV.gather(-1, targets_BL.unsqueeze(-1)).squeeze(-1)
    entropy_BL = -(logp_BLV.exp() * logp_BLV).sum(-1)
    return logp_BL, entropy_BL
