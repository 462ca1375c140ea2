"""GRPO group-relative advantages: a pure function over one group's rewards.

Legend: G = samples in a group (one prompt).

    A_i = (r_i - mean(r)) / (std(r) + eps)          normalize_by_std=True  (GRPO)
    A_i =  r_i - mean(r)                            normalize_by_std=False (Dr. GRPO)

`std` chooses the estimator in the denominator:

- `sample` (default): sqrt(sum (r_i - mean)^2 / (G - 1)), the unbiased estimator. This is what
  verl's `compute_grpo_outcome_advantage` (torch.std, unbiased) and TRL's GRPOTrainer
  (`std` over the group, unbiased) divide by.
- `population`: sqrt(sum (r_i - mean)^2 / G). For the same rewards it is smaller by
  sqrt((G - 1) / G), so its advantages are larger by sqrt(G / (G - 1)) (x1.07 at G = 8).

A group whose rewards are all equal carries no learning signal: it is reported as
zero-variance (advantages 0) so the buffer can drop and count it.

Limitations: with G = 1 the sample std is undefined (0 / 0). Such a group is reported as
zero-variance with advantage 0, under either estimator: one sample has no group to be
compared with. verl instead uses mean 0 and std 1 there (A = r); TRL gives NaN. The buffer
drops groups smaller than 2 before they get here, so this only matters to other callers.
eps is 1e-6 by default, as in verl; TRL adds 1e-4.
"""

from __future__ import annotations

import math
from typing import Literal

StdKind = Literal["sample", "population"]


def group_advantages(
    rewards_G: list[float],
    eps: float = 1e-6,
    normalize_by_std: bool = True,
    std: StdKind = "sample",
) -> tuple[list[float], bool]:
    """Returns (advantages_G, zero_variance)."""
    if not rewards_G:
        raise ValueError("a group needs at least one reward")
    if std not in ("sample", "population"):
        raise ValueError(f"std must be 'sample' or 'population', got {std!r}")
    g = len(rewards_G)
    if g == 1:
        return [0.0], True
    mean = sum(rewards_G) / g
    sq = sum((r - mean) ** 2 for r in rewards_G)
    sd = math.sqrt(sq / (g - 1 if std == "sample" else g))
    # Exact equality is not required: rewards like 0.1 + 0.2 vs 0.3 differ by float noise.
    zero_variance = sd < 1e-12
    if zero_variance:
        return [0.0] * g, True
    if normalize_by_std:
        adv = [(r - mean) / (sd + eps) for r in rewards_G]
    else:
        adv = [r - mean for r in rewards_G]
    return adv, zero_variance


def train_sample(s, advantage: float):
    """What the trainer needs of scored sample `s` (tokens, the engine's logprobs, the mask of
    the model's own tokens in a multi-turn episode) with its advantage."""
    from moerl.records import TrainSample

    return TrainSample(
        prompt_token_ids=s.prompt_token_ids,
        response_token_ids=s.response_token_ids,
        response_logprobs=s.response_logprobs,
        advantage=advantage,
        policy_version=s.policy_version,
        response_mask=s.response_mask,
        routed_experts=s.routed_experts,
        token_versions=s.token_versions,
    )
