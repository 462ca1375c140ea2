"""Expert load imbalance: tokens per expert per MoE layer, from the policy's own router.

Design, details and limitations: docs/bench-reports/suite.md#how-it-works-benchmarksimbalancepy.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def expert_loads(
    model, sequences: Sequence[Sequence[int]], pad_id: int = 0, batch_rows: int = 64
) -> torch.Tensor:
    """[layers, experts] int64 counts of (token, expert) routings of `sequences`."""
    from moerl.components.policy_update.ep_moe import sparse_blocks
    from moerl.models.families import family_of

    blocks = [block for _, _, block in sparse_blocks(model)]
    if not blocks:
        raise ValueError("the model has no MoE sparse blocks to count expert loads on")
    experts = family_of(model.config).num_experts(model.config)
    counts = torch.zeros(len(blocks), experts, dtype=torch.long)
    mask_T: list[torch.Tensor] = []  # the current micro-batch's flattened real-token mask

    def hook(layer: int):
        def fn(module, args, output) -> None:
            idx_TK = output[2] if isinstance(output, tuple) else output
            keep = idx_TK[mask_T[0].to(idx_TK.device)].reshape(-1)
            counts[layer] += torch.bincount(keep.long().cpu(), minlength=experts)

        return fn

    handles = [b.gate.register_forward_hook(hook(i)) for i, b in enumerate(blocks)]
    device = next(model.parameters()).device
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            for start in range(0, len(sequences), batch_rows):
                rows = [list(s) for s in sequences[start : start + batch_rows] if len(s)]
                if not rows:
                    continue
                length = max(len(r) for r in rows)
                ids = torch.full((len(rows), length), pad_id, dtype=torch.long)
                attn = torch.zeros((len(rows), length), dtype=torch.long)
                for i, r in enumerate(rows):
                    ids[i, : len(r)] = torch.tensor(r)
                    attn[i, : len(r)] = 1
                mask_T[:] = [attn.reshape(-1).bool()]
                model(input_ids=ids.to(device), attention_mask=attn.to(device))
    finally:
        for h in handles:
            h.remove()
        model.train(was_training)
    return counts


def imbalance(counts: torch.Tensor) -> list[float]:
    """Per layer: max / mean tokens per expert (1.0 = balanced; 0 counts give 1.0)."""
    out = []
    for row in counts.double():
        mean = float(row.mean())
        out.append(float(row.max()) / mean if mean > 0 else 1.0)
    return out
