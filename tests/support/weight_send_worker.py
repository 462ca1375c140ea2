"""Jobs for tests/rollout/test_weight_sync.py on a gloo world (tests/support/gloo_world.py): one
rank of a (dp, ep) trainer mesh, the policy loaded sharded as the trainer loads it (FSDP2 on the
mesh), which joins its group of the collective weight path and sends versions to live engines.

Each version perturbs every rank's own shard (different per rank and version, so a misplaced
row shows), writes the durable copy (`export_ep_checkpoint`, every rank its files) and sends the
same version over the wire (`ep_send.WeightSender`). Every rank's counts come back to the test.
"""

from __future__ import annotations

import os
import signal
import zlib
from pathlib import Path

import torch

SEND_BUCKET_BYTES = 64_000  # small: several frames per rank and version


def _perturb(model, rank: int, version: int) -> None:
    with torch.no_grad():
        for name, p in model.named_parameters():
            local = p.to_local() if hasattr(p, "to_local") else p
            seed = zlib.crc32(name.encode()) + 1000 * rank + 100_000 * version
            g = torch.Generator().manual_seed(seed)
            local.add_(0.01 * torch.randn(local.shape, generator=g))


def _load(ckpt: str, dp: int, ep: int):
    from transformers import AutoConfig

    from moerl.components.policy_update.ep_checkpoint import load_ep_model
    from moerl.components.policy_update.ep_train import apply_fsdp, build_mesh
    from moerl.config import parse_config
    from moerl.kernels import make_dispatcher
    from moerl.models.families import family_of

    cfg = parse_config(
        {"trainer": {"parallelism": {"expert_parallel_size": ep, "data_parallel_shard": dp}}}
    )
    mesh = build_mesh(cfg)
    hf = AutoConfig.from_pretrained(ckpt)
    dispatcher = make_dispatcher(
        "all_to_all", num_experts=family_of(hf).num_experts(hf), group=mesh.get_group("ep")
    )
    model, blocks, layout = load_ep_model(
        ckpt, dispatcher, torch.float32, "cpu", shard=lambda m, b: apply_fsdp(m, b, mesh)
    )
    return mesh, model, blocks, layout


def send_versions(
    rank: int,
    world: int,
    dp: int,
    ep: int,
    ckpt: str,
    ports: list[int],
    engine_ranks: int,
    versions: list[int],
    out_dir: str,
    kill: dict | None = None,
    timeout_s: float = 60.0,
):
    """Join this rank's group, then per version: perturb, export the durable copy to
    out_dir/v<version>, send it. `kill` {"rank", "version", "after_frames"}: that rank SIGKILLs
    itself once it has sent that many frames of that version (a trainer killed mid-send)."""
    from moerl.components.policy_update.ep_export import expected_keys, export_ep_checkpoint
    from moerl.components.policy_update.ep_send import WeightSender
    from moerl.components.redistribute_weights import wire

    mesh, model, blocks, layout = _load(ckpt, dp, ep)
    sender = WeightSender(
        wire.GroupAddress("127.0.0.1", ports[rank], 1 + engine_ranks), "cpu", timeout_s
    )
    sender.join()
    out = []
    try:
        for v in versions:
            _perturb(model, rank, v)
            export = export_ep_checkpoint(
                model, blocks, layout, Path(ckpt), Path(out_dir) / f"v{v}", mesh
            )
            if kill and kill["rank"] == rank and kill["version"] == v:
                _arm_kill(kill["after_frames"])
            stats = sender.send(
                model, blocks, layout, mesh, wire.Session(v, f"sha-v{v}"), None, SEND_BUCKET_BYTES
            )
            out.append(
                {
                    "version": v,
                    "sent": stats.bytes,
                    "tensors": stats.tensors,
                    "frames": stats.frames,
                    "keys": stats.keys,
                    "written": export.bytes_written[rank],
                    "total": export.total_bytes,
                    "expected": sorted(expected_keys(blocks, layout)),
                }
            )
    finally:
        sender.close()
    return out


def _arm_kill(after_frames: int) -> None:
    """SIGKILL this process once `after_frames` frames of the next send went out."""
    from moerl.components.redistribute_weights import wire

    original = wire.FrameSender._frame
    count = {"n": 0}

    def frame(self, kind, header, payload):
        if count["n"] >= after_frames:
            os.kill(os.getpid(), signal.SIGKILL)
        count["n"] += 1
        return original(self, kind, header, payload)

    wire.FrameSender._frame = frame  # type: ignore[method-assign]
