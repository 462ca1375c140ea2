"""Reference implementations the tests compare the product against: no stage runs them.

Legend (as in components/policy_update/loss.py and ep_moe.py): B batch, T tokens per row,
R rows received (one per (token, local expert) pair), H hidden, I expert intermediate,
L local experts, E experts.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch.nn import functional as F

from moerl.components.policy_update.ep_moe import EPMoEBlock, LocalExperts
from moerl.components.policy_update.loss import LossStats, importance_weights, policy_loss
from moerl.components.policy_update.trainer import load_state, save_state, train_on_batch
from moerl.config import RunConfig
from moerl.records import TrainSample, read_records

log = logging.getLogger(__name__)


def reference_policy_update(
    cfg: RunConfig,
    batch_path: str | Path,
    state_in: str | Path,
    state_out: str | Path,
    iteration: int,
) -> dict[str, float]:
    """The single-process update without a mesh (`train_on_batch`): the reference the mesh's
    equivalence tests compare against."""
    t0 = time.perf_counter()
    torch.manual_seed(cfg.trainer.seed + iteration)
    state_in, state_out = Path(state_in), Path(state_out)
    # 1. state
    model, opt, counters = load_state(state_in, cfg)
    batch = read_records(batch_path, TrainSample)
    # 2-4. train (an empty batch, every group dropped, still yields the next version unchanged)
    if batch:
        metrics = train_on_batch(
            model, opt, counters, batch, cfg, seed=cfg.trainer.seed + iteration
        )
    else:
        log.warning(
            "iteration %d: empty training batch (every group dropped); weights unchanged", iteration
        )
        metrics = {"train/steps": 0.0, "train/skipped_steps": 0.0}
    metrics["train/empty_batch"] = float(not batch)
    counters.version += 1
    # 5. save
    save_state(model, opt, counters, state_in, state_out, cfg.rollout.resolved.dtype)
    metrics["timing/policy_update_s"] = time.perf_counter() - t0
    return metrics


def grpo_token_loss(
    logp_BT: torch.Tensor,
    old_logp_BT: torch.Tensor,
    engine_logp_BT: torch.Tensor,
    adv_B: torch.Tensor,
    mask_BT: torch.Tensor,
    clip_eps_low: float,
    clip_eps_high: float,
    tis_cap: float,
    n_tokens: float | None = None,
    clip_ratio_c: float | None = None,
) -> tuple[torch.Tensor, LossStats]:
    """PPO with token-level truncated IS and token-mean aggregation (the default `policy_loss`).
    `n_tokens`: the normalizer; default the tokens in this minibatch. Expert-parallel ranks
    pass the token count of the whole (global) minibatch, so their losses sum to the loss.
    `clip_ratio_c`: the dual-clip bound for negative advantages (> 1); None = off."""
    w = importance_weights(old_logp_BT, engine_logp_BT, mask_BT, "token_truncate", tis_cap)
    loss, stats = policy_loss(
        logp_BT,
        old_logp_BT,
        w.w_BT,
        adv_B,
        mask_BT,
        clip_eps_low,
        clip_eps_high,
        n_tokens=n_tokens,
        clip_ratio_c=clip_ratio_c,
    )
    real = mask_BT.bool()
    denom = float(max(n_tokens, 1.0)) if n_tokens is not None else float(real.sum().clamp_min(1))
    truncated = w.truncated_fraction * float(real.sum().clamp_min(1)) / denom
    return loss, LossStats(
        stats.loss, stats.clip_fraction, truncated, stats.mean_ratio, stats.dual_clip_fraction
    )


def experts_loop(
    experts: LocalExperts, recv_RH: torch.Tensor, counts_L: torch.Tensor
) -> torch.Tensor:
    """The per-expert loop `LocalExperts.forward` replaces (its two grouped GEMMs)."""
    outs = []
    for e, rows_RH in enumerate(torch.split(recv_RH, counts_L.tolist())):
        gate, up = F.linear(rows_RH, experts.gate_up_proj_LIH[e]).chunk(2, dim=-1)
        outs.append(F.linear(experts.act_fn(gate) * up, experts.down_proj_LHI[e]))
    return torch.cat(outs) if outs else recv_RH[:0]


def gather_full_experts(ep_block: EPMoEBlock, group=None) -> tuple[torch.Tensor, torch.Tensor]:
    """The full [E, 2I, H] and [E, H, I] expert tensors of an expert-parallel block, on every
    rank (plain tensors: called without FSDP)."""
    ws = dist.get_world_size(group) if dist.is_initialized() else 1
    parts = []
    for local in (ep_block.gate_up_proj_LIH, ep_block.down_proj_LHI):
        t = local.detach().contiguous()
        if ws == 1:
            parts.append(t)
            continue
        bufs = [torch.empty_like(t) for _ in range(ws)]
        dist.all_gather(bufs, t, group=group)
        parts.append(torch.cat(bufs))
    return parts[0], parts[1]
