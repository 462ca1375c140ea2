"""The expert-parallel MoE block: replaces transformers' sparse MoE block in the trainer
(Qwen3-MoE, Mixtral, OLMoE; Qwen2-MoE and DeepSeek-V3 with their shared experts), with the
routed experts sharded over the EP group and tokens moved by a `Dispatcher`.

Legend: B batch, S sequence, T = B*S tokens, H hidden, I expert intermediate, K top-k,
E experts, L = E / ep local experts, R rows received (one per (token, local expert) pair).

- The router stays as in the checkpoint, whatever its kind (softmax top-k; DeepSeek-V3's
  sigmoid scores with the bias correction and grouped top-k): the block only dispatches what
  it returns. Shared experts run on this rank's tokens and are added after the combine.
- Rank r owns experts [r*L, (r+1)*L): its slices of `gate_up_proj` [E, 2I, H] and
  `down_proj` [E, H, I].
- Routing weights are applied in `combine` (the dispatcher's contract).
- The load-balancing aux loss (Switch Transformer form, E * sum_e f_e * P_e over this rank's
  tokens) is computed only when `aux_loss_coef > 0`; the trainer adds it.
- `tokens_per_expert_L` keeps the last forward's per-local-expert counts for logging.

Built from a block on the `meta` device (what `ep_checkpoint.load_ep_model` does), the block
allocates nothing: its expert slices stay `meta` until the loader fills them with this rank's
experts read from the checkpoint files, so no rank ever materializes all experts. Built from a
real block (tests), it copies this rank's slice.

`gather_full_experts` rebuilds the full [E, ...] tensors on every rank (tests); saving gathers
one layer at a time to rank 0 instead (`ep_checkpoint.save_ep_checkpoint`).

The experts run as two grouped GEMMs over all local experts (`F.grouped_mm`; the per-expert
loop survives as `experts_loop`, the reference the tests compare against).

Limitations: Mixtral's router jitter noise is not applied (it is 0 in inference configs);
on CUDA, `F.grouped_mm` wants bf16 (`trainer.mixed_precision: bf16`).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.nn import functional as F

# What a sparse MoE block may hold: the router, the routed experts, and shared experts (with
# Qwen2-MoE's sigmoid gate); anything else is refused.
KEPT = ("gate", "experts", "shared_experts", "shared_expert", "shared_expert_gate")


class LocalExperts(nn.Module):
    """This rank's experts, a module of their own so that FSDP shards them on the data-parallel
    dimension of the mesh apart from the dense weights (`ep_train.apply_fsdp`)."""

    def __init__(self, gate_up_proj_LIH: torch.Tensor, down_proj_LHI: torch.Tensor, act_fn):
        super().__init__()
        self.gate_up_proj_LIH = nn.Parameter(gate_up_proj_LIH)
        self.down_proj_LHI = nn.Parameter(down_proj_LHI)
        self.act_fn = act_fn

    def forward(self, recv_RH: torch.Tensor, counts_L: torch.Tensor) -> torch.Tensor:
        """Rows grouped by local expert (`counts_L` rows each) through their experts: two
        grouped GEMMs (`F.grouped_mm`), no loop over experts and no host sync."""
        offs_L = torch.cumsum(counts_L, 0, dtype=torch.int32)
        gate_up_RI2 = _grads_contiguous(
            F.grouped_mm(recv_RH, self.gate_up_proj_LIH.transpose(-2, -1), offs=offs_L)
        )
        gate, up = gate_up_RI2.chunk(2, dim=-1)
        return _grads_contiguous(
            F.grouped_mm(self.act_fn(gate) * up, self.down_proj_LHI.transpose(-2, -1), offs=offs_L)
        )


def _grads_contiguous(t: torch.Tensor) -> torch.Tensor:
    """grouped_mm's backward refuses an expanded (stride 0) incoming gradient, which a plain
    `.sum()` produces: hand it a contiguous one."""
    if t.requires_grad:
        # (an empty expanded tensor counts as contiguous: build a fresh one then)
        t.register_hook(
            lambda g: (
                g.contiguous()
                if g.numel()
                else torch.zeros(g.shape, dtype=g.dtype, device=g.device)
            )
        )
    return t


def experts_loop(
    experts: LocalExperts, recv_RH: torch.Tensor, counts_L: torch.Tensor
) -> torch.Tensor:
    """The per-expert loop `LocalExperts.forward` replaces, kept as the reference for tests."""
    outs = []
    for e, rows_RH in enumerate(torch.split(recv_RH, counts_L.tolist())):
        gate, up = F.linear(rows_RH, experts.gate_up_proj_LIH[e]).chunk(2, dim=-1)
        outs.append(F.linear(experts.act_fn(gate) * up, experts.down_proj_LHI[e]))
    return torch.cat(outs) if outs else recv_RH[:0]


class EPMoEBlock(nn.Module):
    def __init__(self, block: nn.Module, dispatcher, aux_loss_coef: float = 0.0):
        super().__init__()
        experts = block.experts
        e, ep, r = dispatcher.num_experts, dispatcher.ep_size, dispatcher.ep_rank
        if experts.gate_up_proj.shape[0] != e or e % ep:
            raise ValueError(f"{e} experts cannot be sharded over {ep} ranks")
        n_local = e // ep
        lo = r * n_local
        dropped = sorted(
            {n.split(".")[0] for n, _ in block.named_parameters() if n.split(".")[0] not in KEPT}
        )
        if dropped:  # a part this block would lose: refused, never dropped
            raise ValueError(
                f"the MoE block {type(block).__name__} holds {', '.join(dropped)} besides its router, "
                "experts and shared experts; the expert-parallel block would drop them, so this model "
                "family cannot train on the mesh yet"
            )
        # shared experts run on every token of this rank, dense (FSDP shards them with the layer):
        # DeepSeek-V3's `shared_experts` as they are, Qwen2-MoE's `shared_expert` scaled by the
        # sigmoid of `shared_expert_gate`
        # (kept under the family's own names, so checkpoint keys and parameter names stay the same)
        self._shared = next(
            (n for n in ("shared_experts", "shared_expert") if getattr(block, n, None) is not None),
            None,
        )
        self._shared_gate = (
            "shared_expert_gate" if getattr(block, "shared_expert_gate", None) is not None else None
        )
        for n in filter(None, (self._shared, self._shared_gate)):
            self.add_module(n, getattr(block, n))
        self.gate = block.gate  # the router, replicated
        self.top_k = getattr(block.gate, "top_k", None)
        self.num_experts, self.first_expert = e, lo  # this rank owns experts [lo, lo + n_local)
        # on `meta` the slices are shape-only placeholders: the loader replaces them
        self.experts = LocalExperts(
            experts.gate_up_proj.detach()[lo : lo + n_local].clone(),
            experts.down_proj.detach()[lo : lo + n_local].clone(),
            experts.act_fn,
        )
        self.dispatcher = dispatcher
        if aux_loss_coef > 0 and hasattr(block.gate, "e_score_correction_bias"):
            raise ValueError(
                "trainer.aux_loss_coef > 0: moerl's load-balancing loss is the softmax-router form, and "
                f"{type(block.gate).__name__} is a sigmoid router balanced by its bias correction; set "
                "trainer.aux_loss_coef 0 for this family (trainer.router_bias_update_rate moves that "
                "bias towards balance)"
            )
        self.aux_loss_coef = aux_loss_coef
        self.aux_loss: torch.Tensor | None = None
        self.tokens_per_expert_L: torch.Tensor | None = None

    def forward(self, hidden_BSH: torch.Tensor) -> torch.Tensor:
        b, s, h = hidden_BSH.shape
        x_TH = hidden_BSH.reshape(-1, h)
        router_logits_TE, w_TK, idx_TK = self.gate(x_TH)
        recv_RH, counts_L, handle = self.dispatcher.dispatch(x_TH, idx_TK, w_TK.to(x_TH.dtype))
        self.tokens_per_expert_L = counts_L.detach()
        y_RH = self.experts(recv_RH, counts_L)
        out_TH = self.dispatcher.combine(y_RH, handle)
        if self._shared is not None:
            shared_TH = getattr(self, self._shared)(x_TH)
            if self._shared_gate is not None:
                shared_TH = torch.sigmoid(getattr(self, self._shared_gate)(x_TH)) * shared_TH
            out_TH = out_TH + shared_TH
        if self.aux_loss_coef > 0:
            self.aux_loss = self.aux_loss_coef * load_balancing_loss(router_logits_TE, idx_TK)
        return out_TH.reshape(b, s, h)

    @property
    def gate_up_proj_LIH(self) -> nn.Parameter:
        return self.experts.gate_up_proj_LIH

    @property
    def down_proj_LHI(self) -> nn.Parameter:
        return self.experts.down_proj_LHI

    @property
    def n_local(self) -> int:
        return self.num_experts // self.dispatcher.ep_size


def load_balancing_loss(router_logits_TE: torch.Tensor, idx_TK: torch.Tensor) -> torch.Tensor:
    """E * sum_e f_e * P_e: f_e the fraction of routed (token, k) slots that go to e, P_e the
    mean router probability of e. 1.0 when perfectly balanced."""
    e = router_logits_TE.shape[-1]
    probs_TE = torch.softmax(router_logits_TE.float(), dim=-1)
    valid = idx_TK >= 0
    f_E = torch.bincount(idx_TK[valid], minlength=e).float() / valid.sum().clamp_min(1)
    return e * (f_E * probs_TE.mean(0)).sum()


def sparse_blocks(model: nn.Module) -> list[tuple[nn.Module, str, nn.Module]]:
    """(parent, attribute, block) of every transformers MoE sparse block in `model`."""
    found = []
    for parent in model.modules():
        child = getattr(parent, "mlp", None) or getattr(parent, "block_sparse_moe", None)
        if (
            child is not None
            and hasattr(child, "experts")
            and hasattr(child.experts, "gate_up_proj")
        ):
            found.append(
                (
                    parent,
                    "mlp" if getattr(parent, "mlp", None) is child else "block_sparse_moe",
                    child,
                )
            )
    return found


def parallelize_experts(
    model: nn.Module, dispatcher, aux_loss_coef: float = 0.0
) -> list[EPMoEBlock]:
    """Swap every sparse MoE block of `model` for an EPMoEBlock holding this rank's experts."""
    blocks = []
    for parent, attr, block in sparse_blocks(model):
        ep_block = EPMoEBlock(block, dispatcher, aux_loss_coef)
        setattr(parent, attr, ep_block)
        blocks.append(ep_block)
    if not blocks:
        raise ValueError(
            "no MoE sparse blocks (with fused `experts.gate_up_proj`) found to parallelize"
        )
    return blocks


def gather_full_experts(ep_block: EPMoEBlock, group=None) -> tuple[torch.Tensor, torch.Tensor]:
    """The full [E, 2I, H] and [E, H, I] expert tensors, on every rank."""
    ws = dist.get_world_size(group) if dist.is_initialized() else 1
    parts = []
    for local in (ep_block.gate_up_proj_LIH, ep_block.down_proj_LHI):
        t = local.detach().contiguous()  # plain tensors: tests call this without FSDP
        if ws == 1:
            parts.append(t)
            continue
        bufs = [torch.empty_like(t) for _ in range(ws)]
        dist.all_gather(bufs, t, group=group)
        parts.append(torch.cat(bufs))
    return parts[0], parts[1]
