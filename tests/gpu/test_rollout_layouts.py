"""Rollout engines on CUDA (issue 37): the hot swap by name at TP = 1 (CUDA graphs on) against a
fresh load, bf16 serving (rollout.dtype) against a float32 engine and transformers, and, on a
machine with 2+ GPUs, TP = 2 and DP 2 x EP 2 with each all2all backend (allgather_reducescatter,
deepep_v2). Run by `tests/gpu/run.sh`; skipped without CUDA and the CUDA vllm wheel.

Each engine's logprobs are compared with transformers in float32 on the engine's own sampled
tokens (so dtypes need not sample alike). The bf16 tolerance is calibrated on the spot: four
times transformers' own bf16-vs-fp32 error on the same tokens, at least 0.05. The tiny model
keeps every engine start short; the multi-GPU engines run eager (CUDA graphs are checked at
TP = 1). A DP x EP engine runs on the AsyncLLM core (rollout.engine_api auto), as on CPU
(tests/rollout/test_async_engine.py, DP 2 with a dense model there).
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import pytest
import torch

from moerl.config import parse_config
from moerl.models.tiny import build_tiny_model

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (tests/gpu/run.sh)"),
]

PROMPTS = [[20, 22, 23, 26, 14, 5, 6], [11, 12, 13], [6, 6, 8, 14, 15, 16, 17]]
PROBE = [20, 22, 23, 26, 14, 5, 6, 7, 8, 16]
BACKENDS = ("allgather_reducescatter", "deepep_v2")


def _vllm_cuda() -> None:
    vllm = pytest.importorskip("vllm")
    if "cpu" in getattr(vllm, "__version__", ""):
        pytest.skip(f"needs the CUDA vllm wheel (this is vllm {vllm.__version__})")


def _two_gpus() -> None:
    if torch.cuda.device_count() < 2:
        pytest.skip(f"needs 2 GPUs; this machine has {torch.cuda.device_count()}")


def _rollout(**keys):
    """A small CUDA engine: 0.25 GiB of KV cache, so two engines fit one GPU at once."""
    base = {
        "device": "cuda",
        "gpu_memory_utilization": 0.3,
        "kv_cache_gib": 0.25,
        "max_new_tokens": 12,
        "max_num_seqs": 16,
    }
    return parse_config({"rollout": base | keys}).rollout


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    _vllm_cuda()
    root = Path(tmp_path_factory.mktemp("layouts"))
    tiny = parse_config({}).model.tiny
    a = build_tiny_model(tiny, root / "a")
    b = build_tiny_model(tiny.model_copy(update={"seed": 1}), root / "b")
    return a, b


def _probe(engine) -> tuple[list[int], list[float]]:
    """Greedy tokens and the engine's logprob of each (the prefix cache holds PROBE after)."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    sp = SamplingParams(temperature=0.0, max_tokens=6, logprobs=0)
    (out,) = engine.llm.generate([TokensPrompt(prompt_token_ids=PROBE)], sp, use_tqdm=False)
    o = out.outputs[0]
    return list(o.token_ids), [step[t].logprob for step, t in zip(o.logprobs, o.token_ids)]


def _hf_logprobs(path: Path, seqs: list[tuple[list[int], list[int]]], dtype) -> list[float]:
    """transformers' logprob of every response token of (prompt, response) pairs, on the CPU."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).eval()
    out: list[float] = []
    with torch.no_grad():
        for prompt, resp in seqs:
            ids = torch.tensor([prompt + resp])
            logp = model(input_ids=ids).logits[0].float().log_softmax(-1)
            pos = torch.arange(len(prompt) - 1, len(prompt) + len(resp) - 1)
            out += logp[pos, torch.tensor(resp)].tolist()
    return out


def _against_transformers(path: Path, engine, label: str) -> tuple[float, float]:
    """The engine's seeded samples (temperature 1: processed logprobs are the raw ones) against
    transformers in float32 on the same tokens: (the largest difference, the bf16 tolerance)."""
    groups = engine.generate(PROMPTS, n=2)
    seqs = [(p, c.token_ids) for p, cs in zip(PROMPTS, groups) for c in cs]
    got = [x for cs in groups for c in cs for x in c.logprobs]
    assert len(got) == sum(len(r) for _, r in seqs) > 0
    ref = _hf_logprobs(path, seqs, torch.float32)
    hf_bf16 = _hf_logprobs(path, seqs, torch.bfloat16)
    err = max(abs(x - y) for x, y in zip(got, ref))
    hf_err = max(abs(x - y) for x, y in zip(hf_bf16, ref))
    tol = max(4 * hf_err, 0.05)
    print(
        f"\n{label}: {len(got)} tokens, max |engine - transformers fp32| {err:.2e} "
        f"(transformers bf16: {hf_err:.2e}; bf16 tolerance {tol:.2e})"
    )
    return err, tol


def _dtypes(engine) -> set[str]:
    """The parameter dtypes on every rank (from the digests, `<shape>:<dtype>:...`)."""
    return {
        d.split(":")[1]
        for rank in engine.core.collective_rpc("moerl_param_digests")
        for d in rank.values()
    }


@pytest.fixture(scope="module")
def fresh_b(ckpts):
    """A fresh TP = 1 engine on B with the CUDA defaults (bf16, CUDA graphs): its digests and
    greedy probe, the reference of the swap; and its samples against transformers."""
    from moerl.components.rollout.engine import RolloutEngine

    eng = RolloutEngine(ckpts[1], _rollout())
    try:
        return (
            eng.core.collective_rpc("moerl_param_digests"),
            _probe(eng),
            _dtypes(eng),
            _against_transformers(ckpts[1], eng, "bf16 engine, TP 1"),
        )
    finally:
        eng.close()


def test_a_cuda_hot_swap_by_name_equals_a_fresh_load(ckpts, fresh_b):
    """The hot swap on a multi-process CUDA engine with CUDA graphs: `moerl_swap` called by name
    (no pickled function, no VLLM_ALLOW_INSECURE_SERIALIZATION), every parameter's digest equal to
    a fresh load's, the same greedy tokens and logprobs, after A's KV sat in the prefix cache."""
    from moerl.components.rollout.engine import RolloutEngine

    assert os.environ.get("VLLM_ALLOW_INSECURE_SERIALIZATION", "0") in ("", "0")
    ref_digests, ref_probe, _, _ = fresh_b
    a, b = ckpts
    eng = RolloutEngine(a, _rollout())
    try:
        assert (
            not eng.cfg.resolved.engine_in_process and not eng.cfg.resolved.enforce_eager
        )  # the GPU defaults
        on_a = eng.core.collective_rpc("moerl_param_digests")
        _probe(eng)  # A's KV in the prefix cache: a stale cache would show below
        stats = eng.swap_weights(b, version=1)
        digests = eng.core.collective_rpc("moerl_param_digests")
        tokens, lps = _probe(eng)
    finally:
        eng.close()
    print(f"\nCUDA hot swap TP 1: {stats.bytes / 1e6:.1f} MB in {stats.seconds:.3f} s")
    assert stats.ranks == 1 and not stats.reloaded and eng.version == 1
    assert on_a != ref_digests  # A and B differ, so the comparison has teeth
    assert digests == ref_digests
    assert tokens == ref_probe[0]
    diff = max(abs(x - y) for x, y in zip(lps, ref_probe[1]))
    print(f"greedy probe after the swap vs a fresh load: max logprob difference {diff:.2e}")
    assert diff <= 1e-3


def test_bf16_serving_is_within_bf16_of_a_float32_engine_and_transformers(ckpts, fresh_b):
    """rollout.dtype: the CUDA default serves bfloat16 (every parameter bf16 on the rank); its
    logprobs are within the calibrated bf16 tolerance of transformers in float32, and a
    rollout.dtype float32 engine is within 2e-3."""
    from moerl.components.rollout.engine import RolloutEngine

    _, _, dtypes, (err_bf16, tol) = fresh_b
    assert dtypes == {"torch.bfloat16"}, dtypes
    eng = RolloutEngine(ckpts[1], _rollout(dtype="float32", enforce_eager=True))
    try:
        assert _dtypes(eng) == {"torch.float32"}
        err_fp32, _ = _against_transformers(ckpts[1], eng, "float32 engine, TP 1")
    finally:
        eng.close()
    assert err_fp32 <= 2e-3
    assert err_bf16 <= tol


def test_a_tp2_engine_swaps_on_both_ranks_and_serves_like_transformers(ckpts):
    """TP = 2 over NCCL (eager): both ranks hold a shard of their own, a hot swap reaches both with
    one version and a digest each, and the bf16 samples are within the bf16 tolerance."""
    _two_gpus()
    from moerl.components.rollout.engine import RolloutEngine

    a, b = ckpts
    eng = RolloutEngine(a, _rollout(tensor_parallel_size=2, enforce_eager=True))
    try:
        ranks = eng.core.collective_rpc("moerl_rank")
        assert sorted(r["tp_rank"] for r in ranks) == [0, 1]
        stats = eng.swap_weights(b, version=1)
        assert stats.ranks == 2 and len(set(stats.digests)) == 2 and not stats.reloaded
        err, tol = _against_transformers(b, eng, "bf16 engine, TP 2")
    finally:
        eng.close()
    assert err <= tol


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_dp2_ep2_engine_serves_and_swaps(ckpts, backend):
    """DP 2 x EP 2 (eager): the MoE layers expert-parallel over two GPUs through `backend`; a
    swap reaches both ranks; the bf16 samples are within the bf16 tolerance."""
    _two_gpus()
    if backend.startswith("deepep") and importlib.util.find_spec("deep_ep") is None:
        pytest.skip(f"all2all_backend {backend} needs DeepEP (the deep_ep module is not installed)")
    from moerl.components.rollout.cores import AsyncCore
    from moerl.components.rollout.engine import RolloutEngine

    a, b = ckpts
    cfg = _rollout(
        data_parallel_size=2,
        enable_expert_parallel=True,
        all2all_backend=backend,
        enforce_eager=True,
    )
    eng = RolloutEngine(a, cfg)
    try:
        assert isinstance(eng.core, AsyncCore)
        ranks = eng.core.collective_rpc("moerl_rank")
        assert sorted(r["dp_rank"] for r in ranks) == [0, 1]
        stats = eng.swap_weights(b, version=1)
        # experts split over the two ranks: each loads its own, so their digests differ
        assert stats.ranks == 2 and not stats.reloaded and len(set(stats.digests)) == 2
        err, tol = _against_transformers(b, eng, f"bf16 engine, DP 2 x EP 2, {backend}")
    finally:
        eng.close()
    assert err <= tol
