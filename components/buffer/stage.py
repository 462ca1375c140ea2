"""Buffer stage: group samples by prompt, compute group-relative advantages, drop the groups
that carry no signal, and assemble the training batch.

Dropped and counted: groups with zero reward variance, samples older than
`buffer.max_staleness` policy versions, groups left smaller than 2 by either, and groups with a
failed sample (a verifier or an environment that failed, timed out or ran out of memory): a
failure is never trained on as a reward of 0, and the rest of its group would get a biased
baseline, so the group goes, as in async mode (`worker.classify`). The advantage divides by the group's
sample std (G - 1) unless `buffer.advantage_std` is `population` (see advantage.py).
"""

from __future__ import annotations

import time
from collections import defaultdict
from pathlib import Path

from moerl.components.buffer.advantage import group_advantages, train_sample
from moerl.config import BufferConfig
from moerl.records import ScoredSample, TrainSample, read_records, write_records


def assemble(
    scored: list[ScoredSample], cfg: BufferConfig, trainer_version: int
) -> tuple[list[TrainSample], dict[str, float]]:
    groups: dict[str, list[ScoredSample]] = defaultdict(list)
    stale = 0
    for s in scored:
        if trainer_version - s.policy_version > cfg.max_staleness:
            stale += 1
            continue
        groups[s.prompt_id].append(s)
    batch: list[TrainSample] = []
    dropped_zero_var = dropped_small = dropped_failed = signal = surplus = 0
    for members in groups.values():
        if len(members) < 2:
            dropped_small += 1
            continue
        if any(m.reward_failed for m in members):
            dropped_failed += 1
            continue
        adv, zero_var = group_advantages(
            [m.reward for m in members],
            cfg.advantage_eps,
            cfg.normalize_by_std,
            std=cfg.advantage_std,
        )
        if zero_var and cfg.drop_zero_variance_groups:
            dropped_zero_var += 1
            continue
        if cfg.min_signal_groups is not None and signal >= cfg.min_signal_groups:
            surplus += 1  # dynamic sampling: the batch holds exactly min_signal_groups groups
            continue
        signal += 1
        batch.extend(train_sample(m, a) for m, a in zip(members, adv))
    n_groups = max(len(groups), 1)
    dynamic = (
        {}
        if cfg.min_signal_groups is None
        else {
            "buffer/signal_groups": float(signal),
            "buffer/surplus_signal_groups": float(surplus),
            "buffer/signal_shortfall_groups": float(max(0, cfg.min_signal_groups - signal)),
        }
    )
    return batch, dynamic | {
        "buffer/groups": float(len(groups)),
        "buffer/dropped_zero_variance_groups": float(dropped_zero_var),
        "buffer/dropped_zero_variance_fraction": dropped_zero_var / n_groups,
        "buffer/dropped_small_groups": float(dropped_small),
        "buffer/dropped_failed_groups": float(dropped_failed),
        "buffer/stale_samples": float(stale),
        "buffer/batch_samples": float(len(batch)),
        "buffer/staleness_max": float(
            max((trainer_version - s.policy_version for s in scored), default=0)
        ),
    }


def run_buffer(
    cfg: BufferConfig, scored_path: str | Path, trainer_version: int, out_path: str | Path
) -> dict[str, float]:
    t0 = time.perf_counter()
    batch, metrics = assemble(read_records(scored_path, ScoredSample), cfg, trainer_version)
    write_records(out_path, batch)
    metrics["timing/buffer_s"] = time.perf_counter() - t0
    return metrics
