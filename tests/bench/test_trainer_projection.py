"""The trainer's per-version overhead on paper (benchmarks/trainer_projection.py): the formulas by
hand on small numbers, how the terms move with the inputs, and its place in `moerl bench
project`."""

from __future__ import annotations

import json

import pytest

from benchmarks.trainer_projection import VersionInputs, version_table, version_times
from moerl.errors import ConfigError

GB = 1e9

# Small numbers: 2 nodes x 2 GPUs; a rank writes 1 GB/s and reads 2 GB/s; NVMe does not bind;
# S3 1.5 GB/s per node with a PUT ceiling far above it; gather 4, publisher 2, cache 1 GB/s.
SMALL = VersionInputs(
    nodes=2,
    gpus_per_node=2,
    rank_write_gbps=1.0,
    rank_read_gbps=2.0,
    nvme_write_gbps=10.0,
    nvme_read_gbps=10.0,
    s3_gbps=1.5,
    s3_put_per_s=1e6,
    gather_gbps=4.0,
    publisher_gbps=2.0,
    cache_gbps=1.0,
    start_s=5.0,
    train_s=10.0,
)


def test_every_term_by_hand_on_small_numbers():
    r = version_times("m", 1e9, 1e8, 1e8, SMALL)
    b, a = r["before"], r["after"]
    # r_w = min(2 * 1, 10) = 2 GB/s, r_r = min(2 * 2, 10) = 4, r_s3 = min(2 * 1, 1.5) = 1.5
    assert b["restart_s"] == 5.0
    assert b["load_s"] == pytest.approx(1e9 * 12 / (2 * 4 * GB))  # 1.5
    assert b["optimizer_dcp_s"] == pytest.approx(1e9 * 8 / (2 * 2 * GB))  # 2
    assert b["hf_rank0_s"] == pytest.approx(4 / 4 + 2 / 1)  # gather fp32, write bf16 at b_w
    assert b["master_copy_s"] == pytest.approx(4 / 4 + 4 / 1)
    assert b["critical_path_s"] == pytest.approx(5 + 1.5 + 10 + 2 + 3 + 5)
    assert b["publication_s"] == pytest.approx(14 / 1 + 14 / 2)  # cache tier at 1, S3 at 2
    assert b["version_s"] == pytest.approx(26.5) and not b["publication_bounds"]
    assert b["not_training"] == pytest.approx(1 - 10 / 26.5)
    assert a["export_s"] == pytest.approx(2 / (2 * 2) + 0.1 * 2 / 4)  # 0.55
    # the state to each node's disk on the critical path; to S3 with the publication
    assert a["state_s"] == pytest.approx(12 / (2 * 2)) and not a["state_prefix_bound"]
    assert a["critical_path_s"] == pytest.approx(10 + 0.55 + 3)
    assert a["publication_s"] == pytest.approx(2 / 1 + (2 + 12) / (2 * 1.5))
    assert a["not_training"] == pytest.approx(1 - 10 / 13.55)
    # resume: restart + the state read in parallel, min(G * b_r, b_s3) = 1.5 GB/s per node
    assert r["resume_s"]["before"] == pytest.approx(5 + 12 / (2 * 1.5))
    assert r["resume_s"]["after"] == r["resume_s"]["before"]  # k = 1: nothing to train again
    gb_b, gb_a = r["gb_per_version"]["before"], r["gb_per_version"]["after"]
    assert (gb_b["local_write"], gb_b["local_read"], gb_b["into_rank0"]) == (14, 12, 8)
    assert (gb_b["publisher_pod_out"], gb_b["cache_tier"], gb_b["s3"]) == (28, 14, 14)
    assert gb_a == {
        "local_write": 2,
        "all_gathered_per_rank": pytest.approx(0.2),
        "cache_tier": 2,
        "s3": 14,
    }


def test_the_put_ceiling_state_every_and_the_master_copy():
    from dataclasses import replace

    # 100 PUT/s x 8 MiB = 0.84 GB/s per prefix, below the nodes' 3 GB/s
    r = version_times("m", 1e9, 1e8, 1e8, replace(SMALL, s3_put_per_s=100.0))
    assert r["after"]["state_prefix_bound"]
    assert r["after"]["publication_s"] == pytest.approx(2 + 14e9 / (100 * 8 * 2**20))
    assert r["after"]["publication_bounds"]
    k3 = version_times("m", 1e9, 1e8, 1e8, replace(SMALL, state_every=3))
    assert k3["after"]["state_s"] == pytest.approx(3 / 3)
    assert k3["gb_per_version"]["after"]["s3"] == pytest.approx(2 + 12 / 3)
    assert k3["resume_s"]["after"] == pytest.approx(
        k3["resume_s"]["before"] + 1 * k3["after"]["version_s"]
    )
    same = version_times("m", 1e9, 1e8, 1e8, replace(SMALL, serving_bytes=4.0))
    assert same["before"]["master_copy_s"] == 0.0
    assert same["gb_per_version"]["before"]["local_write"] == 12  # Adam 8 + weights 4
    # the training formula when no time is given: 6 * Pa * T / (W * F * eta)
    t = version_times("m", 1e9, 1e8, 1e8, replace(SMALL, train_s=None))
    assert t["before"]["train_s"] == pytest.approx(6 * 1e8 * 256 * 16 * 4096 / (4 * 989e12 * 0.4))
    with pytest.raises(ConfigError, match="state_every"):
        version_times("m", 1e9, 1e8, 1e8, replace(SMALL, state_every=0))
    with pytest.raises(ConfigError, match="s3_gbps"):
        version_times("m", 1e9, 1e8, 1e8, replace(SMALL, s3_gbps=0))


def test_more_nodes_shrink_the_after_export_not_the_before_gather():
    from dataclasses import replace

    from benchmarks.project import MODELS

    shape = MODELS["deepseek-v3"]
    rows = [
        version_times(
            shape.name,
            shape.total_params,
            shape.active_params,
            shape.total_params - shape.expert_params,
            VersionInputs(nodes=n),
        )
        for n in (4, 8, 16, 32)
    ]
    exports = [r["after"]["export_s"] for r in rows]
    gathers = [r["before"]["hf_rank0_s"] + r["before"]["master_copy_s"] for r in rows]
    assert all(x > y for x, y in zip(exports, exports[1:]))
    assert gathers == [pytest.approx(gathers[0])] * 4 and gathers[0] > 100 * exports[-1]
    # a faster gather shortens the before's rank-0 term, bounded below by one rank's writes
    fast = version_times(
        shape.name,
        shape.total_params,
        shape.active_params,
        shape.total_params - shape.expert_params,
        replace(VersionInputs(), gather_gbps=1e6),
    )
    p, b_w = shape.total_params, 19.9 / 27.4 * GB
    assert fast["before"]["hf_rank0_s"] == pytest.approx(p * 2 / b_w, rel=1e-4)
    assert fast["before"]["hf_rank0_s"] < rows[2]["before"]["hf_rank0_s"]


def test_both_seed_models_in_bench_project(tmp_path, capsys):
    import argparse

    from benchmarks.project import add_project_args, trainer_version
    from moerl.cli import main

    out = tmp_path / "proj"
    assert main(["bench", "project", "--out-dir", str(out)]) == 0
    text = capsys.readouterr().out
    tv = json.loads((out / "report.json").read_text())["trainer_version"]
    assert [r["model"] for r in tv["rows"]] == ["Qwen3-235B-A22B", "DeepSeek-V3"]
    assert tv["inputs"]["nodes"] == 16 and tv["inputs"]["cache_gbps"] == pytest.approx(6.25)
    for r in tv["rows"]:
        assert 0 < r["after"]["not_training"] < r["before"]["not_training"] < 1
        assert r["gb_per_version"]["after"]["cache_tier"] == pytest.approx(r["params"] * 2 / GB)
    assert "trainer per version on 16 x 8 GPUs" in text and "DeepSeek-V3" in text
    summary = (out / "summary.md").read_text()
    assert "T_exp" in summary and "T_hf" in summary
    # the mesh size is the memory fit's --trainer-nodes
    p = argparse.ArgumentParser()
    add_project_args(p)
    wide = trainer_version(p.parse_args(["--trainer-nodes", "32"]))
    assert wide["inputs"]["nodes"] == 32
    assert wide["rows"][0]["after"]["export_s"] < tv["rows"][0]["after"]["export_s"]
    with pytest.raises(ConfigError, match="--cache-nodes"):
        trainer_version(p.parse_args(["--cache-nodes", "0"]))
    assert version_table([], VersionInputs())["rows"] == []
