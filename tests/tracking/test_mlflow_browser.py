"""What an operator sees comparing runs in MLflow's UI, checked in a real browser.

A real `mlflow server` on 127.0.0.1 tracks two short moerl runs (the async mode, `moerl run
--mode async`'s code path, at two learning rates). Headless Chromium (Debian's package, pinned
in the Makefile and installed by scripts/install_browser.sh) renders MLflow's compare view and
its metric view of `reward/mean`; the rendered DOM must hold both runs, the parameter that
differs with both values, and one reward curve per run. The screenshots are kept under
$MOERL_TEST_ARTIFACTS (default .moerl/test-artifacts).

Where the browser could not be installed by the project's setup, the test skips with the
reason the setup recorded (`make test` prints skip reasons: pytest -rs).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import urllib.parse
from pathlib import Path

import pytest

from moerl.config import load_config
from moerl.orchestrate.async_run import run_async
from tests.support.mlflow_server import mlflow_server

pytestmark = pytest.mark.nightly  # the MLflow UI in a headless browser (docs/testing.md)
ROOT = Path(__file__).resolve().parents[2]
SETUP_NOTE = ROOT / ".venv" / "moerl-browser.txt"
RATES = (2e-3, 2e-4)


def _chromium() -> str:
    path = shutil.which("chromium") or shutil.which("chromium-browser")
    if path:
        return path
    note = (
        SETUP_NOTE.read_text().strip()
        if SETUP_NOTE.is_file()
        else "scripts/install_browser.sh has not run"
    )
    pytest.skip(f"no headless Chromium: {note.removeprefix('skip: ')}")


def _render(chromium: str, url: str, screenshot: Path) -> str:
    """The page's DOM once its scripts ran (virtual time: the React app's requests and
    rendering settle without a fixed sleep), and a screenshot of it."""
    flags = [
        chromium,
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-dev-shm-usage",
        "--virtual-time-budget=20000",
        "--window-size=1600,1200",
    ]
    dom = subprocess.run(
        [*flags, "--dump-dom", url], capture_output=True, text=True, timeout=180, check=True
    ).stdout
    subprocess.run(
        [*flags, f"--screenshot={screenshot}", url], capture_output=True, timeout=180, check=True
    )
    return dom


@pytest.fixture(scope="module")
def two_runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("browser")
    with mlflow_server(root) as url:
        ids = []
        for lr in RATES:
            work = root / f"lr{lr}"
            cfg = load_config(
                ROOT / "configs/tiny-moe-grpo.yaml",
                [
                    f"tracking.uri={url}",
                    "tracking.experiment=compare",
                    f"tracking.run_name=lr-{lr}",
                    f"trainer.optimizer.learning_rate={lr}",
                    f"checkpoint.uri={work / 'ckpt'}",
                    f"checkpoint.cache_dir={work / 'cache'}",
                    f"pipeline.work_dir={work / 'work'}",
                    "pipeline.versions=3",
                    "task.prompts_per_iteration=8",
                    "rollout.samples_per_prompt=4",
                    "trainer.optimizer.optimizer_steps_per_iteration=2",
                    "units.max_prompts=4",
                    "buffer.max_staleness=1",
                    "rollout.workers=1",
                    "reward.scorers=1",
                ],
                mode="async",
            )
            summary = run_async(cfg)
            assert summary.ok, f"the async run at learning rate {lr} failed"
            ids.append(summary.run_id)
        yield url, ids


def _artifacts() -> Path:
    out = Path(os.environ.get("MOERL_TEST_ARTIFACTS", ROOT / ".moerl" / "test-artifacts"))
    out.mkdir(parents=True, exist_ok=True)
    return out


def _experiment_id(url: str) -> str:
    from mlflow.tracking import MlflowClient

    return MlflowClient(url).get_experiment_by_name("compare").experiment_id


def _q(value) -> str:
    return urllib.parse.quote(json.dumps(value))


def _text(dom: str) -> str:
    """The page's visible text, tags removed, whitespace collapsed."""
    return re.sub(r"\s+", " ", re.sub(r"<[^>]+>", " ", dom))


def test_the_compare_view_shows_both_runs_and_the_parameter_that_differs(two_runs):
    chromium = _chromium()
    url, ids = two_runs
    page = f"{url}/#/compare-runs?runs={_q(ids)}&experiments={_q([_experiment_id(url)])}"
    shot = _artifacts() / "mlflow-compare.png"
    text = _text(_render(chromium, page, shot))
    assert "Comparing 2 Runs" in text
    for lr, run_id in zip(RATES, ids):
        assert f"lr-{lr}" in text and run_id in text
    # the learning rate's row holds both values; a parameter both runs share holds one twice
    # the plot's axis label comes first
    rows = re.findall(r"trainer\.optimizer\.learning_rate (\S+) (\S+) ", text)
    assert (str(RATES[0]), str(RATES[1])) in rows, rows
    assert ("builtin:digits-copy", "builtin:digits-copy") in re.findall(
        r"task\.dataset (\S+) (\S+) ", text
    )
    # the parameters table's control to keep only the rows that differ
    assert "Show diff only" in text
    assert shot.stat().st_size > 10_000


def test_the_metric_view_plots_a_reward_curve_per_run(two_runs):
    chromium = _chromium()
    url, ids = two_runs
    page = (
        f"{url}/#/metric?runs={_q(ids)}&metric={_q('reward/mean')}&experiments={_q([_experiment_id(url)])}"
        f"&plot_metric_keys={_q(['reward/mean'])}"
    )
    shot = _artifacts() / "mlflow-reward-curves.png"
    dom = _render(chromium, page, shot)
    text = _text(dom)
    for lr in RATES:  # the plot's legend, one entry per run
        assert f"lr-{lr} (reward/mean)" in text
    # plotly draws one opaque line per run through every logged step (and a faint copy of each,
    # the unsmoothed line behind the smoothed one)
    lines = re.findall(r'<path class="js-line" d="([^"]+)" style="[^"]*stroke-opacity: 1;', dom)
    assert len(lines) == len(RATES), len(lines)
    traces = lines
    assert all(d.count("L") >= 2 for d in traces)  # 3 versions: 3 points, 2 segments each
    assert shot.stat().st_size > 10_000
