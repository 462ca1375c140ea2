"""The runtime probe and the config's `require:` block: on this CPU machine the probe records
what is absent (no CUDA, no DeepEP, no EFA) instead of skipping it, and a stage or a run that
requires one of them fails at once, naming it, before any work."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import yaml

from moerl import provenance
from moerl.config import RequireConfig, parse_config
from moerl.errors import RequirementError

PRESENT = {
    "runtime.torch": "2.11.0+cu130",
    "runtime.torch_cuda": "13.0",
    "runtime.cuda_available": "true",
    "runtime.deep_ep": "importable 1.2.1",
    "runtime.efa_devices": "rdmap16s27,rdmap32s27",
    "runtime.libfabric_efa_provider": "efa",
}


def test_the_probe_records_what_is_absent_here():
    probe = provenance.runtime_probe()
    assert probe["runtime.torch"].startswith("2.13.0")
    assert probe["runtime.cuda_available"] == "false" and probe["runtime.gpus"] == "0"
    assert probe["runtime.deep_ep"].startswith("absent (")  # not skipped: the reason is recorded
    assert probe["runtime.efa_devices"] == (
        "none" if not provenance.INFINIBAND.exists() else probe["runtime.efa_devices"]
    )
    assert probe["runtime.env.NVSHMEM_REMOTE_TRANSPORT"] == os.environ.get(
        "NVSHMEM_REMOTE_TRANSPORT", "unset"
    )


@pytest.mark.parametrize(
    "need,absent,needle",
    [
        ("gpu", {"runtime.cuda_available": "false"}, "require.gpu: CUDA is not available"),
        (
            "deepep",
            {"runtime.deep_ep": "absent (ModuleNotFoundError: No module named 'deep_ep')"},
            "require.deepep: DeepEP does not import",
        ),
        ("efa", {"runtime.efa_devices": "none"}, "require.efa: EFA devices none"),
        ("efa", {"runtime.libfabric_efa_provider": "absent"}, "libfabric efa provider absent"),
    ],
)
def test_each_requirement_fails_only_when_its_piece_is_missing(need, absent, needle):
    require = RequireConfig(**{need: True})
    assert provenance.missing_requirements(require, PRESENT) == []
    (msg,) = provenance.missing_requirements(require, {**PRESENT, **absent})
    assert needle in msg
    # not required: recorded only
    assert provenance.missing_requirements(RequireConfig(), {**PRESENT, **absent}) == []


def test_build_info_is_read_as_tags_and_absent_outside_an_image(tmp_path):
    from moerl import buildinfo

    assert provenance.build_info(tmp_path / "none.json") == {"build.info": "absent"}
    # what an image build writes, here on CPU
    buildinfo.write(tmp_path / "b.json", buildinfo.collect())
    tags = provenance.build_info(tmp_path / "b.json")
    assert tags["build.torch"].startswith("2.13.0") and tags["build.deep_ep"] == "missing"
    (tmp_path / "bad.json").write_text(json.dumps({"not": "a record"}))
    assert provenance.build_info(tmp_path / "bad.json")["build.info"].startswith("unreadable (")


def test_a_stage_that_requires_a_gpu_fails_before_any_work():
    from moerl.components.rollout.stage import run_rollout

    cfg = parse_config({"require": {"gpu": True}})
    with pytest.raises(RequirementError, match="rollout: require.gpu: CUDA is not available"):
        run_rollout(cfg, "", None, 0, "/nonexistent/samples.jsonl")  # the policy is never touched


@pytest.mark.slow  # `moerl run` as a process (refused before any work)
def test_moerl_run_requiring_deepep_exits_2_before_any_work(tmp_path):
    (tmp_path / "run.yaml").write_text(yaml.safe_dump({"require": {"deepep": True}}))
    env = {k: v for k, v in os.environ.items() if k != "MLFLOW_TRACKING_URI"}
    r = subprocess.run(
        [sys.executable, "-m", "moerl.cli", "run", "run.yaml"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 2, r.stdout + r.stderr
    assert "require.deepep: DeepEP does not import" in r.stderr and "Traceback" not in r.stderr
    assert not (tmp_path / "mlflow.db").exists() and not (tmp_path / "checkpoints").exists()


def test_cpu_group_stages_record_the_probe_but_do_not_enforce_gpu_requirements(tmp_path):
    """`require:` is about the GPU stages; a reward or buffer pod has no GPU by design. It still
    records its build-info and runtime on the run."""
    from mlflow.tracking import MlflowClient

    from moerl import tracking

    cfg = parse_config(
        {"require": {"gpu": True}, "tracking": {"uri": f"sqlite:///{tmp_path / 'm.db'}"}}
    )
    run_id = tracking.start_run(cfg, tracking.resolve_uri(cfg.tracking), {})
    probe = provenance.stage_start(cfg, "reward", run_id, enforce=False)
    assert probe["runtime.cuda_available"] == "false"
    tags = MlflowClient(tracking.resolve_uri(cfg.tracking)).get_run(run_id).data.tags
    assert (
        tags["runtime.reward.cuda_available"] == "false" and tags["build.reward.info"] == "absent"
    )
    assert tags["runtime.reward.torch"] == probe["runtime.torch"]
    with pytest.raises(RequirementError, match="policy_update: require.gpu"):
        provenance.stage_start(cfg, "policy_update", run_id)


def test_the_light_probe_reads_the_build_without_importing_torch(monkeypatch):
    """CPU-group stages that do not load torch are probed from package metadata and the
    NVIDIA device nodes (moerl/provenance.py `_light_torch`)."""
    full, light = provenance.runtime_probe(), provenance.runtime_probe(light=True)
    assert (
        light["runtime.torch"] == full["runtime.torch"]
        and light["runtime.torch_cuda"] == full["runtime.torch_cuda"]
    )
    assert light["runtime.cuda_available"] == full["runtime.cuda_available"] == "false"
    assert {k: v for k, v in light.items() if k.startswith("runtime.env.")} == {
        k: v for k, v in full.items() if k.startswith("runtime.env.")
    }
    versions = {"torch": "2.11.0+cu130", "deep_ep": "2.1.0"}
    monkeypatch.setattr(provenance, "_pkg", versions.get)
    gpu_build = provenance._light_torch()
    assert gpu_build["runtime.torch_cuda"] == "13.0" and gpu_build["runtime.deep_ep"].startswith(
        "installed 2.1.0"
    )
    assert (
        gpu_build["runtime.cuda_available"]
        == str(provenance.Path("/dev/nvidiactl").exists()).lower()
    )
