"""Expert-parallel GRPO policy update: the torchrun worker the policy_update task launches
when `trainer.expert_parallel_size` > 1.

    torchrun --nnodes 1 --nproc-per-node EP --master-addr 127.0.0.1 --master-port P \\
        -m moerl.components.policy_update.ep_train --config-json ... --batch ... \\
        --state-in ... --state-out ... --iteration I --metrics-out M

(or, with `trainer.launcher: local`, EP plain processes with RANK/WORLD_SIZE set and a file
store for the rendezvous).

Every rank reads the whole batch and the same seeded permutation; each minibatch is split
round-robin over ranks. Every rank holds the replicated weights (attention, router, norms,
embeddings) and its shard of the experts; tokens reach their experts through the dispatcher.
Losses are normalized by the token count of the whole minibatch, so the ranks' losses sum to
the EP = 1 loss, and replicated gradients are summed across ranks (all-reduce): one step with
EP = 2 gives the same loss and gradients as EP = 1 (tests/test_ep_trainer.py).

Steps: (1) process group and dispatcher; (2) load the state, swap in EP MoE blocks;
(3) pi_old for this rank's samples; (4) N steps (non-finite losses skipped on all ranks
together); (5) rank 0 gathers the experts and saves the standard HF checkpoint; every rank
saves its optimizer shard.

Limitations: resuming with a different expert_parallel_size than the optimizer shards were
written with fails (the Adam state of sharded experts does not reshard yet).
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import time
from pathlib import Path

import torch
import torch.distributed as dist

from moerl.config import RunConfig, config_from_json
from moerl.errors import TrainingError
from moerl.records import TrainSample, read_records
from moerl.components.policy_update.ep_moe import gather_full_experts, parallelize_experts, sparse_blocks
from moerl.components.policy_update.loss import grpo_token_loss
from moerl.components.policy_update.trainer import (TRAINER_DIR, Counters, _load_state, _save_state, pack,
                                                    sequence_logprobs)

log = logging.getLogger(__name__)


def optimizer_file(rank: int, world: int) -> str:
    return f"optimizer-ep{rank}-of-{world}.pt"


def setup(cfg: RunConfig, state_in: Path):
    """(model, opt, counters, ep_blocks, originals, dispatcher) on this rank."""
    from moerl.kernels import make_dispatcher

    rank, world = dist.get_rank(), dist.get_world_size()
    model, _, counters = _load_state(state_in, cfg)  # the optimizer is rebuilt over this rank's params below
    dispatcher = make_dispatcher(cfg.trainer.ep_backend, num_experts=_num_experts(model), group=dist.group.WORLD,
                                 ranks_per_node=cfg.trainer.ranks_per_node, allow_fallback=cfg.trainer.allow_fallback)
    originals = sparse_blocks(model)
    ep_blocks = parallelize_experts(model, dispatcher, cfg.trainer.aux_loss_coef)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.trainer.learning_rate, weight_decay=cfg.trainer.weight_decay)
    shard = state_in / TRAINER_DIR / optimizer_file(rank, world)
    if shard.is_file():
        opt.load_state_dict(torch.load(shard, weights_only=True))
    elif any((state_in / TRAINER_DIR).glob("optimizer*.pt")):
        raise TrainingError(f"policy_update: {state_in / TRAINER_DIR} holds optimizer state for another layout than "
                            f"expert_parallel_size={world}; resume with the expert_parallel_size it was written with")
    return model, opt, counters, ep_blocks, originals, dispatcher


def _num_experts(model) -> int:
    c = model.config
    return getattr(c, "num_experts", None) or c.num_local_experts


def _expert_param_ids(ep_blocks) -> set[int]:
    return {id(p) for b in ep_blocks for p in (b.gate_up_proj_LIH, b.down_proj_LHI)}


def _sync_and_clip(model, ep_blocks, max_norm: float) -> float:
    """All-reduce (sum) replicated grads; clip by the global norm over replicated + sharded."""
    expert_ids = _expert_param_ids(ep_blocks)
    replicated = [p for p in model.parameters() if p.grad is not None and id(p) not in expert_ids]
    experts = [p for p in model.parameters() if p.grad is not None and id(p) in expert_ids]
    for p in replicated:
        dist.all_reduce(p.grad)
    sq_rep = sum(float(p.grad.pow(2).sum()) for p in replicated)
    sq_exp = torch.tensor(sum(float(p.grad.pow(2).sum()) for p in experts), dtype=torch.float64)
    dist.all_reduce(sq_exp)
    norm = math.sqrt(sq_rep + float(sq_exp))
    if norm > max_norm:
        for p in replicated + experts:
            p.grad.mul_(max_norm / (norm + 1e-6))
    return norm


def train_ep(model, opt, counters: Counters, ep_blocks, batch: list[TrainSample], cfg: RunConfig,
             seed: int) -> dict[str, float]:
    tc, temperature = cfg.trainer, cfg.rollout.temperature
    rank, world = dist.get_rank(), dist.get_world_size()
    p = pack(batch, model.config.pad_token_id or 0)
    n = p.input_ids_NL.shape[0]
    perm = torch.randperm(n, generator=torch.Generator().manual_seed(seed))
    chunks = [c for c in perm.chunk(max(1, min(tc.optimizer_steps_per_iteration, n // world))) if len(c) >= world]
    mine = [c[rank::world] for c in chunks]
    # 3. pi_old for this rank's samples, before any step
    model.eval()
    old_logp = torch.zeros_like(p.engine_logp_NL1)
    with torch.no_grad():
        all_mine = torch.cat(mine)
        old_logp[all_mine] = sequence_logprobs(model, p, all_mine, temperature)[0]
    # 4. steps
    model.train()
    sums = torch.zeros(6, dtype=torch.float64)  # loss, clip, entropy, tis, tokens, steps
    skipped = 0
    for chunk, idx in zip(chunks, mine):
        n_tok = float(p.mask_NL1[chunk].sum())
        logp, entropy = sequence_logprobs(model, p, idx, temperature)
        loss, stats = grpo_token_loss(logp, old_logp[idx], p.engine_logp_NL1[idx], p.adv_N[idx], p.mask_NL1[idx],
                                      tc.clip_eps_low, tc.clip_eps_high, tc.tis_cap, n_tokens=n_tok)
        if tc.aux_loss_coef > 0:
            loss = loss + sum(b.aux_loss for b in ep_blocks if b.aux_loss is not None) / world
        finite = torch.tensor([1.0 if math.isfinite(float(loss)) else 0.0])
        dist.all_reduce(finite, op=dist.ReduceOp.MIN)  # skip on every rank or on none
        opt.zero_grad(set_to_none=True)
        if finite.item() < 1:
            skipped += 1
            counters.consecutive_skipped += 1
            counters.skipped_total += 1
            if counters.consecutive_skipped >= tc.max_consecutive_skipped_steps:
                raise TrainingError(f"policy_update: {counters.consecutive_skipped} optimizer steps in a row had a "
                                    f"non-finite loss (trainer.max_consecutive_skipped_steps="
                                    f"{tc.max_consecutive_skipped_steps})")
            continue
        loss.backward()
        _sync_and_clip(model, ep_blocks, tc.max_grad_norm)
        opt.step()
        counters.consecutive_skipped = 0
        counters.step += 1
        m = p.mask_NL1[idx]
        # stats are fractions of this rank's tokens: weight them back to token counts
        local_tok = float(m.sum())
        sums += torch.tensor([stats.loss, stats.clip_fraction * local_tok, float((entropy.detach() * m).sum()),
                              stats.tis_truncated_fraction * local_tok, local_tok, 1.0 / world], dtype=torch.float64)
    dist.all_reduce(sums)
    done = max(sums[5].item(), 1e-9)
    tok = max(sums[4].item(), 1.0)
    counts = torch.stack([b.tokens_per_expert_L.float() for b in ep_blocks if b.tokens_per_expert_L is not None])
    gathered = [torch.zeros_like(counts) for _ in range(world)]
    dist.all_gather(gathered, counts)
    per_expert = torch.cat(gathered, dim=1).sum(0)  # [E] over layers, last step
    return {
        "train/loss": sums[0].item() / done, "train/clip_fraction": sums[1].item() / tok,
        "train/entropy": sums[2].item() / tok, "train/tis_truncated_fraction": sums[3].item() / tok,
        "train/steps": round(done), "train/skipped_steps": float(skipped), "train/tokens": tok,
        "train/ep_size": float(world),
        "moe/expert_load_imbalance": float(per_expert.max() / per_expert.mean().clamp_min(1e-9)),
        **{f"moe/tokens_expert_{e}": float(c) for e, c in enumerate(per_expert.tolist())},
    }


def save_ep(model, opt, counters: Counters, ep_blocks, originals, state_in: Path, state_out: Path) -> None:
    rank, world = dist.get_rank(), dist.get_world_size()
    full = [gather_full_experts(b) for b in ep_blocks]  # collective: every rank takes part
    (state_out / TRAINER_DIR).mkdir(parents=True, exist_ok=True)
    torch.save(opt.state_dict(), state_out / TRAINER_DIR / optimizer_file(rank, world))
    if rank == 0:
        for (parent, attr, block), (gate_up, down) in zip(originals, full):
            with torch.no_grad():
                block.experts.gate_up_proj.copy_(gate_up)
                block.experts.down_proj.copy_(down)
            setattr(parent, attr, block)  # the router module is shared, so its trained weights are there
        _save_state(model, None, counters, state_in, state_out)
    dist.barrier()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser()
    for name in ("--config-json", "--batch", "--state-in", "--state-out", "--metrics-out"):
        ap.add_argument(name, required=True)
    ap.add_argument("--iteration", type=int, required=True)
    a = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format=f"[ep rank {os.environ.get('RANK', '?')}] %(message)s")
    cfg = config_from_json(Path(a.config_json).read_text())
    backend = "nccl" if cfg.trainer.device == "cuda" else "gloo"
    # env:// under torchrun; the local launcher passes a file store (no TCP rendezvous listener)
    init = os.environ.get("MOERL_INIT_METHOD", "env://")
    if init.startswith("file://"):
        dist.init_process_group(backend, init_method=init, rank=int(os.environ["RANK"]),
                                world_size=int(os.environ["WORLD_SIZE"]))
    else:
        dist.init_process_group(backend)
    t0 = time.perf_counter()
    try:
        torch.manual_seed(cfg.trainer.seed + a.iteration)
        model, opt, counters, ep_blocks, originals, dispatcher = setup(cfg, Path(a.state_in))
        batch = read_records(a.batch, TrainSample)
        metrics = train_ep(model, opt, counters, ep_blocks, batch, cfg, seed=cfg.trainer.seed + a.iteration) \
            if len(batch) >= dist.get_world_size() else {"train/steps": 0.0, "train/skipped_steps": 0.0}
        metrics["train/empty_batch"] = float(len(batch) < dist.get_world_size())
        counters.version += 1
        save_ep(model, opt, counters, ep_blocks, originals, Path(a.state_in), Path(a.state_out))
        if dist.get_rank() == 0:
            metrics["timing/policy_update_s"] = time.perf_counter() - t0
            fallback = getattr(dispatcher, "fallback_from", None)
            metrics["moe/ep_fallback"] = float(fallback is not None)
            Path(a.metrics_out).write_text(json.dumps({"metrics": metrics, "dispatcher": dispatcher.name,
                                                       "fallback_from": fallback}))
    finally:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
