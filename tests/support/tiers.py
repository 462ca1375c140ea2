"""The suite's tiers, work units and order: a pytest plugin registered by tests/conftest.py.

Tiers (docs/testing.md):
- unit (`tests/unit/`): no marker; pure logic.
- `slow`: in `make test`; starts a real engine, server-backed run or pipeline that every change
  must pass.
- `nightly`: only in `make test-nightly`; long learning curves, real benchmark runs, second-order
  fault runs.

The guard: at collection, a test that uses an engine, an async run, a pipeline run or the TRL arm
(in its own body, in a fixture it requests, or in a helper of its module that it calls) without
its tier's marker is an error naming the test and what it uses. What counts is listed in
`HEAVY`; a test in `tests/unit/` may use none of it.

Work units: `make test` runs pytest-xdist with this plugin's scheduler (`GroupScheduling`):
every test belongs to a group, by default its module (a module's fixtures are built once, on one
worker), or the module's `TEST_GROUP` where modules must share one worker's fixture. A group
runs whole on one worker.

Order: the groups whose selected tests took longest when last measured go first (each starts at
once on its own worker, the short ones fill in behind). The times come from
`tests/durations.json`, one entry a test, which every run rewrites for the tests it ran (the
controller process, at session end): a test new to it counts 0 until it has run once.
"""

from __future__ import annotations

import ast
import functools
import importlib
import inspect
import json
import os
import re
import textwrap
from collections import defaultdict
from pathlib import Path
from typing import Any

import pytest
from xdist.scheduler import LoadScopeScheduling

DURATIONS = Path(__file__).resolve().parents[1] / "durations.json"
DURATIONS_ENV = "MOERL_TEST_DURATIONS"  # another file (tests of this plugin)

SLOW, NIGHTLY, GPU = "slow", "nightly", "gpu"  # gpu: tests/gpu/run.sh, on a CUDA machine
# What a test may use only in a tier, by what its code says: (pattern, what, allowed markers).
HEAVY: tuple[tuple[re.Pattern[str], str, frozenset[str]], ...] = (
    (
        re.compile(r"\bRolloutEngine\(|\bengine_pool\b|\bLLM\(|'serve'"),
        "a vLLM engine",
        frozenset({SLOW, NIGHTLY}),
    ),
    (
        re.compile(r"\brun_async_cli\(|\bHarness\(|\bLocalAsyncRun\(|\brun_async\("),
        "an async run",
        frozenset({SLOW, NIGHTLY}),
    ),
    (
        re.compile(
            r"\blocal\.init\(|\brun_pipeline\(|\brun_local\(|'moerl\.cli', 'run'|'run', '--mode'"
        ),
        "a pipeline run",
        frozenset({SLOW, NIGHTLY}),
    ),
    (re.compile(r"\b_trl_arm\(|\bGRPOTrainer\("), "the TRL arm", frozenset({NIGHTLY})),
)


def _source(obj: object) -> str:
    """The code of a function without its docstrings, comments and multi-line strings (what it
    does, not what it says)."""
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(obj)))  # type: ignore[arg-type]
    except (OSError, TypeError, SyntaxError):
        return ""
    for node in ast.walk(tree):
        body = getattr(node, "body", None)
        if (
            isinstance(body, list)
            and body
            and isinstance(body[0], ast.Expr)
            and isinstance(body[0].value, ast.Constant)
            and isinstance(body[0].value.value, str)
        ):
            body[0] = ast.Pass()
    for node in ast.walk(tree):  # a multi-line string is text (a file a test writes), not a call
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and "\n" in node.value:
            node.value = ""
    return ast.unparse(tree)


CALL = re.compile(r"\b(\w+)\(")


class _Reader:
    """What each function uses from HEAVY (as indices), read once per function: its own code,
    and what the functions of its module that it calls use, to a fixed point (a test calling
    `_run(...)` is judged by what `_run` does)."""

    def __init__(self) -> None:
        self._own: dict[object, tuple[frozenset[int], frozenset[str]]] = {}
        self._modules: dict[str, dict[str, frozenset[int]]] = {}

    def own(self, fn: object) -> tuple[frozenset[int], frozenset[str]]:
        """(HEAVY indices in fn's own code, the names it calls)."""
        if fn not in self._own:
            code = _source(fn)
            used = frozenset(i for i, (pat, _, _) in enumerate(HEAVY) if pat.search(code))
            self._own[fn] = used, frozenset(CALL.findall(code))
        return self._own[fn]

    def module(self, module: object) -> dict[str, frozenset[int]]:
        """Each module-level function's uses, its callees' included."""
        name = getattr(module, "__name__", "")
        if name not in self._modules:
            fns = {
                a: v
                for a, v in vars(module).items()
                if inspect.isfunction(v) and v.__module__ == name
            }
            uses = {a: set(self.own(v)[0]) for a, v in fns.items()}
            calls = {a: self.own(v)[1] & set(fns) for a, v in fns.items()}
            changed = True
            while changed:
                changed = False
                for a, callees in calls.items():
                    before = len(uses[a])
                    for c in callees:
                        uses[a] |= uses[c]
                    changed |= len(uses[a]) != before
            self._modules[name] = {a: frozenset(u) for a, u in uses.items()}
        return self._modules[name]

    def uses(self, fn: object, module: object | None) -> frozenset[int]:
        used, calls = self.own(fn)
        if module is None:
            return used
        helpers = self.module(module)
        return used.union(*(helpers[c] for c in calls if c in helpers))


def heavy_uses(item: pytest.Item, reader: _Reader) -> list[tuple[str, frozenset[str]]]:
    """What `item` uses from HEAVY, as (what, the markers that allow it): read in the test's
    body, in every fixture it requests (directly or not), and in the module helpers they call."""
    fn = getattr(item, "function", None)
    if fn is None:
        return []
    used = set(reader.uses(fn, getattr(item, "module", None)))
    info = getattr(item, "_fixtureinfo", None)
    for defs in info.name2fixturedefs.values() if info else ():
        for d in defs:
            used |= reader.uses(d.func, inspect.getmodule(d.func))
    return [(HEAVY[i][1], HEAVY[i][2]) for i in sorted(used)]


class Tiers:
    """The guard, first thing at collection."""

    @pytest.hookimpl(tryfirst=True)
    def pytest_collection_modifyitems(self, items: list[pytest.Item]) -> None:
        _guard(items)


class Order:
    """The longest groups first, once the tier's tests are selected (`-m` deselects before
    this runs); each test's measured time written back at session end, by the controller."""

    def __init__(self, config: pytest.Config) -> None:
        self.config = config
        self.times: dict[str, float] = defaultdict(float)
        self.is_worker = hasattr(config, "workerinput")

    @pytest.hookimpl(trylast=True)
    def pytest_collection_modifyitems(self, items: list[pytest.Item]) -> None:
        known = _read_durations()
        root = self.config.rootpath
        group = {i.nodeid: group_of(root, _module_path(i.nodeid)) for i in items}
        total: dict[str, float] = defaultdict(float)
        for i in items:
            total[group[i.nodeid]] += known.get(_test_id(i.nodeid), 0.0)
        order = {i.nodeid: n for n, i in enumerate(items)}
        items.sort(key=lambda i: (-total[group[i.nodeid]], group[i.nodeid], order[i.nodeid]))

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        if not self.is_worker:  # the controller (or a run without workers) sees every report
            self.times[_test_id(report.nodeid)] += report.duration

    def pytest_sessionfinish(self) -> None:
        if self.is_worker or not self.times or self.config.option.collectonly:
            return
        known = _read_durations()
        known.update({t: round(s, 2) for t, s in self.times.items()})
        path = durations_path()
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(dict(sorted(known.items())), indent=0) + "\n")
        tmp.replace(path)


def _guard(items: list[pytest.Item]) -> None:
    """Fail collection, naming each test, where a test uses HEAVY outside its tier."""
    reader = _Reader()
    errors = []
    for item in items:
        marks = {m.name for m in item.iter_markers()} & {SLOW, NIGHTLY, GPU}
        in_unit = "tests/unit/" in item.nodeid.replace(os.sep, "/")
        for what, allowed in heavy_uses(item, reader):
            if in_unit:
                errors.append(f"{item.nodeid}: a unit test uses {what}: move it out of tests/unit/")
            elif not marks & (allowed | {GPU}):
                need = " or ".join(f"@pytest.mark.{m}" for m in sorted(allowed))
                errors.append(f"{item.nodeid}: uses {what} without its tier's marker ({need})")
        if in_unit and marks:
            errors.append(
                f"{item.nodeid}: tests/unit/ is the unit tier; it takes no {sorted(marks)} marker"
            )
    if errors:
        raise pytest.UsageError("test tiers (tests/support/tiers.py):\n  " + "\n  ".join(errors))


def _test_id(nodeid: str) -> str:
    """A test's id, without the `@group` suffix pytest-xdist's loadgroup adds where it can."""
    head, sep, tail = nodeid.rpartition("@")
    return head if sep and "]" not in tail and "::" not in tail else nodeid


def _module_path(nodeid: str) -> str:
    return nodeid.split("::", 1)[0]


@functools.cache
def group_of(root: Path, module: str) -> str:
    """A test module's work unit: its `TEST_GROUP` (assigned, or imported under that name from
    a support module), else its own path. Read from the file, so that the controller, which
    collects nothing, groups as the workers do."""
    try:
        tree = ast.parse((root / module).read_text())
    except (OSError, SyntaxError, ValueError):
        return module
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(
            isinstance(t, ast.Name) and t.id == "TEST_GROUP" for t in node.targets
        ):
            if isinstance(node.value, ast.Constant) and isinstance(node.value.value, str):
                return node.value.value
        if isinstance(node, ast.ImportFrom) and node.module:
            for alias in node.names:
                if alias.asname == "TEST_GROUP":
                    return str(getattr(importlib.import_module(node.module), alias.name))
    return module


class GroupScheduling(LoadScopeScheduling):
    """pytest-xdist's scope scheduling with a test's group (`group_of`) as its scope: a group
    runs whole on one worker, in collection order (the longest first, `Order`). It replaces
    `--dist loadgroup`, whose `@group` suffix pytest 9 no longer lets a plugin set."""

    def _split_scope(self, nodeid: str) -> str:
        return group_of(self.config.rootpath, _module_path(nodeid))


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> GroupScheduling | None:
    if config.getvalue("dist") in ("loadscope", "loadgroup"):
        return GroupScheduling(config, log)
    return None


def durations_path() -> Path:
    return Path(os.environ.get(DURATIONS_ENV) or DURATIONS)


def _read_durations() -> dict[str, float]:
    try:
        data = json.loads(durations_path().read_text())
    except (OSError, ValueError):
        return {}
    return {str(k): float(v) for k, v in data.items()} if isinstance(data, dict) else {}


def pytest_configure(config: pytest.Config) -> None:
    """Registered as a plugin (tests/conftest.py's `pytest_plugins`, or `-p tests.support.tiers`)."""
    config.pluginmanager.register(Tiers(), "moerl-tiers")
    config.pluginmanager.register(Order(config), "moerl-order")
