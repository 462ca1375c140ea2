"""`moerl bench trainer-versions` on a (1, 2) gloo mesh, two versions: both arms run for real
(`run_policy_update` spawning its ranks each version; ranks spawned once, a session loaded
once), the report holds both, the persistent arm loads nothing per version, and both arms'
weights were compared. Nothing about speed is asserted beyond overheads being positive."""

from __future__ import annotations

import json

import pytest

from benchmarks.trainer_versions import parse_mesh, run_bench_trainer_versions
from moerl.errors import ConfigError


def test_bad_arguments_are_refused_before_any_rank(tmp_path):
    for bad in ("2", "2x", "0x2", "1x1", "axb"):
        with pytest.raises(ConfigError, match="--mesh"):
            parse_mesh(bad)
    assert parse_mesh("2X2") == (2, 2)
    with pytest.raises(ConfigError, match="--samples: 1"):
        run_bench_trainer_versions(tmp_path, versions=1, mesh=(1, 2), samples=1)
    with pytest.raises(ConfigError, match="must be divisible by"):
        run_bench_trainer_versions(tmp_path, mesh=(1, 3))
    assert not (tmp_path / "report.json").exists()


@pytest.mark.nightly  # a real benchmark run (docs/testing.md)
def test_bench_trainer_versions_smoke(tmp_path, capsys):
    out = tmp_path / "bench"
    rep = run_bench_trainer_versions(out, versions=2, mesh=(1, 2), steps=1, samples=4)
    on_disk = json.loads((out / "report.json").read_text())
    assert on_disk["bench"] == "trainer-versions" and on_disk["ok"] is True
    assert {"mesh", "versions_per_arm", "summary", "weights", "rows", "persistent_one_time"} <= set(
        on_disk
    )
    assert on_disk["mesh"] == [1, 2] and on_disk["versions_per_arm"] == 2
    assert "torch" in json.dumps(on_disk["versions"])  # the envelope's provenance, not ours
    s = rep["summary"]
    assert set(s["arms"]) == {"restart", "persistent"}
    assert s["overhead_ratio"] > 0 and len(s["overhead_ratio_per_repeat"]) == 1
    for arm in ("restart", "persistent"):
        a = s["arms"][arm]
        assert a["versions"] == 2
        assert a["median_overhead_s"] > 0 and a["median_steps_s"] > 0
        assert 0 < a["median_non_training_fraction"] < 1
    rows = rep["rows"]
    assert sorted((r["arm"], r["version"]) for r in rows) == [
        ("persistent", 1),
        ("persistent", 2),
        ("restart", 1),
        ("restart", 2),
    ]
    for r in rows:
        assert r["overhead_s"] > 0 and r["steps_s"] > 0 and r["train_steps"] == 1, r
        assert r["wall_s"] == pytest.approx(r["steps_s"] + r["overhead_s"])
        if r["arm"] == "persistent":  # loaded once, before the first version
            assert r["load_s"] == 0 and r["session_loads"] == 0, r
            assert r["outer_wall_s"] >= r["wall_s"]
        else:  # every version reads the previous one's files
            assert r["load_s"] > 0 and r["session_loads"] == 1, r
    one = rep["persistent_one_time"]
    assert len(one) == 1 and one[0]["start_s"] >= one[0]["load_s"] > 0
    # the weights check ran after every version and training moved the weights
    w = rep["weights"]
    assert [d["version"] for d in w["per_version"]] == [1, 2]
    assert w["max_abs_diff"] <= w["tolerance"] == 1e-5
    assert w["moved"] > 1e-4
    md = (out / "summary.md").read_text()
    printed = capsys.readouterr().out
    for text in (md, printed):
        assert "restart / persistent" in text and "persistent" in text and "agree" in text
