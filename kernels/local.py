"""The `local` backend: one rank owns every expert, so dispatch is a permutation by expert.

Shape legend: T tokens, H hidden, K top-k, E experts (= L, all local), P routed (token, k)
pairs, R received rows (= P here).

No communication. Useful single-process (tests, the walking skeleton) and as the reference
point for the other backends' bookkeeping: the same plan machinery with the exchange removed.

Limitations: ep_size is always 1 (also inside a larger torch.distributed world: every
process holds every expert); passing a group of more than one rank is an error.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from moerl.errors import ConfigError
from moerl.kernels.dispatcher import (
    Gather,
    PickK,
    PlanDispatcher,
    PlanHandle,
    group_size_rank,
    sort_pairs_by_expert,
)


class LocalDispatcher(PlanDispatcher):
    name = "local"

    def __init__(self, num_experts: int, group: Any = None):
        if group is not None and group_size_rank(group)[0] != 1:
            raise ConfigError(
                "the local dispatcher has no communication: use group=None (every rank holds all "
                "experts), or the all_to_all backend for expert parallelism"
            )
        # ep_size 1 even inside a larger world: each process runs every expert on its own tokens.
        super().__init__(num_experts, group=None, size_rank=(1, 0))

    def dispatch(
        self, x_TH: Tensor, topk_idx_TK: Tensor, topk_weights_TK: Tensor
    ) -> tuple[Tensor, Tensor, PlanHandle]:
        self._check_inputs(x_TH, topk_idx_TK, topk_weights_TK)
        T, K = topk_idx_TK.shape
        token_P, k_P, expert_P = sort_pairs_by_expert(topk_idx_TK)
        plan_x = (Gather(token_P, T),)
        plan_w = (PickK(token_P, k_P, T, K),)
        counts_E = torch.bincount(expert_P, minlength=self.num_experts)
        return self._finish(
            x_TH, topk_idx_TK, topk_weights_TK, plan_x, plan_w, counts_E, sent_rows={}
        )
