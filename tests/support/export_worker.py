"""Worker body for the parallel-export tests (torch.multiprocessing spawn): one rank of the
(dp, ep) mesh, each family's checkpoint loaded sharded as the trainer loads it (FSDP2 on the
mesh, `ep_train.apply_fsdp`), this rank's shards perturbed, then exported twice: by
`ep_export.export_ep_checkpoint` (every rank writes) and `ep_checkpoint.save_ep_checkpoint`
(rank 0 writes), in the model's dtype and in bfloat16 (a float32 model's serving copy)."""

import zlib
from pathlib import Path

import torch

DTYPES = {"float32": None, "bfloat16": torch.bfloat16}
EXPORT_SHARD_BYTES = 40_000  # small: several files per rank


def _perturb(model, rank: int) -> None:
    """Noise on every rank's own shard (different per rank), so each row a gather moves is
    unique and a misplaced one shows."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            local = p.to_local() if hasattr(p, "to_local") else p
            g = torch.Generator().manual_seed(zlib.crc32(name.encode()) + 1000 * rank)
            local.add_(0.01 * torch.randn(local.shape, generator=g))


def export_rank(rank, world, dp, ep, models, out_dir):
    """`models`: {label: (checkpoint dir, the dtype the model is loaded in)}. Writes out_dir/<family>/{export,save}_<dtype>
    and out_dir/rank<r>.pt (per family: this rank's experts and the export's stats)."""
    # a job of tests/support/gloo_world.py: the world's process group is already up
    from moerl.components.policy_update.ep_checkpoint import load_ep_model, save_ep_checkpoint
    from moerl.components.policy_update.ep_export import export_ep_checkpoint
    from moerl.components.policy_update.ep_train import apply_fsdp, build_mesh
    from moerl.config import parse_config
    from moerl.kernels import make_dispatcher

    cfg = parse_config(
        {"trainer": {"parallelism": {"expert_parallel_size": ep, "data_parallel_shard": dp}}}
    )
    mesh = build_mesh(cfg)
    record = {}
    for fam, (path, model_dtype) in models.items():
        path = Path(path)
        from transformers import AutoConfig

        from moerl.models.families import family_of

        hf = AutoConfig.from_pretrained(path)
        dispatcher = make_dispatcher(
            "all_to_all", num_experts=family_of(hf).num_experts(hf), group=mesh.get_group("ep")
        )
        model, blocks, layout = load_ep_model(
            path,
            dispatcher,
            getattr(torch, model_dtype),
            "cpu",
            shard=lambda m, b: apply_fsdp(m, b, mesh),
        )
        _perturb(model, rank)
        stats = {}
        for name, dtype in DTYPES.items():
            stats[name] = export_ep_checkpoint(
                model,
                blocks,
                layout,
                path,
                Path(out_dir) / fam / f"export_{name}",
                mesh,
                dtype=dtype,
                max_shard_bytes=EXPORT_SHARD_BYTES,
            )
            save_ep_checkpoint(
                model,
                blocks,
                layout,
                path,
                Path(out_dir) / fam / f"save_{name}",
                ep_group=mesh.get_group("ep"),
                dtype=dtype,
            )
        record[fam] = {
            "first_expert": blocks[0].first_expert,
            "n_local": blocks[0].n_local,
            "fused": [k.fused for k in layout.experts],
            "dense_bytes": sum(
                p.numel() * p.element_size()
                for n, p in model.state_dict(keep_vars=True).items()
                if n in layout.names
            ),
            "stats": stats,
        }
    torch.save(record, f"{out_dir}/rank{rank}.pt")
