"""What the async trainer accepts from the scored stream: every field it reads checked before a
group reaches a batch, so a malformed or forged entry is dead-lettered (counted) by the bus
instead of crashing the trainer, at every restart, after it was read.

`EntryCheck` checks a group's id against the units issued (`u<seq>/<k>:<prompt_id>`, seq at most
the run's `unit_seq`, k below `units.max_prompts`, the prompt its samples answer), its G samples
(`rollout.samples_per_prompt`, sample indices 0..G-1), every token id within the model's
vocabulary, and every number finite. Entries delivered to the trainer more than
`max_deliveries` times (restarts that each read its pending list again) are dead-lettered too.

Limitations: a forged group that passes every check (right id, in-vocabulary tokens, a
plausible reward) is trained on; only the stage ACL keeps other writers out.
"""

from __future__ import annotations

import json
import math
import re
import time
from pathlib import Path
from typing import Any

from moerl.bus import RunBus
from moerl.records import ScoredSample

_GROUP_ID = re.compile(r"^u(\d{1,12})/(\d{1,6}):(.*)$", re.S)
_OPTIONAL_NUMBERS = ("model_score", "rule_score", "env_reward")


def _finite(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def check_t_generated(group: dict) -> None:
    if "t_generated" in group:
        t = group["t_generated"]
        if not _finite(t) or not 0 < t < time.time() + 3600:
            raise ValueError(f"t_generated must be a unix time, got {str(t)[:40]!r}")


def scored_samples(group: dict) -> None:
    """Parse a scored group in place (the fields every check needs): its samples ScoredSamples
    of one prompt, its `t_generated` (if any) a finite time no later than now (plus skew)."""
    samples = [ScoredSample.model_validate(s) for s in group["samples"]]
    if len({s.prompt_id for s in samples}) != 1:
        raise ValueError("a group's samples answer one prompt; these answer several")
    check_t_generated(group)
    group["samples"] = samples


def model_vocab(cfg, folder: Path | None = None) -> int:  # noqa: ANN001 - a RunConfig
    """Token ids a sample may hold: the `vocab_size` (a multimodal config's `text_config`) of the
    config.json in `folder` (the version the trainer continues from: the embeddings it trains),
    else of `model.path`, else the embedded tiny model's tokenizer's."""
    if folder is not None and (folder / "config.json").is_file():
        hf = json.loads((folder / "config.json").read_text())
    elif cfg.model.path:
        from moerl.models.source import hf_config

        hf = hf_config(cfg.model.path, cfg.checkpoint)
    else:
        from moerl.models.tiny import tiny_vocab

        return len(tiny_vocab())
    return int((hf.get("text_config") or hf)["vocab_size"])


class EntryCheck:
    """The trainer's whole check of one scored group (the module docstring); a callable for
    `RunBus.take_scored` / `take_pending`'s `validate`, raising ValueError on what it refuses."""

    def __init__(self, bus: RunBus, g: int, vocab: int, max_prompts: int, max_deliveries: int):
        self.bus, self.g, self.vocab, self.max_prompts = bus, g, vocab, max_prompts
        self.max_deliveries = max_deliveries
        self.issued = 0  # the run's unit_seq, read again when a group names a later unit

    @classmethod
    def for_run(cls, cfg, bus: RunBus, folder: Path | None = None) -> EntryCheck:  # noqa: ANN001
        """The run's check (`cfg` a RunConfig); `folder`: the version it continues from."""
        return cls(
            bus,
            cfg.rollout.samples_per_prompt,
            model_vocab(cfg, folder),
            cfg.units.max_prompts,
            # its first delivery, then one per restart that read it back: 2 x units.max_attempts
            2 * cfg.units.max_attempts,
        )

    def __call__(self, group: dict) -> None:
        gid = group["group_id"]
        m = _GROUP_ID.match(gid)
        if m is None:
            raise ValueError(f"group id {gid[:80]!r} is not u<seq>/<k>:<prompt_id>")
        seq, k, prompt_id = int(m[1]), int(m[2]), m[3]
        if k >= self.max_prompts:
            raise ValueError(f"group {gid[:80]!r}: k {k} >= units.max_prompts {self.max_prompts}")
        if seq > self.issued:
            self.issued = self.bus.positions()["unit_seq"]
        if not 0 < seq <= self.issued:
            raise ValueError(
                f"group {gid[:80]!r} names unit {seq}, never issued (last {self.issued})"
            )
        if len(group["samples"]) != self.g:
            raise ValueError(
                f"{len(group['samples'])} samples, not rollout.samples_per_prompt {self.g}"
            )
        scored_samples(group)
        samples: list[ScoredSample] = group["samples"]
        if samples[0].prompt_id != prompt_id:
            raise ValueError(
                f"samples answer {samples[0].prompt_id[:80]!r}, the id names {prompt_id[:80]!r}"
            )
        if sorted(s.sample_index for s in samples) != list(range(self.g)):
            raise ValueError(f"sample indices are not 0..{self.g - 1}")
        for s in samples:
            self._sample(s)

    def _sample(self, s: ScoredSample) -> None:
        for name in ("prompt_token_ids", "response_token_ids"):
            ids = getattr(s, name)
            if ids and (min(ids) < 0 or max(ids) >= self.vocab):
                raise ValueError(
                    f"sample {s.sample_index}: {name} outside the vocabulary [0, {self.vocab}): "
                    f"{min(ids)}..{max(ids)}"
                )
        if not all(map(math.isfinite, s.response_logprobs)):
            raise ValueError(f"sample {s.sample_index}: a response logprob is not finite")
        if not math.isfinite(s.reward):
            raise ValueError(f"sample {s.sample_index}: reward {s.reward} is not finite")
        for name in _OPTIONAL_NUMBERS:
            v = getattr(s, name)
            if v is not None and not math.isfinite(v):
                raise ValueError(f"sample {s.sample_index}: {name} {v} is not finite")
