"""Moved config keys: every key that left `trainer.` for a section, or moved between sections,
is refused wherever it comes from (the file, `--set`, a `modes:` block, the run form's
overrides) with one line naming its new place, and `moerl config migrate` rewrites a file to
the new form."""

import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from moerl.config import load_config, parse_config
from moerl.config.trainer import MOVED, TrainerConfig
from moerl.errors import ConfigError
from moerl.pipelines.params import merge

ROOT = Path(__file__).resolve().parents[2]


def moerl(*args):
    return subprocess.run(
        [sys.executable, "-m", "moerl.cli", *args], capture_output=True, text=True, timeout=120
    )


def _default(new: str):
    """The new key's default value (JSON form): a value the key accepts."""
    _, section, key = new.split(".")
    return TrainerConfig().model_dump(mode="json")[section][key]


def _nested(dotted: str, value) -> dict:
    """`a.b.c`, value -> {"a": {"b": {"c": value}}}."""
    *parents, key = dotted.split(".")
    out: dict = {key: value}
    for part in reversed(parents):
        out = {part: out}
    return out


def _refusal(old: str, new: str) -> str:
    return f"{old}: moved to {new} (moerl config migrate FILE rewrites a file)"


def test_every_trainer_field_but_seed_moved_into_a_section():
    assert set(TrainerConfig.model_fields) == {
        "seed",
        "optimizer",
        "schedule",
        "loss",
        "correction",
        "parallelism",
        "moe",
    }
    assert len(MOVED) == 37
    assert MOVED["trainer.learning_rate"] == "trainer.optimizer.learning_rate"
    assert MOVED["trainer.router_replay"] == "trainer.moe.router_replay"
    # the streaming schedule left the optimizer's section for a section of its own
    assert MOVED["trainer.stream"] == MOVED["trainer.optimizer.stream"] == "trainer.schedule.stream"


@pytest.mark.parametrize("old, new", sorted(MOVED.items()))
def test_a_moved_key_is_refused_naming_its_new_place(tmp_path, old, new):
    value = _default(new)
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(_nested(old, value)))
    with pytest.raises(ConfigError) as e:
        load_config(path)
    assert str(e.value) == _refusal(old, new)
    # in --set
    empty = tmp_path / "empty.yaml"
    empty.write_text("{}\n")
    with pytest.raises(ConfigError) as e:
        load_config(empty, [f"{old}={yaml.safe_dump(value, default_flow_style=True).strip()}"])
    assert str(e.value) == _refusal(old, new)
    # in the modes: block, for the mode that selects it only
    path.write_text(yaml.safe_dump({"modes": {"async": _nested(old, value)}}))
    assert load_config(path, mode="sync").pipeline.mode == "sync"
    with pytest.raises(ConfigError) as e:
        load_config(path, mode="async")
    assert str(e.value) == _refusal(old, new)
    # and the new place loads
    assert parse_config(_nested(new, value))


def test_several_moved_keys_are_one_line_naming_each():
    with pytest.raises(ConfigError) as e:
        parse_config({"trainer": {"learning_rate": 0.01, "tis_cap": 3.0, "seed": 1}})
    msg = str(e.value)
    assert "\n" not in msg
    assert "trainer.learning_rate: moved to trainer.optimizer.learning_rate" in msg
    assert "trainer.tis_cap: moved to trainer.correction.tis_cap" in msg
    assert msg.endswith("(moerl config migrate FILE rewrites a file)")


def test_the_run_forms_overrides_are_refused_too():
    base = load_config(ROOT / "configs" / "tiny-moe-grpo.yaml")
    with pytest.raises(ConfigError) as e:
        merge(base, {}, ["trainer.clip_eps_high=0.3"])
    assert str(e.value) == "run parameters: " + _refusal(
        "trainer.clip_eps_high", "trainer.loss.clip_eps_high"
    )
    assert merge(base, {}, ["trainer.loss.clip_eps_high=0.3"]).trainer.loss.clip_eps_high == 0.3


def test_the_cli_exits_2_with_one_line_before_any_work(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("trainer:\n  learning_rate: 0.01\n")
    r = moerl("config", "show", str(path))
    assert r.returncode == 2 and r.stdout == ""
    assert r.stderr.strip().splitlines() == [
        "moerl: error: " + _refusal("trainer.learning_rate", "trainer.optimizer.learning_rate")
    ]
    r = moerl("run", str(path), "--iterations", "1")
    assert r.returncode == 2, r.stderr
    assert _refusal("trainer.learning_rate", "trainer.optimizer.learning_rate") in r.stderr


OLD = """\
# a run config in the old, flat trainer form
model:
  tiny:
    num_experts: 4
trainer:
  seed: 7
  learning_rate: 0.001     # tuned
  optimizer_steps_per_iteration: 4
  clip_eps_high: 0.28
  tis_mode: token_mask
  tis_mask_low: 0.5
  expert_parallel_size: 2
  aux_loss_coef: 0.01
rollout:
  temperature: 0.9
modes:
  sync:
    trainer:
      clip_eps_high: 3.0
  async:
    trainer:
      learning_rate: 0.0005
    buffer:
      max_staleness: 1
"""

NEW = """\
model:
  tiny:
    num_experts: 4
trainer:
  seed: 7
  optimizer: {learning_rate: 0.001, optimizer_steps_per_iteration: 4}
  loss: {clip_eps_high: 0.28}
  correction: {tis_mode: token_mask, tis_mask_low: 0.5}
  parallelism: {expert_parallel_size: 2}
  moe: {aux_loss_coef: 0.01}
rollout:
  temperature: 0.9
modes:
  sync:
    trainer:
      loss: {clip_eps_high: 3.0}
  async:
    trainer:
      optimizer: {learning_rate: 0.0005}
    buffer:
      max_staleness: 1
"""


def test_migrate_rewrites_a_file_that_then_loads_as_the_new_form(tmp_path):
    old, out, new = tmp_path / "old.yaml", tmp_path / "out.yaml", tmp_path / "new.yaml"
    old.write_text(OLD)
    new.write_text(NEW)
    r = moerl("config", "migrate", str(old), "-o", str(out))
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert "trainer.learning_rate -> trainer.optimizer.learning_rate" in lines
    assert "modes.sync.trainer.clip_eps_high -> modes.sync.trainer.loss.clip_eps_high" in lines
    assert (
        "modes.async.trainer.learning_rate -> modes.async.trainer.optimizer.learning_rate" in lines
    )
    assert len([line for line in lines if " -> " in line]) == 9
    assert "comments are dropped" in lines[-1]
    assert old.read_text() == OLD  # -o leaves the input as it was
    assert yaml.safe_load(out.read_text()) == yaml.safe_load(NEW)
    for mode in ("sync", "async"):
        assert load_config(out, mode=mode) == load_config(new, mode=mode)
    # in place, and again: nothing left to move
    r = moerl("config", "migrate", str(old))
    assert r.returncode == 0, r.stderr
    assert yaml.safe_load(old.read_text()) == yaml.safe_load(NEW)
    r = moerl("config", "migrate", str(old))
    assert r.returncode == 0 and "nothing to migrate" in r.stdout


def test_migrate_refuses_a_file_with_both_the_old_and_the_new_key(tmp_path):
    both = tmp_path / "both.yaml"
    text = "trainer:\n  learning_rate: 0.01\n  optimizer:\n    learning_rate: 0.02\n"
    both.write_text(text)
    r = moerl("config", "migrate", str(both))
    assert r.returncode == 2
    assert "trainer.learning_rate and trainer.optimizer.learning_rate are both set" in r.stderr
    assert both.read_text() == text
    # under modes: too, and nothing is written
    both.write_text(
        "modes:\n  async:\n    trainer:\n      tis_cap: 3\n      correction: {tis_cap: 4}\n"
    )
    r = moerl("config", "migrate", str(both), "-o", str(tmp_path / "out.yaml"))
    assert r.returncode == 2
    assert "modes.async.trainer.tis_cap and modes.async.trainer.correction.tis_cap" in r.stderr
    assert not (tmp_path / "out.yaml").exists()


@pytest.mark.parametrize("name", ["tiny-moe-grpo.yaml", "tiny-moe-lookup.yaml", "tiny-rm.yaml"])
def test_the_shipped_configs_are_in_the_new_form(tmp_path, name):
    r = moerl("config", "migrate", str(ROOT / "configs" / name), "-o", str(tmp_path / "o.yaml"))
    assert r.returncode == 0 and "nothing to migrate" in r.stdout, r.stdout + r.stderr


def test_migrate_moves_the_streaming_schedule_out_of_the_optimizer(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text(
        "trainer:\n  optimizer: {learning_rate: 0.01, stream: false}\n"
        "modes:\n  async:\n    trainer:\n      optimizer: {stream: true}\n"
    )
    with pytest.raises(ConfigError, match=r"^trainer.optimizer.stream: moved to trainer.schedule"):
        load_config(path)
    r = moerl("config", "migrate", str(path))
    assert r.returncode == 0, r.stderr
    assert "trainer.optimizer.stream -> trainer.schedule.stream" in r.stdout.splitlines()
    assert yaml.safe_load(path.read_text()) == {
        "trainer": {"optimizer": {"learning_rate": 0.01}, "schedule": {"stream": False}},
        "modes": {"async": {"trainer": {"optimizer": {}, "schedule": {"stream": True}}}},
    }
    assert load_config(path).trainer.schedule.stream is False
    # two old places of one new key: refused, nothing written
    text = "trainer:\n  stream: true\n  optimizer: {stream: false}\n"
    path.write_text(text)
    r = moerl("config", "migrate", str(path))
    assert r.returncode == 2
    assert "both move to trainer.schedule.stream" in r.stderr
    assert path.read_text() == text
