"""`bench wide-ep` runs deepep_v2 with the NCCL_GIN_TYPE production engines run: the kernel
image's (images/deepep-efa/Dockerfile's ARG, its ENV, its build-info), read there and nowhere
else. A leg takes it, refuses an environment that sets another (naming both and where each comes
from), and the planned scripts leave it to the image; no code, script or manifest sets a second
GIN type literal.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from benchmarks import wide_ep
from moerl import buildinfo
from moerl.config import parse_config
from moerl.errors import ConfigError

ROOT = Path(__file__).resolve().parents[2]
KERNEL = ROOT / "images" / "deepep-efa" / "Dockerfile"
# where a second GIN type could be set for engines or legs (docs and tests only describe them)
SOURCES = ("benchmarks", "moerl", "components", "pipelines", "kernels", "images", "manifests", "scripts")  # fmt: skip
LITERAL = re.compile(r"""NCCL_GIN_TYPE["']?\s*(?:[:=]|\n\s*value:|\s+)\s*["']?(\d+)""")


def _production() -> str:
    """The kernel image's default, read here on its own (the test's reading, not the bench's)."""
    (value,) = re.findall(r"^ARG NCCL_GIN_TYPE=(\d+)$", KERNEL.read_text(), re.M)
    return value


@pytest.fixture
def no_image(monkeypatch, tmp_path):
    """A checkout, not an image: no build-info."""
    monkeypatch.setenv(buildinfo.PATH_ENV, str(tmp_path / "absent.json"))


def _image(monkeypatch, tmp_path, gin_type: str) -> Path:
    """An image whose build-info declares `gin_type` (as the kernel image's build step does)."""
    path = buildinfo.write(
        tmp_path / "build-info.json",
        buildinfo.collect({"nccl_gin_type": gin_type}, image="rollout", probes={}),
    )
    monkeypatch.setenv(buildinfo.PATH_ENV, str(path))
    return path


def test_a_deepep_v2_leg_runs_the_kernel_images_gin_type(no_image):
    prod = _production()
    assert wide_ep.kernel_gin_type() == (prod, f"{KERNEL} (ARG NCCL_GIN_TYPE)")
    # outside the image nothing sets it: the leg sets production's; inside, the image's ENV is it
    for env in ({}, {"NCCL_GIN_TYPE": prod}):
        got = wide_ep.deepep_v2_env({"PATH": "/bin", **env})
        assert got == {"PATH": "/bin", "NCCL_GIN_ENABLE": "1", "NCCL_GIN_TYPE": prod}
    assert "NCCL_GIN_TYPE" not in wide_ep.DEEPEP_V2_ENV


def test_another_gin_type_is_refused_naming_both_and_their_sources(no_image):
    prod = _production()
    other = "2" if prod != "2" else "5"
    with pytest.raises(ConfigError) as err:
        wide_ep.deepep_v2_env({"NCCL_GIN_TYPE": other})
    msg = str(err.value)
    assert f"NCCL_GIN_TYPE={other} in this environment differs from {prod}" in msg
    assert f"{KERNEL} (ARG NCCL_GIN_TYPE)" in msg
    assert f"--set deepep-efa.args.NCCL_GIN_TYPE={other}" in msg  # what would make them agree


def test_in_an_image_its_build_info_is_production_and_a_leg_refuses_before_any_work(
    monkeypatch, tmp_path
):
    path = _image(monkeypatch, tmp_path, "2")  # built with --set ...NCCL_GIN_TYPE=2
    assert wide_ep.kernel_gin_type() == ("2", f"{path} (declared nccl_gin_type)")
    assert wide_ep.deepep_v2_env({"NCCL_GIN_TYPE": "2"})["NCCL_GIN_TYPE"] == "2"
    monkeypatch.setenv("NCCL_GIN_TYPE", "5")  # a pod env that overrides the image's
    with pytest.raises(ConfigError, match=rf"NCCL_GIN_TYPE=5 .* differs from 2, .*{path}"):
        wide_ep.run_leg(  # refused before the model is read (it does not exist)
            model=str(tmp_path / "no-model"),
            backend="deepep_v2",
            lay=wide_ep.Layout(nodes=2, dp_local=8),
            workload=wide_ep.Workload(),
            out=tmp_path / "leg.json",
        )
    assert not (tmp_path / "leg.json").exists()


def test_without_an_image_or_a_checkout_the_leg_cannot_tell_and_says_so(no_image, tmp_path):
    with pytest.raises(ConfigError, match="cannot tell the NCCL_GIN_TYPE production engines run"):
        wide_ep.deepep_v2_env({}, dockerfile=tmp_path / "Dockerfile")
    two = tmp_path / "Dockerfile"
    two.write_text("ARG NCCL_GIN_TYPE=5\nARG NCCL_GIN_TYPE=2\n")
    with pytest.raises(Exception, match="expected one `ARG NCCL_GIN_TYPE=<value>` line.*found 2"):
        wide_ep.kernel_gin_type(two)


def test_the_planned_scripts_leave_the_gin_type_to_the_image():
    cfg = parse_config(
        {
            "model": {"path": "Qwen/Qwen3-30B-A3B-FP8"},
            "pipeline": {"base_image": "registry.example/moerl-rollout:1"},
            "rollout": {"device": "cuda"},
            "cluster": {"launch": {"mode": "kubernetes"}},
        }
    )
    planned = wide_ep.plan_jobsets(
        cfg, backends=["deepep_v2"], nodes=[2], repeats=1, workload=wide_ep.Workload()
    )
    text = json.dumps(planned)
    assert "NCCL_GIN_ENABLE=1" in text and "NCCL_GIN_TYPE" not in text


def test_no_second_gin_type_literal_anywhere_but_the_kernel_images_arg():
    """The one place: `ARG NCCL_GIN_TYPE=` in the kernel image (the bake file does not override
    it, else the Dockerfile's default would not be production's)."""
    found = []
    for top in SOURCES:
        for path in sorted((ROOT / top).rglob("*")):
            if not path.is_file() or path.suffix in (".pyc", ".md") or "__pycache__" in path.parts:
                continue
            lines = path.read_text(errors="replace").splitlines()
            code = "\n".join("" if x.lstrip().startswith("#") else x for x in lines)
            for m in LITERAL.finditer(code):
                n = code.count("\n", 0, m.start())
                if not (path == KERNEL and lines[n].startswith("ARG NCCL_GIN_TYPE=")):
                    found.append(f"{path.relative_to(ROOT)}:{n + 1}: {lines[n].strip()}")
    assert not found, "a second NCCL_GIN_TYPE; read the kernel image's instead:\n" + "\n".join(
        found
    )
    assert "NCCL_GIN_TYPE" not in (ROOT / "images" / "docker-bake.hcl").read_text()
