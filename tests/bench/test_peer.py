"""`moerl bench peer`: the settings TRL is given, time to reward and the ratio over rounds,
arguments refused before any work, the moerl arm's command, and a real short TRL arm
(GRPOTrainer, 2 versions) on the version 0 moerl builds. Speed is never asserted."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks.modes import arm_config
from benchmarks.peer import (
    CpuUsage,
    WeightsDiffer,
    _own_cpu_s,
    _trl_arm,
    add_times,
    build_v0,
    check_counts,
    check_weights,
    clear_own_dirs,
    differences,
    moerl_argv,
    parse_targets,
    round_order,
    round_ratios,
    run_bench_peer,
    settings_map,
    summarize,
    trl_kwargs,
    trl_rows,
    weights_sha256,
)
from moerl.cli import build_parser
from moerl.config import load_config
from moerl.errors import ConfigError

ROOT = Path(__file__).resolve().parents[2]
CONFIG = ROOT / "configs/tiny-moe-grpo.yaml"
SMALL = ["task.prompts_per_iteration=16", "trainer.optimizer.optimizer_steps_per_iteration=2"]


def test_targets_rounds_and_versions_are_checked(tmp_path):
    assert parse_targets("0.9, 0.5,0.99") == (0.5, 0.9, 0.99)
    assert parse_targets([1.0]) == (1.0,)
    for bad in ("", "0", "1.5", "a,0.5", "0.5,0.5", "-0.1"):
        with pytest.raises(ConfigError, match="--targets must be distinct reward levels"):
            parse_targets(bad)
    with pytest.raises(ConfigError, match="--rounds must be >= 1"):
        check_counts(0, None)
    with pytest.raises(ConfigError, match="--versions must be >= 1"):
        check_counts(1, 0)
    out = tmp_path / "never"
    with pytest.raises(ConfigError, match="--rounds"):
        run_bench_peer(CONFIG, rounds=0, out_dir=out)
    with pytest.raises(ConfigError, match="--targets"):
        run_bench_peer(CONFIG, targets="0.5,2", out_dir=out)
    assert not out.exists()  # refused before any work


def test_rounds_alternate_the_first_arm():
    assert [round_order(i) for i in range(3)] == [
        ("trl", "moerl"),
        ("moerl", "trl"),
        ("trl", "moerl"),
    ]


def test_settings_map_reads_the_async_config():
    cfg = load_config(CONFIG, [], mode="async")
    rows = {field: (key, value) for key, field, value in settings_map(cfg)}
    p, g = cfg.task.prompts_per_iteration, cfg.rollout.samples_per_prompt
    steps = cfg.trainer.optimizer.optimizer_steps_per_iteration
    assert rows["num_generations"][1] == g == 8
    assert rows["generation_batch_size"][1] == p * g
    assert rows["steps_per_generation"] == ("trainer.optimizer.optimizer_steps_per_iteration", 32)
    assert rows["per_device_train_batch_size"][1] * steps == p * g
    assert rows["learning_rate"][1] == 5e-4  # the async modes: block's, not the file's 1e-3
    assert rows["epsilon"][1] == 0.2 and rows["epsilon_high"][1] == 0.28
    assert rows["loss_type"][1] == "dapo" and rows["scale_rewards"][1] == "group"
    assert rows["beta"][1] == 0.0 and rows["num_iterations"][1] == 1
    assert rows["top_k"][1] == 0  # moerl's -1 (off) is TRL's 0
    assert rows["max_completion_length"][1] == cfg.rollout.max_new_tokens
    assert rows["shuffle_dataset"][1] is False
    assert rows["lr_scheduler_type"][1] == "constant" and rows["warmup_steps"][1] == 0
    kw = trl_kwargs(cfg, versions=5)
    assert kw["max_steps"] == 5 * steps and "generation_batch_size" not in kw
    other = load_config(
        CONFIG,
        ["buffer.normalize_by_std=false", "trainer.loss.loss_agg_mode=seq-mean-token-mean"],
        mode="async",
    )
    kw = trl_kwargs(other, versions=1)
    assert kw["scale_rewards"] == "none" and kw["loss_type"] == "grpo"


def test_the_report_says_how_the_moerl_arm_stays_on_policy():
    streamed = differences(load_config(CONFIG, [], mode="async"))
    assert any(
        d.startswith("trainer.schedule.stream (async, buffer.max_staleness 0)")
        and "engine's logprobs" in d
        for d in streamed
    )
    bf16 = differences(load_config(CONFIG, ["rollout.dtype=bfloat16"], mode="async"))
    assert any("its own logprobs just before each minibatch" in d for d in bf16)
    behind = differences(load_config(CONFIG, ["buffer.max_staleness=1"], mode="async"))
    assert any(d.startswith("buffer.max_staleness 1 (async)") for d in behind)
    assert not any(d.startswith("trainer.schedule.stream") for d in behind)
    assert len(streamed) == len(behind)


@pytest.mark.parametrize(
    "override, key",
    [
        ("trainer.loss.policy_loss=gspo", "trainer.loss.policy_loss"),
        ("trainer.loss.clip_ratio_c=3.0", "trainer.loss.clip_ratio_c"),
        ("buffer.min_signal_groups=4", "buffer.min_signal_groups"),
        ("trainer.optimizer.optimizer_steps_per_iteration=3", "optimizer_steps_per_iteration"),
    ],
)
def test_what_trl_cannot_run_is_refused(override, key):
    cfg = load_config(CONFIG, [override], mode="async")
    with pytest.raises(ConfigError, match=key):
        settings_map(cfg)


def _arm(rewards, times):
    return add_times({"ok": True, "rewards": rewards, "reward_s": times}, (0.5, 0.9))


def test_time_to_reward_and_the_median_ratio_over_rounds():
    trl = _arm([0.2, 0.6, 0.95], [10.0, 15.0, 20.0])
    assert trl["time_to_reward"] == {"0.5": 15.0, "0.9": 20.0}
    never = _arm([0.2, 0.6], [10.0, 12.0])
    assert never["time_to_reward"]["0.9"] is None
    rounds = []
    for moerl in (
        _arm([0.55, 0.92], [12.0, 16.0]),  # 0.8x, 0.8x
        _arm([0.1, 0.7, 0.91], [10.0, 20.0, 30.0]),  # 1.33x, 1.5x
        _arm([0.6, 0.95], [7.5, 10.0]),  # 0.5x, 0.5x
    ):
        for r in (trl, moerl):
            r["per_version_s"], r["first_version_s"], r["wall_s"] = 5.0, r["reward_s"][0], 30.0
        arms = {"trl": trl, "moerl": moerl}
        rounds.append(
            {"order": ["trl", "moerl"], "arms": arms, "ratios": round_ratios(arms, (0.5, 0.9))}
        )
    assert rounds[0]["ratios"] == {"0.5": 12.0 / 15.0, "0.9": 16.0 / 20.0}
    s = summarize(rounds, (0.5, 0.9))
    assert s["ratio"] == {"0.5": 12.0 / 15.0, "0.9": 16.0 / 20.0}  # the middle of 3
    assert s["time_to_reward"]["trl"]["0.9"] == 20.0
    assert s["time_to_reward"]["moerl"]["0.5"] == 12.0
    # a round where an arm failed or missed the target has no ratio; the median skips it
    failed = {"trl": trl, "moerl": {"ok": False, "error": "x"}}
    assert round_ratios(failed, (0.5,)) == {"0.5": None}
    assert round_ratios({"trl": trl, "moerl": never}, (0.9,)) == {"0.9": None}


def test_the_moerl_arm_is_the_users_command(tmp_path):
    argv = moerl_argv(CONFIG, SMALL, 4, tmp_path / "moerl")
    assert argv[:4] == ["run", str(CONFIG), "--mode", "async"]
    a = build_parser().parse_args(argv)  # what `moerl run ...` parses
    got = load_config(a.config, a.set, mode=a.mode)
    assert got == arm_config(CONFIG, SMALL, "async", 4, tmp_path / "moerl")
    assert got.pipeline.versions == 4 and got.model.warm_start == "none"
    assert Path(got.checkpoint.uri).is_relative_to(tmp_path / "moerl")


def test_without_trl_the_extra_is_named_before_any_work(tmp_path):
    out = tmp_path / "out"
    code = (
        "import sys; sys.modules['trl'] = None\n"  # as if the extra were not installed
        "from moerl.cli import main\n"
        f"sys.exit(main(['bench', 'peer', {str(CONFIG)!r}, '--out-dir', {str(out)!r}]))\n"
    )
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert p.returncode == 2, p.stdout + p.stderr
    assert "pip install 'moerl[peer]'" in p.stdout + p.stderr
    assert not out.exists()


@pytest.mark.nightly
def test_trl_arm_runs_two_versions_on_moerls_version_0(tmp_path):
    cfg = arm_config(CONFIG, SMALL, "async", 2, tmp_path / "trl")
    v0 = build_v0(cfg, tmp_path / "v0")
    again = build_v0(cfg, tmp_path / "v0-again")  # moerl's build from model.tiny.seed
    assert weights_sha256(v0) == weights_sha256(again)
    assert len(trl_rows(cfg, 2)) == 32
    (tmp_path / "trl").mkdir()
    res = _trl_arm(cfg, 2, tmp_path / "trl", v0)
    assert res["ok"] and res["versions_trained"] == 2
    assert res["weights_sha256"] == weights_sha256(v0)
    assert res["batch_sizes"] == [16 * 8, 16 * 8]  # one reward call per generation batch
    assert all(0.0 <= r <= 1.0 for r in res["rewards"])
    s = res["reward_s"]
    assert 0.0 < s[0] < s[1] <= res["wall_s"]
    assert res["threads"] == len(os.sched_getaffinity(0))
    assert res["per_version_s"] == pytest.approx(s[1] - s[0])
    got = res["grpo_config"]  # what GRPOConfig was given
    assert got["shuffle_dataset"] is False and got["steps_per_generation"] == 2
    assert got["per_device_train_batch_size"] == 64 and got["max_steps"] == 4
    assert res["unused_loaded"] == []  # neither vLLM nor MLflow in the arm's process


def test_the_trl_arms_process_imports_trl_without_vllm_or_mlflow():
    """TRL and transformers import vLLM and MLflow whenever they are installed (moerl's
    environment has both); the TRL arm hides them first, as a plain TRL script never loads them."""
    pytest.importorskip("trl")
    code = (
        "import sys; from benchmarks.peer import hide_from_trl; hide_from_trl(); "
        "from trl import GRPOConfig, GRPOTrainer; from trl.import_utils import is_vllm_available; "
        "print(is_vllm_available(), sorted(m for m in ('vllm', 'mlflow') "
        "if sys.modules.get(m) is not None))"
    )
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-2000:]
    assert p.stdout.split("\n")[-2] == "False []"


def test_an_arm_on_other_weights_fails_loudly():
    same = {"model.safetensors": "a" * 64}
    check_weights("moerl", dict(same), same)
    with pytest.raises(WeightsDiffer, match="the trl arm started from other weights"):
        check_weights("trl", {"model.safetensors": "b" * 64}, same)
    with pytest.raises(WeightsDiffer):
        check_weights("moerl", {}, same)


def test_an_arms_own_cpu_is_not_counted_as_other_load():
    usage, own0 = CpuUsage(), _own_cpu_s()
    burn = "import time\nt = time.process_time()\nwhile time.process_time() - t < 1.0: pass\n"
    subprocess.run([sys.executable, "-c", burn], check=True, timeout=60)  # a waited-for child
    assert _own_cpu_s() - own0 >= 0.9  # the child's CPU is the arm's own
    others = usage.others_cores()
    assert others is not None and others >= 0.0  # what the rest of the machine did meanwhile


def test_a_rerun_replaces_only_the_benchs_own_dirs(tmp_path):
    clear_own_dirs(tmp_path / "missing")  # a first run: nothing there yet
    for d in ("v0", "round1/moerl/checkpoints", "round2/trl", "mine"):
        (tmp_path / d).mkdir(parents=True)
    (tmp_path / "report.json").write_text("{}")
    clear_own_dirs(tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["mine", "report.json"]
