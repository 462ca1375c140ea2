"""moerl's command line.

    moerl run CONFIG [--set k=v] run the sync GRPO pipeline locally (kfp.local), tracked in MLflow
    moerl run --mode async CONFIG   the async mode: the same stage entrypoints as local
                                processes, joined by an embedded Valkey
    moerl run CONFIG --resume RUN_ID   continue a run from its last published version
    moerl compile [--mode M] [--target eks] CONFIG [-o]   write the sync or async pipeline as
                                KFP IR YAML; --target eks: cluster-safe, with pod settings
    moerl config show [--mode M] CONFIG    print the resolved config, defaults included
    moerl schedule CONFIG --cron '0 0 3 * * *' --host URL   a KFP recurring run (warm-started);
                                --argo-out FILE also writes an Argo CronWorkflow
    moerl submit CONFIG --host URL   compile for EKS and start one KFP run
    moerl bench weights         publish / fetch / hot-swap / redistribution, side by side
    moerl bench ep-memory       peak RSS per expert-parallel rank at EP = 1, 2, 4, side by side
    moerl bench modes CONFIG    sync vs async vs the one-process floor on the same workload

`--mode` (sync or async) selects the config file's `modes:` block and `pipeline.mode`; without
it the file's `pipeline.mode` decides (default sync).

Errors that moerl raises on purpose (`MoerlError`) print one line and exit non-zero: 2 for a
bad config, 1 otherwise. Anything else is a bug and keeps its traceback.
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

import yaml

from moerl.config import load_config
from moerl.errors import MoerlError
from moerl.schedule import add_parsers as add_schedule_parsers

DEFAULT_COMPILED = {"sync": "pipelines/compiled/grpo.yaml", "async": "pipelines/compiled/grpo_async.yaml",
                    "reward_model": "pipelines/compiled/reward_model.yaml"}
MODE_CHOICES = ("sync", "async")


def _cmd_config_show(args: argparse.Namespace) -> int:
    from moerl.tracking import redact

    cfg = load_config(args.config, args.set, mode=args.mode)
    sys.stdout.write(redact(yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False)))
    return 0


def _cmd_compile(args: argparse.Namespace) -> int:
    from moerl.runner import compile_pipeline

    cfg = load_config(args.config, args.set, mode=args.mode)
    default = DEFAULT_COMPILED["reward_model" if cfg.pipeline.kind == "reward_model" else cfg.pipeline.mode]
    if args.target != "local":
        default = default.replace(".yaml", f"-{args.target}.yaml")
    out = compile_pipeline(cfg, Path(args.output or default), target=args.target, resume=args.resume,
                           start_iteration=args.start_iteration)
    print(f"wrote {out}")
    return 0


def _cmd_run(args: argparse.Namespace) -> int:
    cfg = load_config(args.config, args.set, mode=args.mode)
    if cfg.pipeline.kind == "reward_model" and cfg.pipeline.mode == "async":
        from moerl.errors import ConfigError

        raise ConfigError("pipeline.mode: a reward-model run (pipeline.kind reward_model) is one pipeline on "
                          "kfp.local; use sync (its default)")
    if cfg.pipeline.mode == "async" and cfg.pipeline.kind == "grpo":
        from moerl.asyncrun import run_async

        if args.iterations is not None:  # one policy update per sync iteration = one async version
            cfg = load_config(args.config, [*args.set, f"pipeline.versions={args.iterations}"], mode=args.mode)
        summary = run_async(cfg, verbose=args.verbose, resume=args.resume)
    else:
        from moerl.runner import run_local

        summary = run_local(cfg, iterations=args.iterations, verbose=args.verbose, resume=args.resume)
    return 0 if summary.ok else 1


def _cmd_bench_weights(args: argparse.Namespace) -> int:
    from moerl.components.redistribute_weights.bench import run_bench

    rows = run_bench([s for s in args.sizes.split(",") if s], Path(args.out), repeats=args.repeats,
                     endpoint_url=args.endpoint_url, bucket=args.bucket)
    return 0 if all(r.parity_ok for r in rows) else 1


def _cmd_bench_dispatch(args: argparse.Namespace) -> int:
    from moerl.kernels.bench import run_bench_dispatch

    run_bench_dispatch(tokens=args.tokens, hidden=args.hidden, topk=args.topk, experts=args.experts, skew=args.skew,
                       world_sizes=tuple(int(w) for w in args.world_sizes.split(",")),
                       ranks_per_node=args.ranks_per_node, warmup=args.warmup, repeats=args.repeats,
                       out=Path(args.out))
    return 0


def _cmd_bench_ep_memory(args: argparse.Namespace) -> int:
    from moerl.components.policy_update.bench_memory import parse_world_sizes, run_bench_ep_memory

    run_bench_ep_memory(parse_world_sizes(args.world_sizes), Path(args.out), num_layers=args.layers,
                        num_experts=args.experts, hidden_size=args.hidden,
                        moe_intermediate_size=args.moe_intermediate_size)
    return 0


def _cmd_bench_modes(args: argparse.Namespace) -> int:
    from moerl.bench.modes import parse_arms, run_bench_modes

    report = run_bench_modes(args.config, args.set, iterations=args.iterations, out=args.out,
                             arms=parse_arms(args.arms), work_dir=args.work_dir)
    return 0 if report["ok"] else 1


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="moerl", description="RL post-training (GRPO) for MoE LLMs on Kubeflow")
    p.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = p.add_subparsers(dest="command", required=True)

    run = sub.add_parser("run", help="run GRPO locally: the sync pipeline with kfp.local, or the async mode")
    run.add_argument("config")
    run.add_argument("--mode", choices=MODE_CHOICES, default=None,
                     help="sync (kfp.local pipeline) or async (long-lived local processes, embedded Valkey); "
                          "default: the config's pipeline.mode")
    run.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                     help="override a config value, e.g. --set trainer.expert_parallel_size=2 (repeatable)")
    run.add_argument("--iterations", type=int, default=None,
                     help="override pipeline.iterations (sync) or pipeline.versions (async)")
    run.add_argument("--resume", metavar="RUN_ID", default=None,
                     help="continue this run from its last published version (same MLflow run)")
    run.set_defaults(func=_cmd_run)

    comp = sub.add_parser("compile", help="compile the sync or async pipeline to KFP IR YAML")
    comp.add_argument("config")
    comp.add_argument("--mode", choices=MODE_CHOICES, default=None,
                      help="sync or async (needs valkey.url); default: the config's pipeline.mode")
    comp.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    comp.add_argument("--target", choices=("local", "eks"), default="local",
                      help="eks: refuse local paths and SQLite tracking, give every task its worker group's image, "
                           "placement, resources, scratch, /dev/shm, Secrets and timeout (docs/eks.md)")
    comp.add_argument("--resume", metavar="RUN_ID", default=None,
                      help="sync: compile the continuation of this MLflow run (chained runs past the iteration cap)")
    comp.add_argument("--start-iteration", type=int, default=0,
                      help="with --resume: the published version the continuation starts from")
    comp.add_argument("-o", "--output", default=None,
                      help=f"default {DEFAULT_COMPILED['sync']} (sync) or {DEFAULT_COMPILED['async']} (async)")
    comp.set_defaults(func=_cmd_compile)

    bench = sub.add_parser("bench", help="benchmarks (side by side, ratios)")
    bsub = bench.add_subparsers(dest="bench_command", required=True)
    bw = bsub.add_parser("weights", help="publish / fetch / hot-swap / redistribution of a policy version")
    bw.add_argument("--sizes", default="tiny,0.5b", help="comma-separated: tiny, 0.5b")
    bw.add_argument("--repeats", type=int, default=3)
    bw.add_argument("--out", default="bench/weights.json")
    bw.add_argument("--endpoint-url", default=None, help="an S3 endpoint (default: start weed mini on 127.0.0.1)")
    bw.add_argument("--bucket", default="moerl-bench")
    bw.set_defaults(func=_cmd_bench_weights)
    bd = bsub.add_parser("dispatch", help="expert-parallel dispatch/combine backends side by side (gloo here)")
    bd.add_argument("--tokens", type=int, default=4096)
    bd.add_argument("--hidden", type=int, default=1024)
    bd.add_argument("--topk", type=int, default=8)
    bd.add_argument("--experts", type=int, default=64)
    bd.add_argument("--skew", choices=["uniform", "zipf"], default="uniform")
    bd.add_argument("--world-sizes", default="2,4")
    bd.add_argument("--ranks-per-node", type=int, default=2)
    bd.add_argument("--warmup", type=int, default=5)
    bd.add_argument("--repeats", type=int, default=20)
    bd.add_argument("--out", default="bench/dispatch.json")
    bd.set_defaults(func=_cmd_bench_dispatch)
    bm = bsub.add_parser("ep-memory", help="peak RSS per expert-parallel rank at EP = 1, 2, 4 (load, step, save)")
    bm.add_argument("--world-sizes", default="1,2,4")
    bm.add_argument("--layers", type=int, default=None, help="default 4")
    bm.add_argument("--experts", type=int, default=None, help="default 64")
    bm.add_argument("--hidden", type=int, default=None, help="default 512")
    bm.add_argument("--moe-intermediate-size", type=int, default=None, help="default 256")
    bm.add_argument("--out", default="bench/ep_memory.json")
    bm.set_defaults(func=_cmd_bench_ep_memory)
    bmo = bsub.add_parser("modes", help="the same workload in sync, async and the one-process floor, side by side")
    bmo.add_argument("config")
    bmo.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    bmo.add_argument("--iterations", type=int, default=10, help="versions per arm (sync iterations = async versions)")
    bmo.add_argument("--arms", default="floor,sync,async")
    bmo.add_argument("--out", default="bench/modes.json")
    bmo.add_argument("--work-dir", default=None, help="keep each arm's files here (default: a temp dir, deleted)")
    bmo.set_defaults(func=_cmd_bench_modes)

    config = sub.add_parser("config", help="inspect a run config")
    csub = config.add_subparsers(dest="config_command", required=True)
    show = csub.add_parser("show", help="print the resolved config with defaults")
    show.add_argument("config")
    show.add_argument("--mode", choices=MODE_CHOICES, default=None,
                      help="resolve the config's modes: block for this mode")
    show.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    show.set_defaults(func=_cmd_config_show)
    add_schedule_parsers(sub)  # moerl schedule, moerl submit
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.INFO,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        return args.func(args)
    except MoerlError as err:
        from moerl.tracking import redact

        print(f"moerl: error: {redact(str(err))}", file=sys.stderr)
        return err.exit_code


if __name__ == "__main__":
    sys.exit(main())
