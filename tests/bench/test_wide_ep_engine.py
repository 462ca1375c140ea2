"""What a wide-ep leg's engine got (benchmarks/wide_ep_engine.py): the EPLB balancedness and
all2all-manager lines as the installed vLLM 0.32 writes them (its own format strings, read from
its sources, logged through its own logger), the EPLB flags through vLLM's own argument parser,
the transport of recorded legs (stand-in NCCL plugin files as in tests/rollout/test_transport.py)
and the report's rule on them: a leg over several nodes off its backend over EFA fails it.
"""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
import tempfile
from importlib.util import find_spec
from pathlib import Path

import pytest

from benchmarks import wide_ep
from benchmarks import wide_ep_engine as we

VLLM = Path(find_spec("vllm").submodule_search_locations[0])  # type: ignore[union-attr,index]
EFA_PROBE = {
    "runtime.deep_ep": "importable 2.0.0",
    "runtime.efa_devices": "rdmap16s27,rdmap32s27",
    "runtime.libfabric": "2.3.0",
    "runtime.libfabric_efa_provider": "efa",
}

# a line of a vLLM 0.32 server log, as EngineCore DP rank 0 writes it (the format quoted in
# wide_ep_engine.py: vllm/distributed/eplb/eplb_state.py:634 after vllm/logger.py:28-32)
EPLB_LINE = (
    "(EngineCore_DP0 pid=4211) INFO 12-07 05:17:13 [eplb_state.py:634] EPLB step: 750000010 "
    "for model Qwen/Qwen3-30B-A3B-FP8: avg_tokens=1536.00, max_tokens=2304, "
    "balancedness=0.6667, steps until the next rearrangement: 249999990"
)


def _vllm_format(rel: str, needle: str) -> tuple[str, int]:
    """The format string of the installed vLLM's logger call whose message holds `needle`, and
    the call's line."""
    tree = ast.parse((VLLM / rel).read_text())
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr in ("info", "info_once")
            and node.args
            and isinstance(node.args[0], ast.Constant)
            and needle in str(node.args[0].value)
        ):
            return str(node.args[0].value), node.lineno
    raise AssertionError(f"no logger call with {needle!r} in vllm/{rel}")


def _vllm_log(calls: list[tuple[str, str, list]]) -> str:
    """`calls` (logger name, format, args) logged by vLLM's own logger, configured as a server
    configures it, in an engine core named EngineCore_DP0; what it printed."""
    script = (
        "import json, sys\n"
        "from vllm.config.logging import LoggingConfig\n"
        "from vllm.logger import configure_logging, init_logger, set_vllm_process_name\n"
        "configure_logging(LoggingConfig())\n"
        "set_vllm_process_name('EngineCore_DP0')\n"
        "for name, fmt, args in json.loads(sys.argv[1]):\n"
        "    init_logger(name).info(fmt, *args)\n"
    )
    # at INFO whatever an earlier test in this process left in the environment (the rollout
    # worker's entry point defaults VLLM_LOGGING_LEVEL to WARNING)
    env = {**os.environ, "VLLM_LOGGING_LEVEL": "INFO"}
    r = subprocess.run(
        [sys.executable, "-c", script, json.dumps(calls)],
        capture_output=True, text=True, timeout=120, env=env,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr[-2000:]
    return r.stdout + r.stderr


def test_eplb_and_all2all_lines_in_the_installed_vllms_own_format_are_parsed():
    fmt, line = _vllm_format("distributed/eplb/eplb_state.py", "EPLB step:")
    assert line == 634  # the line wide_ep_engine.py quotes
    manager, mline = _vllm_format(
        "distributed/device_communicators/cuda_communicator.py", "all2all manager"
    )
    assert (manager, mline) == ("Using %s all2all manager.", 280)
    eplb = "vllm.distributed.eplb.eplb_state"
    model = "Qwen/Qwen3-30B-A3B-FP8"
    text = _vllm_log(
        [
            ("vllm.distributed.device_communicators.cuda_communicator", manager,
             ["DeepEPV2All2AllManager"]),
            (eplb, fmt, [750000000, model, 0.0, 0, 0.0, 250000000]),  # an idle step
            (eplb, fmt, [750000010, model, 1536.0, 2304, 1536 / 2304, 249999990]),
            (eplb, fmt, [750000020, model, 1000.0, 1000, 1.0, 249999980]),
            (eplb, fmt, [750000030, f"{model} (draft)", 10.0, 30, 1 / 3, 249999970]),
        ]
    )  # fmt: skip
    assert "(EngineCore_DP0 pid=" in text and "] EPLB step: 750000010 for model" in text
    steps = we.parse_eplb_steps(text)
    assert [s["step"] for s in steps] == [750000000, 750000010, 750000020, 750000030]
    assert steps[1] == {
        "step": 750000010,
        "model": model,
        "avg_tokens": 1536.0,
        "max_tokens": 2304,
        "balancedness": pytest.approx(0.6667),
    }
    imb = we.eplb_imbalance(text)
    assert imb["status"] == "measured" and imb["model"] == model
    assert (imb["steps"], imb["idle_steps"]) == (2, 1)
    assert imb["imbalance"] == pytest.approx((2304 + 1000) / (1536 + 1000))
    assert imb["per_step"]["max"] == pytest.approx(1.5) and imb["per_step"]["n"] == 2
    assert imb["draft_imbalance"] == pytest.approx(3.0)  # kept apart from the model's
    assert we.all2all_from_log(text) == "deepep_v2"
    # the literal line of the docstring's format
    (s,) = we.parse_eplb_steps(EPLB_LINE)
    assert (s["avg_tokens"], s["max_tokens"]) == (1536.0, 2304)
    assert we.eplb_imbalance(EPLB_LINE)["imbalance"] == pytest.approx(1.5)


def test_no_eplb_line_or_a_leg_that_cannot_measure_says_why():
    idle = EPLB_LINE.replace("avg_tokens=1536.00, max_tokens=2304", "avg_tokens=0.00, max_tokens=0")
    assert we.eplb_imbalance(idle) == {
        "status": "not measured",
        "why": "no 'EPLB step' line with routed tokens in the server log over the timed "
        "requests (1 idle)",
    }
    assert we.eplb_imbalance("INFO nothing")["status"] == "not measured"
    assert "cpu leg" in we.imbalance_unavailable("cpu", False, 10, True)
    assert "expert parallelism off" in we.imbalance_unavailable("cuda", False, 10, True)
    assert "--eplb-log-interval 0" in we.imbalance_unavailable("cuda", True, 0, True)
    assert "--url without --server-log" in we.imbalance_unavailable("cuda", True, 10, False)
    assert we.imbalance_unavailable("cuda", True, 10, True) == ""


def test_the_eplb_flags_pass_vllms_own_argument_parser_into_its_eplb_config():
    """The leader's and followers' flags, parsed by the installed vLLM as `vllm serve` parses
    them: EPLB on, balancedness logged every N steps, no rearrangement."""
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.entrypoints.launchers.cli_args import make_arg_parser
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    lay = wide_ep.Layout(nodes=2, dp_local=8, tp=1, device="cuda")
    args = wide_ep.engine_args(
        "deepep_v2", lay, address="10.0.0.1", headless=True, start_rank=8, eplb_log_interval=7
    )
    ns = make_arg_parser(FlexibleArgumentParser()).parse_args(["--model", "m", *args])
    e = AsyncEngineArgs.from_cli_args(ns)
    assert e.enable_eplb and e.enable_expert_parallel and e.all2all_backend == "deepep_v2"
    assert e.eplb_config.log_balancedness and e.eplb_config.log_balancedness_interval == 7
    assert e.eplb_config.step_interval == we.EPLB_STEP_INTERVAL
    assert (e.data_parallel_size, e.data_parallel_size_local) == (16, 8)
    assert we.eplb_args(0) == []
    assert "--enable-eplb" not in wide_ep.engine_args("deepep_v2", lay, eplb_log_interval=0)
    one = wide_ep.Layout(nodes=1, dp_local=1, device="cuda")  # one GPU: no EP, no EPLB
    assert "--enable-eplb" not in wide_ep.engine_args("deepep_v2", one, eplb_log_interval=7)


# ---- the transport of recorded legs ----------------------------------------------------------


OFI = (
    "NCCL INFO Using network Libfabric\n"
    "NCCL INFO NET/OFI Selected provider is efa, fabric is efa (found 16 nics)\n"
)
SOCKET = "NCCL INFO NET/IB : No device found.\nNCCL INFO Using network Socket\n"


@pytest.fixture
def lib(tmp_path: Path) -> Path:
    """aws-ofi-nccl with GIN, as tests/rollout/test_transport.py stands it in."""
    d = tmp_path / "lib"
    d.mkdir()
    (d / "libnccl-net-ofi.so").write_bytes(
        b"\x7fELF\x00ncclNetPlugin_v10\x00ncclGinPlugin_v14\x00ofi_init\x00"
    )
    return d


def _env(lib: Path, nccl: str | None = OFI, **more: str) -> dict[str, str]:
    """The server's environment: the plugin, the deepep_v2 settings, and NCCL's INFO log files
    (two engine processes) holding `nccl`, as `nccl_debug_to_file` would have them written."""
    env = {"LD_LIBRARY_PATH": str(lib), "NCCL_NET_PLUGIN": "ofi", **wide_ep.DEEPEP_V2_ENV, **more}
    if nccl is not None:
        d = Path(tempfile.mkdtemp(dir=lib.parent))
        for pid in (101, 102):
            (d / f"nccl.ip-10-0-0-1.{pid}.log").write_text(
                f"ip-10-0-0-1:{pid}:{pid} [0] NCCL INFO NCCL version 2.31.1+cuda13.0\n"
                + "".join(f"ip-10-0-0-1:{pid}:{pid} [0] {x}\n" for x in nccl.splitlines())
            )
        env |= {"NCCL_DEBUG": "INFO", "NCCL_DEBUG_FILE": str(d / "nccl.%h.%p.log")}
    return env


def _t(backend: str, env: dict, log: str | None, nodes: int = 2, probe=EFA_PROBE) -> dict:
    return we.leg_transport(
        backend, device="cuda", nodes=nodes, dp=8 * nodes, dp_local=8, tp=1,
        expert_parallel=True, env=env, probe=probe, log=log,
    )  # fmt: skip


def _log(manager: str) -> str:
    return (
        f"(EngineCore_DP0 pid=1) INFO 12-07 05:00:00 [cuda_communicator.py:280] Using {manager} "
        "all2all manager.\n"
    )


def test_leg_transport_records_what_the_engine_got(lib):
    env = _env(lib)
    good = _t("deepep_v2", env, _log("DeepEPV2All2AllManager"))
    assert good["path"] == "deepep_v2+gin/efa" and good["all2all_observed"] == "deepep_v2"
    assert good["gin"] == "configured" and good["net"] == "efa"
    assert good["net_source"] == "nccl log" and "2 of 2 process logs" in good["nccl_evidence"]
    assert good["efa_devices"] == "rdmap16s27,rdmap32s27" and good["libfabric_provider"] == "efa"
    # vLLM built another manager than asked: the path is the one it built
    other = _t("deepep_v2", env, _log("AgRsAll2AllManager"))
    assert other["all2all_observed"] == "allgather_reducescatter"
    assert other["path"] == "allgather_reducescatter/efa"
    # NCCL says sockets, whatever the environment promised
    sock = _t("deepep_v2", _env(lib, SOCKET), _log("DeepEPV2All2AllManager"))
    assert sock["path"] == "deepep_v2 fallback" and "NCCL's log" in sock["why"]
    ag = _t("allgather_reducescatter", _env(lib, SOCKET), _log("AgRsAll2AllManager"))
    assert ag["path"] == "allgather_reducescatter/sockets" and ag["net"] == "sockets"
    # no NCCL log: the environment's word, said to be inferred
    inferred = _t("deepep_v2", _env(lib, None), _log("DeepEPV2All2AllManager"))
    assert inferred["path"] == "deepep_v2+gin/efa" and inferred["net_source"] == "environment"
    # DeepEP V2 told to skip GIN
    nogin = _t("deepep_v2", {**env, "EP_DISABLE_GIN": "1"}, _log("DeepEPV2All2AllManager"))
    assert nogin["path"] == "deepep_v2 fallback" and "EP_DISABLE_GIN=1" in nogin["why"]
    # no plugin, no EFA: the environment alone says sockets
    bare = _t("deepep_v2", {}, None, probe={"runtime.efa_devices": "none"})
    assert bare["path"] == "deepep_v2 fallback" and bare["all2all_observed"] == we.NO_LOG
    assert _t("deepep_v2", env, "INFO up\n")["all2all_observed"] == we.NOT_LOGGED
    assert _t("deepep_v2", env, None, nodes=1)["path"] == "nvlink-only"


def _rec(backend: str, nodes: int, transport: dict | None, repeat: int = 0) -> dict:
    lay = wide_ep.Layout(nodes=nodes, dp_local=8, device="cuda")
    reqs = [wide_ep.Request(sent=0.0, first=0.1, last=1.0, tokens=10, usage_tokens=10)]
    moe = {"model_type": "qwen3_moe", "experts_per_token": 8, "experts": 128, "vocab_size": 9}
    return wide_ep.leg_record(
        reqs, 1.0, lay, backend, wide_ep.Workload(prompts=1, max_tokens=10), [[1, 2]], moe,
        "m", repeat, wide_ep.efa_bytes(None, None), {"status": "not measured", "why": "x"},
        None, transport=transport, eplb_log_interval=10,
    )  # fmt: skip


def test_the_report_fails_a_multi_node_leg_off_its_backend_over_efa_naming_it(lib):
    env = _env(lib)
    ok_v2 = _rec("deepep_v2", 2, _t("deepep_v2", env, _log("DeepEPV2All2AllManager")))
    ok_ag = _rec("allgather_reducescatter", 2, _t("allgather_reducescatter", env,
                                                  _log("AgRsAll2AllManager")))  # fmt: skip
    assert ok_v2["transport_problem"] is None and ok_ag["transport_problem"] is None
    rep = wide_ep.build_report([ok_ag, ok_v2])
    assert rep["ok"] and rep["transport_problems"] == []
    g = {x["backend"]: x for x in rep["groups"]}
    assert g["deepep_v2"]["path"] == "deepep_v2+gin/efa"
    assert g["allgather_reducescatter"]["path"] == "allgather_reducescatter/efa"
    md = wide_ep.markdown(rep)
    assert "| deepep_v2+gin/efa | ok |" in md and "| path | ok |" in md

    sock = _rec("deepep_v2", 2, _t("deepep_v2", _env(lib, SOCKET),
                                   _log("DeepEPV2All2AllManager")), repeat=1)  # fmt: skip
    unobserved = _rec("deepep_v2", 2, _t("deepep_v2", env, "INFO up\n"), repeat=2)
    inferred = _rec("allgather_reducescatter", 2, _t("allgather_reducescatter", _env(lib, None),
                                                     _log("AgRsAll2AllManager")), repeat=1)  # fmt: skip
    rep = wide_ep.build_report([ok_ag, ok_v2, sock, unobserved, inferred])
    assert not rep["ok"]
    assert rep["checks"]["multi_node_legs_got_their_backend_over_efa"] is False
    assert rep["checks"]["every_leg_ok"]  # the requests were fine: only the transport fails
    p0, p1, p2 = rep["transport_problems"]
    assert p0.startswith(
        "2 nodes allgather_reducescatter repeat 1: asked allgather_reducescatter/efa, got "
        "NCCL's network not observed: NCCL_DEBUG=unset"
    )  # the environment said EFA, but nothing saw NCCL use it
    assert p1.startswith("2 nodes deepep_v2 repeat 1: asked deepep_v2+gin/efa, got deepep_v2 ")
    assert "fallback" in p1 and "Using network Socket" in p1
    assert p2 == (
        "2 nodes deepep_v2 repeat 2: asked deepep_v2+gin/efa, got vLLM's all2all manager: "
        "not in the server log"
    )
    md = wide_ep.markdown(rep)
    assert "| deepep_v2 fallback, deepep_v2+gin/efa | FAIL |" in md
    assert f"- {p1}" in md and "Transport not as asked" in md
    # a record without a transport (before it was recorded) at 2 nodes fails; 1 node never
    assert we.path_problem(_rec("deepep_v2", 2, None)) == (
        "2 nodes deepep_v2 repeat 0: no transport recorded"
    )
    one = _rec("deepep_v2", 1, _t("deepep_v2", {}, None, nodes=1))
    assert one["transport"]["path"] == "nvlink-only" and we.path_problem(one) is None
