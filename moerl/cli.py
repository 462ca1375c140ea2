"""moerl's command line: run, compile, config, schedule, submit, bench, compare, models.

`moerl --help` and each subcommand's `--help` list the commands; docs/guide.md walks through
them. Errors that moerl raises on purpose (`MoerlError`) print one line and exit non-zero (2
for a bad config, 1 otherwise); anything else is a bug and keeps its traceback.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import sys
from collections.abc import Sequence
from pathlib import Path

import yaml

from moerl.config import load_config
from moerl.errors import MoerlError
from moerl.orchestrate.schedule import add_parsers as add_schedule_parsers

DEFAULT_COMPILED = {
    "sync": "pipelines/compiled/grpo.yaml",
    "async": "pipelines/compiled/grpo_async.yaml",
    "reward_model": "pipelines/compiled/reward_model.yaml",
}
MODE_CHOICES = ("sync", "async")


def _cmd_config_show(args: argparse.Namespace) -> int:
    from moerl.tracking import redact

    cfg = load_config(args.config, args.set, mode=args.mode)
    sys.stdout.write(redact(yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False)))
    return 0


def _cmd_config_migrate(args: argparse.Namespace) -> int:
    from moerl.config.load import read_config_file
    from moerl.config.migrate import migrate_mapping

    data = read_config_file(args.config)
    moved = migrate_mapping(data)
    if not moved:
        print(f"{args.config}: nothing to migrate")
        return 0
    out = args.output or args.config
    Path(out).write_text(yaml.safe_dump(data, sort_keys=False))
    for old, new in moved:
        print(f"{old} -> {new}")
    print(f"wrote {out} (comments are dropped: PyYAML does not keep them)")
    return 0


def _cmd_config_docs(args: argparse.Namespace) -> int:
    from moerl.config.docs import DOC_PATH, stale, write

    path = args.output or DOC_PATH
    if args.check:
        if stale(path):
            what = (
                "is stale: it differs from"
                if Path(path).is_file()
                else "is missing, generated from"
            )
            print(
                f"moerl: error: {path} {what} the config models (moerl/config/); run "
                "`moerl config docs` to regenerate it",
                file=sys.stderr,
            )
            return 1
        print(f"{path} is up to date")
        return 0
    print(f"wrote {write(path)}")
    return 0


def _cmd_compile(args: argparse.Namespace) -> int:
    from moerl.orchestrate.compile import compile_pipeline

    cfg = load_config(args.config, args.set, mode=args.mode)
    default = DEFAULT_COMPILED[
        "reward_model" if cfg.pipeline.kind == "reward_model" else cfg.pipeline.mode
    ]
    if args.target != "local":
        default = default.replace(".yaml", f"-{args.target}.yaml")
    out = compile_pipeline(
        cfg,
        Path(args.output or default),
        target=args.target,
        resume=args.resume,
        start_iteration=args.start_iteration,
    )
    print(f"wrote {out}")
    return 0


def _cmd_run(args: argparse.Namespace) -> int:
    cfg = load_config(args.config, args.set, mode=args.mode)
    if cfg.pipeline.kind == "reward_model" and cfg.pipeline.mode == "async":
        from moerl.errors import ConfigError

        raise ConfigError(
            "pipeline.mode: a reward-model run (pipeline.kind reward_model) is one pipeline on "
            "kfp.local; use sync (its default)"
        )
    if cfg.pipeline.mode == "async" and cfg.pipeline.kind == "grpo":
        from moerl.orchestrate.async_run import run_async

        if args.iterations is not None:  # one policy update per sync iteration = one async version
            cfg = load_config(
                args.config, [*args.set, f"pipeline.versions={args.iterations}"], mode=args.mode
            )
        summary = run_async(cfg, verbose=args.verbose, resume=args.resume)
    else:
        from moerl.orchestrate.sync_run import run_local

        summary = run_local(
            cfg, iterations=args.iterations, verbose=args.verbose, resume=args.resume
        )
    return 0 if summary.ok else 1


def _add_lab_parsers(sub, argv: Sequence[str] | None) -> None:
    """`moerl bench ...` and `moerl compare`, from the `benchmarks` package (the lab), found by
    name: the product never imports it. Without it, both commands say how to install it."""
    try:
        lab = importlib.import_module("benchmarks.cli")
    except ModuleNotFoundError as err:
        if err.name not in ("benchmarks", "benchmarks.cli"):
            raise
        for name in ("bench", "compare"):
            p = sub.add_parser(name, help="benchmarks (not installed: the `benchmarks` package)")
            p.add_argument("rest", nargs=argparse.REMAINDER)
            p.set_defaults(func=_lab_missing)
        return
    lab.add_bench_parsers(sub, argv)


def _lab_missing(args: argparse.Namespace) -> int:
    raise MoerlError(
        f"moerl {args.command}: the `benchmarks` package is not installed; install moerl from "
        "its repository (`pip install -e .` there) to get `moerl bench` and `moerl compare`"
    )


def _add_run_parser(sub) -> None:
    """`moerl run`."""
    run = sub.add_parser(
        "run", help="run GRPO locally: the sync pipeline with kfp.local, or the async mode"
    )
    run.add_argument("config")
    run.add_argument(
        "--mode",
        choices=MODE_CHOICES,
        default=None,
        help="sync (kfp.local pipeline) or async (long-lived local processes, embedded Valkey); "
        "default: the config's pipeline.mode",
    )
    run.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a config value, e.g. --set trainer.parallelism.expert_parallel_size=2 (repeatable)",
    )
    run.add_argument(
        "--iterations",
        type=int,
        default=None,
        help="override pipeline.iterations (sync) or pipeline.versions (async)",
    )
    run.add_argument(
        "--resume",
        metavar="RUN_ID",
        default=None,
        help="continue this run from its last published version (same MLflow run)",
    )
    run.set_defaults(func=_cmd_run)


def _add_compile_parser(sub) -> None:
    """`moerl compile`."""
    comp = sub.add_parser("compile", help="compile the sync or async pipeline to KFP IR YAML")
    comp.add_argument("config")
    comp.add_argument(
        "--mode",
        choices=MODE_CHOICES,
        default=None,
        help="sync or async (needs valkey.url); default: the config's pipeline.mode",
    )
    comp.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    comp.add_argument(
        "--target",
        choices=("local", "eks"),
        default="local",
        help="eks: refuse local paths and SQLite tracking, give every task its worker group's image, "
        "placement, resources, scratch, /dev/shm, Secrets and timeout (docs/eks.md)",
    )
    comp.add_argument(
        "--resume",
        metavar="RUN_ID",
        default=None,
        help="sync: compile the continuation of this MLflow run (chained runs past the iteration cap)",
    )
    comp.add_argument(
        "--start-iteration",
        type=int,
        default=0,
        help="with --resume: the published version the continuation starts from",
    )
    comp.add_argument(
        "-o",
        "--output",
        default=None,
        help=f"default {DEFAULT_COMPILED['sync']} (sync) or {DEFAULT_COMPILED['async']} (async)",
    )
    comp.set_defaults(func=_cmd_compile)


def _add_config_parsers(sub) -> None:
    """`moerl config {show,docs,migrate}`."""
    config = sub.add_parser("config", help="inspect a run config")
    csub = config.add_subparsers(dest="config_command", required=True)
    show = csub.add_parser("show", help="print the resolved config with defaults")
    show.add_argument("config")
    show.add_argument(
        "--mode",
        choices=MODE_CHOICES,
        default=None,
        help="resolve the config's modes: block for this mode",
    )
    show.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    show.set_defaults(func=_cmd_config_show)
    docs = csub.add_parser(
        "docs", help="write docs/config.md, the reference of every config key, from the models"
    )
    docs.add_argument(
        "--check",
        action="store_true",
        help="write nothing; exit 1 naming the file when it differs from the models",
    )
    docs.add_argument("-o", "--output", default=None, help="default docs/config.md")
    docs.set_defaults(func=_cmd_config_docs)
    migrate = csub.add_parser(
        "migrate",
        help="rewrite a config file's moved keys (e.g. trainer.learning_rate -> "
        "trainer.optimizer.learning_rate) to their new places",
    )
    migrate.add_argument("config")
    migrate.add_argument("-o", "--output", default=None, help="default: rewrite CONFIG in place")
    migrate.set_defaults(func=_cmd_config_migrate)


def _add_tasks_parser(sub) -> None:
    """`moerl tasks make`."""
    tasks = sub.add_parser(
        "tasks", help="make datasets of real tasks offline (the moerl[tasks] extra)"
    )
    tsub = tasks.add_subparsers(dest="tasks_command", required=True)
    make = tsub.add_parser("make", help="write a JSONL dataset of generated tasks")
    make.add_argument("source", choices=("reasoning-gym",))
    make.add_argument(
        "--names",
        required=True,
        help="comma-separated reasoning-gym generators (e.g. gsm_symbolic,basic_arithmetic); "
        "`--names list` prints them",
    )
    make.add_argument("--seed", type=int, default=0)
    make.add_argument("--size", type=int, default=100, help="items per generator")
    make.add_argument(
        "--math",
        action="store_true",
        help="task `math` (scored by math-verify) instead of `reasoning_gym` (the generator's scorer)",
    )
    make.add_argument(
        "--config",
        default="{}",
        help='per-generator settings as JSON, e.g. \'{"basic_arithmetic": {"max_terms": 3}}\'',
    )
    make.add_argument("-o", "--output", required=True, help="the JSONL file to write")
    make.set_defaults(func=_cmd_tasks_make)


def _add_models_parser(sub) -> None:
    """`moerl models import`."""
    models = sub.add_parser("models", help="prepare a model checkpoint for moerl")
    msub = models.add_subparsers(dest="models_command", required=True)
    imp = msub.add_parser(
        "import",
        help="convert a local HF checkpoint (DeepSeek-V3's FP8 one) into the bf16/fp32 one the "
        "trainer loads (docs/models.md)",
    )
    imp.add_argument("src", metavar="SRC", help="the local checkpoint directory")
    imp.add_argument("dst", metavar="DST", help="the directory to write (must not exist)")
    imp.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16")
    imp.add_argument(
        "--shard-gib", type=float, default=5.0, help="largest output shard, GiB (default 5)"
    )
    imp.set_defaults(func=_cmd_models_import)


def build_parser(argv: Sequence[str] | None = None) -> argparse.ArgumentParser:
    """The whole command line. With `argv`, only the `moerl bench` command it names gets its
    flags (the others' benchmark modules are not imported)."""
    p = argparse.ArgumentParser(
        prog="moerl", description="RL post-training (GRPO) for MoE LLMs on Kubeflow"
    )
    p.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = p.add_subparsers(dest="command", required=True)

    _add_run_parser(sub)
    _add_compile_parser(sub)
    _add_lab_parsers(sub, argv)  # moerl bench ..., moerl compare (benchmarks/cli.py)
    _add_config_parsers(sub)
    add_schedule_parsers(sub)  # moerl schedule, moerl submit
    _add_tasks_parser(sub)
    _add_models_parser(sub)
    return p


def _cmd_models_import(args) -> int:
    from moerl.models.importer import import_checkpoint

    done = import_checkpoint(
        args.src, args.dst, dtype=args.dtype, shard_bytes=int(args.shard_gib * 2**30)
    )
    rec = done.record
    mtp = rec["mtp"]
    print(
        f"[moerl] wrote {done.path} ({rec['dtype']}, {rec['shards']} shard(s)): "
        f"{rec['dequantized_tensors']} tensors dequantized, {rec['copied_tensors']} copied, "
        + (
            f"{mtp['dropped_keys']} multi-token-prediction tensors dropped (moerl_import.json)"
            if mtp["dropped_keys"]
            else "no multi-token-prediction layer"
        ),
        flush=True,
    )
    return 0


def _cmd_tasks_make(args) -> int:
    import json

    from moerl.errors import ConfigError
    from moerl.tasks.offline import generator_names, make_reasoning_gym

    if args.names == "list":
        print("\n".join(generator_names()))
        return 0
    try:
        config = json.loads(args.config)
    except ValueError as err:
        raise ConfigError(
            f"--config: not JSON ({err}); allowed: an object of generator name -> settings"
        ) from None
    if not isinstance(config, dict) or not all(isinstance(v, dict) for v in config.values()):
        raise ConfigError("--config: allowed: a JSON object of generator name -> settings object")
    names = [n.strip() for n in args.names.split(",") if n.strip()]
    rows = make_reasoning_gym(names, args.seed, args.size, math=args.math, config=config)
    out = Path(args.output)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("".join(r.model_dump_json(exclude_none=True) + "\n" for r in rows))
    print(
        f"[moerl] wrote {len(rows)} rows ({', '.join(names)}, seed {args.seed}) to {out}; task "
        f"{'math' if args.math else 'reasoning_gym'}, scored by its shipped verifier",
        flush=True,
    )
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = build_parser(argv).parse_args(argv)
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    try:
        return args.func(args)
    except MoerlError as err:
        from moerl.tracking import redact

        print(f"moerl: error: {redact(str(err))}", file=sys.stderr)
        return err.exit_code


if __name__ == "__main__":
    sys.exit(main())
