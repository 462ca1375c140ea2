"""The benchmark package's pure parts: statistics, network counters read from files, the
projection, the expert-load counter and the memory-fit and serving formulas."""

from __future__ import annotations

import math
import statistics

import pytest

from benchmarks import netio
from benchmarks.project import (
    MODELS,
    Inputs,
    calibrate_bytes,
    formulas,
    project,
    remote_node_fraction,
)
from benchmarks.stats import distribution, noise_exceeded, percentile, summarize, t975
from moerl.errors import ConfigError


# -- stats --------------------------------------------------------------------------------------
def test_summary_matches_the_textbook_t_interval():
    xs = [10.0, 12.0, 11.0, 13.0, 9.0]
    s = summarize(xs)
    assert s["mean"] == pytest.approx(statistics.mean(xs))
    assert s["std"] == pytest.approx(statistics.stdev(xs))
    half = 2.776 * statistics.stdev(xs) / math.sqrt(5)  # t(0.975, 4)
    assert s["ci95"] == pytest.approx([11.0 - half, 11.0 + half])
    assert s["ci95"][0] < s["mean"] < s["ci95"][1]


def test_one_value_has_no_spread_and_bad_values_are_refused():
    assert summarize([3.0]) == {
        "n": 1,
        "mean": 3.0,
        "std": 0.0,
        "ci95": [3.0, 3.0],
        "min": 3.0,
        "max": 3.0,
    }
    with pytest.raises(ValueError, match="at least one"):
        summarize([])
    with pytest.raises(ValueError, match="finite"):
        summarize([1.0, float("nan")])
    with pytest.raises(ValueError):
        t975(0)
    assert t975(100) == 1.96


def test_percentiles_are_nearest_rank_and_measured_values():
    xs = list(range(1, 101))
    assert percentile(xs, 50) == 50 and percentile(xs, 90) == 90 and percentile(xs, 99) == 99
    assert percentile([5.0], 99) == 5.0
    d = distribution([0.3, 0.1, 0.2])
    assert d["p50"] == 0.2 and d["max"] == 0.3 and d["n"] == 3
    assert distribution([]) == {"n": 0}


def test_noise_is_exceeded_only_when_intervals_do_not_overlap():
    a, b = summarize([1.0, 1.1, 0.9]), summarize([2.0, 2.1, 1.9])
    assert noise_exceeded(a, b) is True
    assert noise_exceeded(a, summarize([1.05, 0.95, 1.2])) is False
    assert noise_exceeded(a, summarize([5.0])) is None


# -- network counters -----------------------------------------------------------------------------
PROC_NET_DEV = """Inter-|   Receive                                                |  Transmit
 face |bytes    packets errs drop fifo frame compressed multicast|bytes    packets errs drop fifo colls carrier compressed
    lo: 1000      10    0    0    0     0          0         0     2000      10    0    0    0     0       0          0
  eth0: 300       3    0    0    0     0          0         0      400       4    0    0    0     0       0          0
"""


def test_proc_net_dev_is_parsed_and_summed(tmp_path):
    assert netio.proc_net_dev(PROC_NET_DEV) == {"lo": (1000, 2000), "eth0": (300, 400)}
    f = tmp_path / "dev"
    f.write_text(PROC_NET_DEV)
    snap = netio.snapshot(ib_root=tmp_path / "no-ib", net_dev=f)
    assert snap.source == "proc-net-dev:eth0,lo" and snap.rx_bytes == 1300 and snap.tx_bytes == 2400


def test_efa_and_ib_counters_are_preferred_with_their_units(tmp_path):
    efa = tmp_path / "ib" / "rdmap0" / "ports" / "1" / "hw_counters"
    efa.mkdir(parents=True)
    (efa / "tx_bytes").write_text("5000\n")
    (efa / "rx_bytes").write_text("7000\n")
    ib = tmp_path / "ib" / "mlx5_0" / "ports" / "1" / "counters"
    ib.mkdir(parents=True)
    (ib / "port_xmit_data").write_text("10\n")  # 4-byte words
    (ib / "port_rcv_data").write_text("20\n")
    snap = netio.snapshot(ib_root=tmp_path / "ib", net_dev=tmp_path / "missing")
    assert snap.source == "rdma:mlx5_0/1,rdmap0/1"
    assert snap.tx_bytes == 5000 + 40 and snap.rx_bytes == 7000 + 80
    later = netio.Snapshot(snap.source, snap.tx_bytes + 100, snap.rx_bytes, snap.t + 2.0)
    d = netio.delta(snap, later)
    assert d["tx_bytes"] == 100 and d["rx_bytes"] == 0 and d["tx_mb_s"] == pytest.approx(50e-6)
    with pytest.raises(ValueError, match="differ"):
        netio.delta(snap, netio.Snapshot("proc-net-dev:lo", 0, 0))


# -- projection ---------------------------------------------------------------------------------
def test_remote_node_fraction_is_the_hypergeometric_expectation():
    assert remote_node_fraction(64, 8, 1) == 0.0
    # 2 nodes of 1 expert each, top-1: the other node with probability 1/2
    assert remote_node_fraction(2, 1, 2) == pytest.approx(0.5)
    # every expert chosen (k = E): every other node is hit
    assert remote_node_fraction(16, 16, 4) == pytest.approx(3.0)


def test_the_byte_model_agrees_with_the_dispatchers_own_counting():
    c = calibrate_bytes(experts=64, topk=8, nodes=4, gpus_per_node=2, tokens=4096)
    assert 0.97 < c["ratio_per_node_dedup"] < 1.03 and 0.97 < c["ratio_per_expert"] < 1.03


def test_projection_is_consistent_and_shows_where_the_gain_shrinks():
    rep = project(Inputs(model="qwen3-30b-a3b", nodes=4, decode_batch=128))
    base, fast = rep["dispatchers"]["nccl-a2a"], rep["dispatchers"]["deepep"]
    for side in (base, fast):
        d = side["decode"]
        assert d["step_s"] == pytest.approx(d["compute_s"] + d["comm_s"])
        assert d["comm_share"] == pytest.approx(d["comm_s"] / d["step_s"])
        assert d["output_tokens_per_s"] == pytest.approx(128 * 32 / d["step_s"])
        assert 0 < side["train"]["comm_share"] < 1
    assert fast["decode"]["comm_s"] < base["decode"]["comm_s"]  # node dedup + lower latency
    gains = [r["gain_trajectories"] for r in rep["sweep_env"]]
    # environment time dilutes the gain
    assert gains == sorted(gains, reverse=True) and gains[0] > gains[-1] > 0
    assert rep["gain"]["claim_holds"] == (rep["gain"]["trajectories"] >= 0.40)
    assert any("t_comm" in line for line in formulas()) and rep["formulas"] == formulas()
    # a single node has no inter-node traffic: both dispatchers differ only by latency
    one = project(Inputs(nodes=1, gpus_per_node=8))
    assert one["dispatchers"]["nccl-a2a"]["decode"]["bytes_inter_per_layer"] == 0.0


def test_projection_inputs_are_validated_naming_the_flag():
    with pytest.raises(ConfigError, match="--model"):
        project(Inputs(model="gpt-5"))
    with pytest.raises(ConfigError, match="do not split"):
        project(Inputs(model="qwen3-30b-a3b", nodes=3))
    with pytest.raises(ConfigError, match="--efficiency"):
        project(Inputs(efficiency=1.5))
    assert set(MODELS) == {"qwen3-30b-a3b", "qwen3-235b-a22b", "deepseek-v3"}


def test_bench_project_command_writes_report_summary_and_plots(tmp_path, capsys):
    from moerl.cli import main

    out = tmp_path / "proj"
    assert (
        main(["bench", "project", "--model", "deepseek-v3", "--nodes", "4", "--out-dir", str(out)])
        == 0
    )
    import json

    rep = json.loads((out / "report.json").read_text())
    assert rep["bench"] == "project" and rep["ok"] and rep["versions"]
    assert rep["inputs"]["model"] == "deepseek-v3" and rep["ep"] == 32
    for name in rep["plots"]:
        assert (out / name).stat().st_size > 1000
    assert (
        "t_comm" in (out / "summary.md").read_text()
        and "micro_batch_tokens_max" in (out / "summary.md").read_text()
    )
    assert [r["model"] for r in rep["memory_fit"]["rows"]] == [
        "Qwen3-30B-A3B",
        "Qwen3-235B-A22B",
        "DeepSeek-V3",
    ]
    assert "gain of deepep over nccl-a2a" in capsys.readouterr().out
    with pytest.raises(SystemExit) as exc:  # argparse: the allowed models are named
        main(["bench", "project", "--model", "nope", "--out-dir", str(out)])
    assert exc.value.code == 2 and "qwen3-30b-a3b" in capsys.readouterr().err
    # 128 experts over 24 GPUs
    assert main(["bench", "project", "--nodes", "3", "--out-dir", str(out)]) == 2


# -- expert loads -------------------------------------------------------------------------------
@pytest.mark.parametrize("architecture", ["qwen3_moe", "mixtral", "deepseek_v3"])
def test_expert_loads_count_every_real_token_k_times_and_ignore_padding(tmp_path, architecture):
    import torch
    from transformers import AutoModelForCausalLM

    from benchmarks.imbalance import expert_loads, imbalance
    from moerl.config import parse_config
    from moerl.models.families import family_of
    from moerl.models.tiny import build_tiny_model

    cfg = parse_config({"model": {"tiny": {"architecture": architecture}}})
    build_tiny_model(cfg.model.tiny, tmp_path)
    model = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32)
    seqs = [[5, 6, 7, 8, 9], [10, 11], [12, 13, 14]]
    counts = expert_loads(model, seqs, pad_id=0, batch_rows=2)
    k = cfg.model.tiny.experts_per_token
    moe_layers = len(family_of(model.config).moe_layer_ids(model.config))
    assert counts.shape == (moe_layers, cfg.model.tiny.num_experts)
    assert (counts.sum(dim=1) == 10 * k).all()  # 10 real tokens, k experts each, every layer
    # trailing pads are tokens too
    again = expert_loads(model, [seqs[0] + [0, 0, 0], seqs[1], seqs[2]], pad_id=0)
    assert (again.sum(dim=1) == 13 * k).all()
    ratios = imbalance(counts)
    assert all(r >= 1.0 for r in ratios)
    assert imbalance(torch.tensor([[2, 2, 2, 2]])) == [1.0] and imbalance(
        torch.tensor([[4, 0, 0, 0]])
    ) == [4.0]


def test_memory_fit_at_the_seeds_scale_reproduces_the_published_arithmetic():
    """Static memory per GPU with FSDP2 + EP over 128 H200 (fp32 master, grads and Adam: 16 bytes
    per parameter) and with the dense part replicated at EP 8, as docs/benchmarks.md states it;
    activation checkpointing is what lets the largest models take a useful micro-batch."""
    from benchmarks.memfit import FitInputs, choose_ep, fit

    on, off = FitInputs(), FitInputs(activation_checkpointing=False)
    expected = {
        "qwen3-30b-a3b": (3.81, 82.1),
        "qwen3-235b-a22b": (29.4, 581),
        "deepseek-v3": (83.9, 1581),
    }
    for name, (static, replicated) in expected.items():
        row = fit(MODELS[name], on)
        assert row["mesh"] == {"dp": 16, "ep": 8} and row["gpus"] == 128
        assert row["static_gb"] == pytest.approx(static, rel=0.01)
        assert row["static_gb_replicated_dense"] == pytest.approx(replicated, rel=0.01)
        assert (
            row["fits_static"]
            and row["micro_batch_tokens_max"] > fit(MODELS[name], off)["micro_batch_tokens_max"]
        )
    # 8192 tokens without checkpointing
    assert not fit(MODELS["deepseek-v3"], off)["fits_at_micro_batch_tokens"]
    assert fit(MODELS["deepseek-v3"], on)["fits_at_micro_batch_tokens"]
    # 16 GPUs cannot hold it
    assert not fit(MODELS["deepseek-v3"], FitInputs(nodes=2))["fits_static"]
    assert choose_ep(128, 8) == 8 and choose_ep(6, 8) == 6 and choose_ep(7, 4) == 1


def test_serving_a_version_to_the_fleet_follows_its_formulas():
    """benchmarks/redistribution.py, checked by hand for Qwen3-235B-A22B (470 GB in BF16) at 32
    rollout nodes: S3 is capped by the prefix's request rate, one cache node by its link, and the
    fan-out by the slower of a node's TCP link and the tier."""
    from benchmarks.redistribution import FleetInputs, serve_times

    r = serve_times("Qwen3-235B-A22B", 235e9, FleetInputs())
    S = 470e9
    assert r["efa_bound_s"] == pytest.approx(S / 400e9)
    assert r["s3_only_s"] == pytest.approx(32 * S / (5500 * 8 * 2**20))  # the prefix ceiling binds
    assert r["cache_tier_s"] == pytest.approx(32 * S / 6.25e9)
    assert r["fanout_s"] == pytest.approx(S / 6.25e9 + 32 * 64 * 2**20 / 12.5e9)
    more = serve_times("Qwen3-235B-A22B", 235e9, FleetInputs(cache_nodes=2))
    # now the node links bind
    assert more["fanout_s"] == pytest.approx(S / 12.5e9 + 32 * 64 * 2**20 / 12.5e9)
    assert r["fanout_vs_s3"] > 4 and more["fanout_vs_s3"] > 8
    # one node: every path is one copy over its link
    # the collective path: every trainer rank's share over EFA at eta of line rate, no S3, no disk
    eta_efa = 0.5 * 400e9
    wire = S / eta_efa + 32 * 64 * 2**20 / eta_efa + S / (16 * 8 * 400e9)
    assert r["collective_s"] == pytest.approx(wire)
    assert r["files_s"] == pytest.approx(r["servable_s"] + r["fanout_s"])
    assert r["files_vs_collective"] == pytest.approx(r["files_s"] / wire)
    assert r["collective_s"] < 5 < 60 < r["files_s"]  # seconds against minutes at the seed's scale
    slower = serve_times("Qwen3-235B-A22B", 235e9, FleetInputs(wire_efficiency=0.25))
    assert slower["collective_s"] > r["collective_s"] and slower["files_s"] == r["files_s"]
    one = serve_times("x", 1e9, FleetInputs(rollout_nodes=1))
    assert one["s3_only_s"] == pytest.approx(2e9 / 12.5e9)
