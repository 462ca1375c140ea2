"""`trainer.schedule.stream`: a version trained minibatch by minibatch on the run's mesh as
`gather` takes its groups (`Streamed`), and its metrics merged from the minibatches'
(`merge_steps`).

Design, details and limitations: docs/async.md#componentspolicy_updateworkerpy.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import TYPE_CHECKING

from moerl.bus import RunBus
from moerl.components.buffer.worker import train_samples
from moerl.components.policy_update.gather import check_failures
from moerl.config import RunConfig
from moerl.errors import ConfigError
from moerl.records import ScoredSample

if TYPE_CHECKING:
    from moerl.components.policy_update.mesh import Leader


def _weight_key(key: str) -> str | None:
    """The total a per-minibatch mean of `key` is weighted by when merged, if any."""
    if key.startswith("rollout_corr/"):
        split = key.split("/")
        return "/".join([*split[:-1], "tokens"]) if len(split) > 2 else "rollout_corr/tokens"
    if key == "train/logprob_mismatch":
        return "train/tokens"
    if key.startswith(("moe/routing_", "moe/replay_")) or key == (
        "moe/token_any_layer_mismatch_fraction"
    ):
        return "moe/routing_tokens"
    return None


# what the whole-batch path reports from its last step
LAST_STEP = ("moe/tokens_expert_", "moe/expert_load_imbalance", "moe/router_max_load_ratio")


def merge_steps(steps: list[dict[str, float]], engine_pi_old: bool = True) -> dict[str, float]:
    """One version's metrics from its streamed minibatches' (`trainer.schedule.stream`), each reduced as
    the whole-batch path reduces it over steps: counts and token totals summed, maxima and
    minima kept, per-token means weighted by their tokens, the load statistics the last
    step's, `train/*` averaged over the minibatches that took a step. With the engine's
    logprobs as pi_old (`engine_pi_old`), what compares pi_old with them is left out (0)."""
    out: dict[str, float] = {"trainer/streamed_minibatches": float(len(steps))}
    stepped = [m for m in steps if m.get("train/steps", 0.0) > 0] or steps
    for key in sorted({k for m in steps for k in m}):
        if engine_pi_old and (key == "train/logprob_mismatch" or key.startswith("rollout_corr/")):
            continue
        have = [m for m in steps if key in m]
        vals = [m[key] for m in have]
        weight = _weight_key(key)
        if key in ("train/steps", "train/skipped_steps") or key.endswith(
            ("tokens", "rs_masked_sequences")
        ):
            out[key] = sum(vals)
        elif key.endswith("_max"):
            out[key] = max(vals)
        elif key.endswith("_min"):
            out[key] = min(vals)
        elif key.startswith(LAST_STEP):
            out[key] = vals[-1]
        elif weight is not None:
            w = [m.get(weight, 0.0) for m in have]
            out[key] = sum(v * x for v, x in zip(vals, w)) / sum(w) if sum(w) else vals[-1]
        else:
            some = [m[key] for m in stepped if key in m] or vals
            out[key] = sum(some) / len(some)
    out["train/empty_batch"] = float(not steps or all(m["train/empty_batch"] for m in steps))
    return out


class Streamed:
    """`trainer.schedule.stream`: one version trained minibatch by minibatch on the run's mesh, each as
    `gather` takes its groups (`__call__`), then written (`save`)."""

    def __init__(
        self, cfg: RunConfig, bus: RunBus, mesh: Leader | None, version: int, pi_old: str
    ) -> None:
        if mesh is None:
            raise ConfigError(
                "trainer.schedule.stream: true cannot run without the run's mesh; set "
                "trainer.parallelism.persistent_ranks: true"
            )
        self.cfg, self.bus, self.mesh, self.version = cfg, bus, mesh, version
        self.pi_old = (
            pi_old  # engine | proximal (RunConfig.resolved.stream_pi_old, or the caller's)
        )
        self.steps: list[dict[str, float]] = []
        self.seconds = 0.0  # in the minibatches' steps
        # samples too few for every rank to take one (a minibatch of mostly zero-variance
        # groups), carried into the next minibatch
        self.carry: list = []

    def __call__(self, groups: list[list[ScoredSample]]) -> None:
        check_failures(self.bus, self.cfg)
        t = time.perf_counter()
        samples = self.carry + train_samples(groups, self.cfg.buffer)
        self.carry = samples if 0 < len(samples) < self.mesh.control.world else []
        if self.carry:
            samples = []
        self.steps.append(self.mesh.train_step(samples, self.version, len(self.steps), self.pi_old))
        self.seconds += time.perf_counter() - t

    def save(self, out_dir: Path) -> dict[str, float]:
        """The version's files, and its metrics (`merge_steps`, the save's)."""
        t = time.perf_counter()
        metrics = merge_steps(self.steps, self.pi_old == "engine")
        # what was left over after the last minibatch: fewer samples than ranks, untrained
        metrics["train/dropped_samples"] = float(len(self.carry))
        metrics["trainer/stream_pi_old_engine"] = float(self.pi_old == "engine")
        metrics.update(self.mesh.save_version(self.version, out_dir))
        metrics["timing/policy_update_s"] = self.seconds + time.perf_counter() - t
        return metrics
