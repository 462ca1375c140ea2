"""Worker body for the trainer-mesh tests (torch.multiprocessing spawn): one rank of the real
sharded trainer (`ep_train.setup`: FSDP2 on the (dp, ep) mesh), one loss and backward on its
rows, every gradient gathered whole, and the bytes this rank holds after one optimizer step."""

from pathlib import Path

import torch
import torch.distributed as dist


def _whole_expert(t, ep_group):
    """A local expert tensor (a dp shard under FSDP) gathered over dp, then over ep: [E, ...]."""
    local = t.full_tensor() if hasattr(t, "full_tensor") else t
    parts = [torch.empty_like(local) for _ in range(dist.get_world_size(ep_group))]
    dist.all_gather(parts, local.contiguous(), group=ep_group)
    return torch.cat(parts)


def _local_bytes(t) -> int:
    t = t.to_local() if hasattr(t, "to_local") else t
    return t.numel() * t.element_size()


def mesh_rank(rank, world, dp, ep, model_path, out_dir, trainer=None):
    # a job of tests/support/gloo_world.py: the world's process group is already up
    from moerl.components.policy_update.ep_train import setup
    from moerl.config import parse_config
    from tests.support import ep_worker

    cfg = parse_config(
        {
            "trainer": {
                # `trainer`: more parallelism keys (activation_checkpointing, ...)
                "parallelism": {
                    "expert_parallel_size": ep,
                    "data_parallel_shard": dp,
                    **(trainer or {}),
                },
            }
        }
    )
    model, opt, _, blocks, _, _, mesh = setup(cfg, Path(model_path))
    ep_group = mesh.get_group("ep")
    packed = ep_worker.batch_tensors()
    n = packed.input_ids_NL.shape[0]
    mine = torch.arange(n)[rank::world]
    calls = []  # forwards of the first decoder layer: once more in the backward when recomputed
    model.model.layers[0].register_forward_pre_hook(lambda m, a: calls.append(1))
    loss = ep_worker.step_loss_and_grads(
        model,
        packed,
        mine,
        n_tokens=float(packed.mask_NL1.sum()),
        chunk_tokens=cfg.trainer.parallelism.logprob_chunk_tokens,
    )
    total = loss.detach().clone()
    dist.all_reduce(total)
    experts = {id(p) for b in blocks for p in (b.gate_up_proj_LIH, b.down_proj_LHI)}
    grads, placements = {}, {}
    for name, p in model.named_parameters():
        g = _whole_expert(p.grad, ep_group) if id(p) in experts else p.grad.full_tensor()
        grads[name.replace("_LIH", "").replace("_LHI", "")] = g
        placements[name] = str(p.grad.placements) + " on " + str(p.grad.device_mesh.mesh_dim_names)
    opt.step()  # Adam's state exists from here on
    held = sum(_local_bytes(p) + _local_bytes(p.grad) for p in model.parameters())
    held += sum(
        _local_bytes(v)
        for st in opt.state.values()
        for v in st.values()
        if torch.is_tensor(v) and v.dim()
    )
    dtypes = {str(p.dtype) for p in model.parameters()} | {
        str(v.dtype)
        for st in opt.state.values()
        for v in st.values()
        if torch.is_tensor(v) and v.dim()
    }
    torch.save(
        {
            "loss": total,
            "grads": grads,
            "held_bytes": held,
            "placements": placements,
            "dtypes": dtypes,
            "layer_forwards": len(calls),
        },
        f"{out_dir}/rank{rank}.pt",
    )
