"""The GPU images' lock resolves on PyPI (nightly: it needs the network): pip's resolver, in a
dry run, over everything the images' pip steps install (the kernel image's torch line, moerl's
GPU requirements, the rollout image's vLLM) constrained by images/constraints-gpu.txt, so an
image build cannot fail on a pin; and every package it resolves is either locked or pinned
exactly by what requires it (torch's CUDA wheels), so nothing floats.

Resolved for this interpreter's platform, which must be the images' (linux x86_64, their
CPython minor); wheels are chosen for this host's glibc, not Ubuntu 22.04's. MOERL_PYPI_INDEX
points it at a mirror (default https://pypi.org/simple). About 90 s on 2 cores.
"""

from __future__ import annotations

import json
import os
import platform
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.nightly  # the network: PyPI

ROOT = Path(__file__).resolve().parents[2]
IMAGES = ROOT / "images"
LOCK = IMAGES / "constraints-gpu.txt"
INDEX = os.environ.get("MOERL_PYPI_INDEX", "https://pypi.org/simple")


def _shown(path: Path) -> str:
    return str(path.relative_to(ROOT) if path.is_relative_to(ROOT) else path)


def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _arg(dockerfile: Path, name: str) -> str:
    (value,) = re.findall(rf"^ARG {name}=(\S+)$", dockerfile.read_text(), re.M)
    return value


def _requirements() -> list[str]:
    """What the images' pip steps ask for: the kernel image's own line (torch and its build
    tools), moerl's GPU requirements (trainer and rollout) and vLLM (rollout)."""
    kernel = IMAGES / "deepep-efa" / "Dockerfile"
    pat = r'pip install -c /opt/moerl/constraints-gpu\.txt ("torch==\$\{TORCH_VERSION\}".*?) \\$'
    (line,) = re.findall(pat, kernel.read_text(), re.M)
    torch = _arg(kernel, "TORCH_VERSION")
    own = [a.strip('"').replace("${TORCH_VERSION}", torch) for a in line.split()]
    sys.path.insert(0, str(IMAGES))
    try:
        from requirements_gpu import gpu_requirements
    finally:
        sys.path.pop(0)
    vllm = _arg(IMAGES / "rollout" / "Dockerfile", "VLLM_VERSION")
    return [*own, *gpu_requirements(ROOT / "pyproject.toml"), f"vllm=={vllm}"]


def _exact_pins(report: dict) -> dict[str, set[str]]:
    """name -> the versions some resolved package requires it at with `==` (a `.*` kept)."""
    pins: dict[str, set[str]] = {}
    for item in report["install"]:
        for req in item["metadata"].get("requires_dist") or []:
            m = re.match(r"\s*([A-Za-z0-9_.-]+)\s*(?:\[[^\]]*\])?\s*\(?\s*==\s*([^;,\s)]+)", req)
            if m:
                pins.setdefault(_norm(m[1]), set()).add(m[2])
    return pins


def _pins(pin: str, version: str) -> bool:
    """`==pin` holds `version` to one release: exact, or a `.*` prefix down to the patch level
    (torch's `nvidia-cublas==13.1.1.3.*`), not a range such as `==13.*`."""
    from packaging.specifiers import Specifier

    if pin.endswith(".*") and pin.count(".") < 3:
        return False
    return Specifier(f"=={pin}").contains(version, prereleases=True)


def test_the_gpu_lock_resolves_on_pypi_and_leaves_nothing_floating(tmp_path):
    py = _arg(IMAGES / "deepep-efa" / "Dockerfile", "PYTHON_VERSION")
    here = (platform.system(), platform.machine(), f"{sys.version_info[0]}.{sys.version_info[1]}")
    if here != ("Linux", "x86_64", ".".join(py.split(".")[:2])):
        pytest.skip(f"resolves for this platform {here}; the images are Linux x86_64 CPython {py}")
    reqs = tmp_path / "requirements.txt"
    reqs.write_text("\n".join(_requirements()) + "\n")
    report = tmp_path / "report.json"
    cmd = [sys.executable, "-m", "pip", "--isolated", "install", "--dry-run", "--ignore-installed",
           "--disable-pip-version-check", "--progress-bar", "off", "--report", str(report), "--index-url", INDEX,
           "-c", str(LOCK), "-r", str(reqs)]  # fmt: skip
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=180)
    noise = (
        "Collecting",
        "  Using cached",
        "  Downloading",
        "  Preparing",
        "  Getting",
        "  Installing",
    )
    said = [x for x in (run.stdout + run.stderr).splitlines() if x and not x.startswith(noise)]
    assert run.returncode == 0, (
        f"{_shown(LOCK)} does not resolve on {INDEX} for {reqs.read_text().split()}:\n"
        + "\n".join(said)[-4000:]
    )
    got = json.loads(report.read_text())
    lock = dict(
        (_norm(n), v) for n, v in re.findall(r"^([A-Za-z0-9_.-]+)==(\S+)$", LOCK.read_text(), re.M)
    )
    pins = _exact_pins(got)
    floating = []
    for item in got["install"]:
        name, version = _norm(item["metadata"]["name"]), item["metadata"]["version"]
        if name in lock:
            assert version.split("+")[0] == lock[name], (name, version, lock[name])
            continue
        if not any(_pins(p, version) for p in pins.get(name, ())):
            floating.append(
                f"{name}=={version} (required as {sorted(pins.get(name, [])) or 'a range'})"
            )
    assert not floating, (
        f"resolved but neither in {_shown(LOCK)} nor pinned exactly by what requires "
        f"them (a later release would change the image): {floating}; add them to the lock"
    )
