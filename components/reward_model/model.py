"""The reward model: a transformers sequence-classification model with one logit, on the same
backbone family as the policy (the tiny Qwen3-MoE built from `model.tiny`, or `model.path`).

It scores the text `prompt + response` followed by the tokenizer's EOS token (so "the
response ended here" is part of what it sees); the head reads the last non-pad token.
Sequences are right-padded, so a score does not depend on the batch it was computed in
(tests/reward/test_reward_model.py checks batched scores against one-by-one scores).

Training minimizes the Bradley-Terry loss, -log σ(r(chosen) - r(rejected)), averaged over
the pairs of a step; evaluation is pairwise accuracy, the fraction of held-out pairs with
r(chosen) > r(rejected).
"""

from __future__ import annotations

import logging
import math
import random
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor

from moerl.config import CheckpointConfig, ModelConfig, RewardModelTrainConfig
from moerl.errors import DataError, TrainingError
from moerl.records import PreferencePair

log = logging.getLogger(__name__)


def bradley_terry_loss(chosen: Tensor, rejected: Tensor) -> Tensor:
    """mean over pairs of -log σ(chosen - rejected) (softplus form: finite for any margin)."""
    return F.softplus(rejected - chosen).mean()


def build_reward_model(
    cfg: ModelConfig, out_dir: str | Path, ck: CheckpointConfig | None = None
) -> Path:
    """A fresh reward model in HF format: the tiny MoE from `cfg.tiny.seed` with a one-logit
    sequence-classification head, or `cfg.path`'s backbone with a new head (`ck`: where an
    s3:// path is read, fetched whole beside `out_dir`)."""
    from transformers import AutoModelForSequenceClassification

    from moerl.models.policy import check_checkpoint
    from moerl.models.tiny import build_tokenizer, tiny_hf_config

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(cfg.tiny.seed)
    if cfg.path:
        import tempfile

        from transformers import AutoTokenizer

        from moerl.models.source import is_remote, local_model

        if is_remote(cfg.path) and ck is None:
            raise ValueError("build_reward_model: a remote model.path needs the checkpoint config")
        # a remote backbone's local copy lives only while it loads
        with tempfile.TemporaryDirectory(prefix="moerl-backbone-") as tmp:
            path = local_model(cfg.path, ck, Path(tmp)) if ck else Path(cfg.path)
            check_checkpoint(path)
            model = AutoModelForSequenceClassification.from_pretrained(
                path, num_labels=1, dtype=torch.float32
            )
            tokenizer = AutoTokenizer.from_pretrained(path)
    else:
        tokenizer = build_tokenizer()
        hf = tiny_hf_config(
            cfg.tiny,
            len(tokenizer),
            tokenizer.pad_token_id,
            tokenizer.eos_token_id,
            tokenizer.bos_token_id,
        )
        hf.num_labels = 1
        model = AutoModelForSequenceClassification.from_config(hf, dtype=torch.float32)
    if model.config.pad_token_id is None:
        raise DataError(
            "model: the reward model needs a pad token (the head finds each text's last token by it)"
        )
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


class RewardModel:
    """A loaded reward model: `score(texts)` in batches of at most `max_batch`."""

    def __init__(self, path: str | Path, device: str = "cpu"):
        from transformers import AutoModelForSequenceClassification, AutoTokenizer

        self.path = Path(path)
        self.device = device
        self.model = (
            AutoModelForSequenceClassification.from_pretrained(path, dtype=torch.float32)
            .to(device)
            .eval()
        )
        self.tokenizer = AutoTokenizer.from_pretrained(path)
        if self.model.config.num_labels != 1:
            raise DataError(
                f"{path}: a reward model has one output (num_labels 1), got {self.model.config.num_labels}"
            )
        self.max_length = int(self.model.config.max_position_embeddings)

    def encode(self, texts: list[str]) -> tuple[Tensor, Tensor]:
        """(input_ids, attention_mask), right-padded; ValueError for a text over max_length."""
        tok = self.tokenizer
        rows = [tok(t, add_special_tokens=False)["input_ids"] + [tok.eos_token_id] for t in texts]
        longest = max((len(r) for r in rows), default=0)
        if longest > self.max_length:
            raise ValueError(
                f"a text of {longest} tokens is longer than the reward model's "
                f"max_position_embeddings ({self.max_length})"
            )
        ids = torch.full((len(rows), longest), tok.pad_token_id, dtype=torch.long)
        mask = torch.zeros((len(rows), longest), dtype=torch.long)
        for i, r in enumerate(rows):
            ids[i, : len(r)] = torch.tensor(r)
            mask[i, : len(r)] = 1
        return ids.to(self.device), mask.to(self.device)

    def forward(self, texts: list[str]) -> Tensor:
        ids, mask = self.encode(texts)
        return self.model(input_ids=ids, attention_mask=mask).logits.squeeze(-1).float()

    @torch.no_grad()
    def score(self, texts: list[str], max_batch: int) -> list[float]:
        out: list[float] = []
        for i in range(0, len(texts), max_batch):
            out.extend(self.forward(texts[i : i + max_batch]).tolist())
        return out


def pair_texts(pairs: list[PreferencePair]) -> tuple[list[str], list[str]]:
    return [p.prompt + p.chosen for p in pairs], [p.prompt + p.rejected for p in pairs]


def pairwise_accuracy(
    rm: RewardModel, pairs: list[PreferencePair], max_batch: int = 256
) -> dict[str, float]:
    """Held-out metrics: accuracy (r(chosen) > r(rejected)), the mean margin and BT loss."""
    chosen, rejected = pair_texts(pairs)
    c = torch.tensor(rm.score(chosen, max_batch))
    r = torch.tensor(rm.score(rejected, max_batch))
    return {
        "rm/eval_accuracy": float((c > r).float().mean()) if pairs else 0.0,
        "rm/eval_margin_mean": float((c - r).mean()) if pairs else 0.0,
        "rm/eval_loss": float(bradley_terry_loss(c, r)) if pairs else 0.0,
        "rm/eval_pairs": float(len(pairs)),
    }


def train_reward_model(
    cfg: RewardModelTrainConfig,
    model_dir: str | Path,
    pairs: list[PreferencePair],
    out_dir: str | Path,
    device: str = "cpu",
) -> dict[str, float]:
    """`cfg.epochs` passes over `pairs` in seeded order, `cfg.batch_size` pairs per AdamW step,
    the BT loss; saves the model and tokenizer to `out_dir`. A non-finite loss fails the run."""
    if not pairs:
        raise DataError(
            "reward_model: no training pairs (reward_model.data after the held-out split)"
        )
    torch.manual_seed(cfg.seed)
    rm = RewardModel(model_dir, device)
    rm.model.train()
    opt = torch.optim.AdamW(
        rm.model.parameters(), lr=cfg.learning_rate, weight_decay=cfg.weight_decay
    )
    rng = random.Random(cfg.seed)
    order = list(pairs)
    t0, steps, losses = time.perf_counter(), 0, []
    for epoch in range(cfg.epochs):
        rng.shuffle(order)
        for i in range(0, len(order), cfg.batch_size):
            chosen, rejected = pair_texts(order[i : i + cfg.batch_size])
            scores = rm.forward(chosen + rejected)
            loss = bradley_terry_loss(scores[: len(chosen)], scores[len(chosen) :])
            if not math.isfinite(loss.item()):
                raise TrainingError(
                    f"reward_model: non-finite loss at epoch {epoch} step {steps}; lower "
                    f"reward_model.learning_rate ({cfg.learning_rate})"
                )
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(rm.model.parameters(), cfg.max_grad_norm)
            opt.step()
            steps += 1
            losses.append(loss.item())
        log.info(
            "reward model epoch %d/%d: loss %.4f (last %d steps)",
            epoch + 1,
            cfg.epochs,
            sum(losses[-20:]) / len(losses[-20:]),
            min(20, len(losses)),
        )
    rm.model.eval()
    out = Path(out_dir)
    rm.model.save_pretrained(out)
    rm.tokenizer.save_pretrained(out)
    tail = losses[-max(1, len(losses) // 10) :]
    return {
        "rm/train_steps": float(steps),
        "rm/train_pairs": float(len(pairs)),
        "rm/train_loss_first": losses[0],
        "rm/train_loss_last": sum(tail) / len(tail),
        "timing/train_reward_model_s": time.perf_counter() - t0,
    }
