"""GRPO group-relative advantages: a pure function over one group's rewards.

Legend: G = samples in a group (one prompt).

    A_i = (r_i - mean(r)) / (std(r) + eps)          normalize_by_std=True  (GRPO)
    A_i =  r_i - mean(r)                            normalize_by_std=False (Dr. GRPO)

std is the population std (divide by G), as in verl's `compute_grpo_outcome_advantage`
with unbiased=False. A group whose rewards are all equal carries no learning signal: it is
reported as zero-variance so the buffer can drop and count it.
"""

from __future__ import annotations

import math


def group_advantages(rewards_G: list[float], eps: float = 1e-6, normalize_by_std: bool = True) -> tuple[list[float], bool]:
    """Returns (advantages_G, zero_variance)."""
    if not rewards_G:
        raise ValueError("a group needs at least one reward")
    g = len(rewards_G)
    mean = sum(rewards_G) / g
    var = sum((r - mean) ** 2 for r in rewards_G) / g
    std = math.sqrt(var)
    zero_variance = std < 1e-12
    if normalize_by_std:
        adv = [(r - mean) / (std + eps) for r in rewards_G]
    else:
        adv = [r - mean for r in rewards_G]
    return adv, zero_variance
