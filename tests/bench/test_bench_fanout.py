"""`moerl bench fanout`: the fan-out's bookkeeping for one version, the bitmaps the workers keep
now against the per-chunk sets they kept before, on a real embedded Valkey (small sizes:
seconds)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from benchmarks.fanout import run_bench_fanout
from moerl.errors import ConfigError
from moerl.store.fanout_book import FLUSH_S, REFRESH_S


def test_a_look_at_the_peers_is_one_get_per_peer_and_far_fewer_commands_than_before(tmp_path):
    peers, chunks, version_s = 6, 300, 4.0
    out = tmp_path / "fanout.json"
    rep = run_bench_fanout(
        out, peers=peers, chunks=chunks, version_s=version_s, windows=0, echo=lambda s: None
    )
    assert rep["ok"] and json.loads(out.read_text())["bench"] == "fanout" and rep["scale"] == 1.0
    before, after = rep["before"]["measured"], rep["after"]["measured"]
    # now: O(peers) per look, one GET of each other peer's bitmap, and at most one look per 0.5 s
    assert after["refreshes"] > 0 and rep["after_bitmap_gets"] == after["refreshes"] * (peers - 1)
    assert rep["after_gets_per_refresh"] == peers - 1
    assert after["refreshes"] <= peers * (rep["version_s"] / REFRESH_S + 1)
    assert "smembers" not in after["calls"] and "sadd" not in after["calls"]
    # announcements and counters batched: at most one flush per peer per FLUSH_S (and a final one),
    # each one SET of the bitmap and one counter script (whose own SET is its operation key)
    flushes = peers * (rep["version_s"] / FLUSH_S + 2)
    assert after["calls"]["evalsha"] <= flushes and after["calls"]["set"] <= 2 * flushes
    assert after["calls"]["evalsha"] < peers * chunks / 10
    # before: a SADD, an EXPIRE and a counter script per chunk, and SMEMBERS per peer per look
    assert before["calls"]["sadd"] == before["calls"]["expire"] == peers * chunks
    assert (
        before["calls"]["smembers"]
        == before["refreshes"] * (peers - 1)
        > after["refreshes"] * (peers - 1)
    )
    assert rep["ratios"]["commands"] >= 5 and before["commands"] >= 5 * after["commands"]
    assert rep["ratios"]["bytes_sent"] > 1
    assert (
        rep["before"]["per_version"]["valkey_cpu_s"]
        > rep["after"]["per_version"]["valkey_cpu_s"]
        > 0
    )


def test_windows_are_scaled_to_the_version(tmp_path):
    rep = run_bench_fanout(
        tmp_path / "w.json",
        peers=4,
        chunks=400,
        version_s=8.0,
        windows=2,
        window_s=1.0,
        echo=lambda s: None,
    )
    assert rep["measured_s"] == 2.0 and rep["scale"] == pytest.approx(rep["version_s"] / 2.0)
    after = rep["after"]
    assert after["per_version"]["commands"] == pytest.approx(
        after["measured"]["commands"] * rep["scale"]
    )
    # two 1 s windows: about two looks per peer per window, never more than 0.5 s apart
    assert 0 < after["measured"]["refreshes"] <= 4 * 2 * 3
    assert rep["ratios"]["commands"] > 3


def test_bad_arguments_are_refused_before_any_work(tmp_path):
    with pytest.raises(ConfigError, match="--peers"):
        run_bench_fanout(tmp_path / "x.json", peers=1)
    with pytest.raises(ConfigError, match="--windows"):
        run_bench_fanout(tmp_path / "x.json", windows=100, window_s=1.0, version_s=10.0)
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "moerl.cli",
            "bench",
            "fanout",
            "--chunks",
            "0",
            "--out",
            str(tmp_path / "x.json"),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2 and "--chunks" in proc.stderr
    assert not (tmp_path / "x.json").exists()
