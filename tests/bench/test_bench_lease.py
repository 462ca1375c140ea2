"""`moerl bench lease`: a worker's lease as the pending list grows, the bus's way against the
XAUTOCLAIM paging it replaced, on a real embedded Valkey (no engine: quick)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from benchmarks.lease import run_bench_lease
from moerl.errors import ConfigError


def test_a_lease_is_one_command_however_long_the_pending_list(tmp_path):
    out = tmp_path / "lease.json"
    rep = run_bench_lease([0, 64], 10, out, echo=lambda s: None)
    assert rep["ok"] and json.loads(out.read_text())["bench"] == "lease"
    short, long = rep["rows"]
    assert (short["pending"], long["pending"]) == (0, 64)
    for row in rep["rows"]:
        old, new = row["xautoclaim"], row["bus"]
        assert old["leases"] == new["leases"] == 10
        # XREADGROUP per lease, and one look for idle units (XPENDING IDLE) in the first
        assert new["commands_per_lease"] == pytest.approx(1.1, abs=0.15)
        assert 0 < new["median_ms"] <= new["p90_ms"]
        assert row["median_ratio"] == pytest.approx(old["median_ms"] / new["median_ms"])
    # the baseline pages through every busy entry, ten per XAUTOCLAIM call
    assert long["xautoclaim"]["commands_per_lease"] >= 64 / 10 + 2
    assert long["xautoclaim"]["commands_per_lease"] > short["xautoclaim"]["commands_per_lease"]


def test_bad_arguments_are_refused_before_any_work(tmp_path):
    with pytest.raises(ConfigError, match="--leases"):
        run_bench_lease([0], 0, tmp_path / "x.json")
    with pytest.raises(ConfigError, match="--pending"):
        run_bench_lease([-1], 5, tmp_path / "x.json")
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "moerl.cli",
            "bench",
            "lease",
            "--pending",
            "a,b",
            "--out",
            str(tmp_path / "x.json"),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2 and "--pending" in proc.stderr
    assert not (tmp_path / "x.json").exists()
