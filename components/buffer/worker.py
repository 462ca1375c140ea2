"""Buffer (async mode): admission of new work by staleness, backpressure, and the batches the
trainer takes, from the scored stream in Valkey. It runs inside the trainer task (the one
consumer of `scored`); the pure parts are functions so they can be unit-tested.

Design, details and limitations: docs/async.md#admission-staleness-and-backpressure.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Literal

from moerl.bus.weights import sha_agrees
from moerl.components.buffer.advantage import group_advantages, train_sample
from moerl.config import BufferConfig
from moerl.records import ScoredSample, TrainSample, newest_version, token_versions

Disposition = Literal["duplicate", "stale", "failed", "filtered", "used"]


def prompts_to_issue(
    *,
    used: int,
    in_flight: int,
    version: int,
    batch_prompts: int,
    versions: int,
    max_staleness: int,
    backlog: int,
    paused: bool,
    cfg: BufferConfig,
    signal_used: int = 0,
    gathered: tuple[int, int] = (0, 0),
) -> tuple[int, bool]:
    """How many prompts to issue now, and whether issuance is paused (backpressure).

    Without dynamic sampling a version consumes `batch_prompts` groups: admit up to
    `max_staleness` + 1 versions ahead of the trainer. With it (`cfg.min_signal_groups` = S) a
    version consumes S groups *with signal* and however many filtered ones come with them, so
    the same bound is counted in signal groups and scaled by the share of consumed groups that
    had signal so far (at least 5 %), and no more than `cfg.resolved.max_gather_groups` groups a version:
    `signal_used` = committed signal groups; `gathered` = (groups, signal groups) the trainer
    holds for its current version, consumed but not committed (no longer waiting generation)."""
    if paused and backlog < cfg.low_watermark:
        paused = False
    elif not paused and backlog >= cfg.high_watermark:
        paused = True
    if paused:
        return 0, paused
    if cfg.min_signal_groups is None:
        need = versions * batch_prompts - used - in_flight
        admit = (max_staleness + version + 1) * batch_prompts - used - in_flight
        return max(0, min(need, admit)), paused
    s, limit = cfg.min_signal_groups, cfg.resolved.max_gather_groups
    assert limit is not None  # set whenever min_signal_groups is (BufferConfig.resolved)
    rate = max(signal_used / used, 0.05) if used >= s else 1.0
    have = signal_used + gathered[1]
    waiting = max(0, in_flight - gathered[0])  # issued, neither committed nor taken by the trainer
    need = math.ceil((versions * s - have) / rate) - waiting
    admit = math.ceil(((max_staleness + version + 1) * s - have) / rate) - waiting
    # and no version consumes more than the gather limit, signal or not
    bound = (max_staleness + version + 1) * limit - used - in_flight
    return max(0, min(need, admit, bound)), paused


def classify(
    group_id: str,
    samples: list[ScoredSample],
    version: int,
    max_staleness: int,
    seen: set[str],
    known: Mapping[int, str | frozenset[str]] | None = None,
) -> Disposition:
    """`known`: the manifest sha256 of each version the trainer published or continues from (and
    its wire name, moerl.bus.weights); a sample whose engine served another sha under one of
    those numbers came from lost weights (a version rolled back and published again under its
    number) and is stale, whatever its number."""
    if group_id in seen:
        return "duplicate"
    if known and not all(
        sha_agrees(known.get(v), sha) for s in samples for v, sha in (s.policy_shas or {}).items()
    ):
        return "stale"
    # a sample from above the trainer's version came from a version that was lost (servable,
    # then gone with both copies before it was durable; see policy_update/worker.py)
    # in-flight weight updates: a response's oldest token decides its staleness, its newest
    # whether it came from a lost version
    if any(
        version - s.policy_version > max_staleness or newest_version(s) > version for s in samples
    ):
        return "stale"
    if any(s.reward_failed for s in samples):
        return "failed"
    if len({s.reward for s in samples}) <= 1:
        return "filtered"
    return "used"


@dataclass
class Batch:
    """The groups one version trains on, and everything disposed of while gathering them."""

    entry_ids: list[str] = field(default_factory=list)
    group_ids: list[str] = field(default_factory=list)
    # used + filtered, in arrival order
    groups: list[list[ScoredSample]] = field(default_factory=list)
    used: list[list[ScoredSample]] = field(default_factory=list)
    # generated -> taken by the trainer, per group
    waits_s: list[float] = field(default_factory=list)

    @property
    def n_groups(self) -> int:
        return len(self.groups)


def train_samples(groups: list[list[ScoredSample]], cfg: BufferConfig) -> list[TrainSample]:
    out: list[TrainSample] = []
    for members in groups:
        adv, _ = group_advantages(
            [m.reward for m in members],
            cfg.advantage_eps,
            cfg.normalize_by_std,
            std=cfg.advantage_std,
        )
        out.extend(train_sample(m, a) for m, a in zip(members, adv))
    return out


def batch_metrics(batch: Batch, version: int) -> dict[str, float]:
    """The same names the sync pipeline logs, from the groups this version consumed."""
    import math

    samples = [s for g in batch.groups for s in g]
    n = max(len(samples), 1)
    rewards = [s.reward for s in samples]
    mean = sum(rewards) / n
    stal = [version - s.policy_version for s in samples]
    n_tok = sum(len(s.response_token_ids) for s in samples)
    # in-flight weight updates (rollout.weight_update in_flight): staleness per generated token,
    # and the samples whose tokens came from more than one version
    tok_stal = sum(version - v for s in samples for v in token_versions(s))
    model = [m for s in samples if (m := getattr(s, "model_score", None)) is not None]
    extra = {"reward/model_score_mean": sum(model) / len(model)} if model else {}
    return extra | {
        "reward/mean": mean,
        "reward/std": math.sqrt(sum((r - mean) ** 2 for r in rewards) / n),
        "reward/exact_fraction": sum(r >= 1.0 for r in rewards) / n,
        "buffer/groups": float(batch.n_groups),
        "buffer/dropped_zero_variance_groups": float(batch.n_groups - len(batch.used)),
        "buffer/dropped_zero_variance_fraction": (batch.n_groups - len(batch.used))
        / max(batch.n_groups, 1),
        "buffer/batch_samples": float(sum(len(g) for g in batch.used)),
        "buffer/staleness_mean": sum(stal) / n,
        "buffer/staleness_max": float(max(stal, default=0)),
        "buffer/token_staleness_mean": tok_stal / max(n_tok, 1),
        "rollout/mixed_version_fraction": sum(s.token_versions is not None for s in samples) / n,
        "response/length_mean": n_tok / n,
        "rollout/samples": float(len(samples)),
        "rollout/truncated_fraction": sum(s.finish_reason == "length" for s in samples) / n,
        "buffer/sample_wait_s_mean": sum(batch.waits_s) / max(len(batch.waits_s), 1),
        "buffer/sample_wait_s_max": max(batch.waits_s, default=0.0),
    }
