"""`run_publish` refuses a state whose weights hold a NaN or an inf: nothing is uploaded and
`latest` stays on the last good version."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from moerl.components.publish_checkpoint.stage import run_publish
from moerl.config import RunConfig
from moerl.errors import CheckpointError
from moerl.store.runs import run_store


def _state(d: Path, bad: float | None = None) -> Path:
    d.mkdir(parents=True)
    (d / "config.json").write_text('{"model_type": "qwen3_moe"}')
    (d / "trainer").mkdir()
    (d / "trainer" / "state.json").write_text('{"step": 2}')
    save_file(
        {"model.embed_tokens.weight": torch.ones(4, 3)}, d / "model-00001-of-00002.safetensors"
    )
    w = torch.zeros(5, 2, dtype=torch.bfloat16)
    if bad is not None:
        w[3, 1] = bad
    save_file(
        {"lm_head.weight": w, "step.count": torch.tensor([7], dtype=torch.int64)},
        d / "model-00002-of-00002.safetensors",
    )
    return d


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_non_finite_weight_refused_before_any_upload(tmp_path: Path, bad: float) -> None:
    cfg = RunConfig.model_validate({"checkpoint": {"uri": str(tmp_path / "ck")}})
    run_publish(cfg, "r1", _state(tmp_path / "good"), 1)
    store = run_store(cfg.checkpoint, "r1")
    with pytest.raises(CheckpointError) as err:
        run_publish(cfg, "r1", _state(tmp_path / "bad", bad=bad), 2)
    assert str(err.value).startswith(
        "refusing to publish version 2: model-00002-of-00002.safetensors tensor "
        "'lm_head.weight' holds 1 non-finite values (NaN/inf) of 10"
    )
    assert store.latest() == 1 and store.versions() == [1]
    assert sorted(store._version_dirs()) == ["v000001"]  # not a byte of version 2, not even staged


def test_unreadable_safetensors_refused(tmp_path: Path) -> None:
    cfg = RunConfig.model_validate({"checkpoint": {"uri": str(tmp_path / "ck")}})
    state = _state(tmp_path / "s")
    (state / "model-00001-of-00002.safetensors").write_bytes(b"\x00" * 5)
    with pytest.raises(
        CheckpointError, match="refusing to publish version 0: cannot read model-00001-of-00002"
    ):
        run_publish(cfg, "r1", state, 0)
    assert run_store(cfg.checkpoint, "r1").latest() is None
