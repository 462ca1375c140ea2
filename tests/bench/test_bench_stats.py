"""The benchmark package's measured parts: the live network counters on loopback traffic, and
`moerl compare` over real MLflow runs (a sqlite store). The pure parts (statistics, counters
parsed from files, the projection) are in tests/unit/test_bench_stats.py."""

from __future__ import annotations

import statistics

import pytest

from benchmarks import netio


# -- network counters ---------------------------------------------------------------------------
def test_the_live_counters_move_with_loopback_traffic():
    import socket

    before = netio.snapshot()
    with socket.socket() as srv:
        srv.bind(("127.0.0.1", 0))
        srv.listen(1)
        with socket.create_connection(srv.getsockname()) as c:
            conn, _ = srv.accept()
            c.sendall(b"x" * 200_000)
            got = 0
            while got < 200_000:
                got += len(conn.recv(65536))
            conn.close()
    d = netio.delta(before, netio.snapshot())
    assert d["tx_bytes"] >= 200_000 and d["rx_bytes"] >= 200_000


# -- compare ------------------------------------------------------------------------------------
def _training_run(
    client, exp_id: str, lr: str, rewards: list[float], iteration_s: list[float]
) -> str:
    run = client.create_run(exp_id)
    rid = run.info.run_id
    client.log_param(rid, "trainer.optimizer.learning_rate", lr)
    client.log_param(rid, "task.dataset", "builtin:digits-copy")
    for i, (r, t) in enumerate(zip(rewards, iteration_s)):
        client.log_metric(rid, "reward/mean", r, step=i)
        client.log_metric(rid, "timing/iteration_s", t, step=i)
        client.log_metric(rid, "timing/rollout_s", 0.6 * t, step=i)
        client.log_metric(rid, "timing/policy_update_s", 0.3 * t, step=i)
        client.log_metric(rid, "rollout/samples", 64.0, step=i)
    client.set_terminated(rid, "FINISHED")
    return rid


def test_compare_reports_differing_params_deltas_noise_and_plots(tmp_path, capsys):
    from mlflow.tracking import MlflowClient

    from benchmarks.compare import run_compare

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    client = MlflowClient(uri)
    exp = client.create_experiment("moerl", artifact_location=(tmp_path / "art").as_uri())
    a = _training_run(
        client, exp, "1e-3", [0.1, 0.2, 0.3, 0.40, 0.42, 0.41], [10.0, 10.2, 9.9, 10.1, 10.0, 9.8]
    )
    b = _training_run(
        client, exp, "2e-3", [0.1, 0.3, 0.5, 0.70, 0.72, 0.71], [10.1, 9.9, 10.0, 10.2, 9.9, 10.0]
    )
    rep = run_compare([a, b], tracking_uri=uri, out_dir=tmp_path / "cmp")
    assert rep["differing_params"] == {"trainer.optimizer.learning_rate": ["1e-3", "2e-3"]}
    rows = {(m["metric"], m["run"]): m for m in rep["metrics"]}
    reward_b = rows[("reward/mean", b)]
    assert reward_b["mean"] == pytest.approx(0.71) and reward_b["delta"] == pytest.approx(
        0.71 - 0.41
    )
    assert reward_b["exceeds_noise"] is True  # last-3 intervals far apart
    assert rows[("timing/iteration_s", b)]["exceeds_noise"] is False  # same speed within noise
    assert rows[("rollout/samples_per_s", a)]["mean"] == pytest.approx(
        statistics.mean([64 / t for t in [10.0, 10.2, 9.9, 10.1, 10.0, 9.8]])
    )
    for m in rep["metrics"]:
        assert m["ci95"][0] <= m["mean"] <= m["ci95"][1]
    for name in rep["plots"]:
        assert (tmp_path / "cmp" / name).stat().st_size > 1000
    assert {"reward_curves.png", "stages.png", "throughput.png"} <= set(rep["plots"])
    logged = client.get_run(rep["mlflow_run_id"])
    assert logged.data.tags["moerl.compare"] == f"{a},{b}"
    arts = {f.path for f in client.list_artifacts(rep["mlflow_run_id"], "compare")}
    assert "compare/report.json" in arts and "compare/reward_curves.png" in arts
    out = capsys.readouterr().out
    assert (
        "EXCEEDS noise" in out
        and "within noise" in out
        and "trainer.optimizer.learning_rate" in out
    )


def test_compare_refuses_unknown_runs_and_a_single_run(tmp_path):
    from moerl.cli import main

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    assert (
        main(
            [
                "compare",
                "0123456789abcdef0123456789abcdef",
                "fedcba9876543210fedcba9876543210",
                "--tracking-uri",
                uri,
                "--out-dir",
                str(tmp_path / "c"),
            ]
        )
        == 2
    )
    assert (
        main(
            [
                "compare",
                "0123456789abcdef0123456789abcdef",
                "--tracking-uri",
                uri,
                "--out-dir",
                str(tmp_path / "c"),
            ]
        )
        == 2
    )
