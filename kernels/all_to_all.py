"""The `all_to_all` backend: the Megatron-style baseline (one row per (token, expert) pair).

Shape legend: T tokens, H hidden, K top-k, E experts, L local experts (E / W), W ranks,
P routed (token, k) pairs on this rank, R rows received by this rank.

Its dispatch and combine steps and limitations: docs/kernels.md#all_to_all-kernelsall_to_allpy.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from moerl.kernels.dispatcher import (
    Exchange,
    Gather,
    PickK,
    PlanDispatcher,
    PlanHandle,
    exchange_counts,
    sort_pairs_by_expert,
)


class AllToAllDispatcher(PlanDispatcher):
    name = "all_to_all"

    def __init__(self, num_experts: int, group: Any = None, ranks_per_node: int = 1):
        # ranks_per_node only classifies the bytes this backend sends (inter- vs intra-node).
        super().__init__(num_experts, group=group, ranks_per_node=ranks_per_node)

    def dispatch(
        self, x_TH: Tensor, topk_idx_TK: Tensor, topk_weights_TK: Tensor
    ) -> tuple[Tensor, Tensor, PlanHandle]:
        self._check_inputs(x_TH, topk_idx_TK, topk_weights_TK)
        T, K = topk_idx_TK.shape
        W, L = self.ep_size, self.num_local_experts
        # 1. pairs sorted by expert == grouped by destination rank, then local expert.
        token_P, k_P, expert_P = sort_pairs_by_expert(topk_idx_TK.to(x_TH.device))
        send_counts_WL = torch.bincount(expert_P, minlength=W * L)
        # 2. per-(rank, local expert) counts; recv_counts_WL[src, e] rows of local expert e from src.
        recv_counts_WL = exchange_counts(send_counts_WL, self.group, W).view(W, L)
        # 3. host-side splits.
        send_splits = tuple(send_counts_WL.view(W, L).sum(1).tolist())
        recv_splits = tuple(recv_counts_WL.sum(1).tolist())
        # 5. received rows arrive [src][local expert]; a stable sort by local expert gives
        #    [local expert][src], i.e. grouped by expert in ascending order.
        expert_of_row_R = torch.repeat_interleave(
            torch.arange(L, device=x_TH.device).repeat(W), recv_counts_WL.reshape(-1)
        )
        by_expert_R = torch.argsort(expert_of_row_R, stable=True)
        exchange = Exchange(self.group, send_splits, recv_splits)
        plan_x = (Gather(token_P, T), exchange, Gather(by_expert_R, len(by_expert_R)))
        plan_w = (PickK(token_P, k_P, T, K), exchange, Gather(by_expert_R, len(by_expert_R)))
        # 4. happens in _finish (the differentiable part).
        return self._finish(
            x_TH,
            topk_idx_TK,
            topk_weights_TK,
            plan_x,
            plan_w,
            recv_counts_WL.sum(0),
            sent_rows=self._count_sent_rows(send_splits),
        )

    def _count_sent_rows(self, send_splits: tuple[int, ...]) -> dict[str, int]:
        my_node = self.ep_rank // self.ranks_per_node
        inter = sum(n for r, n in enumerate(send_splits) if r // self.ranks_per_node != my_node)
        intra = sum(
            n
            for r, n in enumerate(send_splits)
            if r // self.ranks_per_node == my_node and r != self.ep_rank
        )
        return {"inter_node": inter, "intra_node": intra}
