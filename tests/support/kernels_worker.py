"""Helpers for tests/kernels/test_kernels.py: routing scenarios, the contract checks, and the
entry point a spawned gloo world runs.

Shape legend: T tokens, H hidden, K top-k, E experts, L local experts, R received rows.

Every rank rebuilds its own inputs from (scenario, rank) seeds, runs the dispatcher, and
compares against `moerl.kernels.reference` computed on the same rank's tokens (the MoE math
does not depend on where experts live). Each check returns numbers, not asserts, so one
spawned world can run every backend and scenario and the parent test reports per case.
"""

from __future__ import annotations

import json
import logging
import os
import socket
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from moerl.kernels import make_dispatcher
from moerl.kernels.reference import (
    reference_moe,
    reference_rows_for_expert,
    reference_tokens_per_expert,
)

H, K, E = 16, 3, 8
SCENARIOS = ("uniform", "zipf_dropped_empty", "t0_on_rank1")
_SEEDS = {"uniform": 0, "zipf_dropped_empty": 1, "t0_on_rank1": 2, "remote_node_repeat": 3}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def make_inputs(
    scenario: str,
    rank: int,
    num_experts: int = E,
    topk: int = K,
    hidden: int = H,
    device: str = "cpu",
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(x_TH, topk_idx_TK, topk_weights_TK) of one rank for a scenario, deterministic."""
    g = torch.Generator().manual_seed(1000 * _SEEDS[scenario] + rank)
    T = 0 if (scenario == "t0_on_rank1" and rank == 1) else 12 + 3 * rank
    if scenario == "zipf_dropped_empty":
        # Zipf popularity over the first E-2 experts: the last two never receive a token
        # (a whole rank at world 4), and ~15 % of the slots are dropped (-1).
        p_E = torch.tensor(
            [1.0 / (e + 1) ** 1.2 if e < num_experts - 2 else 0.0 for e in range(num_experts)]
        )
        idx_TK = torch.multinomial(p_E.expand(max(T, 1), -1), topk, replacement=False, generator=g)[
            :T
        ]
        idx_TK[torch.rand(T, topk, generator=g) < 0.15] = -1
    elif scenario == "remote_node_repeat":
        # world 4, 2 ranks/node, E 8 (L 2): every token picks 4 experts, all on the other node.
        other_node_experts = torch.arange(4) + (4 if rank < 2 else 0)
        idx_TK = (
            torch.stack([other_node_experts[torch.randperm(4, generator=g)] for _ in range(T)])
            if T
            else torch.zeros(0, 4, dtype=torch.int64)
        )
        topk = 4
    else:
        idx_TK = (
            torch.stack([torch.randperm(num_experts, generator=g)[:topk] for _ in range(T)])
            if T
            else torch.zeros(0, topk, dtype=torch.int64)
        )
    x_TH = torch.randn(T, hidden, generator=g)
    w_TK = torch.rand(T, topk, generator=g) + 0.1
    return x_TH.to(device), idx_TK.to(device), w_TK.to(device)


def expert_fn(x: torch.Tensor, e: int | torch.Tensor) -> torch.Tensor:
    """A different nonlinear function per global expert id."""
    scale = 1.0 + (e.unsqueeze(1) if isinstance(e, torch.Tensor) else e) / E
    return torch.tanh(x) * scale


def check_contract(
    dispatcher: Any, scenario: str, rank: int, device: str = "cpu"
) -> dict[str, Any]:
    """Run one scenario through a dispatcher; return the errors against the reference."""
    x_TH, idx_TK, w_TK = make_inputs(scenario, rank, device=device)
    x_TH.requires_grad_(True)
    w_TK.requires_grad_(True)
    L = dispatcher.num_local_experts
    first = dispatcher.ep_rank * L

    # identity experts: combine(dispatch(x)) == x * sum of non-dropped weights
    recv_x_RH, counts_L, handle = dispatcher.dispatch(x_TH, idx_TK, w_TK)
    out_id_TH = dispatcher.combine(recv_x_RH, handle)
    want_id_TH = x_TH * (w_TK * (idx_TK >= 0)).sum(1, keepdim=True)
    # the identity graph joins the loss below (times 0): its backward runs too, on every rank
    zero = (out_id_TH * 0).sum()

    # counts and row contents per local expert, against every rank's routing
    world = dispatcher.ep_size
    all_idx = torch.cat([make_inputs(scenario, r)[1] for r in range(world)])
    want_counts_L = reference_tokens_per_expert(all_idx, dispatcher.num_experts)[first : first + L]
    rows_err = 0.0
    starts = [0] + torch.cumsum(counts_L, 0).tolist()
    for e in range(L):
        got = recv_x_RH[starts[e] : starts[e + 1]].detach().cpu().float()
        want = torch.cat(
            [
                reference_rows_for_expert(*make_inputs(scenario, r)[:2], first + e)
                for r in range(world)
            ]
        )
        if got.shape != want.shape:
            rows_err = float("inf")
        elif got.numel():  # the order inside one expert's rows is not part of the contract
            rows_err = max(rows_err, _max_err(got[got[:, 0].argsort()], want[want[:, 0].argsort()]))

    # expert-wise function: output and gradients against autograd through the reference
    expert_R = first + torch.repeat_interleave(torch.arange(L, device=device), counts_L.to(device))
    out_TH = dispatcher.combine(expert_fn(recv_x_RH, expert_R), handle)
    ref_TH = reference_moe(x_TH, idx_TK, w_TK, expert_fn)
    G_TH = torch.randn(out_TH.shape, generator=torch.Generator().manual_seed(7 + rank)).to(device)
    grads = torch.autograd.grad((out_TH * G_TH).sum() + zero, (x_TH, w_TK), allow_unused=True)
    ref_grads = torch.autograd.grad((ref_TH * G_TH).sum(), (x_TH, w_TK), allow_unused=True)
    # an unused input (T = 0) has no gradient: compare as zeros
    grads = [torch.zeros_like(t) if g is None else g for g, t in zip(grads, (x_TH, w_TK))]
    ref_grads = [torch.zeros_like(t) if g is None else g for g, t in zip(ref_grads, (x_TH, w_TK))]
    return {
        "identity_err": _max_err(out_id_TH, want_id_TH),
        "out_err": _max_err(out_TH, ref_TH),
        "grad_x_err": _max_err(grads[0], ref_grads[0]),
        "grad_w_err": _max_err(grads[1], ref_grads[1]),
        "counts_ok": counts_L.tolist() == want_counts_L.tolist() and counts_L.dtype == torch.int64,
        "rows_err": rows_err,
        "num_tokens": int(x_TH.shape[0]),
        "num_rows": int(recv_x_RH.shape[0]),
        "bytes": dispatcher.bytes_moved(handle),
    }


def _max_err(a: torch.Tensor, b: torch.Tensor) -> float:
    if a.shape != b.shape:
        return float("inf")
    return (a.detach().float() - b.detach().float()).abs().max().item() if a.numel() else 0.0


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def world_main(
    rank: int, world: int, port: int, configs: list[dict], out_dir: str, device: str = "cpu"
) -> None:
    """Entry point of one spawned rank (gloo on CPU, NCCL with device="cuda"): run every
    config x scenario and write this rank's results as JSON."""
    os.environ["GLOO_SOCKET_IFNAME"] = "lo"  # loopback only
    torch.set_num_threads(1)
    if device == "cuda":
        torch.cuda.set_device(rank)
    dist.init_process_group(
        "nccl" if device == "cuda" else "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world,
        timeout=timedelta(seconds=120),
    )
    results: dict[str, Any] = {}
    try:
        for cfg in configs:
            group = None
            # EP groups of consecutive ranks inside the world (as with DP x EP)
            if "ep_size" in cfg:
                ep = cfg["ep_size"]
                groups = [
                    dist.new_group(list(range(first, first + ep))) for first in range(0, world, ep)
                ]
                group = groups[rank // ep]
            records = _Records()
            logging.getLogger("moerl.kernels").addHandler(records)
            d = make_dispatcher(
                cfg["backend"],
                E,
                group=group,
                ranks_per_node=cfg.get("ranks_per_node", 1),
                allow_fallback=cfg.get("allow_fallback", False),
            )
            logging.getLogger("moerl.kernels").removeHandler(records)
            meta = {"name": d.name, "fallback_from": d.fallback_from, "warnings": records.messages}
            for scenario in cfg.get("scenarios", SCENARIOS):
                # each EP group solves the same problem: inputs are keyed by the rank in the group
                results[f"{cfg['id']}|{scenario}"] = (
                    check_contract(d, scenario, d.ep_rank, device) | meta
                )
            dist.barrier()
    finally:
        Path(out_dir, f"rank{rank}.json").write_text(json.dumps(results))
        dist.destroy_process_group()


def run_world(
    world: int, configs: list[dict], out_dir: Path, device: str = "cpu"
) -> dict[str, list[dict]]:
    """Spawn a world; return {case: [result of rank 0, rank 1, ...]}."""
    import torch.multiprocessing as mp

    mp.spawn(
        world_main,
        args=(world, free_port(), configs, str(out_dir), device),
        nprocs=world,
        join=True,
    )
    per_rank = [json.loads(Path(out_dir, f"rank{r}.json").read_text()) for r in range(world)]
    return {case: [pr[case] for pr in per_rank] for case in per_rank[0]}


# --------------------------------------------------------------------------- a fake deep_ep


class FakeDeepEPBuffer:
    """A one-rank, CPU stand-in for deep_ep.Buffer's V1 semantics as documented: per-rank
    deduplicated rows, local recv_topk_idx (-1 elsewhere) with zeroed weights, an UNWEIGHTED
    combine that also sums topk_weights, cached-handle dispatch, and the low-latency pair
    (per-expert slots, weighted combine). It exercises the deepep adapter's own logic only."""

    num_sms = 20
    created: list[FakeDeepEPBuffer] = []

    class _Config:
        def get_nvl_buffer_size_hint(self, hidden_bytes: int, num_ranks: int) -> int:
            return hidden_bytes

        def get_rdma_buffer_size_hint(self, hidden_bytes: int, num_ranks: int) -> int:
            return 0

    def __init__(
        self,
        group: Any,
        num_nvl_bytes: int = 0,
        num_rdma_bytes: int = 0,
        low_latency_mode: bool = False,
        num_qps_per_rank: int = 24,
        allow_nvlink_for_low_latency_mode: bool = True,
        allow_mnnvl: bool = False,
        explicitly_destroy: bool = False,
    ) -> None:
        self.low_latency_mode, self.num_qps_per_rank = low_latency_mode, num_qps_per_rank
        FakeDeepEPBuffer.created.append(self)

    get_dispatch_config = get_combine_config = staticmethod(
        lambda num_ranks: FakeDeepEPBuffer._Config()
    )
    get_low_latency_rdma_size_hint = staticmethod(lambda *args: 1)
    set_num_sms = staticmethod(lambda n: None)

    def get_dispatch_layout(self, topk_idx: torch.Tensor, num_experts: int):
        in_rank_T1 = (topk_idx >= 0).any(1, keepdim=True)
        per_expert = torch.bincount(topk_idx[topk_idx >= 0], minlength=num_experts)
        return in_rank_T1.sum(0), None, per_expert, in_rank_T1, None

    def dispatch(
        self,
        x,
        handle=None,
        num_tokens_per_rank=None,
        num_tokens_per_rdma_rank=None,
        is_token_in_rank=None,
        num_tokens_per_expert=None,
        topk_idx=None,
        topk_weights=None,
        **kw,
    ):
        assert x.dtype == torch.bfloat16
        if handle is not None:
            return x[handle[0]], None, None, None, None, None
        src_S = is_token_in_rank[:, 0].nonzero().squeeze(1)
        recv_idx_SK = topk_idx[src_S]
        recv_w_SK = torch.where(recv_idx_SK >= 0, topk_weights[src_S], 0.0)
        counts = torch.bincount(
            recv_idx_SK[recv_idx_SK >= 0], minlength=len(num_tokens_per_expert)
        ).tolist()
        return x[src_S], recv_idx_SK, recv_w_SK, counts, (src_S, x.shape[0]), None

    def combine(self, x, handle, topk_weights=None, **kw):
        assert x.dtype == torch.bfloat16
        src_S, T = handle
        out = x.new_zeros((T, x.shape[1])).index_add_(0, src_S, x)
        w = (
            None
            if topk_weights is None
            else topk_weights.new_zeros((T, topk_weights.shape[1])).index_add_(
                0, src_S, topk_weights
            )
        )
        return out, w, None

    def low_latency_dispatch(
        self, x, topk_idx, num_max_dispatch_tokens_per_rank, num_experts, use_fp8=True, **kw
    ):
        assert not use_fp8 and x.shape[0] <= num_max_dispatch_tokens_per_rank
        packed = x.new_zeros((num_experts, num_max_dispatch_tokens_per_rank, x.shape[1]))
        count = torch.zeros(num_experts, dtype=torch.int32)
        where = {}
        for t, k in (topk_idx >= 0).nonzero().tolist():
            e = int(topk_idx[t, k])
            packed[e, count[e]] = x[t]
            where[(t, k)] = (e, int(count[e]))
            count[e] += 1
        return packed, count, where, None, None

    def low_latency_combine(self, x, topk_idx, topk_weights, handle, **kw):
        out = torch.zeros(topk_idx.shape[0], x.shape[2])
        for (t, k), (e, slot) in handle.items():
            out[t] += topk_weights[t, k] * x[e, slot].float()
        return out.to(torch.bfloat16), None, None

    def destroy(self) -> None:
        pass


class FakeElasticBuffer:
    """A one-rank, CPU stand-in for deep_ep.ElasticBuffer's (DeepEP v2) documented semantics in
    non-expand mode: dispatch returns one row per (token, rank) with local recv_topk_idx (-1
    elsewhere), an EPHandle with the received count and per-expert counts, and PADDING rows
    past the received count (garbage rows and indices, as a real buffer may leave them);
    combine is an UNWEIGHTED sum of the valid rows (and sums topk_weights); a dispatch with a
    cached handle reuses the layout. It exercises the deepep adapter's own logic only."""

    created: list[FakeElasticBuffer] = []
    PAD = 3

    def __init__(
        self,
        group: Any,
        num_bytes: int | None = None,
        num_cpu_bytes: int = 0,
        num_max_tokens_per_rank: int = 0,
        hidden: int = 0,
        num_topk: int = 0,
        use_fp8_dispatch: bool = False,
        deterministic: bool = False,
        allow_hybrid_mode: bool = True,
        allow_multiple_reduction: bool = True,
        prefer_overlap_with_compute: bool = True,
        sl_idx: int = 3,
        num_allocated_qps: int = 0,
        num_cpu_timeout_secs: int = 300,
        num_gpu_timeout_secs: int = 100,
        explicitly_destroy: bool = False,
    ) -> None:
        self.num_max_tokens_per_rank, self.hidden, self.num_topk = (
            num_max_tokens_per_rank,
            hidden,
            num_topk,
        )
        self.use_fp8_dispatch, self.explicitly_destroy, self.destroyed = (
            use_fp8_dispatch,
            explicitly_destroy,
            False,
        )
        self.num_bytes = 2 << 20
        FakeElasticBuffer.created.append(self)

    def _pad(self, rows: torch.Tensor) -> torch.Tensor:
        return torch.cat([rows, torch.full((self.PAD, *rows.shape[1:]), 7, dtype=rows.dtype)])

    def dispatch(
        self,
        x,
        topk_idx=None,
        topk_weights=None,
        cumulative_local_expert_recv_stats=None,
        num_experts=None,
        num_max_tokens_per_rank=None,
        expert_alignment=None,
        num_sms=0,
        num_qps=0,
        previous_event=None,
        previous_event_before_epilogue=None,
        async_with_compute_stream=False,
        allocate_on_comm_stream=False,
        handle=None,
        do_handle_copy=True,
        do_cpu_sync=None,
        do_expand=False,
        do_zero_padding=False,
        use_tma_aligned_col_major_sf=False,
    ):
        import types

        assert x.dtype == torch.bfloat16 and not do_expand and x.shape[1] == self.hidden
        assert x.shape[0] <= self.num_max_tokens_per_rank
        if handle is not None:
            assert topk_idx is None
            return self._pad(x[handle.src_S]), None, None, handle, None
        assert (
            num_experts is not None
            and topk_idx.shape[1] == self.num_topk
            and topk_weights.dtype == torch.float32
        )
        src_S = (topk_idx >= 0).any(1).nonzero().squeeze(1)
        recv_idx_SK = topk_idx[src_S]
        recv_w_SK = torch.where(recv_idx_SK >= 0, topk_weights[src_S], 0.0)
        counts = torch.bincount(recv_idx_SK[recv_idx_SK >= 0], minlength=num_experts).tolist()
        handle = types.SimpleNamespace(
            src_S=src_S,
            num_tokens=x.shape[0],
            num_experts=num_experts,
            psum_num_recv_tokens_per_scaleup_rank=torch.tensor([len(src_S)]),
            num_recv_tokens_per_expert_list=counts,
        )
        # stale: expert 0
        idx_pad = torch.zeros((self.PAD, recv_idx_SK.shape[1]), dtype=recv_idx_SK.dtype)
        return (
            self._pad(x[src_S]),
            torch.cat([recv_idx_SK, idx_pad]),
            self._pad(recv_w_SK),
            handle,
            None,
        )

    def combine(
        self,
        x,
        handle,
        topk_weights=None,
        bias=None,
        num_sms=0,
        num_qps=0,
        previous_event=None,
        previous_event_before_epilogue=None,
        async_with_compute_stream=False,
        allocate_on_comm_stream=False,
    ):
        assert x.dtype == torch.bfloat16 and x.shape[0] == len(handle.src_S) + self.PAD
        n = len(handle.src_S)
        out = x.new_zeros((handle.num_tokens, x.shape[1])).index_add_(0, handle.src_S, x[:n])
        w = (
            None
            if topk_weights is None
            else topk_weights.new_zeros((handle.num_tokens, topk_weights.shape[1])).index_add_(
                0, handle.src_S, topk_weights[:n]
            )
        )
        return out, w, None

    def destroy(self) -> None:
        assert self.explicitly_destroy
        self.destroyed = True
