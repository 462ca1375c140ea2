"""Rollout engines on a node's GPUs (moerl/launch/layout.py, moerl/models/sizes.py): engines per
pod, their devices, the workers a pod hosts, pod sizing, and the engine memory fit."""

from __future__ import annotations

import json

import pytest

from moerl.components.rollout.pod import pod_exit, worker_env
from moerl.components.rollout.worker import EXIT_DRAINED
from moerl.config import parse_config
from moerl.errors import ConfigError
from moerl.launch import objects
from moerl.launch.layout import (
    PodLayout,
    check_engine_fit,
    choose_layouts,
    engine_fit,
    pod_layout,
    pod_workers,
    rollout_pod_layout,
    rollout_pods,
)
from moerl.models.sizes import SEED_CONFIGS, model_sizes


def _cfg(rollout=None, launch=None, groups=None):
    return parse_config(
        {
            "checkpoint": {"uri": "s3://moerl-ckpt/prod"},
            "pipeline": {"base_image": "registry.example/moerl:1"},
            "rollout": {"device": "cuda", **(rollout or {})},
            "cluster": {"launch": {"mode": "kubernetes", **(launch or {})}, "groups": groups or {}},
        }
    )


def _bf16(name):
    hf = dict(SEED_CONFIGS[name])
    hf.pop("quantization_config", None)
    return hf


# ---- engines per pod ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("tp", "dp", "engines", "slices"),
    [
        (1, 1, 8, [(i,) for i in range(8)]),  # Qwen3-30B-A3B: 8 x TP1
        (4, 1, 2, [(0, 1, 2, 3), (4, 5, 6, 7)]),  # Qwen3-235B-A22B: 2 x TP4
        (1, 8, 1, [tuple(range(8))]),  # Qwen3-235B-A22B: 1 x DP8-EP8
        (2, 2, 2, [(0, 1, 2, 3), (4, 5, 6, 7)]),
    ],
)
def test_a_pod_runs_gpus_over_tp_x_dp_engines_each_on_its_own_devices(tp, dp, engines, slices):
    layout = pod_layout(8, tp, dp)
    assert (layout.engines, layout.devices_per_engine) == (engines, tp * dp)
    assert layout.slices() == slices
    used = [d for s in layout.slices() for d in s]
    assert sorted(used) == list(range(8))  # every GPU once


def test_an_engine_over_nodes_has_every_gpu_of_each_node():
    layout = pod_layout(8, 1, 32, nodes=4)  # DeepSeek-V3: DP32-EP32 over 4 nodes
    assert (layout.engines, layout.devices_per_engine) == (1, 32)
    assert layout.slices() == [tuple(range(8))]  # this node's share: its 8 GPUs
    with pytest.raises(ConfigError, match="spans 32; set them equal"):
        pod_layout(8, 1, 16, nodes=4)
    # a tensor-parallel group across nodes, or DP ranks that do not split evenly over them
    for tp, dp, nodes in [(16, 1, 2), (3, 8, 3)]:
        with pytest.raises(ConfigError, match="splits its data-parallel ranks evenly"):
            pod_layout(8, tp, dp, nodes=nodes)


@pytest.mark.parametrize(("tp", "dp"), [(3, 1), (1, 3), (16, 1), (2, 8)])
def test_a_layout_that_does_not_divide_the_pod_or_exceeds_it_is_refused(tp, dp):
    with pytest.raises(ConfigError) as e:
        pod_layout(8, tp, dp, gpus_key="cluster.launch.rollout_gpus_per_node")
    msg = str(e.value)
    assert "rollout.tensor_parallel_size x rollout.data_parallel_size" in msg
    assert f"{tp} x {dp} = {tp * dp} GPUs per engine" in msg
    assert "8 GPUs of a rollout pod (cluster.launch.rollout_gpus_per_node)" in msg
    assert "allowed: 1, 2, 4, 8" in msg


def test_an_engine_over_nodes_must_span_all_their_gpus():
    assert pod_layout(8, 1, 16, nodes=2) == PodLayout(8, 16, 1)  # DP 16 over two nodes
    with pytest.raises(ConfigError, match="rollout_nodes_per_worker = 2 nodes of 8 GPUs"):
        pod_layout(8, 8, 1, nodes=2)
    with pytest.raises(ConfigError, match="0 GPUs per rollout pod"):
        pod_layout(0, 1, 1)


def test_workers_fill_pods_in_order_and_the_last_pod_holds_the_rest():
    assert rollout_pods(10, 8) == 2
    assert pod_workers(10, 8, 0) == list(range(8))
    assert pod_workers(10, 8, 1) == [8, 9]
    assert [pod_workers(3, 1, i) for i in range(3)] == [[0], [1], [2]]
    with pytest.raises(ValueError):
        pod_workers(10, 8, 2)


def test_the_pod_layout_follows_the_config_and_the_launch_mode():
    assert rollout_pod_layout(_cfg({"tensor_parallel_size": 4})).engines == 2
    # rollout pod sizing of its own, apart from the trainer's gpus_per_node
    small = _cfg({"tensor_parallel_size": 4}, {"rollout_gpus_per_node": 4})
    assert rollout_pod_layout(small) == PodLayout(4, 4, 1)
    # the task's own pod: the rollout group's GPUs
    in_task = _cfg({"tensor_parallel_size": 2}, {"mode": "in_task"}, {"rollout": {"gpus": 4}})
    assert rollout_pod_layout(in_task).engines == 2
    # cpu: one engine, its TP ranks processes
    cpu = parse_config({"rollout": {"tensor_parallel_size": 2}})
    assert rollout_pod_layout(cpu) == PodLayout(0, 2, 1)
    assert rollout_pod_layout(cpu).slices() == [()]
    with pytest.raises(ConfigError, match="cluster.launch.rollout_gpus_per_node"):
        rollout_pod_layout(_cfg({"tensor_parallel_size": 3}))


# ---- the pods' resources ---------------------------------------------------------------------


def _res(pod):
    return pod["spec"]["containers"][0]["resources"]["limits"]


def test_rollout_pods_request_the_gpus_of_the_engines_they_run_with_their_efa():
    cfg = _cfg({"tensor_parallel_size": 4, "workers": 3})
    full = objects.rollout_pod(cfg, "run1", "rollout-0", ["true"], [], engines=2)
    assert (_res(full)["nvidia.com/gpu"], _res(full)["vpc.amazonaws.com/efa"]) == ("8", "16")
    last = objects.rollout_pod(cfg, "run1", "rollout-1", ["true"], [], engines=1)
    assert (_res(last)["nvidia.com/gpu"], _res(last)["vpc.amazonaws.com/efa"]) == ("4", "8")
    # a rollout pod size of its own; the trainer keeps gpus_per_node
    own = _cfg({"tensor_parallel_size": 4}, {"rollout_gpus_per_node": 4, "efa_per_node": 16})
    pod = objects.rollout_pod(own, "run1", "rollout-0", ["true"], [])
    assert _res(pod)["nvidia.com/gpu"] == "4"
    tj = objects.trainjob(own, "run1", "moerl-tj", ["true"], [])
    assert tj["spec"]["trainer"]["resourcesPerNode"]["limits"]["nvidia.com/gpu"] == "8"


def test_the_launch_check_refuses_a_layout_that_does_not_divide_the_pod():
    from moerl.launch.task import check_launchable

    with pytest.raises(ConfigError, match="3 x 1 = 3 GPUs per engine"):
        check_launchable(_cfg({"tensor_parallel_size": 3}), "rollout_worker")
    check_launchable(_cfg({"tensor_parallel_size": 4}), "rollout_worker")


# ---- a pod's workers ---------------------------------------------------------------------------


def test_each_worker_of_a_pod_sees_only_its_engine_devices():
    layout = pod_layout(8, 4, 1)
    assert worker_env(layout, 1, {"A": "1"}) == {"A": "1", "CUDA_VISIBLE_DEVICES": "4,5,6,7"}
    assert "CUDA_VISIBLE_DEVICES" not in worker_env(PodLayout(0, 2, 1), 0, {})
    # a pod already limited to some devices: indices into them
    limited = {"CUDA_VISIBLE_DEVICES": "2,3,5,7"}
    assert worker_env(pod_layout(4, 2, 1), 1, limited)["CUDA_VISIBLE_DEVICES"] == "5,7"
    with pytest.raises(ConfigError, match="sees 4 GPUs"):
        worker_env(layout, 0, limited)


def test_the_pod_exits_with_a_crash_before_a_drain_and_0_only_when_all_finished():
    assert pod_exit([0, 0, 0]) == 0
    assert pod_exit([0, EXIT_DRAINED, 0]) == EXIT_DRAINED
    assert pod_exit([EXIT_DRAINED, 1, EXIT_DRAINED]) == 1
    assert pod_exit([EXIT_DRAINED, -9]) == -9


# ---- model sizes and the engine memory fit -------------------------------------------------------


def test_seed_model_sizes_match_their_published_totals():
    want = {"Qwen3-30B-A3B": 30.5e9, "Qwen3-235B-A22B": 235e9, "DeepSeek-V3": 671e9}
    for name, total in want.items():
        assert model_sizes(SEED_CONFIGS[name]).total_params == pytest.approx(total, rel=0.01)
    q = model_sizes(SEED_CONFIGS["Qwen3-235B-A22B"])
    assert q.kv_bytes_per_token(2) == 94 * 2 * 4 * 128 * 2
    assert q.kv_bytes_per_token(2, tp=8) == 94 * 2 * 1 * 128 * 2  # 4 KV heads over TP 8: replicated
    d = model_sizes(SEED_CONFIGS["DeepSeek-V3"])
    assert d.fp8 and d.kv_bytes_per_token(2, tp=8) == 61 * (512 + 64) * 2  # MLA: on every rank


def test_dp8_ep8_weights_per_gpu_match_vllms_figure_for_qwen3_235b():
    # docs/training/weight_transfer/sharded_rdt.md (vLLM): 67.8 GiB per rank at DP8+EP8
    f = engine_fit(model_sizes(SEED_CONFIGS["Qwen3-235B-A22B"]), 1, 8, "bfloat16", 140.0, 0.9)
    assert f.weights_gib == pytest.approx(67.8, abs=0.3)


def test_the_smallest_layouts_that_fit_a_p5en_node():
    def choose(hf):
        return choose_layouts(model_sizes(hf), 8, "bfloat16", 140.0, 0.9)

    small = choose(SEED_CONFIGS["Qwen3-30B-A3B"])
    assert (small.tp.tp, small.engines_per_node(small.tp)) == (1, 8)
    big = choose(SEED_CONFIGS["Qwen3-235B-A22B"])
    assert (big.tp.tp, big.engines_per_node(big.tp)) == (4, 2)
    assert (big.dp_ep.dp, big.engines_per_node(big.dp_ep)) == (8, 1)
    fp8 = choose(SEED_CONFIGS["DeepSeek-V3"])
    assert (fp8.tp.tp, fp8.dp_ep.dp, fp8.nodes_needed) == (8, 8, 1)
    bf16 = choose(_bf16("DeepSeek-V3"))
    assert (bf16.tp, bf16.dp_ep, bf16.nodes_needed) == (None, None, 2)


def test_preflight_refuses_an_engine_that_does_not_fit_naming_keys_and_figures(tmp_path):
    hf = SEED_CONFIGS["Qwen3-235B-A22B"]
    with pytest.raises(ConfigError) as e:
        check_engine_fit(_cfg({"tensor_parallel_size": 2}), hf)
    msg = str(e.value)
    for part in (
        "rollout.tensor_parallel_size x rollout.data_parallel_size = 2 x 1",
        "rollout.dtype bfloat16",
        "218.9 GiB of weights",
        "cluster.groups.rollout.gpu_memory_gib 140 x rollout.gpu_memory_utilization 0.9",
        "126.0 GiB",
        "fits: tensor_parallel_size 4 or data_parallel_size 8 with enable_expert_parallel",
    ):
        assert part in msg, (part, msg)
    assert check_engine_fit(_cfg({"tensor_parallel_size": 4}), hf).fits
    # float32 serving doubles the weights: TP 4 no longer fits
    with pytest.raises(ConfigError, match="rollout.dtype float32"):
        check_engine_fit(_cfg({"tensor_parallel_size": 4, "dtype": "float32"}), hf)
    # cpu, or no GPU size: not checked
    assert check_engine_fit(parse_config({}), hf) is None
    assert check_engine_fit(_cfg(groups={"rollout": {"gpu_memory_gib": None}}), hf) is None


def test_preflight_reads_the_checkpoint_config_and_refuses_before_work(tmp_path):
    from moerl.preflight import _check_engine_fit

    (tmp_path / "config.json").write_text(json.dumps(_bf16("DeepSeek-V3")))
    cfg = _cfg({"tensor_parallel_size": 8}).model_copy(
        update={"model": parse_config({}).model.model_copy(update={"path": str(tmp_path)})}
    )
    with pytest.raises(
        ConfigError,
        match="no layout on one node of 8 GPUs; data_parallel_size 16 with enable_expert_parallel "
        "over cluster.launch.rollout_nodes_per_worker 2 nodes",
    ):
        _check_engine_fit(cfg)


# ---- moerl bench project ---------------------------------------------------------------------


def test_bench_project_prints_each_seed_models_engine_layout_on_p5en(tmp_path, capsys):
    from moerl.cli import main

    out = tmp_path / "proj"
    assert main(["bench", "project", "--out-dir", str(out)]) == 0
    text = capsys.readouterr().out
    rows = {
        r["model"]: r
        for r in json.loads((out / "report.json").read_text())["engine_layout"]["rows"]
    }
    assert list(rows) == ["Qwen3-30B-A3B", "Qwen3-235B-A22B", "DeepSeek-V3 FP8", "DeepSeek-V3 bf16"]

    def layout(model, axis):
        r = rows[model][axis]
        return r and (r["tp"], r["dp"], r["engines_per_node"])

    assert layout("Qwen3-30B-A3B", "tp") == (1, 1, 8)
    assert layout("Qwen3-235B-A22B", "tp") == (4, 1, 2)
    assert layout("Qwen3-235B-A22B", "dp_ep") == (1, 8, 1)
    assert layout("DeepSeek-V3 FP8", "tp") == (8, 1, 1)
    assert rows["DeepSeek-V3 FP8"]["weights_gb"] == pytest.approx(671, rel=0.01)
    assert rows["DeepSeek-V3 bf16"]["weights_gb"] == pytest.approx(1342, rel=0.01)
    assert rows["DeepSeek-V3 bf16"]["tp"] is None and rows["DeepSeek-V3 bf16"]["nodes_needed"] == 2
    assert rows["Qwen3-235B-A22B"]["tp"]["weights_gib"] == pytest.approx(109.5, abs=0.1)
    assert "2 x TP4: 109.5 + KV 1.8 GiB" in text and "1 x DP8-EP8: 67.8 + KV 7.3 GiB" in text
    assert "no: DP16-EP16 over 2 nodes (rollout_nodes_per_worker)" in text
    assert "kv = max_model_len" in (out / "summary.md").read_text()
    # a smaller GPU needs more TP; a shorter context shrinks the KV, not the weights
    args = ["bench", "project", "--out-dir", str(out), "--rollout-gpu-gib", "80"]
    assert main([*args, "--max-model-len", "4096"]) == 0
    rep = json.loads((out / "report.json").read_text())["engine_layout"]["rows"]
    assert rep[0]["tp"]["tp"] == 1 and rep[1]["tp"]["tp"] == 8  # 235B on 80 GiB: TP 8
    assert rep[1]["tp"]["kv_gib"] == pytest.approx(94 * 2 * 1 * 128 * 2 * 4096 / 2**30)
    assert main(["bench", "project", "--out-dir", str(out), "--rollout-utilization", "0"]) == 2


def test_compiling_for_eks_refuses_a_layout_that_does_not_divide_the_rollout_pod():
    from moerl.pipelines.eks import check_cluster_safe

    def cfg(mode, tp, gpus=8):
        return parse_config(
            {
                "checkpoint": {"uri": "s3://moerl-ckpt/prod"},
                "tracking": {"uri": "http://mlflow.moerl:5000"},
                "pipeline": {"base_image": "registry.example/moerl:1"},
                "rollout": {"device": "cuda", "tensor_parallel_size": tp},
                "cluster": {"launch": {"mode": mode}, "groups": {"rollout": {"gpus": gpus}}},
            }
        )

    with pytest.raises(
        ConfigError, match=r"3 x 1 = 3 GPUs per engine.*cluster.groups.rollout.gpus"
    ):
        check_cluster_safe(cfg("in_task", 3))
    with pytest.raises(ConfigError, match=r"cluster.launch.rollout_gpus_per_node \(null"):
        check_cluster_safe(cfg("kubernetes", 3))
    check_cluster_safe(cfg("in_task", 4))
    check_cluster_safe(cfg("kubernetes", 8))
