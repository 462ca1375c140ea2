"""The policy update on the trainer's mesh, the trainer's one code path: one process per rank
when the mesh has more than one (`launcher.py` builds the torchrun or local command), or the
calling process as a one-rank mesh (`one_rank`). The mesh, FSDP2 and expert parallelism:
docs/expert-parallel.md; the launch: docs/async.md, `components/policy_update/launcher.py`.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from moerl.components.policy_update.ep_checkpoint import load_ep_model
from moerl.components.policy_update.ep_optimizer import (
    MODEL_DCP,
    OPTIMIZER_DCP,
    load_model_state,
    load_optimizer,
    load_unsharded_optimizer,
    save_model_state,
    save_optimizer,
)
from moerl.components.policy_update.ep_optimizer import local as _local
from moerl.components.policy_update.steps import (
    STAT_KEYS,
    RouterBias,
    Routing,
    accumulate,
    check_device,
    finish_step,
    logprob_mismatch_sum,
    losses_are_finite,
    micro_parts,
    minibatches,
    model_device,
    optimizer_steps,
    prepare_correction,
    rows_per_micro_batch,
    sampled_logprobs,
)
from moerl.components.policy_update.trainer import (
    TRAINER_DIR,
    Counters,
    pack,
    weights_dir,
)
from moerl.config import RunConfig, config_from_json
from moerl.errors import TrainingError
from moerl.models.families import family_of
from moerl.records import TrainSample, read_records

log = logging.getLogger(__name__)


def build_mesh(cfg: RunConfig):
    """The trainer's device mesh over every rank: (dp, ep) = (`trainer.parallelism.data_parallel_shard`,
    `trainer.parallelism.expert_parallel_size`), ranks laid out ep-fastest so that an EP group is
    consecutive ranks (one node's GPUs on the cluster). The
    same ranks as one dimension, the one the dense weights are sharded on (`flat_mesh`)."""
    from torch.distributed.device_mesh import init_device_mesh

    dp, ep = (
        cfg.trainer.parallelism.data_parallel_shard,
        cfg.trainer.parallelism.expert_parallel_size,
    )
    world = dist.get_world_size()
    if dp * ep != world:
        raise TrainingError(
            f"policy_update: {world} ranks cannot form the mesh trainer.parallelism.data_parallel_shard ({dp}) "
            f"x trainer.parallelism.expert_parallel_size ({ep})"
        )
    return init_device_mesh(
        "cuda" if cfg.trainer.parallelism.device == "cuda" else "cpu",
        (dp, ep),
        mesh_dim_names=("dp", "ep"),
    )


def flat_mesh(mesh):
    """Every rank of the (dp, ep) mesh as one dimension (made once, then reused)."""
    return mesh["dp", "ep"]._flatten("dp_ep")


def apply_fsdp(
    model, ep_blocks, mesh, mixed_precision: str = "off", activation_checkpointing: bool = False
) -> list:
    """FSDP2 on the mesh, torchtitan's MoE layout: each MoE layer's local experts sharded on
    the `dp` dimension (the ranks that hold the same experts), every decoder layer's dense
    weights and then the rest (embeddings, final norm, lm_head) on all ranks (`flat`).
    Gradients are summed, never averaged: every rank's loss is already divided by the global
    token count (gloo has no pre-multiplied sum, so the division is ours). Returns the FSDP
    modules, innermost first.

    `mixed_precision` bf16: parameters are all-gathered and computed in bf16 while the sharded
    master weights (what Adam updates) stay float32 and gradients are reduced in float32.
    `activation_checkpointing`: each decoder layer recomputes its activations in the backward
    (transformers' own non-reentrant checkpointing, so parameter names do not change)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    if activation_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    mp = (
        MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        if mixed_precision == "bf16"
        else MixedPrecisionPolicy()
    )
    flat = flat_mesh(mesh)
    units = [fully_shard(b.experts, mesh=mesh["dp"], mp_policy=mp) for b in ep_blocks]
    layers = getattr(getattr(model, "model", None), "layers", None)
    if layers is None:
        raise TrainingError(f"policy_update: {type(model).__name__} has no model.layers to shard")
    units += [fully_shard(layer, mesh=flat, mp_policy=mp) for layer in layers]
    units.append(fully_shard(model, mesh=flat, mp_policy=mp))
    for u in units:
        u.set_force_sum_reduction_for_comms(True)
        u.set_gradient_divide_factor(1.0)
    return units


def setup(
    cfg: RunConfig,
    state_in: Path,
    shard: bool = True,
    fetch: Callable[[str], None] | None = None,
):
    """(model, opt, counters, ep_blocks, layout, dispatcher, mesh) on this rank. The model is
    sharded by FSDP2 on the mesh while on `meta` (`apply_fsdp`), and each rank reads only its
    rows of each tensor from the checkpoint files (`ep_checkpoint.load_ep_model`); with `shard`
    False it holds the dense weights whole and this rank's experts, unsharded (tests of the
    loader); `layout` says where each tensor
    came from, for saving. The optimizer state comes from `trainer/optimizer/` (a Distributed
    Checkpoint, resharded onto this mesh whatever mesh wrote it)."""
    from transformers import AutoConfig

    from moerl.kernels import make_dispatcher

    mesh = build_mesh(cfg)
    dispatcher = make_dispatcher(
        cfg.trainer.parallelism.ep_backend,
        num_experts=_num_experts(AutoConfig.from_pretrained(state_in)),
        group=mesh.get_group("ep"),
        ranks_per_node=cfg.trainer.parallelism.ranks_per_node,
        allow_fallback=cfg.trainer.parallelism.allow_fallback,
        deepep_options=cfg.trainer.parallelism.deepep_options or None,
    )
    tc = cfg.trainer
    # sharded on meta, then each rank reads only its rows
    fsdp = (
        (
            lambda m, blocks: apply_fsdp(
                m,
                blocks,
                mesh,
                tc.parallelism.mixed_precision,
                tc.parallelism.activation_checkpointing,
            )
        )
        if shard
        else None
    )
    model, ep_blocks, layout = load_ep_model(
        weights_dir(state_in),
        dispatcher,
        getattr(torch, cfg.model.dtype),
        tc.parallelism.device,
        tc.moe.aux_loss_coef,
        shard=fsdp,
    )
    tdir = state_in / TRAINER_DIR
    if (tdir / MODEL_DCP).is_dir():  # the master weights as a mesh wrote them, each rank its shard
        if not shard:
            raise TrainingError("policy_update: the sharded master weights need the FSDP model")
        load_model_state(model, ep_blocks, mesh, tdir / MODEL_DCP, _under(fetch, MODEL_DCP))
    counters = (
        Counters(**json.loads((tdir / "state.json").read_text()))
        if (tdir / "state.json").is_file()
        else Counters()
    )
    _check_has_state(tdir, counters)
    opt = torch.optim.AdamW(
        model.parameters(),
        lr=cfg.trainer.optimizer.learning_rate,
        weight_decay=cfg.trainer.optimizer.weight_decay,
    )
    if (tdir / OPTIMIZER_DCP).is_dir():
        if not shard:
            raise TrainingError("policy_update: the sharded optimizer state needs the FSDP model")
        load_optimizer(
            model, opt, ep_blocks, mesh, tdir / OPTIMIZER_DCP, _under(fetch, OPTIMIZER_DCP)
        )
    elif (
        tdir / "optimizer.pt"
    ).is_file():  # the single-process trainer's: resharded onto this mesh
        if not shard:
            raise TrainingError("policy_update: the optimizer state needs the FSDP model")
        load_unsharded_optimizer(model, opt, ep_blocks, tdir / "optimizer.pt", state_in)
    return model, opt, counters, ep_blocks, layout, dispatcher, mesh


def _check_has_state(tdir: Path, counters: Counters) -> None:
    """A trained version without Adam's state (written with `checkpoint.state_every` > 1) would
    continue from fresh moments and, served in bf16, rounded weights: refused, naming it."""
    if counters.version > 0 and not (
        (tdir / OPTIMIZER_DCP).is_dir() or (tdir / "optimizer.pt").is_file()
    ):
        raise TrainingError(
            f"policy_update: version {counters.version} ({tdir.parent}) carries no trainer state "
            "(written with checkpoint.state_every > 1); continue from the newest version with "
            "state, as the async trainer's persistent mesh does"
        )


def _under(fetch: Callable[[str], None] | None, dcp_dir: str) -> Callable[[str], None] | None:
    """`fetch` of a version's file, as a Distributed Checkpoint reader under
    `trainer/<dcp_dir>/` asks for one (its path in that folder)."""
    if fetch is None:
        return None
    f = fetch
    return lambda rel: f(f"{TRAINER_DIR}/{dcp_dir}/{rel}")


def _num_experts(c) -> int:
    """Experts per MoE layer, from a model config (the field its family names)."""
    return family_of(c).num_experts(c)


def _expert_param_ids(ep_blocks) -> set[int]:
    return {id(p) for b in ep_blocks for p in (b.gate_up_proj_LIH, b.down_proj_LHI)}


def _sync_and_clip(model, ep_blocks, max_norm: float) -> float:
    """Clip by the global norm over every gradient. Under FSDP each gradient element lives on
    exactly one rank (dense shards over all ranks, expert shards over the dp ranks of their EP
    group), so one sum of squares over all ranks is the global norm. Without FSDP (tests of
    the dispatcher alone) the replicated gradients are all-reduced here first. The norm is the
    same on every rank, so a non-finite one (returned as is, nothing scaled) makes every rank
    skip the step together."""
    device = model_device(model)
    params = [p for p in model.parameters() if p.grad is not None]
    if any(hasattr(p.grad, "to_local") for p in params):
        sq = torch.tensor(
            sum(float(_local(p.grad).double().pow(2).sum()) for p in params),
            dtype=torch.float64,
            device=device,
        )
        dist.all_reduce(sq)
        norm = math.sqrt(float(sq))
    else:
        expert_ids = _expert_param_ids(ep_blocks)
        replicated = [p for p in params if id(p) not in expert_ids]
        for p in replicated:
            check_device("all_reduce", device, grad=p.grad)
            dist.all_reduce(p.grad)
        sq_rep = sum(float(p.grad.double().pow(2).sum()) for p in replicated)
        sq = torch.tensor(
            sum(float(p.grad.double().pow(2).sum()) for p in params if id(p) in expert_ids),
            dtype=torch.float64,
            device=device,
        )
        dist.all_reduce(sq)
        norm = math.sqrt(sq_rep + float(sq))
    # nan stays nan; `norm > max_norm` alone is False for nan
    if math.isfinite(norm) and norm > max_norm:
        for p in params:
            p.grad.mul_(max_norm / (norm + 1e-6))
    return norm


def train_ep(
    model,
    opt,
    counters: Counters,
    ep_blocks,
    batch: list[TrainSample],
    cfg: RunConfig,
    seed: int,
    pi_old: str | None = None,
) -> dict[str, float]:
    """The single-process step (`trainer.train_on_batch`), expert parallel: same minibatches,
    micro-batches, loss normalization, skip rule and metric names. Every tensor handed to a
    collective lives on the model's device (NCCL takes no CPU tensors).

    `pi_old` (`trainer.schedule.stream`): `batch` is one minibatch of a version, trained in one step,
    against "engine": the engine's logprobs (it served the weights this version's steps start
    from; no pi_old pass), or "proximal": the pass under the weights as they are before this
    step. None: the whole batch, its pi_old pass before any step."""
    tc = cfg.trainer
    rank, world = dist.get_rank(), dist.get_world_size()
    device = model_device(model)
    p = pack(batch, model.config.pad_token_id or 0, device)
    n = p.input_ids_NL.shape[0]
    streamed = pi_old is not None
    chunks = minibatches(n, 1 if streamed else optimizer_steps(cfg, n), seed, world, device)
    rows_per = rows_per_micro_batch(
        p, tc.parallelism.micro_batch_tokens, math.ceil(max(map(len, chunks), default=1) / world)
    )
    parts = [micro_parts(c, rank, world, rows_per) for c in chunks]
    # 3. pi_old for this rank's rows, before any step (same micro-batches on every rank: the
    # forward goes through the dispatcher's collectives)
    model.eval()
    engine_old = pi_old == "engine"
    old_logp = p.engine_logp_NL1.clone() if engine_old else torch.zeros_like(p.engine_logp_NL1)
    # every rank builds the same hooks (the same routers), so collectives stay in step
    routing = Routing.for_batch(model, p, tc.moe.router_replay)
    bias = None
    try:
        with torch.no_grad():
            for idx, padding in (part for ps in parts for part in ps if not engine_old):
                with Routing.old_pass(routing, p, idx, counted=not padding):
                    old_logp[idx] = sampled_logprobs(model, p, idx, cfg)[0]
        mine = (
            torch.cat([c[rank::world] for c in chunks])
            if chunks
            else torch.zeros(0, dtype=torch.long, device=device)
        )
        mismatch = logprob_mismatch_sum(old_logp[mine], p.engine_logp_NL1[mine], p.mask_NL1[mine])
        tokens_before = float(p.mask_NL1[mine].sum())
        # the engine/trainer mismatch over every rank's rows; rejection applied alike on every rank
        p, corr = prepare_correction(
            p, old_logp, cfg, counters.version, rows=mine, distributed=True
        )
        if routing is not None and not engine_old:  # read after a pi_old pass, before steps
            corr.update(routing.metrics(distributed=True))
        # 4. steps
        bias = (
            RouterBias(model, tc.moe.router_bias_update_rate)
            if tc.moe.router_bias_update_rate > 0
            else None
        )
        steps = _ep_steps(
            model, opt, counters, ep_blocks, p, chunks, parts, old_logp, cfg, routing, bias
        )
    finally:
        for hooks in (bias, routing):
            if hooks is not None:
                hooks.close()
    return _ep_metrics(cfg, ep_blocks, steps, mismatch, tokens_before, corr, device)


@dataclass
class _EpSteps:
    """A version's optimizer steps on this rank (`_ep_steps`): its shares of every step's
    statistics, the steps taken and skipped, and the router bias's last balance metrics."""

    sums: dict[str, float]
    done: int = 0
    skipped: int = 0
    balance: dict[str, float] = field(default_factory=dict)


def _ep_steps(
    model,
    opt,
    counters: Counters,
    ep_blocks,
    p,
    chunks,
    parts,
    old_logp,
    cfg: RunConfig,
    routing,
    bias,
) -> _EpSteps:
    """One optimizer step per minibatch (`chunks`, this rank's micro-batches `parts`), every
    rank skipping a step with a non-finite loss or gradient together."""
    tc, world, device = cfg.trainer, dist.get_world_size(), model_device(model)
    model.train()
    aux_fn = (
        (lambda: sum(b.aux_loss for b in ep_blocks if b.aux_loss is not None))
        if tc.moe.aux_loss_coef > 0
        else None
    )
    out = _EpSteps(sums=dict.fromkeys((*STAT_KEYS, "grad_norm"), 0.0))
    for chunk, my_parts in zip(chunks, parts):
        opt.zero_grad(set_to_none=True)
        stats = accumulate(
            model,
            p,
            my_parts,
            old_logp,
            cfg,
            float(p.mask_NL1[chunk].sum()),
            len(chunk),
            aux_fn,
            n_seqs=float((p.mask_NL1[chunk].sum(-1) > 0).sum()),
            routing=routing,
        )
        finite = torch.tensor([float(losses_are_finite(stats))], device=device)
        dist.all_reduce(finite, op=dist.ReduceOp.MIN)  # every rank skips, or none
        grad_norm = _sync_and_clip(model, ep_blocks, tc.optimizer.max_grad_norm)
        # the global norm is identical on every rank: each adds 1/world of it
        if finish_step(
            opt,
            counters,
            cfg,
            stats,
            out.sums,
            grad_norm,
            finite.item() == 1,
            norm_share=1.0 / world,
        ):
            out.done += 1
            # every rank's copy of the bias moves the same way: loads summed over all ranks
            out.balance = bias.step(sum_over_ranks=True) if bias is not None else out.balance
        else:
            out.skipped += 1
            if bias is not None:
                bias.reset()
    return out


def _ep_metrics(
    cfg: RunConfig,
    ep_blocks,
    steps: _EpSteps,
    mismatch: float,
    tokens_before: float,
    corr: dict[str, float],
    device,
) -> dict[str, float]:
    """The version's metrics, summed over every rank: the steps' statistics, the engine/trainer
    mismatch, and the tokens each expert received in the last step."""
    totals = torch.tensor(
        [*steps.sums.values(), mismatch, tokens_before], dtype=torch.float64, device=device
    )
    dist.all_reduce(totals)
    named = dict(zip(steps.sums, totals.tolist()))
    mismatch_sum, tokens = totals[-2].item(), totals[-1].item()
    # tokens per expert over layers, last step: each rank fills its experts' slots with what
    # it received; summed over all ranks (its dp peers hold the same experts, other tokens)
    per_expert = torch.zeros(ep_blocks[0].num_experts, dtype=torch.float64, device=device)
    for b in ep_blocks:
        if b.tokens_per_expert_L is not None:
            per_expert[b.first_expert : b.first_expert + b.n_local] += b.tokens_per_expert_L.to(
                per_expert
            )
    dist.all_reduce(per_expert)
    return {
        **{f"train/{k}": v / max(steps.done, 1) for k, v in named.items()},
        "train/steps": float(steps.done),
        "train/skipped_steps": float(steps.skipped),
        "train/tokens": tokens,
        "train/logprob_mismatch": mismatch_sum / max(tokens, 1.0),
        "train/ep_size": float(cfg.trainer.parallelism.expert_parallel_size),
        "train/dp_shard": float(cfg.trainer.parallelism.data_parallel_shard),
        **steps.balance,
        **corr,
        "moe/expert_load_imbalance": float(per_expert.max() / per_expert.mean().clamp_min(1e-9)),
        **{f"moe/tokens_expert_{e}": float(c) for e, c in enumerate(per_expert.tolist())},
    }


def save_ep(
    model,
    opt,
    counters: Counters,
    ep_blocks,
    layout,
    mesh,
    state_in: Path,
    state_out: Path,
    serving_dtype: str | None = None,
    with_state: bool = True,
) -> dict[str, float]:
    """One version's files, every rank writing its own part in parallel, nothing gathered to
    one rank: the engines' HF checkpoint in `serving_dtype` (`ep_export.export_ep_checkpoint`),
    then, `with_state`, the float32 master weights and Adam's state through Distributed
    Checkpoint (`trainer/model/`, `trainer/optimizer/`: each rank its shard, loadable on any
    mesh), and rank 0 the counters. Returns this rank's export statistics as metrics."""
    from moerl.components.policy_update.ep_export import export_ep_checkpoint

    tdir = state_out / TRAINER_DIR
    tdir.mkdir(parents=True, exist_ok=True)
    master = next(model.parameters()).dtype
    serving = getattr(torch, serving_dtype) if serving_dtype else master
    t0 = time.perf_counter()
    stats = export_ep_checkpoint(model, ep_blocks, layout, state_in, state_out, mesh, dtype=serving)
    t_export = time.perf_counter()
    if with_state:
        save_model_state(model, ep_blocks, mesh, tdir / MODEL_DCP)
        save_optimizer(model, opt, ep_blocks, mesh, tdir / OPTIMIZER_DCP)
    if dist.get_rank() == 0:
        (tdir / "state.json").write_text(json.dumps(asdict(counters)))
    dist.barrier()
    return {
        "timing/trainer_export_s": t_export - t0,
        "timing/trainer_state_save_s": time.perf_counter() - t_export,
        # the busiest rank's share: what bounds the export's time
        "weights/export_max_rank_mb": max(stats.bytes_written) / 1e6,
        "weights/export_max_rank_received_mb": max(stats.bytes_received) / 1e6,
        "weights/export_mb": stats.total_bytes / 1e6,
        "weights/export_writers": float(sum(1 for f in stats.files if f)),
    }


def _synced_clock(cfg: RunConfig) -> float:
    """perf_counter once the GPU's queued work is done (CUDA kernels run asynchronously)."""
    if cfg.trainer.parallelism.device == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter()


@dataclass
class Session:
    """One rank's share of the trainer: what `setup` built, and the folder it loaded (whose
    tokenizer and other files every version's export carries along)."""

    model: Any
    opt: Any
    counters: Counters
    ep_blocks: list
    layout: Any
    dispatcher: Any
    mesh: Any
    state_in: Path

    @classmethod
    def load(
        cls, cfg: RunConfig, state_in: Path, fetch: Callable[[str], None] | None = None
    ) -> Session:
        """`fetch`: the state's shards are not in `state_in`; `fetch(path)` puts a version's file
        there (each rank asks only for those it reads)."""
        model, opt, counters, ep_blocks, layout, dispatcher, mesh = setup(
            cfg, state_in, fetch=fetch
        )
        return cls(model, opt, counters, ep_blocks, layout, dispatcher, mesh, state_in)

    def describe_dispatcher(self) -> tuple[Any, str | None]:
        fallback = getattr(self.dispatcher, "fallback_from", None)
        d = self.dispatcher
        return (d.describe() if hasattr(d, "describe") else d.name), fallback


def join_process_group(cfg: RunConfig) -> None:
    """This rank into the trainer's process group: NCCL on cuda (each rank bound to its local
    device first), gloo on cpu; env:// under torchrun, the local launcher's file store otherwise.
    Every collective is bounded by `trainer.parallelism.collective_timeout_s`: a dead or hung
    rank fails the others instead of blocking them for ever."""
    from datetime import timedelta

    backend = "nccl" if cfg.trainer.parallelism.device == "cuda" else "gloo"
    if cfg.trainer.parallelism.device == "cuda":
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    timeout = timedelta(seconds=cfg.trainer.parallelism.collective_timeout_s)
    init = os.environ.get("MOERL_INIT_METHOD", "env://")
    if init.startswith("file://"):
        dist.init_process_group(
            backend,
            init_method=init,
            rank=int(os.environ["RANK"]),
            world_size=int(os.environ["WORLD_SIZE"]),
            timeout=timeout,
        )
    else:
        dist.init_process_group(backend, timeout=timeout)


@contextmanager
def one_rank(cfg: RunConfig) -> Iterator[dist.Store]:
    """This process as a one-rank mesh: the trainer's one code path when
    `trainer.parallelism.world_size` is 1 (FSDP2 over one rank; the same steps, export, state
    and metrics as on many). Yields the group's in-process store; the group is torn down after.
    Refused when the process already belongs to a group (a second trainer in one process)."""
    from datetime import timedelta

    if dist.is_initialized():
        raise TrainingError(
            "policy_update: this process already belongs to a torch.distributed process group; "
            "the one-rank trainer starts its own"
        )
    cuda = cfg.trainer.parallelism.device == "cuda"
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    store = dist.HashStore()
    dist.init_process_group(
        "nccl" if cuda else "gloo",
        store=store,
        rank=0,
        world_size=1,
        timeout=timedelta(seconds=cfg.trainer.parallelism.collective_timeout_s),
    )
    try:
        yield store
    finally:
        dist.destroy_process_group()


def update(
    cfg: RunConfig, batch_path: Path, state_in: Path, state_out: Path, iteration: int
) -> tuple[dict[str, float], Session]:
    """One restarting update on this rank (inside its process group): load `state_in`, train
    on the batch, write `state_out`. Rank 0's metrics are the update's."""
    t0 = time.perf_counter()
    torch.manual_seed(cfg.trainer.seed + iteration)
    session = Session.load(cfg, state_in)
    batch = read_records(batch_path, TrainSample)
    t_load = _synced_clock(cfg)
    metrics = run_version(cfg, session, batch, iteration, state_out)
    metrics["timing/trainer_load_s"] = t_load - t0
    metrics["timing/policy_update_s"] = time.perf_counter() - t0
    return metrics, session


def run_version(
    cfg: RunConfig,
    s: Session,
    batch: list[TrainSample],
    iteration: int,
    state_out: Path,
    with_state: bool = True,
) -> dict[str, float]:
    """One policy update on a loaded session, then its version's files (`save_ep`). The same on
    every rank and for both the restarting and the persistent trainer; rank 0's metrics are the
    update's."""
    t0 = _synced_clock(cfg)
    metrics = train_steps(cfg, s, batch, cfg.trainer.seed + iteration)
    metrics["timing/trainer_steps_s"] = _synced_clock(cfg) - t0
    metrics.update(save_version(cfg, s, state_out, with_state))
    return metrics


def train_steps(
    cfg: RunConfig, s: Session, batch: list[TrainSample], seed: int, pi_old: str | None = None
) -> dict[str, float]:
    """A version's optimizer steps on `batch` (every rank, the same call), or one streamed
    minibatch (`train_ep`'s `pi_old`); nothing when there are fewer samples than ranks."""
    torch.manual_seed(seed)
    metrics = (
        train_ep(s.model, s.opt, s.counters, s.ep_blocks, batch, cfg, seed=seed, pi_old=pi_old)
        if len(batch) >= dist.get_world_size()
        else {"train/steps": 0.0, "train/skipped_steps": 0.0}
    )
    metrics["train/empty_batch"] = float(len(batch) < dist.get_world_size())
    return metrics


def save_version(
    cfg: RunConfig, s: Session, state_out: Path, with_state: bool = True
) -> dict[str, float]:
    """The trained version's files (`save_ep`), its counters moved on; every rank."""
    t_steps = _synced_clock(cfg)
    s.counters.version += 1
    metrics = save_ep(
        s.model,
        s.opt,
        s.counters,
        s.ep_blocks,
        s.layout,
        s.mesh,
        s.state_in,
        state_out,
        cfg.rollout.resolved.dtype,
        with_state,
    )
    # where the update's time went: the steps (pi_old included, in run_version), saving
    metrics["timing/trainer_save_s"] = _synced_clock(cfg) - t_steps
    # what this rank's GPU held at its peak (rank 0's is reported)
    if cfg.trainer.parallelism.device == "cuda":
        metrics["train/cuda_max_memory_gb"] = torch.cuda.max_memory_allocated() / 1e9
    described, fallback = s.describe_dispatcher()
    metrics["moe/ep_fallback"] = float(fallback is not None)
    return metrics


def main(argv: list[str] | None = None) -> int:
    """One rank of a restarting update (the sync pipeline's policy_update, and the async
    trainer with `trainer.parallelism.persistent_ranks: false`): (1) process group, (dp, ep)
    mesh (ep fastest) and dispatcher; (2) the model built on `meta`, EP blocks swapped in,
    sharded with FSDP2, and only this rank's rows of each tensor read (`ep_checkpoint.py`), the
    master weights and Adam's state from their Distributed Checkpoints (or the single process's
    `optimizer.pt`), resharded onto this mesh (`ep_optimizer.py`); (3) pi_old for this rank's
    samples (every rank reads the whole batch and the same seeded permutation; each minibatch
    is split round-robin over ranks); (4) N steps (non-finite losses skipped on all ranks
    together; the router bias moved after each where the family has one, `steps.RouterBias`);
    (5) the version's files, every rank writing its own part (`save_ep`). The async trainer's
    ranks that live for the whole run: `mesh.py`."""
    ap = argparse.ArgumentParser()
    for name in ("--config-json", "--batch", "--state-in", "--state-out", "--metrics-out"):
        ap.add_argument(name, required=True)
    ap.add_argument("--iteration", type=int, required=True)
    a = ap.parse_args(argv)
    logging.basicConfig(
        level=logging.INFO, format=f"[ep rank {os.environ.get('RANK', '?')}] %(message)s"
    )
    cfg = config_from_json(Path(a.config_json).read_text())
    join_process_group(cfg)
    try:
        metrics, session = update(
            cfg, Path(a.batch), Path(a.state_in), Path(a.state_out), a.iteration
        )
        if dist.get_rank() == 0:
            described, fallback = session.describe_dispatcher()
            Path(a.metrics_out).write_text(
                json.dumps({"metrics": metrics, "dispatcher": described, "fallback_from": fallback})
            )
    finally:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
