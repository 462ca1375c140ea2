"""The expert-parallel `Dispatcher` interface, the transfer plans the CPU backends share, and
`make_dispatcher`.

Shape legend (suffixes on tensor names): T tokens on this rank, H hidden size, K top-k experts
per token, E experts (all ranks), L experts local to this rank (E / ep_size), W ranks in the EP
group, N nodes, G ranks per node, P routed (token, k) pairs, R rows received by this rank (one
per (token, local expert)), S rows of an intermediate hop.

The semantics every backend keeps, the plans and the limitations: docs/kernels.md.
"""

from __future__ import annotations

import logging
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
import torch.distributed as dist
from torch import Tensor

from moerl.errors import ConfigError

log = logging.getLogger(__name__)

Backend = Literal["local", "all_to_all", "hierarchical", "deepep"]
BACKENDS: tuple[str, ...] = ("local", "all_to_all", "hierarchical", "deepep")


# --------------------------------------------------------------------------- handle


@dataclass(frozen=True)
class DispatchHandle:
    """What `dispatch` hands to `combine` and to both backwards. Frozen: nothing mutates it.

    `recv_weights_R` is part of the autograd graph (it came through dispatch), so the
    gradient of the routing weights flows back through the dispatch that produced it.
    """

    num_tokens: int  # T on this rank
    hidden: int  # H
    wire_element_size: int  # bytes per element on the wire (bf16 for deepep)
    topk_idx_TK: Tensor  # kept for bytes_moved; not copied
    tokens_per_local_expert_L: Tensor
    # None where the backend applies weights itself (deepep low-latency)
    recv_weights_R: Tensor | None
    sent_rows: dict[str, int]  # rows this rank put on the wire in dispatch, by link class
    extra: dict[str, Any] = field(default_factory=dict)  # backend-specific metadata


@dataclass(frozen=True)
class PlanHandle(DispatchHandle):
    """A handle of the plan-based backends: the row plans for x and for the weights."""

    plan_x: tuple[Stage, ...] = ()
    plan_w: tuple[Stage, ...] = ()


# --------------------------------------------------------------------------- plan stages


class Stage(ABC):
    """A linear map on rows; `transpose` is its adjoint (used by the reverse path)."""

    @abstractmethod
    def forward(self, t: Tensor) -> Tensor: ...

    @abstractmethod
    def transpose(self, t: Tensor) -> Tensor: ...


@dataclass(frozen=True)
class Gather(Stage):
    """out[i] = in[index[i]]. Its transpose sums the rows back (duplicates add up)."""

    index_S: Tensor
    num_in: int

    def forward(self, t: Tensor) -> Tensor:
        return t.index_select(0, self.index_S)

    def transpose(self, t: Tensor) -> Tensor:
        out = t.new_zeros((self.num_in, *t.shape[1:]))
        return out.index_add_(0, self.index_S, t)


@dataclass(frozen=True)
class PickK(Stage):
    """out[i] = in[row[i], k[i]]: picks one of the K weight columns of a token row."""

    row_S: Tensor
    k_S: Tensor
    num_in: int
    topk: int

    def forward(self, t: Tensor) -> Tensor:
        return t[self.row_S, self.k_S]

    def transpose(self, t: Tensor) -> Tensor:
        out = t.new_zeros((self.num_in, self.topk))
        return out.index_put_((self.row_S, self.k_S), t, accumulate=True)


@dataclass(frozen=True)
class Exchange(Stage):
    """An all_to_all_single of rows with split sizes; the transpose swaps the splits."""

    group: Any  # a ProcessGroup, or None for the default group
    in_splits: tuple[int, ...]
    out_splits: tuple[int, ...]

    def forward(self, t: Tensor) -> Tensor:
        return exchange_rows(t, self.group, self.in_splits, self.out_splits)

    def transpose(self, t: Tensor) -> Tensor:
        return exchange_rows(t, self.group, self.out_splits, self.in_splits)


def exchange_rows(
    t: Tensor, group: Any, in_splits: tuple[int, ...], out_splits: tuple[int, ...]
) -> Tensor:
    """all_to_all_single along dim 0; a group of one is a no-op (no collective)."""
    if len(in_splits) == 1:
        return t
    out = t.new_empty((sum(out_splits), *t.shape[1:]))
    dist.all_to_all_single(
        out,
        t.contiguous(),
        output_split_sizes=list(out_splits),
        input_split_sizes=list(in_splits),
        group=group,
    )
    return out


def exchange_counts(send_counts_W: Tensor, group: Any, group_size: int) -> Tensor:
    """Exchange equal-sized chunks of per-destination counts (int64)."""
    if group_size == 1:
        return send_counts_W
    recv = torch.empty_like(send_counts_W)
    dist.all_to_all_single(recv, send_counts_W.contiguous(), group=group)
    return recv


def run_plan(plan: tuple[Stage, ...], t: Tensor) -> Tensor:
    for stage in plan:
        t = stage.forward(t)
    return t


def run_plan_transposed(plan: tuple[Stage, ...], t: Tensor) -> Tensor:
    for stage in reversed(plan):
        t = stage.transpose(t)
    return t


class _PlanDispatch(torch.autograd.Function):
    """(x_TH, w_TK) -> (recv_x_RH, recv_w_R); backward runs both plans transposed, x first,
    in one node so every rank issues the reverse exchanges in the same order."""

    @staticmethod
    def forward(ctx, plan_x, plan_w, x_TH: Tensor, w_TK: Tensor):
        ctx.plans = (plan_x, plan_w)
        return run_plan(plan_x, x_TH), run_plan(plan_w, w_TK)

    @staticmethod
    def backward(ctx, grad_x_RH: Tensor, grad_w_R: Tensor):
        plan_x, plan_w = ctx.plans
        grad_x = (
            run_plan_transposed(plan_x, grad_x_RH.contiguous()) if ctx.needs_input_grad[2] else None
        )
        grad_w = (
            run_plan_transposed(plan_w, grad_w_R.contiguous()) if ctx.needs_input_grad[3] else None
        )
        return None, None, grad_x, grad_w


class _PlanCombine(torch.autograd.Function):
    """z_RH -> out_TH (the transpose of the x plan: sums each token's rows)."""

    @staticmethod
    def forward(ctx, plan_x, z_RH: Tensor):
        ctx.plan_x = plan_x
        return run_plan_transposed(plan_x, z_RH)

    @staticmethod
    def backward(ctx, grad_out_TH: Tensor):
        return None, run_plan(ctx.plan_x, grad_out_TH.contiguous())


# --------------------------------------------------------------------------- bytes


def routing_bytes(
    topk_idx_TK: Tensor,
    num_local_experts: int,
    ep_rank: int,
    ep_size: int,
    ranks_per_node: int,
    row_bytes: int,
) -> dict[str, int]:
    """Bytes the routing implies for this rank's tokens, the same formula for every backend.

    per_expert: non-dropped (token, expert) pairs whose expert is on another rank.
    per_rank_dedup: distinct (token, destination rank) pairs, destination != this rank.
    per_node_dedup: distinct (token, destination node) pairs, destination != this node
    (what a hierarchical/DeepEP-internode dispatch must put on the inter-node links).
    """
    idx = topk_idx_TK.long()
    valid = idx >= 0
    rank_TK = torch.where(valid, idx // num_local_experts, ep_size)
    per_expert = int((valid & (rank_TK != ep_rank)).sum())
    hit_TW = torch.zeros(idx.shape[0], ep_size + 1, dtype=torch.bool, device=idx.device)
    hit_TW.scatter_(1, rank_TK, True)
    per_rank = int(hit_TW[:, :ep_size].sum()) - int(hit_TW[:, ep_rank].sum())
    num_nodes = ep_size // ranks_per_node
    node_TK = torch.where(valid, rank_TK // ranks_per_node, num_nodes)
    hit_TN = torch.zeros(idx.shape[0], num_nodes + 1, dtype=torch.bool, device=idx.device)
    hit_TN.scatter_(1, node_TK, True)
    my_node = ep_rank // ranks_per_node
    per_node = int(hit_TN[:, :num_nodes].sum()) - int(hit_TN[:, my_node].sum())
    return {
        "per_expert": per_expert * row_bytes,
        "per_rank_dedup": per_rank * row_bytes,
        "per_node_dedup": per_node * row_bytes,
    }


# --------------------------------------------------------------------------- interface


class Dispatcher(ABC):
    """Moves tokens to the ranks that own their experts and brings expert outputs back."""

    name: str = "abstract"
    fallback_from: str | None = None  # set when make_dispatcher fell back to this backend
    fallback_reason: str | None = None

    def __init__(
        self,
        num_experts: int,
        group: Any = None,
        ranks_per_node: int = 1,
        size_rank: tuple[int, int] | None = None,
    ):
        self.group = group
        self.ep_size, self.ep_rank = size_rank if size_rank is not None else group_size_rank(group)
        if num_experts < 1 or num_experts % self.ep_size:
            raise ConfigError(
                f"num_experts ({num_experts}) must be a positive multiple of the EP group size "
                f"({self.ep_size}): experts are sharded contiguously across ranks"
            )
        if ranks_per_node < 1 or self.ep_size % ranks_per_node:
            raise ConfigError(
                f"ranks_per_node ({ranks_per_node}) must divide the EP group size ({self.ep_size})"
            )
        self.num_experts = num_experts
        self.num_local_experts = num_experts // self.ep_size
        self.ranks_per_node = ranks_per_node

    @abstractmethod
    def dispatch(
        self, x_TH: Tensor, topk_idx_TK: Tensor, topk_weights_TK: Tensor
    ) -> tuple[Tensor, Tensor, DispatchHandle]:
        """Returns (recv_x_RH, tokens_per_local_expert_L (int64), handle). recv_x_RH has one row
        per (token, expert) pair routed to this rank's experts, grouped by local expert in
        ascending order. topk_idx == -1 means dropped (never sent)."""

    def combine(self, y_RH: Tensor, handle: DispatchHandle) -> Tensor:
        """y_RH: expert outputs in recv_x_RH's row order. Returns out_TH[t] = sum over the
        token's non-dropped k of topk_weights[t, k] * y[row(t, k)]. The routing weights are
        applied HERE, on the expert side, before the reverse transfer."""
        assert isinstance(handle, PlanHandle), f"{self.name}.combine got a {type(handle).__name__}"
        assert handle.recv_weights_R is not None  # the plan backends always carry the weights
        # Multiply in y's dtype: a bf16 x fp32 product would materialize an fp32 copy of
        # every row (5x slower on CPU); the weight's extra rounding is below bf16's own.
        z_RH = y_RH * handle.recv_weights_R.to(y_RH.dtype).unsqueeze(1)
        return _PlanCombine.apply(handle.plan_x, z_RH)

    def bytes_moved(self, handle: DispatchHandle) -> dict[str, int]:
        """This rank's dispatch bytes; combine moves the same amounts in reverse.

        per_expert / per_rank_dedup / per_node_dedup: the routing's bytes, same formula for
        every backend (see routing_bytes), for this rank's tokens. actual_sent: rows this rank
        put on the wire to other ranks, split into inter-node and intra-node by
        ranks_per_node; for a forwarding backend (hierarchical) that includes forwards of
        other ranks' tokens, so compare sums over the group, not single ranks. Metadata
        (indices, weights, counts) is not counted, as in DeepEP's bandwidth accounting.
        """
        row_bytes = handle.hidden * handle.wire_element_size
        out = routing_bytes(
            handle.topk_idx_TK,
            self.num_local_experts,
            self.ep_rank,
            self.ep_size,
            self.ranks_per_node,
            row_bytes,
        )
        sent_rows = self._sent_rows(handle)
        inter = sent_rows.get("inter_node", 0) * row_bytes
        intra = sent_rows.get("intra_node", 0) * row_bytes
        out.update(
            actual_sent=inter + intra, actual_sent_inter_node=inter, actual_sent_intra_node=intra
        )
        return out

    def _sent_rows(self, handle: DispatchHandle) -> dict[str, int]:
        """Rows put on the wire by class ({"inter_node": n, "intra_node": n})."""
        return handle.sent_rows

    def close(self) -> None:
        """Release backend resources (DeepEP buffers). A no-op for the CPU backends."""
        return None

    def _check_inputs(self, x_TH: Tensor, topk_idx_TK: Tensor, topk_weights_TK: Tensor) -> None:
        if (
            x_TH.dim() != 2
            or topk_idx_TK.dim() != 2
            or topk_idx_TK.shape != topk_weights_TK.shape
            or topk_idx_TK.shape[0] != x_TH.shape[0]
        ):
            raise ValueError(
                f"expected x [T,H], topk_idx [T,K], topk_weights [T,K]; got {tuple(x_TH.shape)}, "
                f"{tuple(topk_idx_TK.shape)}, {tuple(topk_weights_TK.shape)}"
            )
        if topk_idx_TK.numel() and (
            int(topk_idx_TK.max()) >= self.num_experts or int(topk_idx_TK.min()) < -1
        ):
            raise ValueError(
                f"topk_idx must be in [-1, {self.num_experts}); got [{int(topk_idx_TK.min())}, "
                f"{int(topk_idx_TK.max())}]"
            )


class PlanDispatcher(Dispatcher):
    """A backend whose dispatch is a plan of Gather/PickK/Exchange stages."""

    def _finish(
        self,
        x_TH: Tensor,
        topk_idx_TK: Tensor,
        topk_weights_TK: Tensor,
        plan_x: tuple[Stage, ...],
        plan_w: tuple[Stage, ...],
        tokens_per_local_expert_L: Tensor,
        sent_rows: dict[str, int],
    ) -> tuple[Tensor, Tensor, PlanHandle]:
        recv_x_RH, recv_w_R = _PlanDispatch.apply(plan_x, plan_w, x_TH, topk_weights_TK)
        handle = PlanHandle(
            num_tokens=x_TH.shape[0],
            hidden=x_TH.shape[1],
            wire_element_size=x_TH.element_size(),
            topk_idx_TK=topk_idx_TK,
            tokens_per_local_expert_L=tokens_per_local_expert_L,
            recv_weights_R=recv_w_R,
            sent_rows=sent_rows,
            plan_x=plan_x,
            plan_w=plan_w,
        )
        return recv_x_RH, tokens_per_local_expert_L, handle


def sort_pairs_by_expert(topk_idx_TK: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """The non-dropped (token, k) pairs in ascending expert order (ties: token order).
    Returns (token_P, k_P, expert_P)."""
    idx = topk_idx_TK.long()
    K = idx.shape[1]
    flat_P = (idx.reshape(-1) >= 0).nonzero().squeeze(1)
    expert_P = idx.reshape(-1)[flat_P]
    order = torch.argsort(expert_P, stable=True)
    flat_P, expert_P = flat_P[order], expert_P[order]
    return flat_P // K, flat_P % K, expert_P


# --------------------------------------------------------------------------- groups


def group_size_rank(group: Any) -> tuple[int, int]:
    if group is None and not (dist.is_available() and dist.is_initialized()):
        return 1, 0  # single process: a group of one, no collectives
    return dist.get_world_size(group), dist.get_rank(group)


def global_ranks(group: Any) -> list[int]:
    """Global ranks of the group's members, in group-rank order."""
    size, _ = group_size_rank(group)
    if group is None or group is dist.group.WORLD:
        return list(range(size))
    return [dist.get_global_rank(group, i) for i in range(size)]


# --------------------------------------------------------------------------- factory


def make_dispatcher(
    backend: Backend,
    num_experts: int,
    group: Any = None,
    ranks_per_node: int = 1,
    allow_fallback: bool = False,
    deepep_options: dict | None = None,
) -> Dispatcher:
    """Build a dispatcher. Call it on every rank of `group` (the hierarchical backend creates
    sub-groups, a collective). `group=None` means the default process group, or a group of
    one when torch.distributed is not initialized.

    deepep: raises ConfigError when CUDA or deep_ep is missing, unless `allow_fallback`, in
    which case it logs a WARNING and returns an all_to_all dispatcher whose `fallback_from`
    is "deepep" (record it, e.g. as an MLflow tag).
    """
    # Imported here: the backends import this module.
    from moerl.kernels.all_to_all import AllToAllDispatcher
    from moerl.kernels.hierarchical import HierarchicalDispatcher
    from moerl.kernels.local import LocalDispatcher

    if backend == "local":
        return LocalDispatcher(num_experts, group=group)
    if backend == "all_to_all":
        return AllToAllDispatcher(num_experts, group=group, ranks_per_node=ranks_per_node)
    if backend == "hierarchical":
        return HierarchicalDispatcher(num_experts, group=group, ranks_per_node=ranks_per_node)
    if backend == "deepep":
        from moerl.kernels.deepep import DeepEPDispatcher, DeepEPUnavailable

        try:
            return DeepEPDispatcher(
                num_experts, group=group, ranks_per_node=ranks_per_node, options=deepep_options
            )
        except (
            DeepEPUnavailable
        ) as exc:  # only a missing GPU/package falls back; bad options still raise
            if not allow_fallback:
                raise
            log.warning("deepep dispatcher unavailable, falling back to all_to_all: %s", exc)
            fallback = AllToAllDispatcher(num_experts, group=group, ranks_per_node=ranks_per_node)
            fallback.fallback_from = "deepep"
            fallback.fallback_reason = str(exc)
            return fallback
    raise ConfigError(f"unknown dispatcher backend {backend!r}; allowed: {', '.join(BACKENDS)}")
