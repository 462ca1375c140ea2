"""Naive single-process references the dispatcher tests compare against.

Shape legend: T tokens, H hidden, K top-k, E experts, R rows (token, expert) pairs.

Everything here loops over tokens and k in Python: slow, obviously right, and
differentiable through plain autograd (the gradient reference for the backends' custom
backward passes).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

ExpertFn = Callable[[Tensor, int], Tensor]  # (x_H or x_RH, global expert id) -> y of the same shape


def reference_moe(
    x_TH: Tensor, topk_idx_TK: Tensor, topk_weights_TK: Tensor, expert_fn: ExpertFn
) -> Tensor:
    """out[t] = sum over k with topk_idx[t, k] != -1 of topk_weights[t, k] * expert_fn(x[t], e)."""
    rows = []
    for t in range(x_TH.shape[0]):
        acc = torch.zeros_like(x_TH[t])
        for k in range(topk_idx_TK.shape[1]):
            e = int(topk_idx_TK[t, k])
            if e >= 0:
                acc = acc + topk_weights_TK[t, k] * expert_fn(x_TH[t], e)
        rows.append(acc)
    return torch.stack(rows) if rows else x_TH[:0] * 0.0  # T = 0: still part of x's graph


def reference_tokens_per_expert(topk_idx_TK: Tensor, num_experts: int) -> Tensor:
    """How many (token, k) pairs pick each expert (int64 [E])."""
    counts = [0] * num_experts
    for e in topk_idx_TK.reshape(-1).tolist():
        if e >= 0:
            counts[e] += 1
    return torch.tensor(counts, dtype=torch.int64)


def reference_rows_for_expert(x_TH: Tensor, topk_idx_TK: Tensor, expert: int) -> Tensor:
    """The rows an expert receives, in token order ([R_e, H])."""
    rows = [
        x_TH[t]
        for t in range(x_TH.shape[0])
        for k in range(topk_idx_TK.shape[1])
        if int(topk_idx_TK[t, k]) == expert
    ]
    return torch.stack(rows) if rows else x_TH.new_zeros((0, x_TH.shape[1]))
