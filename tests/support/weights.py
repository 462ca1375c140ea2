"""Read a version's HF weights whatever files hold them: one `model.safetensors`, or the files
a `model.safetensors.index.json` names (the mesh's export: each rank its own)."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file


def read_weights(folder: str | Path) -> dict[str, torch.Tensor]:
    folder = Path(folder)
    index = folder / "model.safetensors.index.json"
    if not index.is_file():
        return load_file(folder / "model.safetensors")
    weight_map = json.loads(index.read_text())["weight_map"]
    out: dict[str, torch.Tensor] = {}
    for f in sorted(set(weight_map.values())):
        out.update(load_file(folder / f))
    assert set(out) == set(weight_map), "the index and the files disagree"
    return out
