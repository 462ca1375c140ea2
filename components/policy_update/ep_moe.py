"""The expert-parallel MoE block: replaces transformers' sparse MoE block in the trainer, with
the routed experts sharded over the EP group and tokens moved by a `Dispatcher`. Design:
docs/expert-parallel.md, "The expert-parallel block"; what each family holds:
moerl/models/README.md.

Legend: B batch, S sequence, T = B*S tokens, H hidden, I expert intermediate, K top-k,
E experts, L = E / ep local experts, R rows received (one per (token, local expert) pair).
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

from moerl.models.families import Family, family_of


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


class EPMoEBlock(nn.Module):
    def __init__(
        self, block: nn.Module, dispatcher, family: Family, aux_loss_coef: float = 0.0
    ) -> None:
        super().__init__()
        experts = _module(block, "experts")
        gate_up, down = _tensor(experts, "gate_up_proj"), _tensor(experts, "down_proj")
        router = _module(block, "gate")
        e, ep, r = dispatcher.num_experts, dispatcher.ep_size, dispatcher.ep_rank
        if gate_up.shape[0] != e or e % ep:
            raise ValueError(f"{e} experts cannot be sharded over {ep} ranks")
        n_local = e // ep
        lo = r * n_local
        # what the block may hold: its router, routed experts and the family's shared experts
        kept = family.block_parts
        dropped = sorted(
            {n.split(".")[0] for n, _ in block.named_parameters() if n.split(".")[0] not in kept}
        )
        if dropped:  # a part this block would lose: refused, never dropped
            raise ValueError(
                f"the MoE block {type(block).__name__} holds {', '.join(dropped)} besides its router, "
                "experts and shared experts; the expert-parallel block would drop them, so this model "
                "family cannot train on the mesh yet"
            )
        # shared experts run on every token of this rank, dense (FSDP shards them with the layer),
        # scaled by the sigmoid of their gate where the family has one; kept under the family's
        # own names, so checkpoint keys and parameter names stay the same
        self._shared = family.shared_experts
        self._shared_gate = family.shared_expert_gate
        for n in filter(None, (self._shared, self._shared_gate)):
            self.add_module(n, _module(block, n))
        self.gate = router  # the router, replicated
        self.top_k = getattr(router, "top_k", None)
        self.num_experts, self.first_expert = e, lo  # this rank owns experts [lo, lo + n_local)
        # on `meta` the slices are shape-only placeholders: the loader replaces them
        self.experts = LocalExperts(
            gate_up.detach()[lo : lo + n_local].clone(),
            down.detach()[lo : lo + n_local].clone(),
            experts.act_fn,
        )
        self.dispatcher = dispatcher
        if aux_loss_coef > 0 and family.router_bias is not None:
            raise ValueError(
                "trainer.moe.aux_loss_coef > 0: moerl's load-balancing loss is the softmax-router form, and "
                f"{type(router).__name__} is a sigmoid router balanced by its bias correction; set "
                "trainer.moe.aux_loss_coef 0 for this family (trainer.moe.router_bias_update_rate moves that "
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


def _module(parent: nn.Module, name: str) -> nn.Module:
    child = getattr(parent, name)
    if not isinstance(child, nn.Module):
        raise ValueError(f"{type(parent).__name__}.{name} is not a module")
    return child


def _tensor(parent: nn.Module, name: str) -> torch.Tensor:
    t = getattr(parent, name)
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{type(parent).__name__}.{name} is not a tensor")
    return t


def sparse_blocks(model: nn.Module) -> list[tuple[nn.Module, str, nn.Module]]:
    """(parent, attribute, block) of every transformers MoE sparse block in `model` (under the
    attribute its family names, `Family.moe_block`)."""
    attr = family_of(model).moe_block
    found = []
    for parent in model.modules():
        child = getattr(parent, attr, None)
        if (
            isinstance(child, nn.Module)
            and hasattr(child, "experts")
            and hasattr(child.experts, "gate_up_proj")
        ):
            found.append((parent, attr, child))
    return found


def parallelize_experts(
    model: nn.Module, dispatcher, aux_loss_coef: float = 0.0
) -> list[EPMoEBlock]:
    """Swap every sparse MoE block of `model` for an EPMoEBlock holding this rank's experts."""
    family = family_of(model)
    blocks = []
    for parent, attr, block in sparse_blocks(model):
        ep_block = EPMoEBlock(block, dispatcher, family, aux_loss_coef)
        setattr(parent, attr, ep_block)
        blocks.append(ep_block)
    if not blocks:
        raise ValueError(
            "no MoE sparse blocks (with fused `experts.gate_up_proj`) found to parallelize"
        )
    return blocks
