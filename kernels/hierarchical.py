"""The `hierarchical` backend: one copy per (token, destination node) across nodes, then a
forward inside the destination node (the DeepEP-internode / NCCL EP HT / HybridEP idea).

Shape legend: T tokens, H hidden, K top-k, E experts, L local experts, W ranks,
N nodes, G ranks per node (W = N * G), S1 rows of hop 1 (one per (token, node)),
S2 rows of hop 2 (one per (hop-1 row, rank)), R rows received (one per (token, local expert)).

The groups, the hops and the limitations: docs/kernels.md#hierarchical-kernelshierarchicalpy.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from moerl.kernels.dispatcher import (
    Exchange,
    Gather,
    PickK,
    PlanDispatcher,
    PlanHandle,
    exchange_counts,
    global_ranks,
)


def _dedup_rows(dest_SK: Tensor, num_dest: int) -> tuple[Tensor, Tensor]:
    """For rows whose K slots map to destinations in [0, num_dest) (num_dest = nowhere),
    return (dest_S2, row_S2): one entry per distinct (row, dest), ordered by dest then row."""
    hit_SD = torch.zeros(dest_SK.shape[0], num_dest + 1, dtype=torch.bool, device=dest_SK.device)
    hit_SD.scatter_(1, dest_SK, True)
    dest, row = hit_SD[:, :num_dest].T.nonzero(as_tuple=True)
    return dest, row


class HierarchicalDispatcher(PlanDispatcher):
    name = "hierarchical"

    def __init__(self, num_experts: int, group: Any = None, ranks_per_node: int = 1):
        super().__init__(num_experts, group=group, ranks_per_node=ranks_per_node)
        G = ranks_per_node
        self.num_nodes = self.ep_size // G
        self.node, self.local_index = divmod(self.ep_rank, G)
        self.intra_group, self.inter_group = None, None
        if self.ep_size > 1:
            self.intra_group, self.inter_group = self._make_groups(global_ranks(group))

    def _make_groups(self, members: list[int]) -> tuple[Any, Any]:
        """Every member of the EP group creates every sub-group, in the same order.
        use_local_synchronization: only the EP group's members take part, so several EP
        groups (EP inside a larger data-parallel world) can each build their own."""
        G, N = self.ranks_per_node, self.num_nodes
        intra = inter = None
        for n in range(N):
            g = dist.new_group(
                [members[n * G + i] for i in range(G)], use_local_synchronization=True
            )
            if n == self.node:
                intra = g
        for i in range(G):
            g = dist.new_group(
                [members[n * G + i] for n in range(N)], use_local_synchronization=True
            )
            if i == self.local_index:
                inter = g
        return intra, inter

    def dispatch(
        self, x_TH: Tensor, topk_idx_TK: Tensor, topk_weights_TK: Tensor
    ) -> tuple[Tensor, Tensor, PlanHandle]:
        self._check_inputs(x_TH, topk_idx_TK, topk_weights_TK)
        T, K = topk_idx_TK.shape
        G, N, L = self.ranks_per_node, self.num_nodes, self.num_local_experts
        idx_TK = topk_idx_TK.to(x_TH.device).long()

        # 1. hop 1: one row per (token, destination node), node-major.
        node_TK = torch.where(idx_TK >= 0, idx_TK // (L * G), N)
        node_S1, token_S1 = _dedup_rows(node_TK, N)
        send1 = torch.bincount(node_S1, minlength=N)
        recv1 = exchange_counts(send1, self.inter_group, N)
        hop1 = Exchange(self.inter_group, tuple(send1.tolist()), tuple(recv1.tolist()))
        idx_S1K = hop1.forward(idx_TK.index_select(0, token_S1))  # rows now on this node

        # 2. hop 2: one row per (hop-1 row, owning rank in this node), rank-major.
        rank_S1K = torch.where(idx_S1K >= 0, idx_S1K // L, -1)
        on_node = (rank_S1K >= 0) & (rank_S1K // G == self.node)
        local_S1K = torch.where(on_node, rank_S1K - self.node * G, G)
        local_S2, row_S2 = _dedup_rows(local_S1K, G)
        send2 = torch.bincount(local_S2, minlength=G)
        recv2 = exchange_counts(send2, self.intra_group, G)
        hop2 = Exchange(self.intra_group, tuple(send2.tolist()), tuple(recv2.tolist()))
        idx_S2K = hop2.forward(idx_S1K.index_select(0, row_S2))

        # 3. expand to one row per (token, local expert), grouped by local expert.
        local_expert_S2K = idx_S2K - self.ep_rank * L
        mine = (idx_S2K >= 0) & (local_expert_S2K >= 0) & (local_expert_S2K < L)
        row_R, k_R = mine.nonzero(as_tuple=True)
        expert_R = local_expert_S2K[row_R, k_R]
        order = torch.argsort(expert_R, stable=True)
        row_R, k_R = row_R[order], k_R[order]
        counts_L = torch.bincount(expert_R, minlength=L)

        S1, S2 = idx_S1K.shape[0], idx_S2K.shape[0]
        shared = (Gather(token_S1, T), hop1, Gather(row_S2, S1), hop2)
        plan_x = shared + (Gather(row_R, S2),)
        plan_w = shared + (PickK(row_R, k_R, S2, K),)
        sent_rows = {
            "inter_node": int(send1.sum() - send1[self.node]),
            "intra_node": int(send2.sum() - send2[self.local_index]),
        }
        return self._finish(x_TH, topk_idx_TK, topk_weights_TK, plan_x, plan_w, counts_L, sent_rows)
