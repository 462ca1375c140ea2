"""Policy update stage: N optimizer steps of GRPO on one training batch.

Design, details and limitations: docs/async.md#componentspolicy_updatetrainerpy.
"""

from __future__ import annotations

import json
import logging
import shutil
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from moerl.components.policy_update.steps import (
    STAT_KEYS,
    Packed,
    RouterAux,
    RouterBias,
    Routing,
    accumulate,
    finish_step,
    logprob_mismatch_sum,
    losses_are_finite,
    micro_parts,
    minibatches,
    model_device,
    optimizer_steps,
    policy_logprobs,
    prepare_correction,
    rows_per_micro_batch,
    sequence_logprobs,
)
from moerl.config import RunConfig
from moerl.errors import TrainingError
from moerl.models.policy import mark_dtype
from moerl.records import TrainSample, token_versions

__all__ = [
    "Counters",
    "Packed",
    "TRAINER_DIR",
    "MASTER_DIR",
    "weights_dir",
    "pack",
    "run_policy_update",
    "sequence_logprobs",
    "train_on_batch",
]

log = logging.getLogger(__name__)
TRAINER_DIR = "trainer"
# the master weights (model.dtype) when the engines are served another dtype (rollout.dtype): an
# HF checkpoint under trainer/, which engines never fetch (moerl.store.runs.ENGINE_EXCLUDE)
MASTER_DIR = f"{TRAINER_DIR}/master"


def weights_dir(state_dir: Path) -> Path:
    """Where the trainer reads the policy's weights from: the master copy when the version was
    published in a serving dtype of its own, else the HF checkpoint itself."""
    master = Path(state_dir) / MASTER_DIR
    return master if (master / "config.json").is_file() else Path(state_dir)


@dataclass
class Counters:
    step: int = 0
    version: int = 0
    consecutive_skipped: int = 0
    skipped_total: int = 0


def pack(batch: list[TrainSample], pad_id: int, device: torch.device | str = "cpu") -> Packed:
    """Right-padded tensors of `batch`, built on the CPU and moved to `device` once."""
    seqs = [s.prompt_token_ids + s.response_token_ids for s in batch]
    n, length = len(seqs), max(len(x) for x in seqs)
    cpu = torch.device("cpu")
    ids = torch.full((n, length), pad_id, dtype=torch.long, device=cpu)
    attn = torch.zeros((n, length), dtype=torch.long, device=cpu)
    mask = torch.zeros((n, length - 1), device=cpu)
    eng = torch.zeros((n, length - 1), device=cpu)
    version = torch.full((n, length - 1), -1, dtype=torch.long, device=cpu)
    for i, (s, seq) in enumerate(zip(batch, seqs)):
        ids[i, : len(seq)] = torch.tensor(seq, device=cpu)
        attn[i, : len(seq)] = 1
        p, r = len(s.prompt_token_ids), len(s.response_token_ids)
        # logits at position t predict token t+1: response token k sits at p+k, predicted at p+k-1
        # an environment's tokens (multi-turn) are context, never targets: mask 0
        mask[i, p - 1 : p - 1 + r] = (
            1 if s.response_mask is None else torch.tensor(s.response_mask, device=cpu)
        )
        eng[i, p - 1 : p - 1 + r] = torch.tensor(s.response_logprobs, device=cpu)
        version[i, p - 1 : p - 1 + r] = torch.tensor(
            token_versions(s), dtype=torch.long, device=cpu
        )
    adv = torch.tensor([s.advantage for s in batch], dtype=torch.float32, device=cpu)
    routes = None
    if any(s.routed_experts is not None for s in batch):  # the engine's routes, -1 where none
        shapes = {s.routed_experts.shape[1:] for s in batch if s.routed_experts is not None}
        if len(shapes) > 1:
            raise TrainingError(
                f"the batch's routed_experts disagree on [layers, top-k]: {sorted(shapes)}"
            )
        ((layers, k),) = shapes
        routes = torch.full((n, length, layers, k), -1, dtype=torch.int32, device=cpu)
        for i, s in enumerate(batch):
            if s.routed_experts is not None:
                got_LYK = torch.from_numpy(s.routed_experts.ids())
                routes[i, : got_LYK.shape[0]] = got_LYK.to(torch.int32)
    return Packed(
        *(t.to(device) for t in (ids, attn, ids[:, 1:].clone(), mask, eng, adv, version)),
        routes_NLYK=None if routes is None else routes.to(device),
    )


def load_state(state_dir: Path, cfg: RunConfig):
    """The one-process trainer's state of the version in `state_dir`: (model, AdamW optimizer,
    Counters), on `cfg.trainer.parallelism.device`. Public for callers that train a version
    step by step (the benchmarks' floor arms): `train_on_batch`, then `save_state`."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        weights_dir(state_dir), dtype=getattr(torch, cfg.model.dtype)
    ).to(cfg.trainer.parallelism.device)  # type: ignore[arg-type]  # transformers' decorated to() is mistyped
    if cfg.trainer.parallelism.activation_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    opt = torch.optim.AdamW(
        model.parameters(),
        lr=cfg.trainer.optimizer.learning_rate,
        weight_decay=cfg.trainer.optimizer.weight_decay,
    )
    counters = Counters()
    tdir = state_dir / TRAINER_DIR
    if (tdir / "optimizer.pt").is_file():
        opt.load_state_dict(
            torch.load(
                tdir / "optimizer.pt",
                weights_only=True,
                map_location=cfg.trainer.parallelism.device,
            )
        )
    elif (tdir / "optimizer").is_dir() or any(tdir.glob("optimizer-ep*.pt")):
        raise TrainingError(
            f"policy_update: {tdir} holds the optimizer state of a sharded trainer (a mesh of "
            "ranks); continue on a mesh (trainer.parallelism.data_parallel_shard x trainer.parallelism.expert_parallel_size "
            "> 1), any shape: its Distributed Checkpoint reshards"
        )
    if (tdir / "state.json").is_file():
        counters = Counters(**json.loads((tdir / "state.json").read_text()))
    if counters.version > 0 and not (tdir / "optimizer.pt").is_file():
        raise TrainingError(
            f"policy_update: version {counters.version} ({state_dir}) carries no trainer state "
            "(a mesh's version written with checkpoint.state_every > 1); continue on the mesh"
        )
    return model, opt, counters


def save_state(
    model,
    opt,
    counters: Counters,
    state_in: Path,
    state_out: Path,
    serving_dtype: str | None = None,
) -> None:
    """The version: the HF checkpoint the engines load, in `serving_dtype` (rollout.dtype
    resolved) when given and not the model's own, the master weights then under MASTER_DIR; the
    optimizer state and the counters under trainer/."""
    state_out.mkdir(parents=True, exist_ok=True)
    for f in state_in.iterdir():  # tokenizer and generation config come along unchanged
        if (
            f.is_file()
            and not f.name.endswith(".safetensors")
            and f.name != "model.safetensors.index.json"
        ):
            shutil.copy2(f, state_out / f.name)
    master = next(model.parameters()).dtype
    serving = getattr(torch, serving_dtype) if serving_dtype else master
    if serving == master:
        model.save_pretrained(state_out)
    else:
        model.save_pretrained(
            state_out, state_dict={k: v.to(serving) for k, v in model.state_dict().items()}
        )
        mark_dtype(state_out, str(serving_dtype))
        model.save_pretrained(state_out / MASTER_DIR)
    (state_out / TRAINER_DIR).mkdir(exist_ok=True)
    if opt is not None:  # expert-parallel ranks save their own optimizer shards
        torch.save(opt.state_dict(), state_out / TRAINER_DIR / "optimizer.pt")
    (state_out / TRAINER_DIR / "state.json").write_text(json.dumps(asdict(counters)))


def train_on_batch(
    model, opt, counters: Counters, batch: list[TrainSample], cfg: RunConfig, seed: int
) -> dict[str, float]:
    tc = cfg.trainer
    device = model_device(model)
    p = pack(batch, model.config.pad_token_id or 0, device)
    n = p.input_ids_NL.shape[0]
    # 3. pi_old and the engine/trainer mismatch, before any step
    model.eval()
    routing = Routing.for_batch(model, p, tc.moe.router_replay)
    aux = bias = None
    try:
        old_logp = policy_logprobs(model, p, cfg, routing)
        tokens = float(p.mask_NL1.sum())
        mismatch = logprob_mismatch_sum(old_logp, p.engine_logp_NL1, p.mask_NL1) / max(tokens, 1.0)
        # the engine/trainer mismatch, rejection and importance weights (correction.py)
        p, corr = prepare_correction(p, old_logp, cfg, counters.version)
        # 4. exactly min(steps, n) minibatch steps over a seeded permutation, in micro-batches
        model.train()
        aux = RouterAux(model, tc.moe.aux_loss_coef) if tc.moe.aux_loss_coef > 0 else None
        bias = (
            RouterBias(model, tc.moe.router_bias_update_rate)
            if tc.moe.router_bias_update_rate > 0
            else None
        )
        sums = dict.fromkeys((*STAT_KEYS, "grad_norm"), 0.0)
        done = skipped = 0
        balance: dict[str, float] = {}
        for idx in minibatches(n, optimizer_steps(cfg, n), seed, world=1, device=device):
            opt.zero_grad(set_to_none=True)
            parts = micro_parts(
                idx, 0, 1, rows_per_micro_batch(p, tc.parallelism.micro_batch_tokens, len(idx))
            )
            stats = accumulate(
                model,
                p,
                parts,
                old_logp,
                cfg,
                float(p.mask_NL1[idx].sum()),
                len(idx),
                aux,
                n_seqs=float((p.mask_NL1[idx].sum(-1) > 0).sum()),
                routing=routing,
            )
            grad_norm = float(
                torch.nn.utils.clip_grad_norm_(model.parameters(), tc.optimizer.max_grad_norm)
            )
            if finish_step(opt, counters, cfg, stats, sums, grad_norm, losses_are_finite(stats)):
                done += 1
                balance = bias.step() if bias is not None else balance
            else:  # NaN/inf loss or gradient: the weights stay untouched
                skipped += 1
                if bias is not None:
                    bias.reset()
        if routing is not None:
            corr.update(routing.metrics())
    finally:
        for hooks in (aux, bias, routing):
            if hooks is not None:
                hooks.close()
    metrics = {f"train/{k}": v / max(done, 1) for k, v in sums.items()} | balance | corr
    metrics.update(
        {
            "train/steps": float(done),
            "train/skipped_steps": float(skipped),
            "train/logprob_mismatch": mismatch,
            "train/tokens": tokens,
            "train/ep_size": 1.0,
            "train/dp_shard": 1.0,
        }
    )
    return metrics


def run_policy_update(
    cfg: RunConfig,
    batch_path: str | Path,
    state_in: str | Path,
    state_out: str | Path,
    iteration: int,
    run_id: str = "",
) -> dict[str, float]:
    """One policy update from files (the sync pipeline's task; the async trainer with
    `trainer.parallelism.persistent_ranks: false`), always on the trainer's mesh (`ep_train`):
    its ranks launched when `trainer.parallelism.world_size` > 1, else this process as a
    one-rank mesh. Same steps, files and metric names either way."""
    from moerl.provenance import stage_start

    stage_start(cfg, "policy_update", run_id)  # records where it runs; enforces `require:`
    if cfg.trainer.parallelism.on_mesh:  # FSDP2 + expert parallelism over launched ranks
        from moerl.components.policy_update.launcher import run_expert_parallel

        return run_expert_parallel(cfg, batch_path, state_in, state_out, iteration)
    from moerl.components.policy_update.ep_train import one_rank, update

    with one_rank(cfg):
        metrics, _ = update(cfg, Path(batch_path), Path(state_in), Path(state_out), iteration)
    return metrics
