"""Wide expert parallelism on one machine (issue 39): a DP x EP engine over every GPU here
(data_parallel_size = the GPU count, enable_expert_parallel) with each all2all backend
(allgather_reducescatter; deepep_v2 where deep_ep imports), generating from the tiny MoE model,
and the transport record (components/rollout/transport.py) saying what the engine got: the
backend vLLM resolved, EP size = GPU count, one node so `nvlink-only`. Run by
`tests/gpu/run.sh`; skipped with its reason under 2 CUDA GPUs or without the CUDA vllm wheel.
Across nodes (the EFA paths) needs a rollout group of 2+ nodes: not here.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

from moerl.config import parse_config

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not torch.cuda.is_available() or torch.cuda.device_count() < 2,
        reason=f"needs 2+ CUDA GPUs (this machine has "
        f"{torch.cuda.device_count() if torch.cuda.is_available() else 0}; tests/gpu/run.sh)",
    ),
]

PROMPTS = [[20, 22, 23, 26, 14, 5, 6], [11, 12, 13], [6, 6, 8, 14, 15, 16, 17]]
BACKENDS = ("allgather_reducescatter", "deepep_v2")


@pytest.fixture(scope="module")
def tiny_moe(tmp_path_factory) -> Path:
    vllm = pytest.importorskip("vllm")
    if "cpu" in getattr(vllm, "__version__", ""):
        pytest.skip(f"needs the CUDA vllm wheel (this is vllm {vllm.__version__})")
    from moerl.models.tiny import build_tiny_model

    return build_tiny_model(
        parse_config({}).model.tiny, Path(tmp_path_factory.mktemp("wide")) / "m"
    )


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_dp_x_ep_engine_over_every_gpu_generates_and_records_its_transport(tiny_moe, backend):
    if backend.startswith("deepep") and importlib.util.find_spec("deep_ep") is None:
        pytest.skip(f"all2all_backend {backend} needs DeepEP (the deep_ep module is not installed)")
    from moerl.components.rollout.engine import RolloutEngine
    from moerl.components.rollout.transport import check_engine_transport

    gpus = torch.cuda.device_count()
    cfg = parse_config(
        {
            "rollout": {
                "device": "cuda",
                "data_parallel_size": gpus,
                "enable_expert_parallel": True,
                "all2all_backend": backend,
                "enforce_eager": True,
                "gpu_memory_utilization": 0.3,
                "kv_cache_gib": 0.25,
                "max_new_tokens": 12,
                "max_num_seqs": 16,
            },
            # what a run asking for DeepEP sets; the check raises if vLLM changed the backend
            "require": {"deepep": backend.startswith("deepep")},
        }
    )
    eng = RolloutEngine(tiny_moe, cfg.rollout)
    try:
        record = check_engine_transport(cfg, eng.core.vllm_config)
        groups = eng.generate(PROMPTS, n=2)
    finally:
        eng.close()
    print(f"\n{backend} over {gpus} GPUs: " + ", ".join(f"{k}={v}" for k, v in record.items()))
    assert record["rollout.transport.all2all_backend"] == backend
    assert record["rollout.transport.expert_parallel"] == "true"
    assert record["rollout.transport.ep_size"] == str(gpus)
    assert record["rollout.transport.dp_size"] == str(gpus)
    assert record["rollout.transport.path"] == "nvlink-only"
    assert len(groups) == len(PROMPTS) and all(len(g) == 2 for g in groups)
    for g in groups:
        for c in g:
            assert c.token_ids and len(c.logprobs) == len(c.token_ids)
            assert all(lp <= 0.0 for lp in c.logprobs)
