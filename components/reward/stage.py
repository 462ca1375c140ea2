"""Reward stage: score every sample with its rule verifier, a reward model, or both.

Design, details and limitations: docs/async.md#componentsrewardstagepy.
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterator
from pathlib import Path

from moerl import tracking
from moerl.config import RewardConfig, RunConfig
from moerl.errors import DataError
from moerl.records import Sample, ScoredSample, read_records, write_records
from moerl.registry import reward_model as registry
from moerl.tasks.sandbox import Limits, SandboxPool
from moerl.tasks.verifiers import CALL_VERIFIER, as_score, verifier_target


class ModelScorer:
    """A loaded reward model and how to use it (`reward.model`); `seconds` accumulates its
    inference time. `info` is the registry entry it came from (lineage)."""

    def __init__(self, cfg: RunConfig, info=None, model=None):
        from moerl.components.reward_model.model import RewardModel  # torch

        if cfg.reward.model is None:  # RewardConfig requires it for kind model and mixed
            raise ValueError(f"reward.kind {cfg.reward.kind} has no reward model (reward.model)")
        self.ref = cfg.reward.model
        self.seconds = 0.0
        if model is not None:  # already loaded (tests, benchmarks)
            self.info, self.model = info, model
            return
        self.info = info or registry.resolve(tracking.resolve_uri(cfg.tracking), self.ref)
        self.model = RewardModel(registry.fetch(cfg.checkpoint, self.info), self.ref.device)

    def raw_scores(self, samples: list[Sample]) -> list[float | str]:
        """One raw score per sample, or the error text of the batch that failed."""
        out: list[float | str] = []
        t0 = time.perf_counter()
        for i in range(0, len(samples), self.ref.max_batch):
            batch = samples[i : i + self.ref.max_batch]
            try:
                got = self.model.score([s.prompt + s.response_text for s in batch], len(batch))
                bad = next((v for v in got if not math.isfinite(v)), None)
                if bad is not None:
                    raise ValueError(f"reward model returned {bad}")
                out.extend(got)
            except Exception as err:  # noqa: BLE001 - the batch is failed and counted, never scored 0
                out.extend([f"reward model: {type(err).__name__}: {err}"] * len(batch))
        self.seconds += time.perf_counter() - t0
        return out


def normalize(raw: list[float], how: str) -> list[float]:
    if how == "sigmoid":
        return [1.0 / (1.0 + math.exp(-min(max(v, -60.0), 60.0))) for v in raw]
    if how == "zscore" and raw:
        mean = sum(raw) / len(raw)
        std = math.sqrt(sum((v - mean) ** 2 for v in raw) / len(raw))
        return [(v - mean) / std if std > 1e-8 else 0.0 for v in raw]
    return list(raw)


def open_pool(cfg: RewardConfig) -> SandboxPool:
    """The sandboxed pool the rule verifiers of `cfg` run in (one per scoring process)."""
    sb = cfg.sandbox
    return SandboxPool(
        Limits(
            timeout_s=sb.sample_timeout_s,
            memory_mb=sb.memory_mb,
            workers=sb.workers,
            isolation=sb.isolation,
        )
    )


def rule_scores(samples: list[Sample], cfg: RewardConfig, pool: SandboxPool) -> list[float | str]:
    """Each sample's verifier score, run in the sandbox, or the error text that failed it:
    a verifier that raised, returned something that is not a finite number, ran past
    `sandbox.sample_timeout_s` ("timeout: ...") or past `sandbox.memory_mb` ("memory: ...").
    A multi-turn episode whose environment gave rewards has their sum; one whose environment
    failed is failed ("environment: ..."); otherwise the verifier scores the model's last
    message."""
    out: list[float | str | None] = [None] * len(samples)
    calls, where = [], []
    for i, s in enumerate(samples):
        # the episode's environment failed: the sample is failed, not scored
        if s.env_error is not None:
            out[i] = f"environment: {s.env_error}"
            continue
        if s.env_reward is not None:  # a multi-turn episode scored by its environment's steps
            out[i] = s.env_reward
            continue
        try:  # each call runs `call_verifier` in a sandboxed child, never the verifier here
            target = verifier_target(cfg.verifier, s.task, cfg.verifiers)
            calls.append((CALL_VERIFIER, [target, s.answer_text, s.answer, s.meta]))
            where.append(i)
        except KeyError as err:  # no verifier for the row's task (preflight refuses that first)
            out[i] = f"KeyError: {err}"
    for i, o in zip(where, pool.run(calls)):
        out[i] = as_score(o.ok, o.value, o.error)
    return out  # type: ignore[return-value]


def score(
    samples: list[Sample],
    cfg: RewardConfig,
    model: ModelScorer | None = None,
    pool: SandboxPool | None = None,
) -> list[ScoredSample]:
    """Score `samples`; rule verifiers run in `pool` (a pool opened for this call if None)."""
    if cfg.kind != "rules" and model is None:
        raise ValueError(f"reward.kind {cfg.kind} needs a loaded reward model")
    rules: list[float | str] = []
    if cfg.kind in ("rules", "mixed"):
        if pool is None:
            with open_pool(cfg) as own:
                rules = rule_scores(samples, cfg, own)
        else:
            rules = rule_scores(samples, cfg, pool)
    raw = model.raw_scores(samples) if model is not None and cfg.kind != "rules" else []
    ok_raw = [v for v in raw if isinstance(v, float)]
    normed: Iterator[float] = iter(())
    if raw:
        assert cfg.model is not None  # raw scores: kind model or mixed, which require reward.model
        normed = iter(normalize(ok_raw, cfg.model.normalize))
    out = []
    for i, s in enumerate(samples):
        rule = rules[i] if rules else None
        m_raw = raw[i] if raw else None
        m = next(normed) if isinstance(m_raw, float) else None
        error = next((e for e in (rule, m_raw) if isinstance(e, str)), None)
        if error is not None:
            out.append(
                ScoredSample(
                    **s.model_dump(),
                    reward=0.0,
                    reward_failed=True,
                    reward_error=error,
                    model_score=m_raw if isinstance(m_raw, float) else None,
                )
            )
            continue
        if cfg.kind == "rules":
            r = rule
        elif cfg.kind == "model":
            r = m
        else:  # mixed, neither failed (error is None): both are scores
            assert rule is not None and not isinstance(rule, str) and m is not None
            r = cfg.rules_weight * rule + cfg.model_weight * m
        out.append(ScoredSample(**s.model_dump(), reward=r, model_score=m_raw, rule_score=rule))
    return out


def reward_metrics(scored: list[ScoredSample]) -> dict[str, float]:
    n = max(len(scored), 1)
    rewards = [s.reward for s in scored]
    mean = sum(rewards) / n
    metrics = {
        "reward/mean": mean,
        "reward/std": math.sqrt(sum((r - mean) ** 2 for r in rewards) / n),
        "reward/exact_fraction": sum(r >= 1.0 for r in rewards) / n,
        "reward/failed_samples": float(sum(s.reward_failed for s in scored)),
        # verifiers cut off by the sandbox: past sandbox.sample_timeout_s, past sandbox.memory_mb
        "reward/timeout_samples": float(
            sum((s.reward_error or "").startswith("timeout:") for s in scored)
        ),
        "reward/memory_samples": float(
            sum((s.reward_error or "").startswith("memory:") for s in scored)
        ),
        # a call whose process sent another call's reply or a second line (killed, failed)
        "reward/forged_samples": float(
            sum((s.reward_error or "").startswith("forged:") for s in scored)
        ),
        # an environment that failed its episode (env/* in the rollout's metrics says how)
        "reward/env_failed_samples": float(
            sum((s.reward_error or "").startswith("environment:") for s in scored)
        ),
    }
    model = [s.model_score for s in scored if s.model_score is not None]
    model_failed = sum((s.reward_error or "").startswith("reward model:") for s in scored)
    # the rest of the failures: a verifier that raised, returned no number, or crashed
    metrics["reward/error_samples"] = (
        metrics["reward/failed_samples"]
        - metrics["reward/timeout_samples"]
        - metrics["reward/memory_samples"]
        - metrics["reward/env_failed_samples"]
        - metrics["reward/forged_samples"]
        - model_failed
    )
    if model or model_failed:
        metrics["reward/model_failed_samples"] = float(model_failed)
    if model:
        metrics["reward/model_score_mean"] = sum(model) / len(model)
    rules = [s.rule_score for s in scored if s.rule_score is not None]
    if rules and model:  # mixed: each part on its own
        metrics["reward/rules_mean"] = sum(rules) / len(rules)
    return metrics


def load_model_scorer(cfg: RunConfig, run_id: str = "") -> ModelScorer | None:
    """The reward model `reward.kind` model or mixed needs (None for rules), resolved in the
    registry and fetched verified; its lineage (registry version, URI, store version, manifest
    hash, the reward-model run) is recorded on the MLflow run `run_id`."""
    if cfg.reward.kind == "rules":
        return None
    scorer = ModelScorer(cfg)
    if run_id:
        tracking.set_tags(tracking.resolve_uri(cfg.tracking), run_id, scorer.info.lineage_tags())
    return scorer


def run_reward(
    cfg: RewardConfig | RunConfig,
    samples_path: str | Path,
    out_path: str | Path,
    model: ModelScorer | None = None,
) -> dict[str, float]:
    """Score `samples_path` into `out_path`. Given the whole RunConfig, a reward model
    (`reward.kind` model or mixed) is resolved, fetched and loaded here."""
    if isinstance(cfg, RunConfig):
        if cfg.reward.kind != "rules" and model is None:
            model = ModelScorer(cfg)
        cfg = cfg.reward
    t0 = time.perf_counter()
    scored = score(read_records(samples_path, Sample), cfg, model)
    metrics = reward_metrics(scored)
    if model is not None:
        metrics["timing/reward/model_inference_s"] = model.seconds
    failed = metrics["reward/failed_samples"]
    if scored and failed / len(scored) > cfg.max_failed_fraction:
        first = next(s.reward_error for s in scored if s.reward_failed)
        raise DataError(
            f"reward: {int(failed)} of {len(scored)} samples failed verification "
            f"(> reward.max_failed_fraction {cfg.max_failed_fraction}); first error: {first}"
        )
    write_records(out_path, scored)
    metrics["timing/reward_s"] = time.perf_counter() - t0
    return metrics
