"""A rollout pod's engines as real child processes (components/rollout/pod.py `supervise`): each
worker sees only its engine's devices, a crash drains the siblings and fails the pod with the
crash's code, a SIGTERM (a Spot notice) drains every worker. The workers are a stand-in
(tests/support/pod_child.py) that records what it was given."""

from __future__ import annotations

import json
from pathlib import Path

from moerl.components.rollout.worker import EXIT_DRAINED
from moerl.config import parse_config
from moerl.launch.layout import pod_layout


def _cfg(rollout=None):
    return parse_config(
        {
            "checkpoint": {"uri": "s3://moerl-ckpt/prod"},
            "pipeline": {"base_image": "registry.example/moerl:1"},
            "rollout": {"device": "cuda", **(rollout or {})},
            "cluster": {"launch": {"mode": "kubernetes"}},
        }
    )


def _supervised(tmp_path, monkeypatch, codes):
    from moerl.components.rollout.pod import supervise

    monkeypatch.setenv("POD_CHILD_OUT", str(tmp_path))
    monkeypatch.setenv("POD_CHILD_CODES", codes)
    monkeypatch.chdir(Path(__file__).parents[2])  # the child imports tests.support.pod_child
    cfg, layout = _cfg({"tensor_parallel_size": 2}), pod_layout(8, 2, 1)
    names = [f"rollout-{i}" for i in range(4, 8)]
    code = supervise(cfg, "run1", layout, names, module="tests.support.pod_child")
    return code, {n: json.loads((tmp_path / f"{n}.json").read_text()) for n in names}


def test_a_pods_workers_run_as_processes_each_on_its_engines_devices(tmp_path, monkeypatch):
    code, seen = _supervised(tmp_path, monkeypatch, ",".join(f"rollout-{i}=0" for i in range(4, 8)))
    assert code == 0
    assert [s["devices"] for s in seen.values()] == ["0,1", "2,3", "4,5", "6,7"]
    assert all(s["config"] for s in seen.values())


def test_a_worker_that_crashes_drains_its_siblings_and_fails_the_pod(tmp_path, monkeypatch):
    code, seen = _supervised(tmp_path, monkeypatch, "rollout-5=1")
    assert code == 1  # the crash, not the siblings' drains: the slot's retry restarts the pod
    assert [n for n, s in seen.items() if s.get("drained")] == [
        "rollout-4",
        "rollout-6",
        "rollout-7",
    ]


def test_a_sigterm_to_the_pod_drains_every_worker(tmp_path, monkeypatch):
    import os
    import signal
    import threading
    import time

    def notice():  # a Spot notice, once every worker is up
        deadline = time.monotonic() + 30
        while len(list(tmp_path.glob("*.json"))) < 4 and time.monotonic() < deadline:
            time.sleep(0.05)
        os.kill(os.getpid(), signal.SIGTERM)

    threading.Thread(target=notice, daemon=True).start()
    code, seen = _supervised(tmp_path, monkeypatch, "")
    assert code == EXIT_DRAINED
    assert all(s.get("drained") for s in seen.values())
