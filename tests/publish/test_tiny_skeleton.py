"""The engine's skeleton of the tiny model (moerl/models/tiny.py `build_tiny_skeleton`): the
files `build_tiny_model` writes beside the weights, byte for byte, for every family, with no
weights and no model initialized."""

from __future__ import annotations

import pytest

from moerl.config import load_config
from moerl.models.tiny import build_tiny_model, build_tiny_skeleton


@pytest.mark.parametrize("arch", ["qwen3_moe", "mixtral", "olmoe", "qwen2_moe", "deepseek_v3"])
def test_the_skeleton_is_the_models_files_without_weights(tmp_path, arch):
    t = load_config("configs/tiny-moe-grpo.yaml", [f"model.tiny.architecture={arch}"]).model.tiny
    model, skeleton = build_tiny_model(t, tmp_path / "m"), build_tiny_skeleton(t, tmp_path / "s")
    small = sorted(
        p.name for p in model.iterdir() if not p.name.endswith((".safetensors", ".index.json"))
    )
    assert sorted(p.name for p in skeleton.iterdir()) == small
    assert "config.json" in small and "tokenizer.json" in small
    for name in small:
        assert (skeleton / name).read_bytes() == (model / name).read_bytes(), name
