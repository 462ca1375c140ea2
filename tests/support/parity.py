"""Engine vs trainer logprobs on the engine's own samples: the completions of each prompt as
TrainSamples, scored by the transformers model at `path` in float32 (`sequence_logprobs`, the
trainer's own), with the sampling's temperature / top-k / top-p."""

from __future__ import annotations

from pathlib import Path

import torch


def trainer_and_engine_logprobs(
    path: Path | str,
    prompts: list[list[int]],
    comps: list[list],
    temperature: float = 1.0,
    top_k: int = -1,
    top_p: float = 1.0,
    model=None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(trainer, engine) logprobs of every response token, flattened in the same order.
    `model`: an already loaded model of `path` (else it is loaded in float32)."""
    from transformers import AutoModelForCausalLM

    from moerl.components.policy_update.trainer import pack, sequence_logprobs
    from moerl.records import TrainSample

    batch = [
        TrainSample(
            prompt_token_ids=p,
            response_token_ids=c.token_ids,
            response_logprobs=c.logprobs,
            advantage=0.0,
            policy_version=0,
        )
        for p, cs in zip(prompts, comps)
        for c in cs
    ]
    if model is None:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    packed = pack(batch, pad_id=model.config.pad_token_id or 0)
    with torch.no_grad():
        logp, _ = sequence_logprobs(
            model, packed, torch.arange(len(batch)), temperature, top_k, top_p
        )
    mask = packed.mask_NL1.bool()
    return logp[mask], packed.engine_logp_NL1[mask]
