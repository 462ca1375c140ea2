"""`moerl bench rollout --all2all A,B` / `--tensor-parallel 1,2` / `--data-parallel ...`: rollout
engine layouts and all2all backends side by side on the same prompts (the seed's DeepEP
comparison, on a user's own model and cluster).

Each variant is one engine (the product of the listed axes) in its own process (vLLM's
settings are process-wide); rounds are interleaved A B A B so a slow stretch of the machine
hits every variant. The prompts are encoded once and handed to every variant, which reports
their digest. A variant: warm-up prompts (untimed), then every timed prompt's samples in one
`generate_measured` call: output tokens/s over the call, and per-token latency (TPOT) and time
to first token from vLLM's engine-core timestamps. Each variant's ratios to the first variant
are the medians of its rounds' ratios. Limitations: an engine restarts every round (two large
engines rarely fit the GPUs at once); on one node, expert parallelism runs over NVLink, not
EFA. docs/bench-reports/rollout.md#how-it-works-benchmarksrolloutpy.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any, get_args

from benchmarks import (
    child_main,
    envelope,
    format_table,
    log_tail,
    run_child,
    unit_prompts,
    write_report,
)
from moerl.config import RolloutConfig, RunConfig, load_config
from moerl.errors import ConfigError

PROMPTS_ENV = "MOERL_BENCH_PROMPTS"  # the encoded prompts (JSON), to each variant's child
NO_EP = "none"  # --all2all value: expert parallelism off (the MoE layers tensor-parallel)
TIMEOUT_S = 1800.0  # a variant's round: its engine's load, the warm-up and the window


def all2all_choices() -> tuple[str, ...]:
    """rollout.all2all_backend's values, and `none` (no expert parallelism)."""
    return (NO_EP, *get_args(RolloutConfig.model_fields["all2all_backend"].annotation))


def _names(text: str, flag: str, allowed: Sequence[str]) -> tuple[str, ...]:
    xs = tuple(x.strip() for x in text.split(",") if x.strip())
    if not xs or len(set(xs)) != len(xs) or set(xs) - set(allowed):
        raise ConfigError(
            f"bench rollout: {flag} must list distinct values of {', '.join(allowed)}, "
            f"comma-separated; got {text!r}"
        )
    return xs


def _ints(text: str, flag: str, hi: int) -> tuple[int, ...]:
    try:
        xs = tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        xs = ()
    if not xs or any(k < 1 or k > hi for k in xs) or len(set(xs)) != len(xs):
        raise ConfigError(
            f"bench rollout: {flag} must list distinct integers in 1..{hi}, comma-separated; "
            f"got {text!r}"
        )
    return xs


def variant_settings(
    all2all: str | None, tensor_parallel: str | None, data_parallel: str | None
) -> list[tuple[str, list[str]]]:
    """Each variant's name and its config overrides: the product of the axes listed, in order
    (the first variant is the baseline of the ratios)."""
    axes: list[list[tuple[str, list[str]]]] = []
    if tensor_parallel:
        axes.append(
            [
                (f"tp{k}", [f"rollout.tensor_parallel_size={k}"])
                for k in _ints(tensor_parallel, "--tensor-parallel", 64)
            ]
        )
    if data_parallel:
        axes.append(
            [
                (f"dp{k}", [f"rollout.data_parallel_size={k}"])
                for k in _ints(data_parallel, "--data-parallel", 1024)
            ]
        )
    if all2all:
        axes.append(
            [
                (
                    "no-ep" if b == NO_EP else b,
                    ["rollout.enable_expert_parallel=false"]
                    if b == NO_EP
                    else ["rollout.enable_expert_parallel=true", f"rollout.all2all_backend={b}"],
                )
                for b in _names(all2all, "--all2all", all2all_choices())
            ]
        )
    if not axes:
        raise ConfigError(
            "bench rollout: a layout comparison needs --all2all, --tensor-parallel or "
            "--data-parallel"
        )
    out = [
        ("/".join(n for n, _ in combo), [o for _, sets in combo for o in sets])
        for combo in itertools.product(*axes)
    ]
    if len(out) < 2:
        raise ConfigError(
            f"bench rollout: a layout comparison needs two variants or more; got only {out[0][0]}"
        )
    return out


def layout_variants(
    config: str | Path,
    overrides: Sequence[str],
    all2all: str | None = None,
    tensor_parallel: str | None = None,
    data_parallel: str | None = None,
) -> list[tuple[str, RunConfig]]:
    """Every variant's run config, validated (a variant the config refuses, e.g. an all2all
    backend on cpu, raises ConfigError naming the variant and the key) before any work."""
    out = []
    for name, sets in variant_settings(all2all, tensor_parallel, data_parallel):
        try:
            out.append((name, load_config(config, [*overrides, *sets], mode="async")))
        except ConfigError as err:
            raise ConfigError(f"bench rollout: variant {name} ({', '.join(sets)}): {err}") from err
    return out


def interleaved(names: Sequence[str], repeats: int) -> list[tuple[int, str]]:
    """The order the variants' rounds run in: (round, variant), every variant once per round,
    in the listed order (A B A B ...), so a slow stretch of the machine hits each alike."""
    return [(rnd, name) for rnd in range(repeats) for name in names]


def _digest(ids: list[list[int]]) -> str:
    return hashlib.sha256(json.dumps(ids).encode()).hexdigest()[:16]


def _pick(xs: list[float], q: float) -> float | None:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else None


def _variant(cfg: RunConfig, n_units: int, work: Path) -> dict[str, Any]:
    """One variant's round, in its own process: its engine on the shared checkpoint
    (model.path), the warm-up prompts, then the timed prompts (both from PROMPTS_ENV)."""
    from moerl.components.rollout.engine import RolloutEngine

    assert cfg.model.path  # set by run_bench_layouts
    prompts = json.loads(Path(os.environ[PROMPTS_ENV]).read_text())
    timed, warm = prompts["timed"], prompts["warm"]
    G = cfg.rollout.samples_per_prompt
    started = time.time()
    engine = RolloutEngine(cfg.model.path, cfg.rollout, seed=cfg.rollout.seed, log_stats=True)
    try:
        if warm:  # a fresh engine's first batches pay one-time costs: not timed
            engine.generate(warm, G)
        t0 = time.perf_counter()
        groups, timings = engine.generate_measured(timed, G)
        wall = time.perf_counter() - t0
    finally:
        engine.close()
    tokens = sum(len(c.token_ids) for g in groups for c in g)
    tpot = [t.tpot_s for t in timings if t.tpot_s is not None]
    r = cfg.rollout
    return {
        "started_at": started,
        "prompts_sha256": _digest(timed),
        "prompts": len(timed),
        "requests": len(timings),
        "tokens": tokens,
        "wall_s": wall,
        "tokens_per_s": tokens / wall if wall > 0 else None,
        "tpot_ms_p50": 1e3 * x if (x := _pick(tpot, 0.5)) is not None else None,
        "tpot_ms_p90": 1e3 * x if (x := _pick(tpot, 0.9)) is not None else None,
        "ttft_ms_p50": 1e3 * statistics.median(t.ttft_s for t in timings) if timings else None,
        "load_s": engine.load_s,
        "layout": {
            "tensor_parallel_size": r.tensor_parallel_size,
            "data_parallel_size": r.data_parallel_size,
            "expert_parallel": r.enable_expert_parallel,
            "all2all_backend": r.all2all_backend if r.enable_expert_parallel else None,
            "devices": r.devices_per_engine,
            "dtype": r.resolved.dtype,
        },
    }


def combine(rounds: list[dict[str, Any]], base: list[dict[str, Any]] | None) -> dict[str, Any]:
    """One variant's rounds as one result: its round of median tokens/s, every round's tokens/s
    and p50 per-token latency, and (`base`: the baseline variant's same rounds) each round's
    ratios to the baseline and their medians."""
    if not all(r.get("ok") for r in rounds):
        bad = next(r for r in rounds if not r.get("ok"))
        return {**bad, "rounds": len(rounds)}
    tps = [r["tokens_per_s"] for r in rounds]
    mid = rounds[sorted(range(len(tps)), key=lambda i: tps[i])[(len(tps) - 1) // 2]]
    out = {
        **mid,
        "rounds": len(rounds),
        "tokens_per_s_rounds": tps,
        "tpot_ms_p50_rounds": [r["tpot_ms_p50"] for r in rounds],
    }
    if base is not None and all(b.get("ok") for b in base):
        ratios = [r["tokens_per_s"] / b["tokens_per_s"] for r, b in zip(rounds, base)]
        out["throughput_ratio_rounds"] = ratios
        out["throughput_ratio"] = statistics.median(ratios)
        if all(r["tpot_ms_p50"] and b["tpot_ms_p50"] for r, b in zip(rounds, base)):
            lat = [r["tpot_ms_p50"] / b["tpot_ms_p50"] for r, b in zip(rounds, base)]
            out["tpot_ratio_rounds"] = lat
            out["tpot_ratio"] = statistics.median(lat)
    return out


def run_bench_layouts(
    config: str | Path,
    overrides: Sequence[str],
    all2all: str | None = None,
    tensor_parallel: str | None = None,
    data_parallel: str | None = None,
    units: int = 4,
    warmup_units: int = 2,
    repeats: int = 1,
    out: str | Path = "bench/rollout.json",
    echo=print,
    timeout_s: float = TIMEOUT_S,
) -> dict[str, Any]:
    """The layout comparison (see the module docstring): `units` units of prompts timed,
    `warmup_units` others before them, `repeats` interleaved rounds; `timeout_s` bounds each
    variant's round."""
    from transformers import AutoTokenizer

    from moerl.models.tiny import build_tiny_model
    from moerl.tasks.prompting import encode_prompt

    if not 0 < timeout_s <= 24 * 3600:
        raise ConfigError(f"bench rollout: --timeout must be in (0, 86400] s, got {timeout_s}")
    variants = layout_variants(config, overrides, all2all, tensor_parallel, data_parallel)
    cfg = variants[0][1]
    rounds: dict[str, list[dict[str, Any]]] = {name: [] for name, _ in variants}
    with tempfile.TemporaryDirectory(prefix="moerl-bench-layouts-") as tmp:
        model_dir = Path(tmp) / "model"
        if cfg.model.path:  # local as it is; from S3 or a hub, one whole local copy
            from moerl.models.source import local_model

            model_dir = local_model(cfg.model.path, cfg.checkpoint, model_dir)
        else:  # the tiny model, built once: every variant loads the same files
            build_tiny_model(cfg.model.tiny, model_dir)
        tok = AutoTokenizer.from_pretrained(model_dir)
        every = unit_prompts(cfg, units + warmup_units)
        encode = lambda us: [  # noqa: E731
            encode_prompt(tok, cfg.rollout, p.model_dump()) for u in us for p in u
        ]
        prompts_file = Path(tmp) / "prompts.json"
        timed = encode(every[:units])
        prompts_file.write_text(json.dumps({"timed": timed, "warm": encode(every[units:])}))
        cfgs = {
            name: c.model_copy(
                update={"model": c.model.model_copy(update={"path": str(model_dir)})}
            )
            for name, c in variants
        }
        for rnd, name in interleaved(list(cfgs), repeats):
            vcfg = cfgs[name]
            work = Path(tmp) / f"{name.replace('/', '_')}.{rnd}"
            work.mkdir()
            echo(f"[bench rollout] {name} (round {rnd + 1} of {repeats}) ...")
            code, result, log = run_child(
                "benchmarks.layouts",
                "variant",
                vcfg,
                units,
                work,
                "variant",
                env_extra={PROMPTS_ENV: str(prompts_file)},
                timeout_s=timeout_s,
            )
            if code == 0 and result.exists():
                rounds[name].append({"ok": True, **json.loads(result.read_text())})
            else:
                what = (
                    f"no result from variant {name} round {rnd + 1} after {timeout_s:g} s "
                    "(its engine's load, warm-up and timed window; --timeout)"
                    if code == 124
                    else f"variant {name} round {rnd + 1} exited {code}"
                )
                rounds[name].append({"ok": False, "error": f"{what}\n{log_tail(log)}"})
    base = variants[0][0]
    results = {
        name: combine(rounds[name], None if name == base else rounds[base]) for name, _ in variants
    }
    digests = {r.get("prompts_sha256") for rs in rounds.values() for r in rs if r.get("ok")}
    same_prompts = digests == {_digest(timed)}
    ok = all(r.get("ok") for r in results.values()) and same_prompts
    shape = {
        "units": units,
        "prompts": len(timed),
        "prompts_sha256": _digest(timed),
        "same_prompts": same_prompts,
        "samples_per_prompt": cfg.rollout.samples_per_prompt,
        "max_new_tokens": cfg.rollout.max_new_tokens,
        "max_num_seqs": cfg.rollout.max_num_seqs,
        "model": cfg.model.path or f"tiny {cfg.model.tiny.architecture}",
        "dataset": cfg.task.dataset,
        "warmup_units": warmup_units,
        "repeats": repeats,
        "baseline": base,
    }
    report = envelope("rollout", ok, workload=shape, variants=results)
    write_report(Path(out), report)
    echo(format_layouts(report))
    return report


def format_layouts(report: dict[str, Any]) -> str:
    w = report["workload"]
    spread = lambda xs: f"{min(xs):.2f}-{max(xs):.2f}" if xs and len(xs) > 1 else None  # noqa: E731
    rows = []
    for name, r in report["variants"].items():
        lay = r.get("layout") or {}
        rows.append(
            (
                name,
                r.get("ok"),
                lay.get("devices"),
                r.get("tokens"),
                r.get("tokens_per_s"),
                r.get("throughput_ratio", 1.0 if name == w["baseline"] and r.get("ok") else None),
                spread(r.get("throughput_ratio_rounds")),
                r.get("tpot_ms_p50"),
                r.get("tpot_ms_p90"),
                r.get("tpot_ratio", 1.0 if name == w["baseline"] and r.get("ok") else None),
                r.get("ttft_ms_p50"),
                r.get("load_s"),
            )
        )
    head = (
        f"rollout layouts: {w['prompts']} prompts x G={w['samples_per_prompt']} (the same in every "
        f"variant: {'yes' if w['same_prompts'] else 'NO'}), max_new_tokens {w['max_new_tokens']}, "
        f"{w['model']}; {w['repeats']} interleaved round(s), ratios to {w['baseline']} "
        "(medians of the rounds' ratios)"
    )
    text = (
        head
        + "\n"
        + format_table(
            [
                "variant",
                "ok",
                "GPUs",
                "tokens",
                "tokens/s",
                "x tokens/s",
                "rounds",
                "TPOT ms p50",
                "p90",
                "x TPOT",
                "TTFT ms p50",
                "load s",
            ],
            rows,
        )
    )
    for name, r in report["variants"].items():
        if not r.get("ok"):
            text += f"\n{name} failed: {r.get('error')}"
    return text


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    return child_main(argv, "benchmarks.layouts", "variant", "bench rollout variant", _variant)


if __name__ == "__main__":
    sys.exit(main())
