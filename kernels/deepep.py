"""The `deepep` backend: DeepEP's kernels (V1 `Buffer` or v2 `ElasticBuffer`, chosen by
`deepep_options={"api": ...}`) behind the Dispatcher interface.

Shape legend: T tokens, H hidden, K top-k, E experts, L local experts (E / W), W ranks,
S rows DeepEP receives (one per (token, rank)), R rows handed to the experts (one per
(token, local expert)), M low-latency slots per expert.

The APIs, modes, transport variables and limitations: docs/kernels.md#deepep-kernelsdeepeppy.
"""

from __future__ import annotations

import inspect
import logging
import os
from typing import Any

import torch
import torch.distributed as dist
from pydantic import ValidationError
from torch import Tensor

from moerl.config.trainer import DeepEPOptions
from moerl.errors import ConfigError
from moerl.kernels.dispatcher import Dispatcher, DispatchHandle

log = logging.getLogger(__name__)

HELP = "deepep backend needs a CUDA GPU and the deep_ep package (the moerl kernel image); install it or use all_to_all"
TRANSPORT_ENV_PREFIXES = ("NVSHMEM_", "NCCL_", "FI_", "EP_")
VARIANT_ENV = "DEEPEP_VARIANT"  # set by the kernel image: the API it was built for
API_CLASS = {"v1": "Buffer", "v2": "ElasticBuffer"}


class DeepEPUnavailable(ConfigError):
    """No CUDA device or no deep_ep: the only case make_dispatcher may fall back on."""


def import_deep_ep() -> Any:
    """Return the deep_ep module, or raise DeepEPUnavailable saying what is missing."""
    if not torch.cuda.is_available():
        raise DeepEPUnavailable(f"{HELP} (no CUDA device visible to torch)")
    try:
        import deep_ep
    except (ImportError, OSError, AssertionError) as exc:  # deep_ep asserts on its NCCL at import
        raise DeepEPUnavailable(f"{HELP} (import deep_ep failed: {exc})") from exc
    if not any(hasattr(deep_ep, c) for c in API_CLASS.values()):
        raise DeepEPUnavailable(f"{HELP} (this deep_ep has neither Buffer nor ElasticBuffer)")
    return deep_ep


def select_api(deep_ep: Any, requested: str) -> str:
    """The DeepEP API to use (module doc: "auto"); ConfigError when this deep_ep lacks it."""
    variant = os.environ.get(VARIANT_ENV, "")
    if requested != "auto":
        api, why = requested, "deepep_options.api"
    elif variant:
        if variant not in API_CLASS:
            raise ConfigError(
                f"${VARIANT_ENV}={variant!r}: must be one of {', '.join(API_CLASS)} (the kernel image "
                f"sets it to the DeepEP API it was built with)"
            )
        api, why = variant, f"${VARIANT_ENV}"
    else:
        api, why = (
            ("v2" if hasattr(deep_ep, "ElasticBuffer") else "v1"),
            "the newest API this deep_ep exports",
        )
    if not hasattr(deep_ep, API_CLASS[api]):
        have = [a for a, c in API_CLASS.items() if hasattr(deep_ep, c)]
        raise ConfigError(
            f"deepep: {why} asks for DeepEP {api} (deep_ep.{API_CLASS[api]}), which this deep_ep "
            f"{getattr(deep_ep, '__version__', '')} does not export; it has {', '.join(have) or 'neither'}. "
            f"Use the kernel image built with DEEPEP_VARIANT={api}, or set deepep_options.api"
        )
    log.info("deepep: using DeepEP %s (deep_ep.%s), chosen by %s", api, API_CLASS[api], why)
    return api


def _kwargs_supported(fn: Any, **kwargs: Any) -> dict[str, Any]:
    """Drop keyword arguments an older deep_ep.Buffer does not take (e.g. explicitly_destroy)."""
    params = inspect.signature(fn).parameters
    return {k: v for k, v in kwargs.items() if k in params}


class _V1Wire:
    """DeepEP V1 normal mode: layout, then dispatch; combine; the cached-handle dispatch."""

    def __init__(self, buffer: Any, num_experts: int):
        self.buffer, self.num_experts = buffer, num_experts

    def dispatch(
        self, x_TH: Tensor, idx_TK: Tensor, w_TK: Tensor
    ) -> tuple[Tensor, Tensor, Tensor, list[int], Any, dict]:
        per_rank_W, per_rdma_rank, per_expert_E, in_rank_TW, _ = self.buffer.get_dispatch_layout(
            idx_TK, self.num_experts
        )
        recv_x_SH, recv_idx_SK, recv_w_SK, counts_list, dhandle, _ = self.buffer.dispatch(
            x_TH,
            num_tokens_per_rank=per_rank_W,
            num_tokens_per_rdma_rank=per_rdma_rank,
            is_token_in_rank=in_rank_TW,
            num_tokens_per_expert=per_expert_E,
            topk_idx=idx_TK,
            topk_weights=w_TK,
        )
        return (
            recv_x_SH,
            recv_idx_SK,
            recv_w_SK,
            counts_list,
            dhandle,
            {"per_rdma_rank": per_rdma_rank, "in_rank_TW": in_rank_TW},
        )

    def dispatch_backward(
        self, grad_x_SH: Tensor, grad_w_SK: Tensor, dhandle: Any
    ) -> tuple[Tensor, Tensor]:
        grad_x_TH, grad_w_TK, _ = self.buffer.combine(grad_x_SH, dhandle, topk_weights=grad_w_SK)
        return grad_x_TH, grad_w_TK

    def combine(self, partial_SH: Tensor, dhandle: Any) -> Tensor:
        return self.buffer.combine(partial_SH, dhandle)[0]

    def combine_backward(self, grad_out_TH: Tensor, dhandle: Any) -> Tensor:
        return self.buffer.dispatch(grad_out_TH, handle=dhandle)[0]


class _V2Wire(_V1Wire):
    """DeepEP v2 `ElasticBuffer`: one dispatch call (layout included); combine and the
    cached-handle dispatch as in V1. Rows past the received count are padding."""

    def dispatch(
        self, x_TH: Tensor, idx_TK: Tensor, w_TK: Tensor
    ) -> tuple[Tensor, Tensor, Tensor, list[int], Any, dict]:
        recv_x_SH, recv_idx_SK, recv_w_SK, ehandle, _ = self.buffer.dispatch(
            x_TH, topk_idx=idx_TK, topk_weights=w_TK, num_experts=self.num_experts
        )
        num_recv = (
            int(ehandle.psum_num_recv_tokens_per_scaleup_rank[-1])
            if ehandle.psum_num_recv_tokens_per_scaleup_rank.numel()
            else 0
        )
        if num_recv < recv_idx_SK.shape[0]:  # padding rows: never expanded (their idx may be stale)
            recv_idx_SK = recv_idx_SK.clone()
            recv_idx_SK[num_recv:] = -1
        return (
            recv_x_SH,
            recv_idx_SK,
            recv_w_SK,
            list(ehandle.num_recv_tokens_per_expert_list),
            ehandle,
            {},
        )


class _NormalDispatch(torch.autograd.Function):
    """(x_TH, w_TK) -> (recv_x_SH, recv_w_SK) through DeepEP; backward is DeepEP's combine."""

    @staticmethod
    def forward(ctx, wire, box: dict, x_TH: Tensor, idx_TK: Tensor, w_TK: Tensor):
        recv_x_SH, recv_idx_SK, recv_w_SK, counts_list, dhandle, extra = wire.dispatch(
            x_TH.to(torch.bfloat16).contiguous(), idx_TK, w_TK.float().contiguous()
        )
        box.update(extra, handle=dhandle, recv_idx_SK=recv_idx_SK, counts_list=counts_list)
        ctx.wire, ctx.dhandle, ctx.dtypes = wire, dhandle, (x_TH.dtype, w_TK.dtype)
        return recv_x_SH.to(x_TH.dtype), recv_w_SK.to(w_TK.dtype)

    @staticmethod
    def backward(ctx, grad_x_SH: Tensor, grad_w_SK: Tensor):
        # grad_w is zero on slots of other ranks' experts, so DeepEP's sum over ranks is exact.
        grad_x_TH, grad_w_TK = ctx.wire.dispatch_backward(
            grad_x_SH.to(torch.bfloat16).contiguous(), grad_w_SK.float().contiguous(), ctx.dhandle
        )
        return None, None, grad_x_TH.to(ctx.dtypes[0]), None, grad_w_TK.to(ctx.dtypes[1])


class _NormalCombine(torch.autograd.Function):
    """partial_SH (one weighted row per (token, rank)) -> out_TH, DeepEP's unweighted sum."""

    @staticmethod
    def forward(ctx, wire, dhandle, partial_SH: Tensor, out_dtype: torch.dtype):
        out_TH = wire.combine(partial_SH.to(torch.bfloat16).contiguous(), dhandle)
        ctx.wire, ctx.dhandle, ctx.in_dtype = wire, dhandle, partial_SH.dtype
        return out_TH.to(out_dtype)

    @staticmethod
    def backward(ctx, grad_out_TH: Tensor):
        grad_SH = ctx.wire.combine_backward(
            grad_out_TH.to(torch.bfloat16).contiguous(), ctx.dhandle
        )
        return None, None, grad_SH.to(ctx.in_dtype), None


def _in_rank(idx_TK: Tensor, num_local_experts: int, num_ranks: int) -> Tensor:
    """[T, W] bool: token t has an expert on rank w (what V1's layout returns; v2 does not)."""
    valid = idx_TK >= 0
    rank_TK = torch.where(valid, idx_TK.long() // num_local_experts, num_ranks)
    hit = torch.zeros(idx_TK.shape[0], num_ranks + 1, dtype=torch.bool, device=idx_TK.device)
    return hit.scatter_(1, rank_TK, True)[:, :num_ranks]


class DeepEPDispatcher(Dispatcher):
    name = "deepep"

    def __init__(
        self,
        num_experts: int,
        group: Any = None,
        ranks_per_node: int = 1,
        options: dict | None = None,
    ):
        # Options first: a bad option is a config bug and must not turn into a silent fallback.
        try:
            self.options = DeepEPOptions(**(options or {}))
        except ValidationError as exc:
            raise ConfigError(f"invalid deepep_options: {exc}") from exc
        # raises DeepEPUnavailable, the one case that may fall back
        self._deep_ep = import_deep_ep()
        self.api = select_api(self._deep_ep, self.options.api)
        if self.api == "v2" and self.options.mode == "low_latency":
            raise ConfigError(
                "deepep_options.mode low_latency is DeepEP V1's (low_latency_dispatch); v2's "
                "ElasticBuffer serves decode with the one dispatch/combine pair: use mode normal, or api v1"
            )
        if not dist.is_initialized():
            raise ConfigError(
                "deepep backend needs torch.distributed initialized with NCCL (run under torchrun "
                "and call init_process_group('nccl') before make_dispatcher)"
            )
        super().__init__(num_experts, group=group, ranks_per_node=ranks_per_node)
        self.group = group if group is not None else dist.group.WORLD
        self.mode = self.options.mode
        self.transport_env: dict[str, str] = {}
        self._buffer: Any = None
        self._wire: _V1Wire | _V2Wire | None = None
        self._hidden: int | None = None
        if self.options.num_sms is not None:
            if self.api == "v2":
                raise ConfigError(
                    "deepep_options.num_sms sets V1's Buffer.set_num_sms; v2 picks SMs per call "
                    "from the expert count and top-k: leave it unset with api v2"
                )
            self._deep_ep.Buffer.set_num_sms(self.options.num_sms)

    def describe(self) -> str:
        """What ran, for provenance: e.g. `deepep v2 (ElasticBuffer) normal`."""
        return f"deepep {self.api} ({API_CLASS[self.api]}) {self.mode}"

    # ----------------------------------------------------------------- buffer

    def _apply_env(self) -> None:
        for key, value in self.options.env.items():
            current = os.environ.get(key)
            if current is not None and current != value:
                raise ConfigError(
                    f"deepep_options.env[{key!r}]={value!r} conflicts with the environment ({current!r}); "
                    f"set it in one place"
                )
            log.info("deepep: setting %s=%s (from deepep_options.env)", key, value)
            os.environ[key] = value

    def _get_buffer(self, hidden: int, num_topk: int = 0) -> Any:
        if self._buffer is not None:
            if hidden != self._hidden:
                raise ConfigError(
                    f"deepep dispatcher was sized for hidden {self._hidden}, got {hidden}; "
                    f"make one dispatcher per hidden size"
                )
            return self._buffer
        self._apply_env()
        if self.api == "v2":
            return self._get_elastic_buffer(hidden, num_topk)
        Buffer, W, opts = self._deep_ep.Buffer, self.ep_size, self.options
        if self.mode == "normal":
            nvl, rdma, hidden_bytes = 0, 0, hidden * 2  # bf16 on the wire
            try:
                for cfg in (Buffer.get_dispatch_config(W), Buffer.get_combine_config(W)):
                    nvl = max(nvl, cfg.get_nvl_buffer_size_hint(hidden_bytes, W))
                    rdma = max(rdma, cfg.get_rdma_buffer_size_hint(hidden_bytes, W))
            except AssertionError as exc:
                raise ConfigError(f"DeepEP has no default config for {W} ranks: {exc}") from exc
            kwargs = dict(
                low_latency_mode=False, allow_mnnvl=opts.allow_mnnvl, explicitly_destroy=True
            )
            nvl = opts.num_nvl_bytes if opts.num_nvl_bytes is not None else nvl
            rdma = opts.num_rdma_bytes if opts.num_rdma_bytes is not None else rdma
        else:
            nvl = 0
            rdma = (
                opts.num_rdma_bytes
                if opts.num_rdma_bytes is not None
                else Buffer.get_low_latency_rdma_size_hint(
                    opts.num_max_dispatch_tokens_per_rank, hidden, W, self.num_experts
                )
            )
            # DeepEP: the QP count must equal the number of local experts in low-latency mode.
            kwargs = dict(
                low_latency_mode=True,
                num_qps_per_rank=self.num_local_experts,
                allow_nvlink_for_low_latency_mode=opts.allow_nvlink_for_low_latency_mode,
                allow_mnnvl=opts.allow_mnnvl,
                explicitly_destroy=True,
            )
        self._buffer = Buffer(self.group, nvl, rdma, **_kwargs_supported(Buffer.__init__, **kwargs))
        self._wire = _V1Wire(self._buffer, self.num_experts)
        self._hidden = hidden
        self.transport_env = {
            k: v for k, v in sorted(os.environ.items()) if k.startswith(TRANSPORT_ENV_PREFIXES)
        }
        log.info(
            "deepep V1 %s buffer: %d ranks, nvl %d B, rdma %d B, transport env %s",
            self.mode,
            W,
            nvl,
            rdma,
            self.transport_env,
        )
        return self._buffer

    def _get_elastic_buffer(self, hidden: int, num_topk: int) -> Any:
        """v2: DeepEP sizes the ElasticBuffer from tokens per rank, hidden and top-k (bf16)."""
        opts, ElasticBuffer = self.options, self._deep_ep.ElasticBuffer
        kwargs = dict(
            num_max_tokens_per_rank=opts.num_max_tokens_per_rank,
            hidden=hidden,
            num_topk=num_topk,
            use_fp8_dispatch=False,
            allow_hybrid_mode=opts.allow_hybrid_mode,
            explicitly_destroy=True,
        )
        self._buffer = ElasticBuffer(
            self.group, **_kwargs_supported(ElasticBuffer.__init__, **kwargs)
        )
        self._wire = _V2Wire(self._buffer, self.num_experts)
        self._hidden = hidden
        self.transport_env = {
            k: v for k, v in sorted(os.environ.items()) if k.startswith(TRANSPORT_ENV_PREFIXES)
        }
        log.info(
            "deepep v2 ElasticBuffer: %d ranks, %d tokens/rank, hidden %d, top-%d, %s B, transport env %s",
            self.ep_size,
            opts.num_max_tokens_per_rank,
            hidden,
            num_topk,
            getattr(self._buffer, "num_bytes", "?"),
            self.transport_env,
        )
        return self._buffer

    def close(self) -> None:
        if self._buffer is not None and hasattr(self._buffer, "destroy"):
            self._buffer.destroy()
        self._buffer = self._wire = None

    # ----------------------------------------------------------------- dispatch / combine

    def dispatch(
        self, x_TH: Tensor, topk_idx_TK: Tensor, topk_weights_TK: Tensor
    ) -> tuple[Tensor, Tensor, DispatchHandle]:
        self._check_inputs(x_TH, topk_idx_TK, topk_weights_TK)
        idx_TK = topk_idx_TK.to(getattr(self._deep_ep, "topk_idx_t", torch.int64))
        if self.mode == "low_latency":
            return self._dispatch_low_latency(x_TH, idx_TK, topk_weights_TK)
        if self.api == "v2" and x_TH.shape[0] > self.options.num_max_tokens_per_rank:
            raise ConfigError(
                f"deepep v2: {x_TH.shape[0]} tokens on one dispatch > deepep_options."
                f"num_max_tokens_per_rank ({self.options.num_max_tokens_per_rank}), the ElasticBuffer's size"
            )
        self._get_buffer(x_TH.shape[1], topk_idx_TK.shape[1])
        box: dict[str, Any] = {}
        recv_x_SH, recv_w_SK = _NormalDispatch.apply(self._wire, box, x_TH, idx_TK, topk_weights_TK)
        recv_idx_SK = box["recv_idx_SK"]
        # Expand DeepEP's per-(token, rank) rows to per-(token, local expert), grouped by expert.
        row_R, k_R = (recv_idx_SK >= 0).nonzero(as_tuple=True)
        order = torch.argsort(recv_idx_SK[row_R, k_R], stable=True)
        row_R, k_R = row_R[order], k_R[order]
        counts_L = torch.tensor(box["counts_list"], dtype=torch.int64, device=x_TH.device)
        handle = DispatchHandle(
            num_tokens=x_TH.shape[0],
            hidden=x_TH.shape[1],
            wire_element_size=2,
            topk_idx_TK=topk_idx_TK,
            tokens_per_local_expert_L=counts_L,
            recv_weights_R=recv_w_SK[row_R, k_R],
            sent_rows={},
            extra={
                "mode": "normal",
                "deepep_handle": box["handle"],
                "row_R": row_R,
                "num_recv_rows": recv_x_SH.shape[0],
                "per_rdma_rank": box.get("per_rdma_rank"),
                "in_rank_TW": box.get("in_rank_TW"),
            },
        )
        return recv_x_SH.index_select(0, row_R), counts_L, handle

    def combine(self, y_RH: Tensor, handle: DispatchHandle) -> Tensor:
        """Weights are applied HERE, on the expert side: normal mode multiplies each row by its
        routing weight and sums a token's rows per rank before DeepEP's unweighted combine;
        low-latency mode passes the weights to DeepEP's weighted low_latency_combine."""
        if handle.extra["mode"] == "low_latency":
            return self._combine_low_latency(y_RH, handle)
        z_RH = y_RH * handle.recv_weights_R.unsqueeze(1)  # fp32 when the weights are fp32
        partial_SH = z_RH.new_zeros((handle.extra["num_recv_rows"], handle.hidden)).index_add(
            0, handle.extra["row_R"], z_RH
        )
        return _NormalCombine.apply(
            self._wire, handle.extra["deepep_handle"], partial_SH, y_RH.dtype
        )

    def _dispatch_low_latency(
        self, x_TH: Tensor, idx_TK: Tensor, w_TK: Tensor
    ) -> tuple[Tensor, Tensor, DispatchHandle]:
        if torch.is_grad_enabled() and (x_TH.requires_grad or w_TK.requires_grad):
            raise ConfigError(
                "deepep low_latency mode is inference-only in moerl (no backward); use "
                "deepep_options={'mode': 'normal'} for training, or run under torch.no_grad()"
            )
        M = self.options.num_max_dispatch_tokens_per_rank
        if x_TH.shape[0] > M:
            raise ConfigError(
                f"deepep low_latency: {x_TH.shape[0]} tokens > num_max_dispatch_tokens_per_rank ({M})"
            )
        buffer = self._get_buffer(x_TH.shape[1])
        packed_LMH, count_L, ll_handle, _, _ = buffer.low_latency_dispatch(
            x_TH.to(torch.bfloat16).contiguous(),
            idx_TK,
            M,
            self.num_experts,
            use_fp8=False,
            async_finish=False,
            return_recv_hook=False,
        )
        counts_L = count_L.to(torch.int64)
        valid_LM = torch.arange(packed_LMH.shape[1], device=x_TH.device).unsqueeze(
            0
        ) < counts_L.unsqueeze(1)
        # Boolean indexing copies out of DeepEP's buffer (only two LL results may be alive at once).
        recv_x_RH = packed_LMH[valid_LM].to(x_TH.dtype)
        handle = DispatchHandle(
            num_tokens=x_TH.shape[0],
            hidden=x_TH.shape[1],
            wire_element_size=2,
            topk_idx_TK=idx_TK,
            tokens_per_local_expert_L=counts_L,
            recv_weights_R=None,
            sent_rows={},
            extra={
                "mode": "low_latency",
                "ll_handle": ll_handle,
                "valid_LM": valid_LM,
                "topk_weights_TK": w_TK.float().contiguous(),
                "slots": packed_LMH.shape[1],
            },
        )
        return recv_x_RH, counts_L, handle

    def _combine_low_latency(self, y_RH: Tensor, handle: DispatchHandle) -> Tensor:
        extra = handle.extra
        packed_LMH = torch.zeros(
            (self.num_local_experts, extra["slots"], handle.hidden),
            dtype=torch.bfloat16,
            device=y_RH.device,
        )
        packed_LMH[extra["valid_LM"]] = y_RH.to(torch.bfloat16)
        out_TH, _, _ = self._buffer.low_latency_combine(
            packed_LMH,
            handle.topk_idx_TK,
            extra["topk_weights_TK"],
            extra["ll_handle"],
            async_finish=False,
            return_recv_hook=False,
        )
        return out_TH.to(y_RH.dtype, copy=True)

    # ----------------------------------------------------------------- bytes

    def _sent_rows(self, handle: DispatchHandle) -> dict[str, int]:
        """Normal mode: DeepEP sends one row per (token, rank) over NVLink intranode; internode
        one per (token, node) over RDMA, then NVLink forwards on the landing rank (counted here
        as the forwards this rank's tokens cause). Low-latency: one message per (token, expert)."""
        idx = handle.topk_idx_TK.long()
        if handle.extra["mode"] == "low_latency":
            rank_TK = torch.where(idx >= 0, idx // self.num_local_experts, self.ep_rank)
            my_node = self.ep_rank // self.ranks_per_node
            remote = rank_TK != self.ep_rank
            inter = remote & (rank_TK // self.ranks_per_node != my_node)
            return {"inter_node": int(inter.sum()), "intra_node": int((remote & ~inter).sum())}
        in_rank_TW = handle.extra["in_rank_TW"]
        per_rdma = handle.extra["per_rdma_rank"]
        if in_rank_TW is None:  # v2 reports no layout: derive it; nodes are ranks_per_node groups
            in_rank_TW = _in_rank(idx, self.num_local_experts, self.ep_size)
            G = self.ranks_per_node
            # once per node, forwarded over NVLink
            if G < self.ep_size and self.options.allow_hybrid_mode:
                per_rdma = in_rank_TW.view(in_rank_TW.shape[0], -1, G).any(2).sum(0)
            # without hybrid mode every remote rank is reached over RDMA directly
            elif G < self.ep_size:
                same_node = torch.arange(self.ep_size, device=idx.device) // G == self.ep_rank // G
                return {
                    "inter_node": int(in_rank_TW[:, ~same_node].sum()),
                    "intra_node": int(
                        in_rank_TW[:, same_node].sum() - in_rank_TW[:, self.ep_rank].sum()
                    ),
                }
        if per_rdma is None:  # intranode: everything over NVLink
            return {
                "inter_node": 0,
                "intra_node": int(in_rank_TW.sum() - in_rank_TW[:, self.ep_rank].sum()),
            }
        G = self.ep_size // per_rdma.numel()
        my_rdma = self.ep_rank // G
        not_landing = torch.arange(self.ep_size, device=in_rank_TW.device) % G != self.ep_rank % G
        return {
            "inter_node": int(per_rdma.sum() - per_rdma[my_rdma]),
            "intra_node": int(in_rank_TW[:, not_landing].sum()),
        }
