"""`moerl bench suite CONFIG`: the declared workload, measured stage by stage, repeated.

Design, details and limitations: docs/bench-reports/suite.md#how-it-works-benchmarkssuitepy.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Literal

from benchmarks import child_main, format_table, log_tail, run_child, write_report
from benchmarks.machine import machine_line, machine_record
from benchmarks.stats import distribution, summarize
from moerl import provenance, tracking
from moerl.config import RunConfig, flatten, load_config
from moerl.errors import ConfigError, MoerlError

log = logging.getLogger(__name__)

STAGES = ("rollout", "reward", "buffer", "policy_update", "publication", "redistribution")
PROGRESS_PREFIX = "[moerl-suite] version"
STORES = ("s3", "local", "config")


class RepeatFailed(MoerlError):
    """A repeat's child process failed; the message carries its last output lines."""


# -- one repeat (in the child process) --------------------------------------------------------
def run_repeat(cfg: RunConfig, iterations: int, work: Path) -> dict[str, Any]:
    """`iterations` versions from a fresh version 0, every stage timed; see the module doc."""
    import shutil

    import torch
    from transformers import AutoTokenizer

    from benchmarks import netio
    from benchmarks.imbalance import expert_loads, imbalance
    from moerl.components.buffer.stage import assemble
    from moerl.components.policy_update.trainer import load_state, save_state, train_on_batch
    from moerl.components.publish_checkpoint.stage import prepare_initial, run_publish
    from moerl.components.reward.stage import reward_metrics, score
    from moerl.components.rollout.engine import RolloutEngine
    from moerl.components.rollout.stage import to_samples
    from moerl.store.runs import fetch_for_engine
    from moerl.tasks.dataset import load_dataset
    from moerl.tasks.prompting import encode_prompt

    run_id = f"suite-{uuid.uuid4().hex[:12]}"
    state = prepare_initial(cfg, work / "v0")
    model, opt, counters = load_state(state, cfg)
    tokenizer = AutoTokenizer.from_pretrained(state)
    pad = model.config.pad_token_id or 0
    ds = load_dataset(cfg.task.dataset, cfg.task.max_bad_fraction, cfg.checkpoint)
    run_publish(cfg, run_id, state, 0)
    engine = RolloutEngine(
        fetch_for_engine(cfg.checkpoint, run_id, 0),
        cfg.rollout,
        seed=cfg.rollout.seed,
        log_stats=True,
    )
    versions, requests = [], []
    loop_t0 = time.perf_counter()
    try:
        for i in range(iterations):
            t: dict[str, float] = {}
            v: dict[str, Any] = {"version": i}
            # rollout
            s = time.perf_counter()
            prompts = ds.batch(i, cfg.task.prompts_per_iteration, cfg.task.shuffle_seed)
            ids = [encode_prompt(tokenizer, cfg.rollout, p) for p in prompts]
            completions, timings = engine.generate_measured(ids, cfg.rollout.samples_per_prompt)
            samples = to_samples(prompts, ids, completions, i)
            t["rollout"] = time.perf_counter() - s
            counted = [len(c.token_ids) for comps in completions for c in comps]
            v.update(
                prompts=len(prompts),
                trajectories=len(samples),
                output_tokens=sum(counted),
                engine_generation_tokens=sum(x.generation_tokens for x in timings),
                tokens_match=counted == [x.generation_tokens for x in timings],
                prompt_lens=[len(x) for x in ids],
                response_lens=counted,
            )
            requests += [
                {"ttft_s": x.ttft_s, "tpot_s": x.tpot_s, "e2e_s": x.e2e_s} for x in timings
            ]
            # reward (the verifier)
            s = time.perf_counter()
            scored = score(samples, cfg.reward)
            v["reward_mean"] = reward_metrics(scored)["reward/mean"]
            t["reward"] = time.perf_counter() - s
            # buffer
            s = time.perf_counter()
            batch, _ = assemble(scored, cfg.buffer, trainer_version=i)
            t["buffer"] = time.perf_counter() - s
            v["trained_samples"] = len(batch)
            # expert loads (not timed as a stage): rollout tokens, then the batch's
            rollout_counts = expert_loads(
                model,
                [pid + c.token_ids for pid, comps in zip(ids, completions) for c in comps],
                pad,
            )
            train_counts = expert_loads(
                model, [x.prompt_token_ids + x.response_token_ids for x in batch], pad
            )
            v["imbalance"] = {
                "rollout": imbalance(rollout_counts),
                "train": imbalance(train_counts),
            }
            v["expert_tokens"] = {
                "rollout": int(rollout_counts.sum()),
                "train": int(train_counts.sum()),
            }
            # policy update
            s = time.perf_counter()
            torch.manual_seed(cfg.trainer.seed + i)
            if batch:
                train_on_batch(model, opt, counters, batch, cfg, seed=cfg.trainer.seed + i)
            counters.version += 1
            t["policy_update"] = time.perf_counter() - s
            v["train_tokens"] = sum(len(x.response_token_ids) for x in batch)
            # publication
            s, net0 = time.perf_counter(), netio.snapshot()
            out = work / f"v{i + 1}"
            save_state(model, opt, counters, state, out)
            _, pub = run_publish(cfg, run_id, out, i + 1)
            t["publication"] = time.perf_counter() - s
            v["net_publication"] = netio.delta(net0, netio.snapshot())
            v["publish_bytes"] = int(pub["weights/publish_mb"] * 1e6)
            shutil.rmtree(state, ignore_errors=True)
            state = out
            # redistribution: verified fetch into the node cache + hot swap
            s, net0 = time.perf_counter(), netio.snapshot()
            path = fetch_for_engine(cfg.checkpoint, run_id, i + 1)
            v["fetch_bytes"] = sum(f.stat().st_size for f in path.rglob("*") if f.is_file())
            engine.swap_weights(path)
            t["redistribution"] = time.perf_counter() - s
            v["net_redistribution"] = netio.delta(net0, netio.snapshot())
            v["stage_s"] = t
            versions.append(v)
            print(
                f"{PROGRESS_PREFIX} {i + 1}/{iterations} reward/mean={v['reward_mean']:.3f} "
                + " ".join(f"{k}={x:.1f}s" for k, x in t.items()),
                flush=True,
            )
    finally:
        engine.close()
    return {
        "versions": versions,
        "requests": requests,
        "loop_s": time.perf_counter() - loop_t0,
        "engine_load_s": engine.load_s,
        "params": _param_counts(model),
        "shape": _shape(model),
    }


def _shape(model) -> dict[str, Any]:
    """The policy's MoE dimensions, from its own config (the tiny one or `model.path`'s)."""
    from moerl.models.families import family_of

    return family_of(model.config).shape(model.config)


def _param_counts(model) -> dict[str, int]:
    """Total parameters, routed-expert parameters, and those active per token (everything but
    the experts, plus top-k / experts of them)."""
    from moerl.components.policy_update.ep_moe import sparse_blocks

    total = sum(p.numel() for p in model.parameters())
    experts = sum(p.numel() for _, _, b in sparse_blocks(model) for p in b.experts.parameters())
    from moerl.models.families import family_of

    c = model.config
    e = family_of(c).num_experts(c)
    k = c.num_experts_per_tok
    return {
        "total": total,
        "experts": experts,
        "active_per_token": total - experts + experts * k // e,
    }


# -- the parent: repeats, aggregation, report ----------------------------------------------------
def suite_config(
    config: str | Path,
    overrides: Sequence[str],
    repeat_dir: Path,
    store: str,
    store_uri: str | None = None,
    endpoint_url: str | None = None,
) -> RunConfig:
    """The config of one repeat: the file with `overrides` and its store: `s3` (`store_uri` at
    `endpoint_url`), `local` (a directory in `repeat_dir`) or `config` (the config's own
    checkpoint store and cache, e.g. the run bucket on EKS; each repeat is its own run id)."""
    own = {
        "s3": [f"checkpoint.uri={store_uri}", f"checkpoint.endpoint_url={endpoint_url}"],
        "local": [f"checkpoint.uri={repeat_dir / 'checkpoints'}"],
        "config": [],
    }[store]
    if store != "config":
        own.append(f"checkpoint.cache_dir={repeat_dir / 'cache'}")
    cfg = load_config(config, [*overrides, *own, "model.warm_start=none"], mode="sync")
    if cfg.reward.kind != "rules":
        raise ConfigError(
            "bench suite: reward.kind must be rules (each repeat starts from a fresh store, where no "
            f"reward model is registered); got {cfg.reward.kind}"
        )
    if cfg.trainer.parallelism.expert_parallel_size != 1:
        raise ConfigError(
            "bench suite: trainer.parallelism.expert_parallel_size must be 1 (the suite trains in one process; "
            "the dispatcher comparison measures expert-parallel traffic)"
        )
    return cfg


def _repeat(
    cfg: RunConfig, iterations: int, rdir: Path, bar, env_extra: dict[str, str]
) -> dict[str, Any]:
    def progress_line(line: str) -> None:
        if line.startswith(PROGRESS_PREFIX):
            bar.advance(
                1,
                f"repeat {rdir.name.rsplit('-', 1)[-1]}, "
                + line[len(PROGRESS_PREFIX) :].split()[1],
            )

    t0 = time.perf_counter()
    code, result, log_path = run_child(
        "benchmarks.suite", "repeat", cfg, iterations, rdir, "repeat", env_extra, progress_line
    )
    if code != 0 or not result.is_file():
        raise RepeatFailed(
            f"bench suite: a repeat exited {code}; last lines of its output:\n{log_tail(log_path)}"
        )
    res = json.loads(result.read_text())
    res["wall_s"] = time.perf_counter() - t0
    return res


def _accelerators() -> dict[str, Any]:
    try:
        import torch

        gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    except ImportError:
        gpus = 0
    cores = len(os.sched_getaffinity(0))
    return {
        "kind": "gpu" if gpus else "cpu-core",
        "count": gpus or cores,
        "gpus": gpus,
        "cores": cores,
    }


def aggregate(repeats: list[dict[str, Any]], accel: dict[str, Any]) -> dict[str, Any]:
    """Per-repeat figures, then mean/std/CI across repeats; pooled distributions."""
    per: dict[str, list[float]] = {
        k: []
        for k in (
            "output_tokens_per_s",
            "trajectories_per_s_generation",
            "trajectories_per_s_loop",
            "versions_per_hour",
            "output_tokens_per_s_per_accelerator",
            "ttft_p50_s",
            "tpot_p50_s",
            "e2e_p50_s",
            "imbalance_rollout",
            "imbalance_train",
            "reward_last",
        )
    }
    stage_all: dict[str, list[float]] = {s: [] for s in STAGES}
    stage_mean: dict[str, list[float]] = {s: [] for s in STAGES}
    reqs: list[dict[str, Any]] = []
    over_time: dict[str, list[list[dict[str, Any]]]] = {"rollout": [], "train": []}  # per repeat
    for r in repeats:
        vs = r["versions"]
        rollout_s = sum(v["stage_s"]["rollout"] for v in vs)
        toks, trajs = sum(v["output_tokens"] for v in vs), sum(v["trajectories"] for v in vs)
        per["output_tokens_per_s"].append(toks / rollout_s)
        per["output_tokens_per_s_per_accelerator"].append(toks / rollout_s / accel["count"])
        per["trajectories_per_s_generation"].append(trajs / rollout_s)
        per["trajectories_per_s_loop"].append(trajs / r["loop_s"])
        per["versions_per_hour"].append(3600 * len(vs) / r["loop_s"])
        for key, field in (
            ("ttft_p50_s", "ttft_s"),
            ("tpot_p50_s", "tpot_s"),
            ("e2e_p50_s", "e2e_s"),
        ):
            xs = [q[field] for q in r["requests"] if q[field] is not None]
            if xs:
                per[key].append(distribution(xs)["p50"])
        for side in ("rollout", "train"):
            per_version = [max(v["imbalance"][side]) for v in vs]
            per[f"imbalance_{side}"].append(sum(per_version) / len(per_version))
            over_time[side].append(
                [
                    {
                        "version": v["version"],
                        "max_over_mean_max_layer": max(v["imbalance"][side]),
                        "max_over_mean_mean_layer": sum(v["imbalance"][side])
                        / len(v["imbalance"][side]),
                        "per_layer": v["imbalance"][side],
                    }
                    for v in vs
                ]
            )
        per["reward_last"].append(vs[-1]["reward_mean"])
        for s in STAGES:
            xs = [v["stage_s"][s] for v in vs]
            stage_all[s] += xs
            stage_mean[s].append(sum(xs) / len(xs))
        reqs += r["requests"]
    headline = {k: summarize(v) for k, v in per.items() if v}
    latency = {
        f: distribution([q[f] for q in reqs if q[f] is not None])
        for f in ("ttft_s", "tpot_s", "e2e_s")
    }
    stages = {
        s: {**distribution(stage_all[s]), "per_repeat_mean": summarize(stage_mean[s])}
        for s in STAGES
    }
    stages["reward_model"] = {
        "n": 0,
        "why": "reward.kind is rules: no reward model in this workload",
    }
    net = _network(repeats)
    imbalance = {
        side: {"max_over_mean": headline[f"imbalance_{side}"], "over_time": over_time[side]}
        for side in ("rollout", "train")
    }
    return {
        "headline": headline,
        "latency": latency,
        "stages": stages,
        "imbalance": imbalance,
        "network": net,
    }


def _network(repeats: list[dict[str, Any]]) -> dict[str, Any]:
    pub = [v["publish_bytes"] for r in repeats for v in r["versions"]]
    fetch = [v["fetch_bytes"] for r in repeats for v in r["versions"]]
    out: dict[str, Any] = {
        "publish_bytes_per_version": summarize(pub),
        "fetch_bytes_per_version": summarize(fetch),
        "dispatch_combine_bytes": "see dispatchers (the suite's trainer runs EP = 1)",
    }
    for window in ("publication", "redistribution"):
        ds = [v[f"net_{window}"] for r in repeats for v in r["versions"]]
        out[f"counters_{window}"] = {
            "source": ds[0]["source"],
            "tx_bytes": summarize([d["tx_bytes"] for d in ds]),
            "rx_bytes": summarize([d["rx_bytes"] for d in ds]),
            "tx_mb_s": summarize([d["tx_mb_s"] for d in ds]),
        }
    return out


def disclosure(cfg: RunConfig, repeats: list[dict[str, Any]], iterations: int) -> dict[str, Any]:
    prompt_lens = [x for r in repeats for v in r["versions"] for x in v["prompt_lens"]]
    resp_lens = [x for r in repeats for v in r["versions"] for x in v["response_lens"]]
    return {
        "model": {
            "path": cfg.model.path or f"tiny (seed {cfg.model.tiny.seed})",
            **repeats[0]["shape"],
            "dtype": cfg.model.dtype,
            "serving_dtype": cfg.rollout.resolved.dtype,
            "rollout_tensor_parallel": cfg.rollout.tensor_parallel_size,
            "params": repeats[0]["params"],
        },
        "batch": {
            "prompts_per_version": cfg.task.prompts_per_iteration,
            "samples_per_prompt": cfg.rollout.samples_per_prompt,
            "max_new_tokens": cfg.rollout.max_new_tokens,
            "optimizer_steps_per_version": cfg.trainer.optimizer.optimizer_steps_per_iteration,
            "micro_batch_tokens": cfg.trainer.parallelism.micro_batch_tokens,
            "versions_per_repeat": iterations,
            "max_num_seqs": cfg.rollout.max_num_seqs,
        },
        "lengths": {
            "prompt_tokens": distribution(prompt_lens),
            "response_tokens": distribution(resp_lens),
        },
        "parallelism": {
            "trainer_ep": cfg.trainer.parallelism.expert_parallel_size,
            "rollout_ep": cfg.rollout.enable_expert_parallel,
            "dispatcher_backend": cfg.trainer.parallelism.ep_backend,
            "rollout_all2all_backend": cfg.rollout.all2all_backend,
            "baseline_collective": "gloo all_to_all over loopback (CPU); NCCL on GPU",
        },
        "store": cfg.checkpoint.uri,
        "dataset": cfg.task.dataset,
        "reward": cfg.reward.kind,
    }


def checks(
    report: dict[str, Any], repeats: list[dict[str, Any]], cfg: RunConfig
) -> dict[str, bool]:
    versions = [v for r in repeats for v in r["versions"]]
    want = cfg.task.prompts_per_iteration * cfg.rollout.samples_per_prompt
    cis = []

    def walk(x: Any) -> None:
        if isinstance(x, dict):
            if "ci95" in x and "mean" in x:
                cis.append(x["ci95"][0] - 1e-12 <= x["mean"] <= x["ci95"][1] + 1e-12)
            for y in x.values():
                walk(y)
        elif isinstance(x, list):
            for y in x:
                walk(y)

    walk(report["results"])
    return {
        "tokens_counted_equal_tokens_generated": all(
            v["tokens_match"] and v["output_tokens"] == v["engine_generation_tokens"]
            for v in versions
        ),
        "every_version_has_all_trajectories": all(v["trajectories"] == want for v in versions),
        "every_ci_contains_its_mean": bool(cis) and all(cis),
        "stages_within_loop_time": all(
            sum(sum(v["stage_s"].values()) for v in r["versions"]) <= r["loop_s"] + 1e-6
            for r in repeats
        ),
        "requests_equal_trajectories": all(
            len(r["requests"]) == sum(v["trajectories"] for v in r["versions"]) for r in repeats
        ),
    }


def run_suite(
    config: str | Path,
    overrides: Sequence[str] = (),
    repeats: int = 3,
    iterations: int = 3,
    out_dir: str | Path = "bench/suite",
    store: Literal["s3", "local", "config"] = "s3",
    dispatch: bool = True,
    mlflow: bool = True,
    work_dir: str | Path | None = None,
) -> dict[str, Any]:
    """Run the suite; write report.json, summary.md and plots to `out_dir`; log them to MLflow.
    Returns the report (report["ok"]: every check held).

    Args:
        config: the workload's run config (YAML)
        overrides: config overrides KEY=VALUE (repeatable)
        repeats: independent repeats (>= 3 for a useful interval)
        iterations: policy versions per repeat
        out_dir: report.json, summary.md and plots
        store: s3: weed mini on 127.0.0.1, started and stopped here (default); local: a
            directory; config: the config's checkpoint store (the run bucket on EKS)
        dispatch: the dispatcher comparison at the model's shape (--no-dispatch: skip it)
        mlflow: log the report to MLflow (--no-mlflow: do not)
        work_dir: keep every run's files here (default: a temp dir, deleted)
    """
    from benchmarks.progress import progress

    if repeats < 1 or iterations < 1:
        raise ConfigError(
            f"bench suite: --repeats and --iterations must be >= 1, got {repeats} and {iterations}"
        )
    if store not in STORES:
        raise ConfigError(f"bench suite: --store must be one of {', '.join(STORES)}, got {store!r}")
    out_dir = Path(out_dir)
    load_config(config, list(overrides), mode="sync")  # a bad config fails here, before any work
    accel = _accelerators()
    with tempfile.TemporaryDirectory(prefix="moerl-bench-suite-") as tmp:
        root = Path(work_dir) if work_dir is not None else Path(tmp)
        root.mkdir(parents=True, exist_ok=True)
        with (
            _store(store, root) as (store_uri, endpoint, env_extra),
            progress(repeats * iterations, "bench suite", unit="version") as bar,
        ):
            results, cfg = [], None
            for n in range(repeats):
                rdir = root / f"repeat-{n}"
                rdir.mkdir(parents=True, exist_ok=True)
                cfg = suite_config(
                    config,
                    overrides,
                    rdir,
                    store,
                    f"{store_uri}/r{n}" if store_uri else None,
                    endpoint,
                )
                results.append(_repeat(cfg, iterations, rdir, bar, env_extra))
        assert cfg is not None  # repeats >= 1, checked above
        dispatchers = _dispatch(cfg, results) if dispatch else {"skipped": "--no-dispatch"}
    report: dict[str, Any] = {
        "bench": "suite",
        "schema": 1,
        "config": str(config),
        "overrides": list(overrides),
        "repeats": repeats,
        "iterations": iterations,
        "accelerators": accel,
        "disclosure": disclosure(cfg, results, iterations),
        "results": {**aggregate(results, accel), "dispatchers": dispatchers},
        "raw": {
            "repeats": [
                {
                    "loop_s": r["loop_s"],
                    "wall_s": r["wall_s"],
                    "engine_load_s": r["engine_load_s"],
                    "versions": [
                        {
                            k: v[k]
                            for k in (
                                "version",
                                "stage_s",
                                "output_tokens",
                                "trajectories",
                                "trained_samples",
                                "reward_mean",
                            )
                        }
                        for v in r["versions"]
                    ],
                }
                for r in results
            ]
        },
        "config_resolved": {k: tracking.redact(v) for k, v in flatten(cfg).items()},
        "versions": provenance.collect(),
        "machine": machine_record(),
        "build_info": provenance.build_info(),
    }
    report["checks"] = checks(report, results, cfg)
    report["ok"] = all(report["checks"].values())
    write_outputs(report, out_dir, [q for r in results for q in r["requests"]])
    if mlflow:
        report["mlflow_run_id"] = log_to_mlflow(report, out_dir, cfg)
        write_report(out_dir / "report.json", report)
    return report


@contextmanager
def _store(kind: str, root: Path) -> Iterator[tuple[str | None, str | None, dict[str, str]]]:
    """(store URI, endpoint, credentials env) of the repeats' store: for `s3`, weed mini under
    `root` with a bucket, stopped on exit; otherwise nothing to start."""
    if kind != "s3":
        yield None, None, {}
        return
    import boto3

    from moerl.store.s3server import local_s3_server

    with local_s3_server(root / "s3") as server:
        env = {
            "AWS_ACCESS_KEY_ID": server.access_key,
            "AWS_SECRET_ACCESS_KEY": server.secret_key,
            "AWS_DEFAULT_REGION": "us-east-1",
        }
        boto3.session.Session(
            aws_access_key_id=server.access_key,
            aws_secret_access_key=server.secret_key,
            region_name="us-east-1",
        ).client("s3", endpoint_url=server.endpoint_url).create_bucket(Bucket="moerl-bench")
        yield "s3://moerl-bench/suite", server.endpoint_url, env


def _dispatch(cfg: RunConfig, repeats: list[dict[str, Any]]) -> dict[str, Any]:
    """The dispatch benchmark at this model's shape and the mean training tokens per version."""
    from benchmarks.dispatch import run_bench_dispatch

    shape = repeats[0]["shape"]
    k, layers = shape["experts_per_token"], shape["num_layers"]
    versions = [v for r in repeats for v in r["versions"]]
    tokens = max(
        16, int(sum(v["expert_tokens"]["train"] for v in versions) / len(versions) / k / layers)
    )
    rep = run_bench_dispatch(
        tokens=tokens,
        hidden=shape["hidden_size"],
        topk=k,
        experts=shape["num_experts"],
        world_sizes=(2,),
        ranks_per_node=1,
        warmup=2,
        repeats=10,
        dtype=cfg.model.dtype,
        echo=False,
    )
    return {
        "shape": {
            "tokens_per_rank": tokens,
            "hidden": shape["hidden_size"],
            "topk": k,
            "experts": shape["num_experts"],
            "world": 2,
            "transport": "gloo over loopback",
        },
        "results": rep["results"],
    }


# -- outputs ----------------------------------------------------------------------------------
def format_summary(report: dict[str, Any]) -> str:
    r = report["results"]
    h = r["headline"]

    def ci(s: dict[str, Any], digits: int = 2) -> str:
        return f"{s['mean']:.{digits}f} ± {s['std']:.{digits}f} (95 % CI {s['ci95'][0]:.{digits}f} .. {s['ci95'][1]:.{digits}f})"

    acc = report["accelerators"]
    lines = [
        f"# moerl bench suite: {report['config']}",
        "",
        f"{report['repeats']} repeats x {report['iterations']} versions on {acc['count']} {acc['kind']}(s); "
        f"checks: {'all hold' if report['ok'] else 'FAILED ' + str(report['checks'])}",
        "",
        machine_line(report["machine"]) if report.get("machine") else "machine: not recorded",
        "",
        "## Throughput (mean ± std, 95 % CI over repeats)",
        "",
        "| figure | value |",
        "|---|---|",
    ]
    for key in (
        "output_tokens_per_s",
        "output_tokens_per_s_per_accelerator",
        "trajectories_per_s_generation",
        "trajectories_per_s_loop",
        "versions_per_hour",
    ):
        if key in h:
            lines.append(f"| {key} | {ci(h[key])} |")
    lines += [
        "",
        "## Latency per request (s, pooled over repeats)",
        "",
        "| | n | p50 | p90 | p99 |",
        "|---|---|---|---|---|",
    ]
    for k, d in r["latency"].items():
        if d["n"]:
            lines.append(f"| {k} | {d['n']} | {d['p50']:.4f} | {d['p90']:.4f} | {d['p99']:.4f} |")
    lines += [
        "",
        "## Per stage (s per version, pooled)",
        "",
        "| stage | n | p50 | p90 | p99 |",
        "|---|---|---|---|---|",
    ]
    for s, d in r["stages"].items():
        lines.append(
            f"| {s} | {d['n']} | "
            + (
                " | ".join(f"{d[p]:.3f}" for p in ("p50", "p90", "p99"))
                if d["n"]
                else d.get("why", "-") + " | | "
            )
            + " |"
        )
    lines += [
        "",
        "## Expert load imbalance (max/mean tokens per expert, worst layer, mean over versions)",
        "",
        f"- rollout: {ci(r['imbalance']['rollout']['max_over_mean'], 3)}",
        f"- training: {ci(r['imbalance']['train']['max_over_mean'], 3)}",
        "",
        "## Network",
        "",
    ]
    net = r["network"]
    lines += [
        f"- weights published per version: {net['publish_bytes_per_version']['mean'] / 1e6:.2f} MB; "
        f"fetched per version: {net['fetch_bytes_per_version']['mean'] / 1e6:.2f} MB",
        f"- counters ({net['counters_publication']['source']}): publication tx "
        f"{net['counters_publication']['tx_bytes']['mean'] / 1e6:.2f} MB per version, redistribution tx "
        f"{net['counters_redistribution']['tx_bytes']['mean'] / 1e6:.2f} MB per version",
    ]
    d = r["dispatchers"]
    if "results" in d:
        lines += [
            "",
            f"## Dispatchers at this shape ({d['shape']})",
            "",
            "| backend | world | dispatch p50 ms | combine p50 ms | bytes per rank | GB/s |",
            "|---|---|---|---|---|---|",
        ]
        for row in d["results"]:
            if "skipped" in row:
                lines.append(
                    f"| {row['backend']} | {row['world']} | skipped: {row['skipped'][:80]} | | | |"
                )
            else:
                lines.append(
                    f"| {row['backend']} | {row['world']} | {row['dispatch_p50_ms']:.3f} | "
                    f"{row['combine_p50_ms']:.3f} | {row['bytes_actual_sent']:.0f} | "
                    f"{row['dispatch_gbps_actual_sent']:.3f} |"
                )
    disc = report["disclosure"]
    lines += [
        "",
        "## Disclosure",
        "",
        "```json",
        json.dumps({k: disc[k] for k in disc}, indent=1),
        "```",
        "",
        "Software: " + ", ".join(f"{k} {v}" for k, v in report["versions"].items() if v),
        "",
    ]
    return "\n".join(lines)


def write_outputs(
    report: dict[str, Any], out_dir: Path, requests: Sequence[dict[str, Any]]
) -> None:
    from benchmarks import plots

    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "summary.md").write_text(format_summary(report))
    report["plots"] = plots.suite_plots(report, out_dir, requests)
    write_report(out_dir / "report.json", report)
    h = report["results"]["headline"]
    print(
        format_table(
            ["figure", "mean", "std", "ci95 lo", "ci95 hi", "n"],
            [[k, s["mean"], s["std"], s["ci95"][0], s["ci95"][1], s["n"]] for k, s in h.items()],
        )
    )
    print(f"checks: {report['checks']}")
    print(
        f"wrote {out_dir / 'report.json'}, {out_dir / 'summary.md'} and {len(report['plots'])} plots"
    )


def log_to_mlflow(report: dict[str, Any], out_dir: Path, cfg: RunConfig) -> str:
    """An MLflow run in experiment `moerl-bench`: disclosure as params, headline means as
    metrics, the report, summary and plots as artifacts. Returns its run id."""
    from mlflow.tracking import MlflowClient

    uri = tracking.resolve_uri(cfg.tracking)
    client = MlflowClient(uri)
    run = client.create_run(
        tracking.experiment_id(client, "moerl-bench"),
        tags={"moerl.bench": report["bench"], "mlflow.runName": f"bench-{report['bench']}"},
    )
    rid = run.info.run_id
    params = {f"disclosure.{k}": v for k, v in _flat(report["disclosure"]).items()}
    params.update({f"config.{k}": v for k, v in report["config_resolved"].items()})
    params.update({"bench.repeats": report["repeats"], "bench.iterations": report["iterations"]})
    params.update({k: v for k, v in report["versions"].items() if v})
    tracking.log_params(client, rid, params)
    for k, s in report["results"]["headline"].items():
        client.log_metric(rid, f"bench/{k}", s["mean"])
        client.log_metric(rid, f"bench/{k}_std", s["std"])
    for s, d in report["results"]["stages"].items():
        if d["n"]:
            client.log_metric(rid, f"bench/stage/{s}_p50_s", d["p50"])
    for f in sorted(out_dir.iterdir()):
        if f.is_file() and f.suffix in (".json", ".md", ".png"):
            client.log_artifact(rid, str(f), "bench")
    client.set_terminated(rid, "FINISHED" if report["ok"] else "FAILED")
    return rid


def _flat(d: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(d, dict):
        out = {}
        for k, v in d.items():
            out.update(_flat(v, f"{prefix}{k}."))
        return out
    return {prefix.rstrip("."): json.dumps(d) if isinstance(d, list) else d}


def main(argv: list[str] | None = None) -> int:
    """`python -m benchmarks.suite repeat ...`: one repeat, as `run_suite` starts it."""
    return child_main(
        argv, "benchmarks.suite", "repeat", "one repeat of `moerl bench suite`", run_repeat
    )


if __name__ == "__main__":
    sys.exit(main())
