"""`moerl bench modes`: one workload run three ways, side by side: the floor, sync, async.

Design, details and limitations: docs/bench-reports/modes.md#how-it-works-benchmarksmodespy.
"""

from __future__ import annotations

import json
import logging
import shutil
import sys
import tempfile
import time
import traceback
from collections import defaultdict
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Literal

from benchmarks import child_main, format_table, log_tail, run_child, write_report
from benchmarks.machine import machine_line, machine_record
from benchmarks.progress import progress
from moerl import provenance, tracking
from moerl.config import RunConfig, flatten, load_config
from moerl.errors import ConfigError, MoerlError
from moerl.userfiles import short_repr

log = logging.getLogger(__name__)

ARMS = ("floor", "sync", "async")
# whose `modes:` settings each arm takes
ARM_MODE = {
    "floor": "sync",
    "sync": "sync",
    "async": "async",
}
# What makes two arms the same workload; any difference between the arms' configs is refused.
WORKLOAD_KEYS = (
    "model",
    "task.dataset",
    "task.prompts_per_iteration",
    "task.shuffle_seed",
    "rollout.samples_per_prompt",
    "rollout.max_new_tokens",
    "rollout.temperature",
    "rollout.top_p",
    "rollout.top_k",
    "trainer.optimizer.optimizer_steps_per_iteration",
)
RATIOS = {
    "sync_over_async": ("sync", "async"),
    "sync_over_floor": ("sync", "floor"),
    "async_over_floor": ("async", "floor"),
}


class ArmFailed(MoerlError):
    """One arm of the bench did not finish; the report records why."""


# -- configs ---------------------------------------------------------------------------------
def parse_arms(text: str | Sequence[str]) -> tuple[str, ...]:
    """'floor,sync,async' (or a sequence) as a tuple of known arms, in the order given."""
    arms = tuple(
        a.strip() for a in (text.split(",") if isinstance(text, str) else text) if a.strip()
    )
    unknown = [a for a in arms if a not in ARMS]
    if unknown or not arms or len(set(arms)) != len(arms):
        raise ConfigError(
            f"bench modes: --arms must name each of {', '.join(ARMS)} at most once, comma-separated; "
            f"got {short_repr(','.join(arms))}"
        )
    return arms


def async_busy(metrics: dict[str, float]) -> dict[str, float]:
    """Each stage's busy fraction of an async run (its last MLflow metrics): the workers'
    `async/busy_fraction/<stage>` and the trainer's `async/trainer_busy_fraction`."""
    prefix = "async/busy_fraction/"
    busy = {k[len(prefix) :]: v for k, v in sorted(metrics.items()) if k.startswith(prefix)}
    if "async/trainer_busy_fraction" in metrics:
        busy["trainer"] = metrics["async/trainer_busy_fraction"]
    return busy


def arm_paths(arm_dir: Path) -> list[str]:
    """The overrides that put every path of an arm's run (store, cache, KFP root, work dir,
    MLflow) inside `arm_dir`, with no warm start: every arm starts from the same version 0."""
    return [
        f"checkpoint.uri={arm_dir / 'checkpoints'}",
        f"checkpoint.cache_dir={arm_dir / 'cache'}",
        f"pipeline.pipeline_root={arm_dir / 'pipeline-root'}",
        f"pipeline.work_dir={arm_dir / 'work'}",
        f"tracking.uri=sqlite:///{arm_dir / 'mlflow.db'}",
        "model.warm_start=none",
    ]


def arm_config(
    config: str | Path,
    overrides: Sequence[str],
    arm: str,
    iterations: int,
    arm_dir: Path,
    floor_settings: Literal["sync", "async"] = "sync",
) -> RunConfig:
    """The config of `arm`: the file with `overrides`, the arm's mode, `iterations` versions,
    and every path (store, cache, KFP root, work dir, MLflow) inside `arm_dir`; no warm start.
    `floor_settings`: whose `modes:` block the floor takes (sync, or async: then the floor and
    the async arm train with the same settings, and their difference is the pipeline's)."""
    mode = floor_settings if arm == "floor" else ARM_MODE[arm]
    length = (
        f"pipeline.iterations={iterations}" if mode == "sync" else f"pipeline.versions={iterations}"
    )
    cfg = load_config(config, [*overrides, *arm_paths(arm_dir), length], mode=mode)
    if cfg.pipeline.mode != mode:
        raise ConfigError(
            f"bench modes: --set pipeline.mode={cfg.pipeline.mode} would run the {arm} arm in the "
            "wrong mode; leave pipeline.mode out: the bench runs every mode itself"
        )
    return cfg


def _get(cfg: RunConfig, dotted: str) -> Any:
    obj: Any = cfg
    for part in dotted.split("."):
        obj = getattr(obj, part)
    return obj


def check_same_workload(cfgs: dict[str, RunConfig]) -> None:
    """Raise ConfigError naming the first workload key that differs between two arms."""
    (first, base), *rest = cfgs.items()
    for arm, cfg in rest:
        for key in WORKLOAD_KEYS:
            a, b = _get(base, key), _get(cfg, key)
            if a != b:
                raise ConfigError(
                    f"bench modes: {key} differs between the {first} arm ({short_repr(a)}) and the "
                    f"{arm} arm ({short_repr(b)}); the arms must run the same workload, so set it "
                    "outside the config file's modes: block"
                )


def workload(cfg: RunConfig, iterations: int) -> dict[str, Any]:
    return {
        "iterations": iterations,
        "dataset": cfg.task.dataset,
        "prompts_per_iteration": cfg.task.prompts_per_iteration,
        "samples_per_prompt": cfg.rollout.samples_per_prompt,
        "max_new_tokens": cfg.rollout.max_new_tokens,
        "optimizer_steps_per_iteration": cfg.trainer.optimizer.optimizer_steps_per_iteration,
        "model": cfg.model.path
        or f"tiny {cfg.model.tiny.architecture} (seed {cfg.model.tiny.seed})",
    }


# -- the floor -------------------------------------------------------------------------------
def _floor_version(
    i: int,
    cfg: RunConfig,
    ds,
    tokenizer,
    engine,
    trainer,
    state: Path,
    work: Path,
    t: dict[str, float],
) -> tuple[Path, float, float | None]:
    """One version in the floor: generate, score, assemble, train, save, swap. Adds each
    stage's seconds to `t`; returns the new state dir, the reward mean, and the staleness mean
    of the trained samples (None when every group was dropped)."""
    import torch

    from moerl.components.buffer.stage import assemble
    from moerl.components.policy_update.trainer import save_state, train_on_batch
    from moerl.components.reward.stage import reward_metrics, score
    from moerl.components.rollout.stage import to_samples
    from moerl.tasks.prompting import encode_prompt

    model, opt, counters = trainer
    s = time.perf_counter()
    prompts = ds.batch(i, cfg.task.prompts_per_iteration, cfg.task.shuffle_seed)
    ids = [encode_prompt(tokenizer, cfg.rollout, p) for p in prompts]
    completions = engine.generate(ids, cfg.rollout.samples_per_prompt)
    samples = to_samples(prompts, ids, completions, i)
    t["rollout"] += time.perf_counter() - s
    s = time.perf_counter()
    scored = score(samples, cfg.reward)
    reward = reward_metrics(scored)["reward/mean"]
    t["reward"] += time.perf_counter() - s
    s = time.perf_counter()
    batch, _ = assemble(scored, cfg.buffer, trainer_version=i)
    t["buffer"] += time.perf_counter() - s
    s = time.perf_counter()
    torch.manual_seed(cfg.trainer.seed + i)
    if batch:  # an empty batch (every group dropped) still makes the next version, unchanged
        train_on_batch(model, opt, counters, batch, cfg, seed=cfg.trainer.seed + i)
    counters.version += 1
    t["policy_update"] += time.perf_counter() - s
    s = time.perf_counter()
    out = work / f"v{i + 1}"
    save_state(model, opt, counters, state, out)
    t["save_state"] += time.perf_counter() - s
    s = time.perf_counter()
    engine.swap_weights(out)
    t["swap"] += time.perf_counter() - s
    shutil.rmtree(state, ignore_errors=True)
    staleness = sum(i - x.policy_version for x in batch) / len(batch) if batch else None
    return out, reward, staleness


def run_floor(cfg: RunConfig, iterations: int, work: Path) -> dict[str, Any]:
    """The floor arm (in the child process): `iterations` versions, one engine, a hot swap
    after each update. Returns per-stage seconds, rewards and staleness per version."""
    from transformers import AutoTokenizer

    from moerl.components.policy_update.trainer import load_state
    from moerl.components.publish_checkpoint.stage import prepare_initial
    from moerl.components.rollout.engine import RolloutEngine
    from moerl.tasks.dataset import load_dataset

    t0 = time.perf_counter()
    t: dict[str, float] = defaultdict(float)
    # 1. version 0, the trainer's model and optimizer in memory, one engine
    state = prepare_initial(cfg, work / "v0")
    trainer = load_state(state, cfg)
    tokenizer = AutoTokenizer.from_pretrained(state)
    ds = load_dataset(cfg.task.dataset, cfg.task.max_bad_fraction, cfg.checkpoint)
    t["init_policy"] = time.perf_counter() - t0
    engine = RolloutEngine(state, cfg.rollout, seed=cfg.rollout.seed)
    loads = 1
    t["engine_load"] = engine.load_s
    # 2. the versions
    # version_s: when each version was done (Unix seconds)
    rewards, staleness, version_s = (
        [],
        [],
        [],
    )
    try:
        for i in range(iterations):
            state, reward, stale = _floor_version(
                i, cfg, ds, tokenizer, engine, trainer, state, work, t
            )
            rewards.append(reward)
            staleness.append(stale)
            version_s.append(time.time())  # Unix time: the parent measures from its own start
            print(
                f"[moerl] floor version {i + 1}/{iterations} reward/mean={reward:.3f} | "
                + " ".join(f"{k}={v:.1f}s" for k, v in t.items()),
                flush=True,
            )
    finally:
        engine.close()
    return {
        "stage_s": dict(t),
        "rewards": rewards,
        "staleness": staleness,
        "engine_loads": loads,
        "swaps": iterations,
        "inner_s": time.perf_counter() - t0,
        "version_s": version_s,
    }


def _floor_arm(cfg: RunConfig, iterations: int, arm_dir: Path) -> dict[str, Any]:
    """Run the floor in a child process (dies with this one); its progress lines are echoed,
    everything it prints goes to `floor.log` in the arm's directory."""

    def echo(line: str) -> None:
        if line.startswith("[moerl]"):
            print(line, end="", flush=True)

    code, result, log_path = run_child(
        "benchmarks.modes", "floor", cfg, iterations, arm_dir, "floor", on_line=echo
    )
    if code != 0 or not result.is_file():
        raise ArmFailed(f"floor arm exited {code}; last lines of its output:\n{log_tail(log_path)}")
    return json.loads(result.read_text())


# -- reading the arms ------------------------------------------------------------------------
def _mean(xs: Sequence[float]) -> float | None:
    return sum(xs) / len(xs) if xs else None


def time_to_reward(
    rewards: Sequence[float], reward_s: Sequence[float] | None, target: float
) -> float | None:
    """Seconds from the arm's start to the first version whose reward/mean reached `target`."""
    if not reward_s:
        return None
    return next((s for r, s in zip(rewards, reward_s) if r >= target), None)


def arm_result(
    wall_s: float,
    rewards: Sequence[float],
    engine_loads: int | None,
    staleness_mean: float | None,
    busy: dict[str, float],
    reward_s: Sequence[float] | None = None,
    **detail: Any,
) -> dict[str, Any]:
    """One arm's row of the report. `reward_s`: when each reward value was known, in seconds
    from the arm's start."""
    return {
        "ok": True,
        "wall_s": wall_s,
        "reward_s": list(reward_s) if reward_s else None,
        "reward_first": rewards[0] if rewards else None,
        "reward_last3": _mean(rewards[-3:]),
        "rewards": list(rewards),
        "engine_loads": engine_loads,
        "staleness_mean": staleness_mean,
        "busy": busy,
        "idle": {k: 1.0 - v for k, v in busy.items()},
        **detail,
    }


def _history(uri: str, run_id: str, key: str) -> list[float]:
    return [v for _, v in tracking.metric_history(uri, run_id, key)]


def _start(
    reward_s: Sequence[float], engine_load_s: float | None, first_sample_s: float | None = None
) -> dict[str, float | None]:
    """An arm's start: its first trained version (the first reward's time), an engine's load,
    and (async) a rollout worker's first group after its own start."""
    return {
        "first_version_s": reward_s[0] if reward_s else None,
        "engine_load_s": engine_load_s,
        "first_sample_s": first_sample_s,
    }


def _reward_s(uri: str, run_id: str, t0_unix: float) -> list[float]:
    """When each version's reward/mean was logged, in seconds from the arm's start."""
    return [t - t0_unix for t in tracking.metric_times(uri, run_id, "reward/mean")]


def _own_experiment(cfg: RunConfig, arm_dir: Path) -> str:
    """Create the arm's MLflow experiment with its artifacts in `arm_dir` (not ./mlruns)."""
    from mlflow.tracking import MlflowClient

    uri = tracking.resolve_uri(cfg.tracking)
    MlflowClient(uri).create_experiment(
        cfg.tracking.experiment, artifact_location=(arm_dir / "mlartifacts").as_uri()
    )
    return uri


def _sync_arm(cfg: RunConfig, arm_dir: Path) -> dict[str, Any]:
    from mlflow.tracking import MlflowClient

    from moerl.orchestrate.sync_run import run_local

    uri = _own_experiment(cfg, arm_dir)
    t0, t0_unix = time.perf_counter(), time.time()
    summary = run_local(cfg)
    wall = time.perf_counter() - t0
    if not summary.ok:
        raise ArmFailed(
            "sync arm: the pipeline failed; last lines of its log:\n"
            + log_tail(Path(cfg.pipeline.work_dir) / f"{summary.run_id}.log")
        )
    keys = MlflowClient(uri).get_run(summary.run_id).data.metrics
    stages = sorted(
        k
        for k in keys
        if k.startswith("timing/")
        and k.endswith("_s")
        and k.count("/") == 1
        and k != "timing/iteration_s"
    )
    busy = {k[len("timing/") : -2]: sum(_history(uri, summary.run_id, k)) / wall for k in stages}
    stale_max = _history(uri, summary.run_id, "buffer/staleness_max")
    return arm_result(
        wall,
        _history(uri, summary.run_id, "reward/mean"),
        engine_loads=len(_history(uri, summary.run_id, "rollout/engine_load_s")),
        staleness_mean=0.0 if stale_max and max(stale_max) == 0 else None,
        busy=busy,
        reward_s=_reward_s(uri, summary.run_id, t0_unix),
        run_id=summary.run_id,
    )


def _async_arm(cfg: RunConfig, arm_dir: Path) -> dict[str, Any]:
    from mlflow.tracking import MlflowClient

    from moerl.orchestrate.async_run import run_async

    uri = _own_experiment(cfg, arm_dir)
    t0, t0_unix = time.perf_counter(), time.time()
    summary = run_async(cfg)
    wall = time.perf_counter() - t0
    if not summary.ok:
        raise ArmFailed(
            "async arm: the run failed; last lines of the trainer's log:\n"
            + log_tail(Path(cfg.pipeline.work_dir) / summary.run_id / "logs" / "trainer.log")
        )
    last = MlflowClient(uri).get_run(summary.run_id).data.metrics
    busy = async_busy(last)
    counters = {
        k: int(last[f"async/{k}"])
        for k in (
            "generated",
            "trained",
            "filtered",
            "stale_dropped",
            "duplicates",
            "failed",
            "swaps",
        )
        if f"async/{k}" in last
    }
    reward_s = _reward_s(uri, summary.run_id, t0_unix)
    workers = lambda key: [v for k, v in last.items() if k.startswith(key)]  # noqa: E731
    start = _start(
        reward_s,
        max(workers("async/engine_load_s/"), default=None),
        min(workers("async/first_sample_s/"), default=None),
    )
    return arm_result(
        wall,
        _history(uri, summary.run_id, "reward/mean"),
        engine_loads=int(last["async/engine_loads"]),
        staleness_mean=_mean(_history(uri, summary.run_id, "buffer/staleness_mean")),
        busy=busy,
        reward_s=reward_s,
        run_id=summary.run_id,
        counters=counters,
        start=start,
    )


def _run_arm(arm: str, cfg: RunConfig, iterations: int, arm_dir: Path) -> dict[str, Any]:
    if arm == "floor":
        t0, t0_unix = time.perf_counter(), time.time()
        res = _floor_arm(cfg, iterations, arm_dir)
        wall = time.perf_counter() - t0
        busy = {k: v / wall for k, v in res["stage_s"].items()}
        # None: nothing trained in that version
        stale = [s for s in res["staleness"] if s is not None]
        reward_s = [u - t0_unix for u in res.get("version_s", [])]
        start = _start(reward_s, res["stage_s"].get("engine_load"))
        return arm_result(
            wall,
            res["rewards"],
            res["engine_loads"],
            _mean(stale),
            busy,
            reward_s=reward_s,
            swaps=res["swaps"],
            inner_s=res["inner_s"],
            start=start,
        )
    return _sync_arm(cfg, arm_dir) if arm == "sync" else _async_arm(cfg, arm_dir)


# -- the report ------------------------------------------------------------------------------
def ratios(arms: dict[str, dict[str, Any]]) -> dict[str, float | None]:
    """Wall-time multiples between the arms that finished; None where either did not run."""

    def q(a: str, b: str) -> float | None:
        ra, rb = arms.get(a), arms.get(b)
        if not (ra and rb and ra.get("ok") and rb.get("ok")):
            return None
        return ra["wall_s"] / rb["wall_s"]

    return {name: q(a, b) for name, (a, b) in RATIOS.items()}


def format_report(report: dict[str, Any]) -> str:
    arms, floor = report["arms"], report["arms"].get("floor", {})
    target = report.get("reward_target", 0.8)
    rows = []
    for name, r in arms.items():
        x_floor = r["wall_s"] / floor["wall_s"] if r.get("ok") and floor.get("ok") else None
        t, tf = r.get("time_to_reward"), floor.get("time_to_reward")
        rows.append(
            [
                name,
                r["ok"],
                r.get("wall_s"),
                x_floor,
                r.get("reward_first"),
                r.get("reward_last3"),
                t,
                t / tf if t is not None and tf else None,
                r.get("engine_loads"),
                r.get("staleness_mean"),
            ]
        )
    lines = [
        format_table(
            [
                "arm",
                "ok",
                "wall s",
                "x floor",
                "reward first",
                "reward last3",
                f"s to {target:g}",
                "x floor",
                "engine loads",
                "staleness",
            ],
            rows,
        ),
        "",
    ]
    for name, r in arms.items():
        if r.get("ok"):
            lines.append(
                f"{name} busy (idle = 1 - busy): "
                + ", ".join(f"{k} {v:.2f}" for k, v in r["busy"].items())
            )
        else:
            # an arm's own error ends its output
            last = (r.get("error") or "").strip().splitlines()[-1:]
            lines.append(f"{name} FAILED: {last[0] if last else 'unknown'}")
    for name, r in arms.items():  # the start: the first trained version against an engine's load
        st = r.get("start") or {}
        if r.get("ok") and st.get("first_version_s") is not None:
            f = lambda v: f"{v:.1f} s" if v is not None else "-"  # noqa: E731
            lines.append(
                f"{name} start: first trained version at {f(st['first_version_s'])}, engine load "
                f"{f(st.get('engine_load_s'))}"
                + (
                    f", a worker's first group {f(st['first_sample_s'])} after its start"
                    if st.get("first_sample_s") is not None
                    else ""
                )
            )
    shown = {k: f"{v:.2f}x" if v is not None else "-" for k, v in report["ratios"].items()}
    lines.append(
        f"sync/async (async speedup) {shown['sync_over_async']}; sync/floor {shown['sync_over_floor']}; "
        f"async/floor {shown['async_over_floor']}  (wall-time multiples)"
    )
    if report.get("machine"):  # reports written before the machine record have none
        lines.append(machine_line(report["machine"]))
    return "\n".join(lines)


def run_bench_modes(
    config: str | Path,
    overrides: Sequence[str] = (),
    iterations: int = 10,
    out: str | Path = "bench/modes.json",
    arms: str | Sequence[str] = ARMS,
    work_dir: str | Path | None = None,
    reward_target: float = 0.8,
    floor_settings: Literal["sync", "async"] = "sync",
) -> dict[str, Any]:
    """Run `arms` on the same workload, one after another; write the report to `out` and
    print its table. Returns the report; `report["ok"]` is False when any arm failed (the
    others still run). `work_dir` keeps every arm's directory there; default: a temporary
    directory, removed afterwards.

    Args:
        config: the workload's run config (YAML)
        overrides: config overrides KEY=VALUE (repeatable)
        iterations: versions per arm (sync iterations = async versions)
        out: the report (JSON)
        arms: comma-separated: floor, sync, async
        work_dir: keep each arm's files here (default: a temp dir, deleted)
        reward_target: report each arm's seconds to the first version whose reward/mean reaches
            this
        floor_settings: whose modes: settings the floor trains with (async: the same as the
            async arm's, a like-for-like time to the target)
    """
    arms = parse_arms(arms)
    if iterations < 1:
        raise ConfigError(f"bench modes: --iterations must be >= 1, got {iterations}")
    if floor_settings not in ("sync", "async"):
        raise ConfigError(
            f"bench modes: --floor-settings must be sync or async, got {floor_settings!r}"
        )
    if not 0.0 < reward_target <= 1.0:
        raise ConfigError(f"bench modes: --reward-target must be in (0, 1], got {reward_target}")
    with tempfile.TemporaryDirectory(prefix="moerl-bench-modes-") as tmp:
        root = Path(work_dir) if work_dir is not None else Path(tmp)
        # 1. every arm's config, each in its own fresh directory; the same workload or an error
        dirs = {a: Path(tempfile.mkdtemp(prefix=f"{a}-", dir=_mkdir(root))) for a in arms}
        cfgs = {
            a: arm_config(config, overrides, a, iterations, dirs[a], floor_settings) for a in arms
        }
        check_same_workload(cfgs)
        if any(c.reward.kind != "rules" for c in cfgs.values()):
            raise ConfigError(
                "bench modes: reward.kind must be rules (the arms run in fresh stores, where no reward "
                "model is registered); compare reward-model runs with `moerl run`"
            )
        # 2. the arms, one after another; a failed arm is recorded and the rest still run
        results: dict[str, dict[str, Any]] = {}
        with progress(len(arms), "bench modes", unit="arm") as bar:
            for n, arm in enumerate(arms, 1):
                print(
                    f"[moerl] bench modes: arm {arm} ({n}/{len(arms)}), {iterations} versions, in {dirs[arm]}",
                    flush=True,
                )
                try:
                    results[arm] = _run_arm(arm, cfgs[arm], iterations, dirs[arm])
                except Exception as err:  # noqa: BLE001 - one arm's failure is reported; the others still run
                    if not isinstance(err, MoerlError):  # a bug: keep its traceback
                        traceback.print_exc()
                    results[arm] = {
                        "ok": False,
                        "error": tracking.redact(f"{type(err).__name__}: {err}"),
                    }
                if results[arm]["ok"]:
                    results[arm]["time_to_reward"] = time_to_reward(
                        results[arm]["rewards"], results[arm]["reward_s"], reward_target
                    )
                bar.advance(1, f"{arm} {'done' if results[arm]['ok'] else 'FAILED'}")
    # 3. the report
    first = cfgs[arms[0]]
    report = {
        "bench": "modes",
        "schema": 1,
        "config": str(config),
        "overrides": list(overrides),
        "arms_run": list(arms),
        "workload": workload(first, iterations),
        "arms": results,
        "ratios": ratios(results),
        "reward_target": reward_target,
        "floor_settings": floor_settings,
        "ok": all(r["ok"] for r in results.values()),
        "configs": {a: {k: tracking.redact(v) for k, v in flatten(cfgs[a]).items()} for a in arms},
        "versions": provenance.collect(),
        "machine": machine_record(),
    }
    write_report(Path(out), report)
    print(format_report(report))
    print(f"wrote {out}")
    return report


def _mkdir(p: Path) -> Path:
    p.mkdir(parents=True, exist_ok=True)
    return p


def main(argv: list[str] | None = None) -> int:
    """`python -m benchmarks.modes floor ...`: the floor arm, as `run_bench_modes` starts it."""
    return child_main(
        argv, "benchmarks.modes", "floor", "the floor arm of `moerl bench modes`", run_floor
    )


if __name__ == "__main__":
    sys.exit(main())
