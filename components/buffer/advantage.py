"""GRPO group-relative advantages: a pure function over one group's rewards.

Design, details and limitations: docs/async.md#componentsbufferadvantagepy.
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
