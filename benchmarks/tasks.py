"""`moerl bench tasks`: what running verifiers and environments outside the stage costs, side by
side in one run, and what environments cost a multi-turn rollout.

Design, details and limitations: docs/bench-reports/tasks.md#how-it-works-benchmarkstaskspy.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from benchmarks import envelope, write_report
from benchmarks.stats import percentile

STREAM, GROUP = "moerl-bench:req", "env-workers"


def _timed(fn: Callable[[], Any], n: int) -> list[float]:
    out = []
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return out


def _row(name: str, lat: list[float], base: float | None) -> dict[str, Any]:
    p50, p99 = percentile(lat, 50) * 1e3, percentile(lat, 99) * 1e3
    return {
        "path": name,
        "calls": len(lat),
        "p50_ms": p50,
        "p99_ms": p99,
        "p50_vs_in_process": p50 / (base * 1e3) if base else 1.0,
    }


def serve(url: str, reply_prefix: str) -> None:
    """The Valkey-side worker: answer requests until a request says stop."""
    import valkey

    from moerl.tasks.sandbox import resolve

    r = valkey.Valkey.from_url(url, decode_responses=True)
    try:
        r.xgroup_create(STREAM, GROUP, id="0", mkstream=True)
    except valkey.ResponseError:
        pass
    cache: dict[str, Any] = {}
    while True:
        # valkey-py types every reply Awaitable | Any, the async client's and the sync one's
        got: Any = r.xreadgroup(GROUP, "w0", {STREAM: ">"}, count=1, block=5000)
        for _, entries in got or []:
            for eid, fields in entries:
                req = json.loads(fields["req"])
                if req.get("stop"):
                    r.xack(STREAM, GROUP, eid)
                    return
                fn = cache.get(req["target"]) or cache.setdefault(
                    req["target"], resolve(req["target"])
                )
                r.xadd(
                    reply_prefix + req["client"],
                    {"rep": json.dumps({"id": req["id"], "ok": fn(*req["args"])})},
                )
                r.xack(STREAM, GROUP, eid)


def _valkey_latencies(call: tuple[str, list], n: int) -> list[float]:
    import valkey

    from moerl.bus import EmbeddedValkey

    with tempfile.TemporaryDirectory(prefix="moerl-bench-valkey-") as tmp:
        server = EmbeddedValkey(Path(tmp), appendonly=False).start()
        worker = None
        try:
            prefix = "moerl-bench:rep:"
            worker = subprocess.Popen(
                [sys.executable, "-m", "benchmarks.tasks", "serve", server.url, prefix]
            )
            r = valkey.Valkey.from_url(server.url, decode_responses=True)
            last = "0"

            def rt(i: int) -> None:
                nonlocal last
                r.xadd(
                    STREAM,
                    {
                        "req": json.dumps(
                            {"id": i, "client": "c0", "target": call[0], "args": call[1]}
                        )
                    },
                )
                while True:
                    got: Any = r.xread({prefix + "c0": last}, count=1, block=30000)  # see serve
                    if not got:
                        raise RuntimeError("the Valkey env worker did not answer within 30 s")
                    last, fields = got[0][1][0]
                    if json.loads(fields["rep"])["id"] == i:
                        return

            for i in range(5):  # warm: the worker's imports, the connection
                rt(-1 - i)
            lat = []
            for i in range(n):
                t0 = time.perf_counter()
                rt(i)
                lat.append(time.perf_counter() - t0)
            r.xadd(STREAM, {"req": json.dumps({"stop": True})})
            worker.wait(timeout=30)
            return lat
        finally:
            if worker is not None and worker.poll() is None:
                worker.kill()
                worker.wait()
            server.stop()


def bench_calls(n: int) -> dict[str, Any]:
    from moerl.tasks.environments import RESET, STEP
    from moerl.tasks.sandbox import Limits, SandboxPool
    from moerl.tasks.tools import Lookup
    from moerl.tasks.verifiers import CALL_VERIFIER, call_verifier

    v_target = "moerl.tasks.verifiers:positional"
    v_args: list[Any] = [v_target, "48213", "48213", None]  # call_verifier's, as a sandbox call
    row = {
        "id": "b0",
        "task": "lookup",
        "prompt": "do 482=",
        "answer": "935",
        "meta": {"key": "482", "value": "935"},
    }
    rows: list[dict[str, Any]] = []
    base = statistics.median(_timed(lambda: call_verifier(*v_args), n))
    rows.append(_row("verifier in-process", _timed(lambda: call_verifier(*v_args), n), base))
    env = Lookup()
    env.reset(row)

    def env_step() -> tuple[str | None, float | None, bool]:  # a reset and the first query
        env.reset(row)
        return env.step("482")

    env_base = statistics.median(_timed(env_step, n))
    rows.append(_row("env step in-process", _timed(env_step, n), env_base))
    with SandboxPool(Limits(timeout_s=30.0, workers=1)) as pool:
        pool.run([(CALL_VERIFIER, v_args)])  # the child's start and imports
        rows.append(
            _row("verifier pool", _timed(lambda: pool.run([(CALL_VERIFIER, v_args)]), n), base)
        )
        pool.run([(RESET, ["moerl.tasks.tools:Lookup", "k", row])], keys=["k"])
        # a reset and a query per call, as in-process (the query is the episode's first step)
        rows.append(
            _row(
                "env step pool",
                _timed(
                    lambda: pool.run(
                        [(RESET, ["moerl.tasks.tools:Lookup", "k", row]), (STEP, ["k", "482"])],
                        keys=["k", "k"],
                    ),
                    n,
                ),
                env_base,
            )
        )
    rows.append(_row("verifier valkey", _valkey_latencies((CALL_VERIFIER, v_args), n), base))
    cores = _cores()
    through = [
        pool_throughput(workers, n * 4, isolation)
        for isolation in ("namespaces", "none")
        for workers in (1, 2)
    ]
    in_proc_rate = 1.0 / base
    return {
        "latency": rows,
        "throughput": through,
        "in_process_calls_per_s": in_proc_rate,
        "cores": cores,
    }


def _cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def pool_throughput(workers: int, calls: int, isolation: str = "namespaces") -> dict[str, Any]:
    """Verifier calls per second through a pool of `workers` (each call a fresh process forked
    from the pool's template, in namespaces of its own with `namespaces`)."""
    from moerl.tasks.sandbox import Limits, SandboxPool
    from moerl.tasks.verifiers import CALL_VERIFIER

    v = (CALL_VERIFIER, ["moerl.tasks.verifiers:positional", "482", "482", None])
    with SandboxPool(Limits(timeout_s=30.0, workers=workers, isolation=isolation)) as pool:
        pool.run([v] * workers)  # the template's start and imports
        t0 = time.perf_counter()
        got = pool.run([v] * calls)
        s = time.perf_counter() - t0
    assert all(o.value == 1.0 for o in got), [o for o in got if not o.ok][:3]
    return {
        "isolation": isolation,
        "workers": workers,
        "calls_per_s": calls / s,
        "calls_per_s_per_core": calls / s / min(workers, _cores()),
    }


def bench_rollout(prompts: int, work: Path) -> dict[str, Any]:
    from transformers import AutoTokenizer

    from moerl.components.rollout.engine import RolloutEngine
    from moerl.components.rollout.episodes import EpisodeDriver, env_pool, run_episodes
    from moerl.config import load_config
    from moerl.models.tiny import build_tiny_model
    from moerl.tasks.dataset import load_dataset
    from moerl.tasks.prompting import encode_prompt

    cfg = load_config(Path(__file__).resolve().parents[2] / "configs" / "tiny-moe-lookup.yaml")
    model_dir = build_tiny_model(cfg.model.tiny, work / "model")
    tok = AutoTokenizer.from_pretrained(model_dir)
    engine = RolloutEngine(model_dir, cfg.rollout)
    try:
        rows = load_dataset(cfg.task.dataset, 0.0, cfg.checkpoint).batch(0, prompts, 0)
        G = cfg.rollout.samples_per_prompt
        with env_pool(cfg) as pool:
            engine.generate([encode_prompt(tok, cfg.rollout, r) for r in rows[:4]], G)  # warm
            # single-turn: the same prompts, one generate call (what the rollout costs with no environment)
            t0 = time.perf_counter()
            engine.generate([encode_prompt(tok, cfg.rollout, r) for r in rows], G)
            single_s = time.perf_counter() - t0
            d = EpisodeDriver(cfg, tok, pool)
            eps = [
                d.episode(f"b{i}-{j}", r.model_dump(), encode_prompt(tok, cfg.rollout, r), j, False)
                for i, r in enumerate(rows)
                for j in range(G)
            ]
            t0 = time.perf_counter()
            gen_s = run_episodes(engine, d, eps)
            total = time.perf_counter() - t0
    finally:
        engine.close()
    ends = sorted(e.ended_s for e in eps if e.ended_s is not None)
    return {
        "episodes": len(eps),
        "turns_mean": sum(e.turns for e in eps) / len(eps),
        "rollout_s": total,
        "generate_s": gen_s,
        "env_s": d.env_s,
        "env_share": d.env_s / total,
        "env_calls": d.calls,
        "single_turn_generate_s": single_s,
        "tail_last_episode_s": ends[-1],
        "tail_median_episode_s": statistics.median(ends),
        "tail_last_vs_median": ends[-1] / statistics.median(ends),
    }


def run_bench_tasks(
    n: int = 300, engine: bool = False, prompts: int = 64, out: Path = Path("bench/tasks.json")
) -> dict[str, Any]:
    """The verifier / environment call paths, and with `engine` a multi-turn rollout; the
    report (also written to `out`).

    Args:
        n: calls per latency row
        engine: also the lookup task's episodes on the tiny engine
        prompts: prompts of the multi-turn rollout (x G episodes)
        out: the report (JSON)
    """
    calls = bench_calls(n)
    rep: dict[str, Any] = {"calls": calls}
    if engine:
        with tempfile.TemporaryDirectory(prefix="moerl-bench-tasks-") as tmp:
            rep["rollout"] = bench_rollout(prompts, Path(tmp))
    report = envelope("tasks", True, **rep)
    write_report(out, report)
    print(f"{'path':24} {'p50 ms':>8} {'p99 ms':>8} {'p50 / in-process':>17}")
    for r in calls["latency"]:
        print(
            f"{r['path']:24} {r['p50_ms']:8.3f} {r['p99_ms']:8.3f} {r['p50_vs_in_process']:17.1f}"
        )
    for t in calls["throughput"]:
        print(
            f"pool ({t.get('isolation', 'namespaces')}), {t['workers']} worker(s): {t['calls_per_s']:.0f} calls/s, {t['calls_per_s_per_core']:.0f} per core "
            f"(in-process: {calls['in_process_calls_per_s']:.0f} calls/s)"
        )
    if engine:
        ro = rep["rollout"]
        print(
            f"rollout: {ro['episodes']} episodes, {ro['turns_mean']:.1f} turns, {ro['rollout_s']:.2f} s "
            f"(generate {ro['generate_s']:.2f} s, environments {ro['env_s']:.2f} s = {ro['env_share']:.1%}; "
            f"one single-turn generate of the same prompts {ro['single_turn_generate_s']:.2f} s); "
            f"tail: last episode at {ro['tail_last_episode_s']:.2f} s, median {ro['tail_median_episode_s']:.2f} s "
            f"(x{ro['tail_last_vs_median']:.2f})"
        )
    print(f"report: {out}")
    return report


if __name__ == "__main__":
    if len(sys.argv) == 4 and sys.argv[1] == "serve":
        serve(sys.argv[2], sys.argv[3])
    if len(sys.argv) == 3 and sys.argv[1] == "throughput":  # whichever moerl is importable
        import moerl

        print(moerl.__file__)
        for iso in ("namespaces", "none"):
            for w in (1, 2, 4):
                print(json.dumps(pool_throughput(w, int(sys.argv[2]), iso)), flush=True)
