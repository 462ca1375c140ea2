"""`moerl bench mismatch`: the MoE training-inference mismatch, measured and corrected, side by side.

Design, details and limitations: docs/bench-reports/mismatch.md#how-it-works-benchmarksmismatchpy.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
import time
import traceback
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from benchmarks import child_main, format_table, log_tail, run_child, write_report
from benchmarks.machine import machine_record
from moerl import provenance, tracking
from moerl.config import RunConfig, flatten
from moerl.errors import ConfigError, MoerlError

REPLAY_ARMS = {
    "disabled": ["trainer.moe.router_replay=disabled"],
    "R3": ["trainer.moe.router_replay=R3"],
    "R2": ["trainer.moe.router_replay=R2"],
    "gspo": ["trainer.moe.router_replay=disabled", "trainer.loss.policy_loss=gspo"],
}
NOISE_ENV = "MOERL_BENCH_ROUTER_NOISE"
# per version, from train_on_batch's metrics
TRACKED = (
    "rollout_corr/k3_kl",
    "rollout_corr/kl",
    "rollout_corr/log_ratio_abs_max",
    "rollout_corr/log_ratio_abs_mean",
    "rollout_corr/extreme_fraction",
    "rollout_corr/chi2_token",
    "rollout_corr/is_ess",
    "moe/routing_agreement",
    "moe/token_any_layer_mismatch_fraction",
    "moe/replay_replaced_fraction",
    "train/clip_fraction",
)


def perturbed_copy(state: Path, out: Path, scale: float, seed: int = 0) -> Path:
    """A copy of checkpoint `state` (top-level files: what an engine loads) whose MoE router
    weights carry seeded noise (`scale` x each weight's std); the same seed gives the same
    pattern. The engine is swapped to it: its own loader and prepacking see the noisy weights."""
    import torch
    from safetensors.torch import load_file, save_file

    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    g = torch.Generator().manual_seed(seed)
    n = 0
    for f in sorted(state.iterdir()):
        if not f.is_file():
            continue
        if f.suffix != ".safetensors":
            shutil.copy2(f, out / f.name)
            continue
        tensors = load_file(f)
        for name in sorted(tensors):
            if name.endswith(".gate.weight") and "shared_expert" not in name:
                w = tensors[name]
                noise = torch.randn(w.shape, generator=g, dtype=torch.float32)
                tensors[name] = (w.float() + noise * scale * w.float().std()).to(w.dtype)
                n += 1
        save_file(tensors, out / f.name, metadata={"format": "pt"})
    if n == 0:
        raise MoerlError(f"bench mismatch: {state} has no MoE router weight to perturb")
    return out


def run_replay_arm(cfg: RunConfig, iterations: int, work: Path) -> dict[str, Any]:
    """One replay arm (in the child process): the floor loop with a perturbed engine."""
    import torch
    from transformers import AutoTokenizer

    from moerl.components.buffer.stage import assemble
    from moerl.components.policy_update.trainer import load_state, save_state, train_on_batch
    from moerl.components.publish_checkpoint.stage import prepare_initial
    from moerl.components.reward.stage import reward_metrics, score
    from moerl.components.rollout.engine import RolloutEngine
    from moerl.components.rollout.stage import to_samples
    from moerl.tasks.dataset import load_dataset
    from moerl.tasks.prompting import encode_prompt

    noise = float(os.environ.get(NOISE_ENV, "0"))
    t0 = time.perf_counter()
    state = prepare_initial(cfg, work / "v0")
    model, opt, counters = load_state(state, cfg)
    tokenizer = AutoTokenizer.from_pretrained(state)
    ds = load_dataset(cfg.task.dataset, cfg.task.max_bad_fraction, cfg.checkpoint)

    def served(
        version_dir: Path,
    ) -> Path:  # what the engine gets: the version, or its perturbed copy
        return perturbed_copy(version_dir, work / "engine", noise) if noise > 0 else version_dir

    engine = RolloutEngine(served(state), cfg.rollout, seed=cfg.rollout.seed)
    per_version: list[dict[str, float]] = []
    try:
        for i in range(iterations):
            prompts = ds.batch(i, cfg.task.prompts_per_iteration, cfg.task.shuffle_seed)
            ids = [encode_prompt(tokenizer, cfg.rollout, p) for p in prompts]
            t_gen = time.perf_counter()
            samples = to_samples(
                prompts, ids, engine.generate(ids, cfg.rollout.samples_per_prompt), i, engine
            )
            gen_s = time.perf_counter() - t_gen
            scored = score(samples, cfg.reward)
            batch, buf = assemble(scored, cfg.buffer, trainer_version=i)
            torch.manual_seed(cfg.trainer.seed + i)
            t_train = time.perf_counter()
            m = (
                train_on_batch(model, opt, counters, batch, cfg, seed=cfg.trainer.seed + i)
                if batch
                else {}
            )
            row = {
                "reward/mean": reward_metrics(scored)["reward/mean"],
                "generate_s": gen_s,
                "train_s": time.perf_counter() - t_train,
                "buffer/dropped_zero_variance_fraction": buf[
                    "buffer/dropped_zero_variance_fraction"
                ],
                **{k: m[k] for k in TRACKED if k in m},
            }
            per_version.append(row)
            counters.version += 1
            out = work / f"v{i + 1}"
            save_state(model, opt, counters, state, out)
            engine.swap_weights(served(out))
            shutil.rmtree(state, ignore_errors=True)
            state = out
            print(
                f"[moerl] version {i + 1}/{iterations} reward/mean={row['reward/mean']:.3f} "
                f"k3_kl={row.get('rollout_corr/k3_kl', float('nan')):.2e} "
                f"agreement={row.get('moe/routing_agreement', float('nan')):.3f}",
                flush=True,
            )
    finally:
        engine.close()
    return {"versions": per_version, "inner_s": time.perf_counter() - t0}


def _mean(xs: Sequence[float]) -> float | None:
    xs = [x for x in xs if x is not None]
    return sum(xs) / len(xs) if xs else None


def replay_row(res: dict[str, Any], wall_s: float) -> dict[str, Any]:
    """One replay arm's summary: reward first / last 3, and each tracked metric's mean (max for
    the max |log ratio|) over the versions."""
    vs = res["versions"]
    rewards = [v["reward/mean"] for v in vs]
    summary = {k: _mean([v.get(k) for v in vs]) for k in TRACKED}
    summary["rollout_corr/log_ratio_abs_max"] = max(
        (v["rollout_corr/log_ratio_abs_max"] for v in vs if "rollout_corr/log_ratio_abs_max" in v),
        default=None,
    )
    return {
        "ok": True,
        "wall_s": wall_s,
        "reward_first": rewards[0] if rewards else None,
        "reward_last3": _mean(rewards[-3:]),
        "rewards": rewards,
        "summary": summary,
        "versions": vs,
    }


def _arm_config(
    config, overrides, extra: Sequence[str], iterations: int, arm_dir: Path
) -> RunConfig:
    from benchmarks.modes import arm_config

    return arm_config(config, [*overrides, *extra], "async", iterations, arm_dir)


def _replay_arm(
    arm: str, cfg: RunConfig, iterations: int, arm_dir: Path, noise: float
) -> dict[str, Any]:
    def echo(line: str) -> None:
        if line.startswith("[moerl]"):
            print(f"  {arm}: {line}", end="", flush=True)

    t0 = time.perf_counter()
    code, result, log_path = run_child(
        "benchmarks.mismatch",
        "replay",
        cfg,
        iterations,
        arm_dir,
        arm,
        env_extra={NOISE_ENV: str(noise)},
        on_line=echo,
    )
    if code != 0 or not result.is_file():
        raise MoerlError(
            f"replay arm {arm} exited {code}; last lines of its output:\n{log_tail(log_path)}"
        )
    return replay_row(json.loads(result.read_text()), time.perf_counter() - t0)


def _dynamic_arm(cfg: RunConfig, arm_dir: Path) -> dict[str, Any]:
    from benchmarks.modes import _async_arm, _history

    res = _async_arm(cfg, arm_dir)
    uri = tracking.resolve_uri(cfg.tracking)
    filtered = _history(uri, res["run_id"], "buffer/dropped_zero_variance_fraction")
    rewards = res["rewards"]
    return {
        **res,
        "filtered_fraction": filtered,
        "reward_last5_min": min(rewards[-5:]) if rewards else None,
        "signal_shortfall": sum(_history(uri, res["run_id"], "buffer/signal_shortfall_groups")),
    }


def ratios(replay: dict[str, dict[str, Any]]) -> dict[str, float | None]:
    """R3 / disabled (and the other arms / disabled) for the mismatch metrics: < 1 is less mismatch."""
    base = replay.get("disabled", {})
    out: dict[str, float | None] = {}
    for arm, r in replay.items():
        if arm == "disabled" or not (r.get("ok") and base.get("ok")):
            continue
        for k in (
            "rollout_corr/k3_kl",
            "rollout_corr/log_ratio_abs_mean",
            "rollout_corr/extreme_fraction",
        ):
            a, b = r["summary"].get(k), base["summary"].get(k)
            out[f"{arm}_over_disabled/{k}"] = a / b if a is not None and b else None
    return out


def format_report(report: dict[str, Any]) -> str:
    lines = [f"routing replay, engine routers perturbed by {report['router_noise']} x std:"]
    rows = []
    for arm, r in report["replay"].items():
        s = r.get("summary", {})
        rows.append(
            [
                arm,
                r["ok"],
                r.get("wall_s"),
                r.get("reward_first"),
                r.get("reward_last3"),
                s.get("moe/routing_agreement"),
                s.get("rollout_corr/k3_kl"),
                s.get("rollout_corr/log_ratio_abs_max"),
                s.get("rollout_corr/extreme_fraction"),
                s.get("moe/replay_replaced_fraction"),
            ]
        )
    lines.append(
        format_table(
            [
                "arm",
                "ok",
                "wall s",
                "reward first",
                "reward last3",
                "agreement",
                "k3 KL",
                "max |dlogp|",
                "extreme frac",
                "replaced",
            ],
            rows,
        )
    )
    for k, v in report["ratios"].items():
        lines.append(f"{k}: {'-' if v is None else f'{v:.3f}'}")
    if report["dynamic"]:
        lines.append("")
        lines.append("dynamic sampling (async pipeline):")
        rows = [
            [
                arm,
                r["ok"],
                r.get("wall_s"),
                r.get("reward_first"),
                r.get("reward_last3"),
                r.get("reward_last5_min"),
                _mean((r.get("filtered_fraction") or [])[-3:]),
                r.get("signal_shortfall"),
            ]
            for arm, r in report["dynamic"].items()
        ]
        lines.append(
            format_table(
                [
                    "arm",
                    "ok",
                    "wall s",
                    "reward first",
                    "reward last3",
                    "min last5",
                    "filtered last3",
                    "shortfall groups",
                ],
                rows,
            )
        )
    for section in ("replay", "dynamic"):
        for arm, r in report[section].items():
            if not r.get("ok"):
                last = (r.get("error") or "").strip().splitlines()[-1:]
                lines.append(f"{section} {arm} FAILED: {last[0] if last else 'unknown'}")
    return "\n".join(lines)


def run_bench_mismatch(
    config: str | Path,
    overrides: Sequence[str] = (),
    versions: int = 24,
    router_noise: float = 0.1,
    arms: str | Sequence[str] = ("disabled", "R3"),
    dynamic: bool = True,
    min_signal_groups: int | None = None,
    out: str | Path = "bench/mismatch.json",
    work_dir: str | Path | None = None,
) -> dict[str, Any]:
    """Run both sections; write the report to `out` and print its table.

    Args:
        config: the workload's run config (YAML)
        overrides: config overrides KEY=VALUE (repeatable)
        versions: versions per arm
        router_noise: the engine's routers are perturbed by this x each router weight's std
            (0 = none)
        arms: replay arms, comma-separated: disabled, R3, R2, gspo
        dynamic: the dynamic-sampling arms, two async runs (--no-dynamic: skip them)
        min_signal_groups: the dynamic arm's buffer.min_signal_groups (default:
            task.prompts_per_iteration)
        out: the report (JSON)
        work_dir: keep each arm's files here (default: a temp dir, deleted)
    """
    if isinstance(arms, str):
        arms = [x.strip() for x in arms.split(",") if x.strip()]
    unknown = [a for a in arms if a not in REPLAY_ARMS]
    if unknown or len(set(arms)) != len(arms):
        raise ConfigError(
            f"bench mismatch: --arms takes each of {', '.join(REPLAY_ARMS)} at most once; got "
            f"{','.join(arms)}"
        )
    if versions < 1:
        raise ConfigError(f"bench mismatch: --versions must be >= 1, got {versions}")
    if not 0.0 <= router_noise <= 10.0:
        raise ConfigError(
            f"bench mismatch: --router-noise must be in [0, 10] (x the router weights' std), got "
            f"{router_noise}"
        )
    replay: dict[str, dict[str, Any]] = {}
    dyn: dict[str, dict[str, Any]] = {}
    cfgs: dict[str, RunConfig] = {}
    with tempfile.TemporaryDirectory(prefix="moerl-bench-mismatch-") as tmp:
        root = Path(work_dir) if work_dir is not None else Path(tmp)
        root.mkdir(parents=True, exist_ok=True)
        plan = [
            ("replay", a, [*REPLAY_ARMS[a], "rollout.return_routed_experts=true"]) for a in arms
        ]
        if dynamic:
            base = _arm_config(config, overrides, [], versions, root / "probe")
            s = min_signal_groups or base.task.prompts_per_iteration
            plan += [
                ("dynamic", "filter", []),
                ("dynamic", "dynamic", [f"buffer.min_signal_groups={s}"]),
            ]
        for section, arm, extra in plan:  # configs first: a bad one fails before any arm runs
            arm_dir = Path(tempfile.mkdtemp(prefix=f"{section}-{arm}-", dir=root))
            cfgs[f"{section}/{arm}"] = _arm_config(config, overrides, extra, versions, arm_dir)
        for section, arm, _ in plan:
            cfg = cfgs[f"{section}/{arm}"]
            arm_dir = Path(cfg.pipeline.work_dir).parent
            print(
                f"[moerl] bench mismatch: {section} arm {arm}, {versions} versions, in {arm_dir}",
                flush=True,
            )
            try:
                if section == "replay":
                    replay[arm] = _replay_arm(arm, cfg, versions, arm_dir, router_noise)
                else:
                    dyn[arm] = _dynamic_arm(cfg, arm_dir)
            except Exception as err:  # noqa: BLE001 - one arm's failure is reported; the others still run
                if not isinstance(err, MoerlError):
                    traceback.print_exc()
                (replay if section == "replay" else dyn)[arm] = {
                    "ok": False,
                    "error": tracking.redact(f"{type(err).__name__}: {err}"),
                }
    report = {
        "bench": "mismatch",
        "schema": 1,
        "config": str(config),
        "overrides": list(overrides),
        "versions_per_arm": versions,
        "router_noise": router_noise,
        "replay": replay,
        "dynamic": dyn,
        "ratios": ratios(replay),
        "ok": all(r["ok"] for r in (*replay.values(), *dyn.values())),
        "configs": {
            k: {kk: tracking.redact(v) for kk, v in flatten(c).items()} for k, c in cfgs.items()
        },
        "versions": provenance.collect(),
        "machine": machine_record(),
    }
    write_report(Path(out), report)
    print(format_report(report))
    print(f"wrote {out}")
    return report


def main(argv: list[str] | None = None) -> int:
    """`python -m benchmarks.mismatch replay ...`: one replay arm, as the bench starts it."""
    return child_main(
        argv,
        "benchmarks.mismatch",
        "replay",
        "a replay arm of `moerl bench mismatch`",
        run_replay_arm,
    )


if __name__ == "__main__":
    sys.exit(main())
