"""Policy update stage: N optimizer steps of GRPO on one training batch.

The trainer state travels between iterations, and is published, as one directory: the HF
checkpoint at the top (what engines serve; vLLM reads only top-level files) and `trainer/`
beside it (optimizer state and counters: what a resumed run needs and engines never fetch).

Steps: (1) load model, optimizer and counters; (2) pack the batch into padded tensors;
(3) recompute the start-of-iteration logprobs (pi_old) and the engine/trainer mismatch;
(4) N minibatch steps, skipping and counting any non-finite loss, and failing after
`max_consecutive_skipped_steps` in a row; (5) save the new state.

Legend: N = samples, L = packed sequence length, L1 = L - 1 (next-token positions).
"""

from __future__ import annotations

import json
import logging
import math
import os
import shutil
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from moerl.config import RunConfig
from moerl.errors import TrainingError
from moerl.records import TrainSample, read_records
from moerl.components.policy_update.loss import grpo_token_loss, token_logprobs_and_entropy

log = logging.getLogger(__name__)
TRAINER_DIR = "trainer"


@dataclass
class Counters:
    step: int = 0
    version: int = 0
    consecutive_skipped: int = 0
    skipped_total: int = 0


@dataclass(frozen=True)
class Packed:
    input_ids_NL: torch.Tensor
    attn_NL: torch.Tensor
    targets_NL1: torch.Tensor
    mask_NL1: torch.Tensor  # 1 where the target is a response token
    engine_logp_NL1: torch.Tensor
    adv_N: torch.Tensor


def pack(batch: list[TrainSample], pad_id: int) -> Packed:
    seqs = [s.prompt_token_ids + s.response_token_ids for s in batch]
    n, length = len(seqs), max(len(x) for x in seqs)
    ids = torch.full((n, length), pad_id, dtype=torch.long)
    attn = torch.zeros((n, length), dtype=torch.long)
    mask = torch.zeros((n, length - 1))
    eng = torch.zeros((n, length - 1))
    for i, (s, seq) in enumerate(zip(batch, seqs)):
        ids[i, : len(seq)] = torch.tensor(seq)
        attn[i, : len(seq)] = 1
        p, r = len(s.prompt_token_ids), len(s.response_token_ids)
        # logits at position t predict token t+1: response token k sits at p+k, predicted at p+k-1
        mask[i, p - 1 : p - 1 + r] = 1
        eng[i, p - 1 : p - 1 + r] = torch.tensor(s.response_logprobs)
    adv = torch.tensor([s.advantage for s in batch], dtype=torch.float32)
    return Packed(ids, attn, ids[:, 1:].clone(), mask, eng, adv)


def sequence_logprobs(model, p: Packed, idx: torch.Tensor, temperature: float) -> tuple[torch.Tensor, torch.Tensor]:
    logits = model(input_ids=p.input_ids_NL[idx], attention_mask=p.attn_NL[idx]).logits
    return token_logprobs_and_entropy(logits[:, :-1], p.targets_NL1[idx], temperature)


def _load_state(state_dir: Path, cfg: RunConfig):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(state_dir, dtype=getattr(torch, cfg.model.dtype)).to(cfg.trainer.device)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.trainer.learning_rate, weight_decay=cfg.trainer.weight_decay)
    counters = Counters()
    tdir = state_dir / TRAINER_DIR
    if (tdir / "optimizer.pt").is_file():
        opt.load_state_dict(torch.load(tdir / "optimizer.pt", weights_only=True))
    elif cfg.trainer.expert_parallel_size == 1 and any(tdir.glob("optimizer-ep*.pt")):
        raise TrainingError(f"policy_update: {tdir} holds expert-parallel optimizer shards; resume with the "
                            "trainer.expert_parallel_size they were written with")
    if (tdir / "state.json").is_file():
        counters = Counters(**json.loads((tdir / "state.json").read_text()))
    return model, opt, counters


def _save_state(model, opt, counters: Counters, state_in: Path, state_out: Path) -> None:
    state_out.mkdir(parents=True, exist_ok=True)
    for f in state_in.iterdir():  # tokenizer and generation config come along unchanged
        if f.is_file() and not f.name.endswith(".safetensors") and f.name != "model.safetensors.index.json":
            shutil.copy2(f, state_out / f.name)
    model.save_pretrained(state_out)
    (state_out / TRAINER_DIR).mkdir(exist_ok=True)
    if opt is not None:  # expert-parallel ranks save their own optimizer shards
        torch.save(opt.state_dict(), state_out / TRAINER_DIR / "optimizer.pt")
    (state_out / TRAINER_DIR / "state.json").write_text(json.dumps(asdict(counters)))


def train_on_batch(model, opt, counters: Counters, batch: list[TrainSample], cfg: RunConfig, seed: int) -> dict[str, float]:
    tc, temperature = cfg.trainer, cfg.rollout.temperature
    p = pack(batch, model.config.pad_token_id or 0)
    n = p.input_ids_NL.shape[0]
    # 3. pi_old and the engine/trainer mismatch, before any step
    model.eval()
    with torch.no_grad():
        old_logp, _ = sequence_logprobs(model, p, torch.arange(n), temperature)
    tokens = p.mask_NL1.sum().clamp_min(1)
    mismatch = float(((old_logp - p.engine_logp_NL1).abs() * p.mask_NL1).sum() / tokens)
    # 4. N minibatch steps over a seeded permutation
    model.train()
    gen = torch.Generator().manual_seed(seed)
    chunks = torch.randperm(n, generator=gen).chunk(min(tc.optimizer_steps_per_iteration, n))
    sums = {"loss": 0.0, "clip_fraction": 0.0, "entropy": 0.0, "grad_norm": 0.0, "tis_truncated_fraction": 0.0}
    done = skipped = 0
    for idx in chunks:
        logp, entropy = sequence_logprobs(model, p, idx, temperature)
        loss, stats = grpo_token_loss(logp, old_logp[idx], p.engine_logp_NL1[idx], p.adv_N[idx], p.mask_NL1[idx],
                                      tc.clip_eps_low, tc.clip_eps_high, tc.tis_cap)
        if not math.isfinite(stats.loss):
            skipped += 1
            counters.consecutive_skipped += 1
            counters.skipped_total += 1
            opt.zero_grad(set_to_none=True)
            log.warning("non-finite loss at step %d: skipped (%d in a row)", counters.step, counters.consecutive_skipped)
            if counters.consecutive_skipped >= tc.max_consecutive_skipped_steps:
                raise TrainingError(
                    f"policy_update: {counters.consecutive_skipped} optimizer steps in a row had a non-finite loss "
                    f"(trainer.max_consecutive_skipped_steps={tc.max_consecutive_skipped_steps}); lower "
                    "trainer.learning_rate or check the batch for bad logprobs")
            continue
        opt.zero_grad(set_to_none=True)
        loss.backward()
        grad_norm = float(torch.nn.utils.clip_grad_norm_(model.parameters(), tc.max_grad_norm))
        opt.step()
        counters.consecutive_skipped = 0
        counters.step += 1
        done += 1
        m = p.mask_NL1[idx]
        sums["loss"] += stats.loss
        sums["clip_fraction"] += stats.clip_fraction
        sums["tis_truncated_fraction"] += stats.tis_truncated_fraction
        sums["entropy"] += float((entropy.detach() * m).sum() / m.sum().clamp_min(1))
        sums["grad_norm"] += grad_norm
    metrics = {f"train/{k}": v / max(done, 1) for k, v in sums.items()}
    metrics.update({
        "train/steps": float(done),
        "train/skipped_steps": float(skipped),
        "train/logprob_mismatch": mismatch,
        "train/tokens": float(tokens),
    })
    return metrics


def run_policy_update(cfg: RunConfig, batch_path: str | Path, state_in: str | Path, state_out: str | Path,
                      iteration: int) -> dict[str, float]:
    if cfg.trainer.expert_parallel_size > 1:
        from moerl.components.policy_update.launcher import run_expert_parallel

        return run_expert_parallel(cfg, batch_path, state_in, state_out, iteration)
    t0 = time.perf_counter()
    torch.manual_seed(cfg.trainer.seed + iteration)
    state_in, state_out = Path(state_in), Path(state_out)
    # 1. state
    model, opt, counters = _load_state(state_in, cfg)
    batch = read_records(batch_path, TrainSample)
    # 2-4. train (an empty batch, every group dropped, still yields the next version unchanged)
    if batch:
        metrics = train_on_batch(model, opt, counters, batch, cfg, seed=cfg.trainer.seed + iteration)
    else:
        log.warning("iteration %d: empty training batch (every group dropped); weights unchanged", iteration)
        metrics = {"train/steps": 0.0, "train/skipped_steps": 0.0}
    metrics["train/empty_batch"] = float(not batch)
    counters.version += 1
    # 5. save
    _save_state(model, opt, counters, state_in, state_out)
    metrics["timing/policy_update_s"] = time.perf_counter() - t0
    return metrics
