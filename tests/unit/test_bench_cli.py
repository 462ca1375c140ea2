"""`moerl bench ...`: a table of command -> runner; each command's flags come from its runner's
signature, and the parsed arguments reach the runner as arguments it takes."""

import argparse
import importlib
import inspect
import subprocess
import sys

import pytest

from benchmarks.cli import COMMANDS, add_bench_parsers, param_help

# (argv after `moerl`, the runner's module, the runner): commands that hand a config to a runner
RUNS = [
    (["bench", "suite", "c.yaml", "--no-mlflow"], "benchmarks.suite", "run_suite"),
    (
        ["bench", "scaling", "c.yaml", "--workers", "1,2"],
        "benchmarks.scaling",
        "run_bench_scaling",
    ),
    (["bench", "failures", "c.yaml"], "benchmarks.failures", "run_bench_failures"),
    (
        ["bench", "modes", "c.yaml", "--floor-settings", "async", "--reward-target", "0.5"],
        "benchmarks.modes",
        "run_bench_modes",
    ),
    (["bench", "peer", "--targets", "0.5"], "benchmarks.peer", "run_bench_peer"),
    (["bench", "rollout", "c.yaml", "--timeout", "9"], "benchmarks.rollout", "run_bench_rollout"),
    (["bench", "mismatch", "c.yaml", "--no-dynamic"], "benchmarks.mismatch", "run_bench_mismatch"),
    (["bench", "weights", "--sizes", "tiny"], "benchmarks.weights", "run_bench"),
    (["bench", "ep-memory", "--layers", "2"], "benchmarks.ep_memory", "run_bench_ep_memory"),
    (["bench", "tasks", "--calls", "5"], "benchmarks.tasks", "run_bench_tasks"),
    (["bench", "lease", "--pending", "0,8"], "benchmarks.lease", "run_bench_lease"),
    (["bench", "fanout"], "benchmarks.fanout", "run_bench_fanout"),
    (["bench", "state", "--set", "a.b=1"], "benchmarks.state", "run_bench_state"),
    (
        ["bench", "trainer-versions", "--mesh", "1x2", "--out", "o"],
        "benchmarks.trainer_versions",
        "run_bench_trainer_versions",
    ),
    (["compare", "r1", "r2", "--no-mlflow"], "benchmarks.compare", "run_compare"),
]


def _parse(argv: list[str], lazy: bool = False) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="moerl")
    add_bench_parsers(parser.add_subparsers(dest="command", required=True), argv if lazy else None)
    return parser.parse_args(argv)


@pytest.mark.parametrize(("argv", "module", "runner"), RUNS, ids=[" ".join(r[0][:2]) for r in RUNS])
def test_each_command_calls_its_runner_with_arguments_it_takes(monkeypatch, argv, module, runner):
    a = _parse(argv, lazy=True)  # the flags come from the real runner's signature
    mod = importlib.import_module(module)
    real = inspect.signature(getattr(mod, runner))
    calls: list[inspect.BoundArguments] = []

    def fake(*args, **kwargs):  # the runner's own signature, without running a benchmark
        calls.append(real.bind(*args, **kwargs))  # TypeError on an argument it does not take
        return {"ok": True} if runner != "run_bench" else []

    monkeypatch.setattr(mod, runner, fake)
    assert a.func(a) == 0
    assert len(calls) == 1


def test_the_flags_users_pass_reach_the_runner_under_its_names():
    a = _parse(["bench", "rollout", "c.yaml", "--timeout", "9", "--set", "x=1", "--set", "y=2"])
    assert (a.config, a.timeout_s, a.overrides) == ("c.yaml", 9.0, ["x=1", "y=2"])
    a = _parse(["bench", "suite", "c.yaml", "--no-dispatch", "--store", "local"])
    assert (a.dispatch, a.mlflow, a.store, a.repeats) == (False, True, "local", 3)
    a = _parse(["bench", "trainer-versions", "--out", "o", "--hidden", "64"])
    assert (str(a.out_dir), a.hidden, a.mesh) == ("o", 64, "2x2")
    a = _parse(["bench", "peer"])  # the config is optional here, with the runner's default
    assert a.config == "configs/tiny-moe-grpo.yaml" and a.targets == "0.5,0.9,0.99"
    a = _parse(["bench", "modes", "c.yaml", "--floor-settings", "async", "--reward-target", "0.5"])
    assert (a.floor_settings, a.reward_target) == ("async", 0.5)
    with pytest.raises(SystemExit):  # choices come from the runner's Literal
        _parse(["bench", "modes", "c.yaml", "--floor-settings", "both"])
    with pytest.raises(SystemExit):  # a modes-only option: scaling does not take it
        _parse(["bench", "scaling", "c.yaml", "--floor-settings", "async"])


def test_every_flag_has_help_from_its_runner_docstring():
    parser = argparse.ArgumentParser(prog="moerl")
    add_bench_parsers(parser.add_subparsers(dest="command"))
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    bench = next(
        a for a in sub.choices["bench"]._actions if isinstance(a, argparse._SubParsersAction)
    )
    assert [c.name for c in COMMANDS] == list(bench.choices)
    for name in ("suite", "rollout", "trainer-versions", "lease", "fanout"):
        missing = [
            a.dest
            for a in bench.choices[name]._actions
            if a.dest != "help" and not a.help and a.dest != "overrides"
        ]
        assert not missing, (name, missing)


def test_param_help_reads_the_args_block_with_continuations():
    doc = "Run.\n\n    Args:\n        a: one\n            more\n        b_c: two\n\n    After.\n"
    assert param_help(doc) == {"a": "one more", "b_c": "two"}
    assert param_help("no block") == {}


def test_moerl_bench_imports_only_the_named_benchmark_and_the_product_none():
    code = (
        "import sys; from moerl.cli import build_parser; "
        "build_parser(['bench', 'lease', '--help'][:2]); "
        "print(sorted(m for m in sys.modules if m.startswith('benchmarks')))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["['benchmarks',", "'benchmarks.cli',", "'benchmarks.lease']"]
    code = "import sys, moerl.cli; print([m for m in sys.modules if m.startswith('benchmarks')])"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_without_the_benchmarks_package_bench_says_how_to_get_it(monkeypatch, capsys):
    from moerl import cli

    def missing(name):
        raise ModuleNotFoundError(f"No module named {name!r}", name="benchmarks")

    monkeypatch.setattr(cli.importlib, "import_module", missing)
    assert cli.main(["bench", "suite", "c.yaml"]) == 1
    assert "the `benchmarks` package is not installed" in capsys.readouterr().err
