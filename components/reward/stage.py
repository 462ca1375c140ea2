"""Reward stage: score every sample with its rule verifier.

A verifier that raises marks its sample failed (reward 0, `reward_failed`, the error text)
and is counted; it never crashes the stage. If more than `reward.max_failed_fraction` of the
samples fail, the stage raises `DataError`: that many failures mean a broken verifier or
dataset, and training on it would be noise.
"""

from __future__ import annotations

import math
import time
from pathlib import Path

from moerl.config import RewardConfig
from moerl.errors import DataError
from moerl.records import Sample, ScoredSample, read_records, write_records
from moerl.components.reward.verifiers import verifier_for


def score(samples: list[Sample], cfg: RewardConfig) -> list[ScoredSample]:
    out = []
    for s in samples:
        try:
            r = float(verifier_for(cfg.verifier, s.task)(s.response_text, s.answer))
            if not math.isfinite(r):
                raise ValueError(f"verifier returned {r}")
            out.append(ScoredSample(**s.model_dump(), reward=r))
        except Exception as err:  # noqa: BLE001 - any verifier failure is counted, never fatal
            out.append(ScoredSample(**s.model_dump(), reward=0.0, reward_failed=True,
                                    reward_error=f"{type(err).__name__}: {err}"))
    return out


def reward_metrics(scored: list[ScoredSample]) -> dict[str, float]:
    n = max(len(scored), 1)
    rewards = [s.reward for s in scored]
    mean = sum(rewards) / n
    return {
        "reward/mean": mean,
        "reward/std": math.sqrt(sum((r - mean) ** 2 for r in rewards) / n),
        "reward/exact_fraction": sum(r >= 1.0 for r in rewards) / n,
        "reward/failed_samples": float(sum(s.reward_failed for s in scored)),
    }


def run_reward(cfg: RewardConfig, samples_path: str | Path, out_path: str | Path) -> dict[str, float]:
    t0 = time.perf_counter()
    scored = score(read_records(samples_path, Sample), cfg)
    metrics = reward_metrics(scored)
    failed = metrics["reward/failed_samples"]
    if scored and failed / len(scored) > cfg.max_failed_fraction:
        first = next(s.reward_error for s in scored if s.reward_failed)
        raise DataError(f"reward: {int(failed)} of {len(scored)} samples failed verification "
                        f"(> reward.max_failed_fraction {cfg.max_failed_fraction}); first error: {first}")
    write_records(out_path, scored)
    metrics["timing/reward_s"] = time.perf_counter() - t0
    return metrics
