"""Every `moerl bench` command, and `moerl compare`: a table of command -> runner.

A command's flags come from its runner's signature, not from a parser written per command:
parameters without a default are positional (so is `config`, optional when it has a default);
the others are `--flags` named after them (`out_dir` -> `--out-dir`), with the runner's
default. `bool` is a switch (`--x` when the default is False, `--no-x` when True), `Literal[...]`
gives choices, `int`/`float`/`Path` convert, and a parameter that also takes `str` (comma-separated
lists, `AxB` meshes) gets the text, which the runner parses itself. `overrides` is `--set
KEY=VALUE` (repeatable). Help text: the runner docstring's `Args:` block. `moerl` finds this
module by name at run time (moerl/cli.py); the product never imports it.
"""

from __future__ import annotations

import argparse
import functools
import importlib
import inspect
import re
import types
import typing
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

SKIPPED = frozenset({"echo"})  # runner parameters for callers, never flags


@dataclass(frozen=True)
class Command:
    """One `moerl bench` command: `runner` is `module:function` in this package."""

    name: str
    runner: str
    help: str
    flags: Mapping[str, str] = field(default_factory=dict)  # parameter -> flag, where they differ
    defaults: Mapping[str, Any] = field(default_factory=dict)  # CLI defaults that differ
    ok: Callable[[Any], bool] | None = None  # exit 0 when it holds (default: report["ok"])
    skip: frozenset[str] = frozenset()  # parameters for Python callers only
    # `module:function` adding the command's own arguments, for commands whose flags are not
    # one runner's signature; `runner` then takes the parsed namespace
    parser: str | None = None


def _weights_ok(rows: Any) -> bool:
    return all(r.parity_ok for r in rows)


COMMANDS: tuple[Command, ...] = (
    Command(
        "suite",
        "suite:run_suite",
        "the workload, every stage measured, repeated (report, summary, plots, MLflow)",
    ),
    Command(
        "scaling",
        "scaling:run_bench_scaling",
        "the same workload at several rollout-worker / scorer counts (async)",
    ),
    Command(
        "failures",
        "failures:run_bench_failures",
        "policy-iteration time under injected SIGTERM / SIGKILL (async)",
    ),
    Command(
        "modes",
        "modes:run_bench_modes",
        "the same workload in sync, async and the one-process floor, side by side",
    ),
    Command(
        "peer",
        "peer:run_bench_peer",
        "moerl's async run against TRL's GRPOTrainer on the same version 0, prompts, verifier and "
        "settings: time to each reward level, per version (the moerl[peer] extra)",
    ),
    Command(
        "fleet",
        "fleet:run_bench_fleet",
        "an elastic rollout fleet (min..max workers) against a fixed one (min), on a workload whose "
        "response length changes mid-run: time, worker-seconds, idle, starvation",
    ),
    Command(
        "rollout",
        "rollout:run_bench_rollout",
        "the async rollout worker's output tokens/s against a bare vLLM engine on the same "
        "prompts, side by side",
        flags={"timeout_s": "timeout"},
    ),
    Command(
        "mismatch",
        "mismatch:run_bench_mismatch",
        "MoE training-inference mismatch: routing replay under an induced router mismatch, and "
        "dynamic sampling, side by side",
    ),
    # `project`: 30 model and cluster inputs, shared with its Python API (`inputs_from_args`)
    Command(
        "project",
        "project:run_from_args",
        "the seed's scale on paper: dispatch share, rollout gain of a faster dispatcher",
        parser="project:add_project_args",
    ),
    Command(
        "weights",
        "weights:run_bench",
        "publish / fetch / hot-swap / redistribution of a policy version",
        ok=_weights_ok,
    ),
    Command(
        "weight-sync",
        "weight_sync:run_bench",
        "a version to live engines by files and over the wire (collective), side by side",
    ),
    Command(
        "dispatch",
        "dispatch:run_bench_dispatch",
        "expert-parallel dispatch/combine backends side by side (gloo here)",
        defaults={"out": Path("bench/dispatch.json")},
    ),
    Command(
        "ep-memory",
        "ep_memory:run_bench_ep_memory",
        "per-rank state bytes (vs 1/world) and peak RSS at several trainer meshes",
        flags={"num_layers": "layers", "num_experts": "experts", "hidden_size": "hidden"},
        defaults={"out": Path("bench/ep_memory.json")},
    ),
    Command(
        "tasks",
        "tasks:run_bench_tasks",
        "verifier / environment calls in-process vs the sandboxed pool vs Valkey, and the "
        "environments' share of a multi-turn rollout",
        flags={"n": "calls"},
    ),
    Command(
        "lease",
        "lease:run_bench_lease",
        "a rollout worker's lease as the pending list grows: the bus's way against XAUTOCLAIM "
        "paging (Valkey commands and wall time per lease)",
    ),
    Command(
        "fanout",
        "fanout:run_bench_fanout",
        "the fan-out's bookkeeping for one version (simulated peers, a real Valkey): Valkey "
        "commands and CPU, now against the per-chunk sets it replaced",
    ),
    # `wide-ep`: four subcommands, run on different machines (its parser adds them)
    Command(
        "wide-ep",
        "",
        "DeepEP (deepep_v2) over EFA vs all-gather at 1, 2, 4 nodes per engine: EKS JobSets "
        "(plan), one measured leg (leg), a node's EFA counters (nic), the merged table (report)",
        parser="wide_ep:add_parser",
    ),
    Command(
        "state",
        "state:run_bench_state",
        "Valkey's and each stage's memory over a long async run (bounded state)",
    ),
    Command(
        "trainer-versions",
        "trainer_versions:run_bench_trainer_versions",
        "the async trainer's overhead per version on a gloo mesh: restarting the ranks every "
        "version against ranks spawned once, interleaved, side by side",
        flags={"out_dir": "out"},
        skip=frozenset({"model"}),
    ),
)
COMPARE = Command(
    "compare",
    "compare:run_compare",
    "MLflow runs side by side: differing params, metric deltas vs noise, plots",
    flags={"log_run": "mlflow"},
)


def resolve(target: str) -> Callable[..., Any]:
    """`module:function` in this package -> the function (imported now)."""
    module, name = target.split(":")
    return getattr(importlib.import_module(f"benchmarks.{module}"), name)


def param_help(doc: str | None) -> dict[str, str]:
    """The `Args:` block of a docstring: `name: text` lines, continued by deeper indentation."""
    out: dict[str, str] = {}
    lines = (doc or "").splitlines()
    start = next((i for i, ln in enumerate(lines) if ln.strip() == "Args:"), None)
    if start is None:
        return out
    indent, name = None, None
    for line in lines[start + 1 :]:
        if not line.strip():
            break
        depth = len(line) - len(line.lstrip())
        m = re.match(r"\s*(\w+): (.*)", line)
        if m and (indent is None or depth <= indent):
            indent, name = depth, m.group(1)
            out[name] = m.group(2).strip()
        elif name is not None and indent is not None and depth > indent:
            out[name] += " " + line.strip()
        else:
            break
    return out


def _members(annotation: Any) -> tuple[Any, ...]:
    """The types a union allows, without None (or the annotation itself)."""
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        return tuple(a for a in typing.get_args(annotation) if a is not type(None))
    return (annotation,)


def _cli_default(value: Any) -> Any:
    """A runner default as the flag's default: sequences as their comma-separated text."""
    if isinstance(value, (tuple, list)):
        return ",".join(str(v) for v in value)
    return value


def argument_spec(name: str, annotation: Any, default: Any) -> dict[str, Any]:
    """`add_argument` keywords for one runner parameter (not its name or help)."""
    members = _members(annotation)
    plain = members[0] if len(members) == 1 else None
    if name == "overrides":
        return {"action": "append", "default": [], "metavar": "KEY=VALUE"}
    if plain is bool:
        return {"action": "store_false" if default else "store_true"}
    if typing.get_origin(plain) is Literal:
        return {"choices": typing.get_args(plain), "default": default}
    if str in members:
        return {"default": _cli_default(default)}
    if plain in (int, float, Path):
        return {"type": plain, "default": default}
    raise TypeError(f"bench cli: parameter {name!r} ({annotation!r}) has no command-line form")


def _with_default(text: str | None, spec: dict[str, Any]) -> str | None:
    """The help text, with the default where it says none and there is one to show."""
    value = spec.get("default")
    text = text and text.replace("%", "%%")  # argparse formats help with %
    if text is None or "default" in text or value in (None, [], "") or "action" in spec:
        return text
    return f"{text} (default {value})"


def add_runner_args(p: argparse.ArgumentParser, cmd: Command, fn: Callable[..., Any]) -> None:
    """`cmd`'s arguments on `p`, from `fn`'s signature and docstring; `func` runs `cmd`."""
    hints = typing.get_type_hints(fn)
    helps = param_help(fn.__doc__)
    variadic = (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD)
    params = [
        q
        for q in inspect.signature(fn).parameters.values()
        if q.name not in SKIPPED | cmd.skip and q.kind not in variadic
    ]
    for param in params:
        annotation = hints.get(param.name, str)
        if param.default is param.empty:  # positional: one value, or a list of them
            many = _members(annotation)[0] is not str and "Sequence" in str(annotation)
            p.add_argument(param.name, nargs="+" if many else None, help=helps.get(param.name))
            continue
        default = cmd.defaults.get(param.name, param.default)
        spec = argument_spec(param.name, annotation, default)
        spec["help"] = _with_default(helps.get(param.name), spec)
        if param.name == "config":  # the workload file: positional, optional with a default
            p.add_argument("config", nargs="?", default=default, help=spec["help"])
            continue
        flag = cmd.flags.get(param.name, param.name).replace("_", "-")
        if spec.get("action") == "store_false":
            flag = f"no-{flag}"
        names = ["--set"] if param.name == "overrides" else [f"--{flag}"]
        p.add_argument(*names, dest=param.name, **spec)
    p.set_defaults(func=functools.partial(_run, cmd, tuple(q.name for q in params)))


def _run(cmd: Command, names: tuple[str, ...], a: argparse.Namespace) -> int:
    """Call `cmd`'s runner (looked up now) with the parsed arguments `names`; its exit code."""
    result = resolve(cmd.runner)(**{k: getattr(a, k) for k in names})
    ok = cmd.ok(result) if cmd.ok else not isinstance(result, dict) or result.get("ok", True)
    return 0 if ok else 1


def _run_namespace(cmd: Command, a: argparse.Namespace) -> int:
    """Call `cmd`'s runner with the parsed namespace (commands with a `parser` of their own)."""
    return 0 if resolve(cmd.runner)(a)["ok"] else 1


def add_command(sub: Any, cmd: Command, full: bool) -> None:
    """`cmd` on the subparsers `sub`; its arguments only when `full` (they import its module)."""
    if cmd.parser and not cmd.runner:  # a group of subcommands: its parser adds the group
        if full:
            resolve(cmd.parser)(sub)
        else:
            sub.add_parser(cmd.name, help=cmd.help)
        return
    p = sub.add_parser(cmd.name, help=cmd.help)
    if not full:
        return
    if cmd.parser:
        resolve(cmd.parser)(p)
        p.set_defaults(func=functools.partial(_run_namespace, cmd))
        return
    add_runner_args(p, cmd, resolve(cmd.runner))


def _wanted(argv: Sequence[str] | None) -> set[str] | None:
    """The commands `argv` names, `compare` or one bench command (None: all of them, as a
    test of the whole table wants)."""
    if argv is None:
        return None
    words = [w for w in argv if not w.startswith("-")][:2]
    if words[:1] == ["bench"]:
        return set(words[1:])
    return set(words[:1])


def add_bench_parsers(sub: Any, argv: Sequence[str] | None = None) -> None:
    """`moerl bench ...` and `moerl compare` on the top-level subparsers `sub`. With `argv`,
    only the command it names gets its arguments (only that benchmark's module is imported)."""
    wanted = _wanted(argv)
    bench = sub.add_parser("bench", help="benchmarks (side by side, ratios, docs/benchmarks.md)")
    bsub = bench.add_subparsers(dest="bench_command", required=True)
    for cmd in COMMANDS:
        add_command(bsub, cmd, wanted is None or cmd.name in wanted)
    co = sub.add_parser(COMPARE.name, help=COMPARE.help)
    if wanted is None or COMPARE.name in wanted:
        add_runner_args(co, COMPARE, resolve(COMPARE.runner))
