"""The suite's tier guard, work units and order (tests/support/tiers.py), on small suites run
in-process by pytester with the plugin loaded as `make test` loads it."""

import json

import pytest

from tests.support.gloo_world import GROUP
from tests.support.tiers import group_of

ENGINE_VIA_HELPER = """
def _start(path):
    from moerl.components.rollout.engine import RolloutEngine

    return RolloutEngine(path, None)


def _indirect(path):
    return _start(path)


{marker}
def test_starts_an_engine(tmp_path):
    '''RolloutEngine( in a docstring is not a use.'''
    _indirect(tmp_path)
"""


@pytest.fixture
def suite(pytester, tmp_path, monkeypatch):
    monkeypatch.setenv("MOERL_TEST_DURATIONS", str(tmp_path / "durations.json"))
    pytester.makeini("[pytest]\nmarkers =\n    slow: x\n    nightly: x\n    gpu: x\n")
    return pytester


def _collect(suite, *args):
    return suite.runpytest_inprocess("-p", "tests.support.tiers", "--collect-only", "-q", *args)


def test_an_engine_started_through_a_helper_without_a_tier_fails_collection(suite):
    suite.makepyfile(test_engine=ENGINE_VIA_HELPER.format(marker=""))
    res = _collect(suite)
    assert res.ret != 0
    res.stderr.fnmatch_lines(
        ["*test_engine.py::test_starts_an_engine: uses a vLLM engine without its tier's marker*"]
    )


@pytest.mark.parametrize("marker", ["@pytest.mark.slow", "@pytest.mark.nightly"])
def test_either_tier_marker_admits_an_engine(suite, marker):
    suite.makepyfile(test_engine="import pytest\n" + ENGINE_VIA_HELPER.format(marker=marker))
    assert _collect(suite).ret == 0


def test_a_docstring_or_comment_is_not_a_use(suite):
    suite.makepyfile(
        test_words="""
def test_words():
    '''Compares with RolloutEngine( and run_async_cli(.'''
    # GRPOTrainer( is what TRL calls it
    assert True
"""
    )
    assert _collect(suite).ret == 0


def test_the_trl_arm_needs_the_nightly_tier_and_a_fixture_counts(suite):
    suite.makepyfile(
        test_peer="""
import pytest


@pytest.fixture
def arm():
    return _trl_arm(1)


def _trl_arm(n):
    return n


@pytest.mark.slow
def test_peer(arm):
    assert arm == 1
"""
    )
    res = _collect(suite)
    assert res.ret != 0
    res.stderr.fnmatch_lines(["*test_peer: uses the TRL arm*(@pytest.mark.nightly)*"])


def test_the_unit_tier_may_not_start_a_run(suite):
    for d in ("proj", "proj/tests", "proj/tests/unit"):  # a package of its own name
        suite.mkpydir(d)
    (suite.path / "proj/tests/unit/test_run.py").write_text(
        "def test_run(tmp_path):\n    run_async_cli(tmp_path, 'c.yaml', 'e', 1)\n"
    )
    res = _collect(suite, "proj")
    assert res.ret != 0
    res.stderr.fnmatch_lines(["*test_run.py::test_run: a unit test uses an async run*"])


def test_every_test_is_grouped_and_the_longest_group_goes_first(suite, tmp_path):
    suite.makepyfile(
        test_a="import time\n\ndef test_a1():\n    time.sleep(0.01)\n\ndef test_a2():\n    pass\n",
        test_b="import time\n\ndef test_b1():\n    time.sleep(0.3)\n",
        test_c="TEST_GROUP = 'shared'\n\ndef test_c1():\n    pass\n",
    )
    # a first run writes the durations of what it ran
    assert suite.runpytest_inprocess("-p", "tests.support.tiers", "-q").ret == 0
    times = json.loads((tmp_path / "durations.json").read_text())
    assert set(times) == {
        "test_a.py::test_a1",
        "test_a.py::test_a2",
        "test_b.py::test_b1",
        "test_c.py::test_c1",
    }
    assert times["test_b.py::test_b1"] >= 0.3 > times["test_a.py::test_a1"]
    # the next collection puts the longest first (b), and a selection is ordered by what it
    # selected: without test_b1, a (0.01 s) goes before c; a module's group is its path, or
    # its TEST_GROUP
    res = suite.runpytest_inprocess("-p", "tests.support.tiers", "-q", "--collect-only")
    ids = [line for line in res.stdout.lines if "::" in line]
    assert ids[0] == "test_b.py::test_b1", ids
    res = suite.runpytest_inprocess(
        "-p", "tests.support.tiers", "-q", "--collect-only", "-k", "not b1 and not a2"
    )
    ids = [line for line in res.stdout.lines if "::" in line]
    assert ids == ["test_a.py::test_a1", "test_c.py::test_c1"], ids
    assert group_of(suite.path, "test_a.py") == "test_a.py"
    assert group_of(suite.path, "test_c.py") == "shared"


def test_a_group_imported_under_test_group_is_the_support_modules_name(tmp_path):
    (tmp_path / "test_w.py").write_text(
        "from tests.support.gloo_world import GROUP as TEST_GROUP\n\ndef test_w():\n    pass\n"
    )
    assert group_of(tmp_path, "test_w.py") == GROUP == "gloo-worlds"
    assert group_of(tmp_path, "missing.py") == "missing.py"
