"""manifests/components/bench-rollout: the `moerl bench rollout --all2all` Job, built offline
with the prod-bench-rollout overlay: it takes one whole rollout node as a launched rollout pod
does (the same resources, selector, taints, priority), its command parses as a layout
comparison, and every variant it lists validates on the ConfigMap's workload. (The overlay's
schemas and pod security: tests/launch/test_manifests.py, which builds every overlay.)"""

from __future__ import annotations

import argparse

import pytest

from tests.launch.test_manifests import MANIFESTS, _build, _groups, _pod_specs, _tolerates


@pytest.fixture(scope="module")
def objs() -> list[dict]:
    return _build(MANIFESTS / "overlays" / "prod-bench-rollout")


def test_the_job_takes_a_rollout_node_as_a_launched_rollout_pod_does(objs):
    from moerl.config import parse_config
    from moerl.launch.objects import resources

    spec = dict(_pod_specs(objs))[("Job", "moerl", "moerl-bench-rollout")]
    selector, taints = _groups()["rollout"]
    assert spec["nodeSelector"] == selector and all(
        _tolerates(spec["tolerations"], t) for t in taints
    )
    cfg = parse_config({})
    (c,) = spec["containers"]
    assert c["resources"] == resources(cfg)  # GPUs, EFA devices, hugepages, cpu, memory
    assert int(c["resources"]["limits"]["nvidia.com/gpu"]) == cfg.cluster.launch.gpus_per_node
    assert spec["priorityClassName"] == cfg.cluster.launch.rollout_priority_class
    assert spec["serviceAccountName"] == cfg.cluster.launch.rollout_service_account
    assert c["securityContext"]["capabilities"] == {"drop": ["ALL"], "add": ["IPC_LOCK"]}


def test_the_jobs_command_is_a_layout_comparison_every_variant_of_which_validates(objs, tmp_path):
    from benchmarks.cli import add_bench_parsers
    from benchmarks.layouts import layout_variants

    spec = dict(_pod_specs(objs))[("Job", "moerl", "moerl-bench-rollout")]
    (c,) = spec["containers"]
    parser = argparse.ArgumentParser()
    add_bench_parsers(parser.add_subparsers(dest="command"))
    a = parser.parse_args(c["command"][1:])
    assert a.bench_command == "rollout" and a.repeats >= 3
    assert a.all2all.split(",") == ["allgather_reducescatter", "deepep_v2"]
    (cm,) = [
        o
        for o in objs
        if o["kind"] == "ConfigMap" and o["metadata"]["name"].startswith("moerl-bench-rollout")
    ]
    vol = {v["name"]: v for v in spec["volumes"]}["config"]
    assert vol["configMap"]["name"] == cm["metadata"]["name"]  # kustomize's hashed name
    mount = {m["name"]: m["mountPath"] for m in c["volumeMounts"]}["config"]
    assert a.config == f"{mount}/rollout.yaml"
    cfg_file = tmp_path / "rollout.yaml"
    cfg_file.write_text(cm["data"]["rollout.yaml"])
    variants = layout_variants(cfg_file, a.overrides, a.all2all, a.tensor_parallel, a.data_parallel)
    gpus = int(c["resources"]["limits"]["nvidia.com/gpu"])
    for name, cfg in variants:  # each engine spans the node's GPUs, expert-parallel over them
        r = cfg.rollout
        assert r.device == "cuda" and r.enable_expert_parallel and r.all2all_backend == name
        assert r.devices_per_engine == gpus
        tiny = cfg.model.tiny  # the shipped tiny model shards over them
        assert tiny.num_heads % gpus == 0 and tiny.num_experts % gpus == 0
    # only in this overlay
    prod = _build(MANIFESTS / "overlays" / "prod")
    assert "moerl-bench-rollout" not in {k[2] for k in dict(_pod_specs(prod))}
