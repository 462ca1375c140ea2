"""`moerl bench ...`: each command's parsed arguments reach its runner as arguments it takes."""

import argparse
import importlib
import inspect

import pytest

from moerl.bench.cli import add_bench_parsers

# (argv after `moerl`, the runner's module, the runner): commands that hand a config to a runner
COMMANDS = [
    (["bench", "suite", "c.yaml"], "moerl.bench.suite", "run_suite"),
    (
        ["bench", "scaling", "c.yaml", "--workers", "1,2"],
        "moerl.bench.scaling",
        "run_bench_scaling",
    ),
    (["bench", "failures", "c.yaml"], "moerl.bench.failures", "run_bench_failures"),
    (
        ["bench", "modes", "c.yaml", "--floor-settings", "async", "--reward-target", "0.5"],
        "moerl.bench.modes",
        "run_bench_modes",
    ),
    (["bench", "rollout", "c.yaml"], "moerl.bench.rollout", "run_bench_rollout"),
    (["bench", "mismatch", "c.yaml"], "moerl.bench.mismatch", "run_bench_mismatch"),
    (["bench", "fanout"], "moerl.bench.fanout", "run_bench_fanout"),
    (["bench", "state"], "moerl.bench.state", "run_bench_state"),
]


def _parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="moerl")
    add_bench_parsers(parser.add_subparsers(dest="command", required=True))
    return parser.parse_args(argv)


@pytest.mark.parametrize(("argv", "module", "runner"), COMMANDS, ids=[c[0][1] for c in COMMANDS])
def test_each_bench_command_calls_its_runner_with_arguments_it_takes(
    monkeypatch, argv, module, runner
):
    mod = importlib.import_module(module)
    real = inspect.signature(getattr(mod, runner))
    calls: list[inspect.BoundArguments] = []

    def fake(*args, **kwargs):  # the runner's own signature, without running a benchmark
        calls.append(real.bind(*args, **kwargs))  # TypeError on an argument it does not take
        return {"ok": True}

    monkeypatch.setattr(mod, runner, fake)
    a = _parse(argv)
    assert a.func(a) == 0
    assert len(calls) == 1


def test_modes_options_reach_bench_modes():
    a = _parse(["bench", "modes", "c.yaml", "--floor-settings", "async", "--reward-target", "0.5"])
    assert (a.floor_settings, a.reward_target) == ("async", 0.5)
    with pytest.raises(SystemExit):  # a modes-only option: scaling does not take it
        _parse(["bench", "scaling", "c.yaml", "--floor-settings", "async"])
