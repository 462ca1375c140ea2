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

Steps: (1) process group and dispatcher; (2) build the model on `meta`, swap in EP MoE blocks,
and read only the replicated weights and this rank's experts from the files
(`ep_checkpoint.py`); (3) pi_old for this rank's samples; (4) N steps (non-finite losses
skipped on all ranks together); (5) rank 0 receives the experts one layer at a time and writes
the standard HF checkpoint; every rank saves its optimizer shard.

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
from dataclasses import asdict
from pathlib import Path

import torch
import torch.distributed as dist

from moerl.config import RunConfig, config_from_json
from moerl.errors import TrainingError
from moerl.records import TrainSample, read_records
from moerl.components.policy_update.ep_checkpoint import load_ep_model, save_ep_checkpoint
from moerl.components.policy_update.steps import (STAT_KEYS, accumulate, check_device, finish_step,
                                                  logprob_mismatch_sum, losses_are_finite, micro_parts, minibatches,
                                                  model_device, rows_per_micro_batch, sampled_logprobs)
from moerl.components.policy_update.trainer import TRAINER_DIR, Counters, pack

log = logging.getLogger(__name__)


def optimizer_file(rank: int, world: int) -> str:
    return f"optimizer-ep{rank}-of-{world}.pt"


def setup(cfg: RunConfig, state_in: Path):
    """(model, opt, counters, ep_blocks, layout, dispatcher) on this rank. The model holds the
    replicated weights and only this rank's experts, read from the checkpoint files
    (`ep_checkpoint.load_ep_model`); `layout` says where each tensor came from, for saving."""
    from transformers import AutoConfig

    from moerl.kernels import make_dispatcher

    rank, world = dist.get_rank(), dist.get_world_size()
    dispatcher = make_dispatcher(cfg.trainer.ep_backend, num_experts=_num_experts(AutoConfig.from_pretrained(state_in)),
                                 group=dist.group.WORLD, ranks_per_node=cfg.trainer.ranks_per_node,
                                 allow_fallback=cfg.trainer.allow_fallback,
                                 deepep_options=cfg.trainer.deepep_options or None)
    model, ep_blocks, layout = load_ep_model(state_in, dispatcher, getattr(torch, cfg.model.dtype), cfg.trainer.device,
                                             cfg.trainer.aux_loss_coef)
    state = state_in / TRAINER_DIR / "state.json"
    counters = Counters(**json.loads(state.read_text())) if state.is_file() else Counters()
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.trainer.learning_rate, weight_decay=cfg.trainer.weight_decay)
    shard = state_in / TRAINER_DIR / optimizer_file(rank, world)
    if shard.is_file():
        opt.load_state_dict(torch.load(shard, weights_only=True, map_location=cfg.trainer.device))
    elif any((state_in / TRAINER_DIR).glob("optimizer*.pt")):
        raise TrainingError(f"policy_update: {state_in / TRAINER_DIR} holds optimizer state for another layout than "
                            f"expert_parallel_size={world}; resume with the expert_parallel_size it was written with")
    return model, opt, counters, ep_blocks, layout, dispatcher


def _num_experts(c) -> int:
    """Experts per MoE layer, from a model config (Qwen3-MoE or Mixtral naming)."""
    return getattr(c, "num_experts", None) or c.num_local_experts


def _expert_param_ids(ep_blocks) -> set[int]:
    return {id(p) for b in ep_blocks for p in (b.gate_up_proj_LIH, b.down_proj_LHI)}


def _sync_and_clip(model, ep_blocks, max_norm: float) -> float:
    """All-reduce (sum) replicated grads; clip by the global norm over replicated + sharded.
    The norm is the same on every rank, so a non-finite one (returned as is, nothing scaled)
    makes every rank skip the step together."""
    device = model_device(model)
    expert_ids = _expert_param_ids(ep_blocks)
    replicated = [p for p in model.parameters() if p.grad is not None and id(p) not in expert_ids]
    experts = [p for p in model.parameters() if p.grad is not None and id(p) in expert_ids]
    for p in replicated:
        check_device("all_reduce", device, grad=p.grad)
        dist.all_reduce(p.grad)
    sq_rep = sum(float(p.grad.double().pow(2).sum()) for p in replicated)
    sq_exp = torch.tensor(sum(float(p.grad.double().pow(2).sum()) for p in experts), dtype=torch.float64,
                          device=device)
    dist.all_reduce(sq_exp)
    norm = math.sqrt(sq_rep + float(sq_exp))  # nan stays nan; `norm > max_norm` alone is False for nan
    if math.isfinite(norm) and norm > max_norm:
        for p in replicated + experts:
            p.grad.mul_(max_norm / (norm + 1e-6))
    return norm


def train_ep(model, opt, counters: Counters, ep_blocks, batch: list[TrainSample], cfg: RunConfig,
             seed: int) -> dict[str, float]:
    """The single-process step (`trainer.train_on_batch`), expert parallel: same minibatches,
    micro-batches, loss normalization, skip rule and metric names. Every tensor handed to a
    collective lives on the model's device (NCCL takes no CPU tensors)."""
    tc = cfg.trainer
    rank, world = dist.get_rank(), dist.get_world_size()
    device = model_device(model)
    p = pack(batch, model.config.pad_token_id or 0, device)
    n = p.input_ids_NL.shape[0]
    chunks = minibatches(n, tc.optimizer_steps_per_iteration, seed, world, device)
    rows_per = rows_per_micro_batch(p, tc.micro_batch_tokens, math.ceil(max(map(len, chunks), default=1) / world))
    parts = [micro_parts(c, rank, world, rows_per) for c in chunks]
    # 3. pi_old for this rank's rows, before any step (same micro-batches on every rank: the
    # forward goes through the dispatcher's collectives)
    model.eval()
    old_logp = torch.zeros_like(p.engine_logp_NL1)
    with torch.no_grad():
        for idx, _ in (part for ps in parts for part in ps):
            old_logp[idx] = sampled_logprobs(model, p, idx, cfg)[0]
    mine = torch.cat([c[rank::world] for c in chunks]) if chunks else torch.zeros(0, dtype=torch.long, device=device)
    mismatch = logprob_mismatch_sum(old_logp[mine], p.engine_logp_NL1[mine], p.mask_NL1[mine])
    # 4. steps
    model.train()
    aux_fn = (lambda: sum(b.aux_loss for b in ep_blocks if b.aux_loss is not None)) if tc.aux_loss_coef > 0 else None
    sums = dict.fromkeys((*STAT_KEYS, "grad_norm"), 0.0)  # this rank's shares of every step's statistics
    done = skipped = 0
    for chunk, my_parts in zip(chunks, parts):
        opt.zero_grad(set_to_none=True)
        stats = accumulate(model, p, my_parts, old_logp, cfg, float(p.mask_NL1[chunk].sum()), len(chunk), aux_fn)
        finite = torch.tensor([float(losses_are_finite(stats))], device=device)
        dist.all_reduce(finite, op=dist.ReduceOp.MIN)  # every rank skips, or none
        grad_norm = _sync_and_clip(model, ep_blocks, tc.max_grad_norm)
        # the global norm is identical on every rank: each adds 1/world of it
        if finish_step(opt, counters, cfg, stats, sums, grad_norm, finite.item() == 1, norm_share=1.0 / world):
            done += 1
        else:
            skipped += 1
    totals = torch.tensor([*sums.values(), mismatch, float(p.mask_NL1[mine].sum())], dtype=torch.float64,
                          device=device)
    dist.all_reduce(totals)
    named = dict(zip(sums, totals.tolist()))
    mismatch_sum, tokens = totals[-2].item(), totals[-1].item()
    counts = torch.stack([b.tokens_per_expert_L.float() for b in ep_blocks if b.tokens_per_expert_L is not None])
    gathered = [torch.zeros_like(counts) for _ in range(world)]
    dist.all_gather(gathered, counts)
    per_expert = torch.cat(gathered, dim=1).sum(0)  # [E] over layers, last step
    return {
        **{f"train/{k}": v / max(done, 1) for k, v in named.items()},
        "train/steps": float(done), "train/skipped_steps": float(skipped), "train/tokens": tokens,
        "train/logprob_mismatch": mismatch_sum / max(tokens, 1.0), "train/ep_size": float(world),
        "moe/expert_load_imbalance": float(per_expert.max() / per_expert.mean().clamp_min(1e-9)),
        **{f"moe/tokens_expert_{e}": float(c) for e, c in enumerate(per_expert.tolist())},
    }


def save_ep(model, opt, counters: Counters, ep_blocks, layout, state_in: Path, state_out: Path) -> None:
    """Every rank saves its optimizer shard; rank 0 writes the standard HF checkpoint, receiving
    the experts one layer at a time (a collective: every rank takes part) and the counters."""
    rank, world = dist.get_rank(), dist.get_world_size()
    (state_out / TRAINER_DIR).mkdir(parents=True, exist_ok=True)
    torch.save(opt.state_dict(), state_out / TRAINER_DIR / optimizer_file(rank, world))
    save_ep_checkpoint(model, ep_blocks, layout, state_in, state_out)
    if rank == 0:
        (state_out / TRAINER_DIR / "state.json").write_text(json.dumps(asdict(counters)))
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
    if cfg.trainer.device == "cuda":  # before the process group: NCCL binds each rank to its current device
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
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
        model, opt, counters, ep_blocks, layout, dispatcher = setup(cfg, Path(a.state_in))
        batch = read_records(a.batch, TrainSample)
        metrics = train_ep(model, opt, counters, ep_blocks, batch, cfg, seed=cfg.trainer.seed + a.iteration) \
            if len(batch) >= dist.get_world_size() else {"train/steps": 0.0, "train/skipped_steps": 0.0}
        metrics["train/empty_batch"] = float(len(batch) < dist.get_world_size())
        counters.version += 1
        save_ep(model, opt, counters, ep_blocks, layout, Path(a.state_in), Path(a.state_out))
        if dist.get_rank() == 0:
            metrics["timing/policy_update_s"] = time.perf_counter() - t0
            fallback = getattr(dispatcher, "fallback_from", None)
            metrics["moe/ep_fallback"] = float(fallback is not None)
            described = dispatcher.describe() if hasattr(dispatcher, "describe") else dispatcher.name
            Path(a.metrics_out).write_text(json.dumps({"metrics": metrics, "dispatcher": described,
                                                       "fallback_from": fallback}))
    finally:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
