"""The collective weight path into CUDA vLLM engines (docs/weights.md, "Weights over the wire").

- one GPU: a CPU trainer rank (one-rank gloo world) sends two versions over a gloo group into a
  CUDA engine (TP = 1, CUDA graphs on), which loads them through vLLM's weight-transfer API into
  its live parameters; every version's digests and probe logprobs equal a hot swap of its
  durable copy. NCCL cannot join the trainer and the engine here (one communicator refuses two
  ranks on one device), so the group is gloo by request, and the CUDA load path is what runs.
- two GPUs or more: the same into a TP = 2 engine (both ranks join every group; skipped on one).
  Not covered yet: NCCL groups, which need the trainer rank's tensors on a CUDA device of its
  own (the trainer's CUDA path) beside the engine's.

Run by `tests/gpu/ladder.sh` (rung "collective weight sync") and `tests/gpu/run.sh`.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from moerl.config import parse_config
from moerl.models.tiny import build_tiny_model
from tests.support.weight_send_worker import Trainer, probe

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (tests/gpu/run.sh)"),
]


def _cfg(tp: int):
    return parse_config(
        {
            "rollout": {
                "device": "cuda",
                "tensor_parallel_size": tp,
                "max_new_tokens": 8,
                "max_num_seqs": 4,
                "gpu_memory_utilization": 0.3,
                "weight_sync": "collective",
            },
            "model": {"tiny": {"architecture": "qwen3_moe", "max_position_embeddings": 64}},
        }
    )


def _deliver(engine, trainer: Trainer, out: Path, ranks: int) -> None:
    trainer.join_engines([engine], ranks)
    got = {}
    for v in (1, 2):
        stats = engine.receive_weights(v, f"sha-v{v}", deadline_s=120.0)
        assert engine.version == v and stats.ranks == ranks
        got[v] = (stats.digests, probe(engine))
    sent = trainer.wait()
    assert all(r["sent"] == r["written"] > 0 for rank in sent for r in rank)
    for v in (1, 2):
        files = engine.swap_weights(out / f"v{v}", version=v)
        assert files.digests == got[v][0]
        assert probe(engine) == got[v][1]
    assert got[1][0] != got[2][0]


def test_collective_sync_into_a_cuda_engine_over_gloo(gloo_worlds, tmp_path):
    from moerl.components.rollout.engine import RolloutEngine

    cfg = _cfg(1)
    ckpt = build_tiny_model(cfg.model.tiny, tmp_path / "v0")
    engine = RolloutEngine(ckpt, cfg.rollout)
    try:
        trainer = Trainer(gloo_worlds(1), (1, 1), 1, ckpt, [1, 2], tmp_path, backend="gloo")
        _deliver(engine, trainer, tmp_path, 1)
    finally:
        engine.close()


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs: a TP = 2 engine")
def test_collective_sync_into_a_tp2_cuda_engine(gloo_worlds, tmp_path):
    from moerl.components.rollout.engine import RolloutEngine

    cfg = _cfg(2)
    ckpt = build_tiny_model(cfg.model.tiny, tmp_path / "v0")
    engine = RolloutEngine(ckpt, cfg.rollout)
    try:
        trainer = Trainer(gloo_worlds(1), (1, 1), 2, ckpt, [1, 2], tmp_path, backend="gloo")
        _deliver(engine, trainer, tmp_path, 2)
    finally:
        engine.close()
