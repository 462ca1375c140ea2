"""FP8 serving on one CUDA GPU (rollout.quantization fp8): vLLM quantizes the weights it loads to
FP8, and every version after the first reaches them by moerl's hot swap (reload_weights through
hotswap.hot_swap, FP8 parameters re-quantized in place). Run by `tests/gpu/run.sh`; skipped
without CUDA and the CUDA vllm wheel.

An FP8 engine starts on the tiny MoE checkpoint A, is hot-swapped to B (version 1) and back to A
(version 2). After each swap its prompt logprobs of fixed token sequences (the same tokens on
every engine) are compared with a bf16 engine loaded fresh on the same checkpoint. Tolerance: the
mean |FP8 - bf16| over all tokens at most 0.05 nats and at most a quarter of the mean |A - B|
between the two bf16 engines (so a swap that did not land, leaving the other version's weights,
fails), and no token beyond 0.5 nats. The engines run one at a time, eager.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from moerl.config import parse_config
from moerl.models.tiny import build_tiny_model

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (tests/gpu/run.sh)"),
]

SEQS = [
    [20, 22, 23, 26, 14, 5, 6, 7, 8, 16, 30, 31, 12, 9],
    [11, 12, 13, 40, 41, 42, 43, 6, 6, 8, 14, 15],
    [6, 6, 8, 14, 15, 16, 17, 50, 51, 52, 3, 4, 5, 60],
]
MEAN_TOL, MAX_TOL = 0.05, 0.5


def _vllm_cuda() -> None:
    vllm = pytest.importorskip("vllm")
    if "cpu" in getattr(vllm, "__version__", ""):
        pytest.skip(f"needs the CUDA vllm wheel (this is vllm {vllm.__version__})")


def _rollout(**keys):
    base = {
        "device": "cuda",
        "gpu_memory_utilization": 0.3,
        "kv_cache_gib": 0.25,
        "max_num_seqs": 8,
        "enforce_eager": True,
    }
    return parse_config({"rollout": base | keys}).rollout


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    _vllm_cuda()
    root = Path(tmp_path_factory.mktemp("fp8"))
    tiny = parse_config({}).model.tiny
    return (
        build_tiny_model(tiny, root / "a"),
        build_tiny_model(tiny.model_copy(update={"seed": 1}), root / "b"),
    )


def _score(engine) -> list[float]:
    """The engine's logprob of every token of SEQS after the first, from its prompt logprobs."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    sp = SamplingParams(temperature=1.0, max_tokens=1, prompt_logprobs=0)
    outs = engine.llm.generate([TokensPrompt(prompt_token_ids=s) for s in SEQS], sp, use_tqdm=False)
    return [
        out.prompt_logprobs[i][tok].logprob
        for s, out in zip(SEQS, outs)
        for i, tok in enumerate(s)
        if i > 0
    ]


def _dtypes(engine) -> set[str]:
    """The parameter dtypes on the engine's rank (`<shape>:<dtype>:...` digests)."""
    return {
        d.split(":")[1]
        for rank in engine.core.collective_rpc("moerl_param_digests")
        for d in rank.values()
    }


def _mean_max(x: list[float], y: list[float]) -> tuple[float, float]:
    assert len(x) == len(y) > 0
    d = [abs(a - b) for a, b in zip(x, y)]
    return sum(d) / len(d), max(d)


@pytest.fixture(scope="module")
def bf16(ckpts) -> tuple[list[float], list[float]]:
    """Fresh bf16 engines' logprobs on A, then on B (one engine at a time)."""
    from moerl.components.rollout.engine import RolloutEngine

    out = []
    for path in ckpts:
        eng = RolloutEngine(path, _rollout())
        try:
            out.append(_score(eng))
        finally:
            eng.close()
    return out[0], out[1]


def test_an_fp8_engine_hot_swaps_twice_and_serves_like_bf16(ckpts, bf16):
    from moerl.components.rollout.engine import RolloutEngine

    a, b = ckpts
    ref_a, ref_b = bf16
    apart, _ = _mean_max(ref_a, ref_b)
    tol = min(MEAN_TOL, apart / 4)
    eng = RolloutEngine(a, _rollout(quantization="fp8"))
    try:
        assert "torch.float8_e4m3fn" in _dtypes(eng)  # the linear weights are stored in FP8
        on_a = _score(eng)
        s1 = eng.swap_weights(b, version=1)
        on_b = _score(eng)
        s2 = eng.swap_weights(a, version=2)
        back_on_a = _score(eng)
        assert "torch.float8_e4m3fn" in _dtypes(eng)  # still FP8 after two swaps
    finally:
        eng.close()
    assert not s1.reloaded and not s2.reloaded and eng.version == 2
    rows = [
        ("A at start", on_a, ref_a),
        ("B after swap 1", on_b, ref_b),
        ("A after swap 2", back_on_a, ref_a),
    ]
    print(f"\nbf16 A vs B: mean |diff| {apart:.3e}; FP8 tolerance: mean {tol:.3e}, max {MAX_TOL}")
    for label, got, ref in rows:
        mean, worst = _mean_max(got, ref)
        print(f"FP8 {label} vs bf16: mean |diff| {mean:.3e}, max {worst:.3e}")
        assert mean <= tol, (label, mean, tol)
        assert worst <= MAX_TOL, (label, worst)
