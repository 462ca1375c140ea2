"""The async trainer's persistent mesh on NCCL: one rank per visible GPU (one on a one-GPU
machine: the mesh path with bf16 mixed precision), three versions trained on one `Session`
kept in memory equal three versions each reloaded from the previous version's files (master
weights and Adam from their per-rank Distributed Checkpoints), and the per-version time of
each: what a version costs when nothing is reloaded. Run by `tests/gpu/run.sh`; skipped
without CUDA. Written without a GPU; not yet run on one (docs/verified.md)."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest
import torch

from moerl.config import parse_config
from moerl.models.tiny import build_tiny_model
from moerl.records import TrainSample
from tests.support.weights import read_weights

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (tests/gpu/run.sh)"),
]


def _cfg(world: int):
    ep = 2 if world % 2 == 0 else 1
    return parse_config(
        {
            "trainer": {
                "optimizer": {"optimizer_steps_per_iteration": 2, "learning_rate": 1e-3},
                "parallelism": {
                    "device": "cuda",
                    "mixed_precision": "bf16",
                    "expert_parallel_size": ep,
                    "data_parallel_shard": world // ep,
                },
            }
        }
    )


def _batches(n: int = 3) -> list[list[TrainSample]]:
    g = torch.Generator().manual_seed(0)
    out = []
    for b in range(n):
        rows = []
        for i in range(16):
            ids = torch.randint(5, 25, (12,), generator=g).tolist()
            rows.append(
                TrainSample(
                    prompt_token_ids=ids[:6],
                    response_token_ids=ids[6:],
                    response_logprobs=(-torch.rand(6, generator=g) * 3).tolist(),
                    advantage=(1.0 + i / 8) * (-1) ** (i + b),
                    policy_version=b,
                )
            )
        out.append(rows)
    return out


def _rank(rank: int, world: int, start: str, out: str, port: int) -> None:
    import torch.distributed as dist

    from moerl.components.policy_update.ep_train import Session, join_process_group, run_version

    os.environ.update(
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
    )
    cfg = _cfg(world)
    join_process_group(cfg)
    try:
        times = {}
        kept = Session.load(cfg, Path(start))
        t0 = time.perf_counter()
        for v, batch in enumerate(_batches()):
            run_version(cfg, kept, batch, v, Path(out) / "persistent" / f"v{v + 1}")
        torch.cuda.synchronize()
        times["persistent"] = time.perf_counter() - t0
        prev, t0 = Path(start), time.perf_counter()
        for v, batch in enumerate(_batches()):
            fresh = Session.load(cfg, prev)
            prev = Path(out) / "restart" / f"v{v + 1}"
            run_version(cfg, fresh, batch, v, prev)
        torch.cuda.synchronize()
        times["restart"] = time.perf_counter() - t0
        if rank == 0:
            (Path(out) / "times.txt").write_text(f"{times['persistent']} {times['restart']}")
    finally:
        dist.destroy_process_group()


def test_persistent_versions_equal_reloaded_versions_on_nccl(tmp_path):
    import torch.multiprocessing as mp

    from moerl.launch.procs import free_port

    world = torch.cuda.device_count()
    build_tiny_model(parse_config({}).model.tiny, tmp_path / "s0")
    mp.spawn(
        _rank,
        args=(world, str(tmp_path / "s0"), str(tmp_path), free_port()),
        nprocs=world,
        join=True,
    )
    for v in (1, 2, 3):
        a = read_weights(tmp_path / "persistent" / f"v{v}")
        b = read_weights(tmp_path / "restart" / f"v{v}")
        worst = max(float((a[k].float() - b[k].float()).abs().max()) for k in a)
        assert worst <= 1e-5, (v, worst)
    persistent, restart = map(float, (tmp_path / "times.txt").read_text().split())
    print(
        f"\n{world} NCCL rank(s): 3 versions in {persistent:.2f} s kept in memory, "
        f"{restart:.2f} s reloading each ({restart / persistent:.2f}x)"
    )
