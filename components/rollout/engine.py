"""A vLLM engine that generates G samples per prompt and returns the engine's token logprobs.

The engine reports `processed_logprobs`: the logprob of each sampled token under the
temperature-scaled distribution the sampler drew from, which is what the trainer recomputes
(logits / temperature) for the PPO ratio and the importance weight.

Limitations: one engine per process. With `engine_in_process` (the CPU default) vLLM's
engine core runs inside the caller (VLLM_ENABLE_V1_MULTIPROCESSING=0, executor "uni"), which is
set in the environment before the engine is built and therefore applies to the whole process.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass
from pathlib import Path

from moerl.config import RolloutConfig

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Completion:
    token_ids: list[int]
    logprobs: list[float]
    text: str
    finish_reason: str


class RolloutEngine:
    """vLLM `LLM` over a local HF checkpoint directory."""

    def __init__(self, model_dir: str | Path, cfg: RolloutConfig, dtype: str = "float32", seed: int | None = None):
        if cfg.engine_in_process:
            os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        from vllm import LLM

        self.cfg = cfg
        t0 = time.perf_counter()
        kwargs = dict(
            model=str(model_dir),
            dtype=dtype,
            seed=cfg.seed if seed is None else seed,
            gpu_memory_utilization=cfg.gpu_memory_utilization,
            enforce_eager=cfg.enforce_eager,
            max_num_seqs=cfg.max_num_seqs,
            logprobs_mode="processed_logprobs",
            disable_log_stats=True,
        )
        if cfg.max_model_len is not None:
            kwargs["max_model_len"] = cfg.max_model_len
        if cfg.engine_in_process:
            kwargs["distributed_executor_backend"] = "uni"
        if cfg.enable_expert_parallel:  # GPU only (validated in config): vLLM EP + its all2all kernels
            kwargs["enable_expert_parallel"] = True
            kwargs["all2all_backend"] = cfg.all2all_backend
        self.llm = LLM(**kwargs)
        self.load_s = time.perf_counter() - t0
        log.info("vLLM engine loaded %s in %.1f s", model_dir, self.load_s)

    def sampling_params(self, n: int):
        from vllm import SamplingParams

        c = self.cfg
        return SamplingParams(n=n, temperature=c.temperature, top_p=c.top_p, top_k=c.top_k,
                              max_tokens=c.max_new_tokens, logprobs=0)

    def generate(self, prompts_token_ids: list[list[int]], n: int) -> list[list[Completion]]:
        """n completions for each prompt, in prompt order."""
        from vllm.inputs import TokensPrompt

        outs = self.llm.generate([TokensPrompt(prompt_token_ids=ids) for ids in prompts_token_ids],
                                 self.sampling_params(n), use_tqdm=False)
        result = []
        for out in outs:
            comps = []
            for o in out.outputs:
                ids = list(o.token_ids)
                lps = [float(step[tok].logprob) for step, tok in zip(o.logprobs or [], ids)]
                if len(lps) != len(ids):
                    raise RuntimeError(f"engine returned {len(lps)} logprobs for {len(ids)} tokens")
                comps.append(Completion(ids, lps, o.text, str(o.finish_reason)))
            result.append(comps)
        return result

    def swap_weights(self, model_dir: str | Path, bucket_mb: int = 512):
        """Hot-swap to the checkpoint in `model_dir` (see redistribute_weights/hotswap.py)."""
        from moerl.components.redistribute_weights.hotswap import hot_swap

        return hot_swap(self.llm, model_dir, bucket_mb)

    def close(self) -> None:
        # Drop the engine so its memory and (if any) worker processes go with it.
        llm, self.llm = self.llm, None
        del llm
