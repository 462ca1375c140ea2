"""The trainer's GPU numbers, on one GPU: the grouped expert GEMMs against the per-expert loop
(equal in bf16, and how much faster), and the FSDP2 + EP step of a ~1 B-parameter Qwen3-MoE
over NCCL with bf16 mixed precision: tokens/s/GPU, MFU, and `max_memory_allocated` against
the static formula of `moerl bench project` (16 bytes per parameter) plus the activations the
same formula predicts. Run by `tests/gpu/run.sh`; skipped without CUDA.

The model is random-init from a config (no hub download), with the embedded tokenizer's
27-token vocabulary, so the head costs nothing and the numbers are the decoder's.

Limitations: one GPU, so EP = 1 (the dispatcher moves no tokens) and FSDP shards over one
rank: the all-to-all and DeepEP comparison needs several GPUs (`kernels/gpu_bench.sh`). MFU is
model FLOPs (8 x active parameters x tokens: the pi_old forward, then forward and backward;
attention scores and recomputation not counted) over the H200's dense bf16 peak, 989 TFLOP/s.
"""

from __future__ import annotations

import os
import time

import pytest
import torch

from moerl.config import TinyMoeConfig, parse_config
from moerl.models.tiny import build_tiny_model
from moerl.records import TrainSample, write_records
from tests.support.weights import read_weights

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (tests/gpu/run.sh)"),
]

H200_BF16_PEAK = 989e12
# ~1 B parameters, ~0.15 B active: 12 layers, 64 experts of width 512, top-8
SCALE_MODEL = dict(
    hidden_size=1024,
    num_layers=12,
    num_heads=16,
    num_kv_heads=4,
    head_dim=64,
    num_experts=64,
    experts_per_token=8,
    moe_intermediate_size=512,
    max_position_embeddings=4096,
)


def grouped_vs_loop(
    device: str,
    local_experts: int = 32,
    hidden: int = 2048,
    width: int = 768,
    rows: int = 16384,
    repeats: int = 10,
) -> dict[str, float]:
    """Forward and backward of one rank's experts on `rows` routed rows, grouped GEMM and loop:
    the largest relative difference of outputs and gradients, and the time of each."""
    import torch.nn.functional as F

    from moerl.components.policy_update.ep_moe import LocalExperts
    from tests.support.oracles import experts_loop

    g = torch.Generator().manual_seed(0)
    dt = torch.bfloat16 if device == "cuda" else torch.float32
    w1 = (torch.randn(local_experts, 2 * width, hidden, generator=g) * hidden**-0.5).to(device, dt)
    w2 = (torch.randn(local_experts, hidden, width, generator=g) * width**-0.5).to(device, dt)
    experts = LocalExperts(w1, w2, F.silu)
    share = torch.distributions.Dirichlet(torch.ones(local_experts)).sample()
    counts = torch.floor(share * rows).long()
    counts[0] += rows - int(counts.sum())
    x = torch.randn(rows, hidden, generator=g).to(device, dt)
    dy = torch.randn(rows, hidden, generator=g).to(device, dt)
    counts = counts.to(device)

    def run(fn):
        experts.zero_grad(set_to_none=True)
        xi = x.detach().requires_grad_()
        y = fn(xi)
        y.backward(dy)
        return y.detach().float(), xi.grad.float(), experts.gate_up_proj_LIH.grad.float()

    def clocked(fn) -> float:
        for _ in range(2):
            run(fn)
        if device == "cuda":
            torch.cuda.synchronize()
        t = time.perf_counter()
        for _ in range(repeats):
            run(fn)
        if device == "cuda":
            torch.cuda.synchronize()
        return (time.perf_counter() - t) / repeats

    grouped = run(lambda xi: experts(xi, counts))
    loop = run(lambda xi: experts_loop(experts, xi, counts))
    rel = max(float((a - b).norm() / b.norm()) for a, b in zip(grouped, loop))
    t_grouped = clocked(lambda xi: experts(xi, counts))
    t_loop = clocked(lambda xi: experts_loop(experts, xi, counts))
    flops = 3 * 2 * rows * hidden * 3 * width  # forward + backward of the three expert GEMMs
    return {
        "rel_diff": rel,
        "grouped_s": t_grouped,
        "loop_s": t_loop,
        "grouped_tflops": flops / t_grouped / 1e12,
        "loop_tflops": flops / t_loop / 1e12,
    }


def scale_batch(n: int, prompt: int, response: int, seed: int = 0) -> list[TrainSample]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        ids = torch.randint(4, 27, (prompt + response,), generator=g).tolist()
        out.append(
            TrainSample(
                prompt_token_ids=ids[:prompt],
                response_token_ids=ids[prompt:],
                response_logprobs=[-3.0] * response,
                advantage=(-1.0) ** i,
                policy_version=0,
            )
        )
    return out


def active_params(t: TinyMoeConfig, vocab: int = 27) -> int:
    """Parameters one token goes through: attention, norms, the router, k experts, embedding row, head."""
    h, hd = t.hidden_size, t.head_dim
    attn = h * hd * (t.num_heads * 2 + t.num_kv_heads * 2)
    experts = t.experts_per_token * 3 * h * t.moe_intermediate_size
    return t.num_layers * (attn + experts + h * t.num_experts) + 2 * vocab * h


def prepare(root, model: dict, samples: int, prompt: int, response: int):
    """The random-init model (TinyMoeConfig fields) and a batch of `samples` sequences."""
    build_tiny_model(TinyMoeConfig(**model), root / "s0")
    write_records(root / "batch.jsonl", scale_batch(samples, prompt, response))
    return root


def fsdp_step(
    root, out, device: str, model: dict, samples: int, prompt: int, response: int, **sections
) -> dict[str, float]:
    """One policy update of the mesh trainer on `prepare`'s model and batch, written to `out`;
    its metrics plus tokens/s/GPU, MFU and the memory formula's numbers."""

    from moerl.components.policy_update.launcher import run_expert_parallel

    t = TinyMoeConfig(**model)
    state = root / "s0"
    base = {
        "parallelism": {"device": device, "launcher": "torchrun", "mixed_precision": "bf16"},
        "optimizer": {"learning_rate": 1e-5, "optimizer_steps_per_iteration": 2},
    }
    cfg = parse_config(
        {
            "model": {"tiny": model},
            "trainer": {  # `sections` merged over these, key by key
                s: base.get(s, {}) | sections.get(s, {}) for s in base | sections
            },
        }
    )
    m = run_expert_parallel(cfg, root / "batch.jsonl", state, out, iteration=0)
    params = sum(x.numel() for x in read_weights(state).values())
    tokens = samples * (prompt + response)
    act = active_params(t)
    steps_s = m["timing/trainer_steps_s"]
    # the memory formula of benchmarks/memfit.py at one GPU: static 16 B/param; activations
    # per token of one micro-batch, bf16, with checkpointing L*2h + one layer's
    h, k, width, L = t.hidden_size, t.experts_per_token, t.moe_intermediate_size, t.num_layers
    per_layer = 2 * (8 * h + k * (2 * h + 3 * width))
    act_per_token = (
        (L * 2 * h + per_layer)
        if cfg.trainer.parallelism.activation_checkpointing
        else L * per_layer
    )
    micro = cfg.trainer.parallelism.micro_batch_tokens or tokens
    return {
        **m,
        "params": params,
        "active_params": act,
        "tokens": tokens,
        "tokens_per_s_per_gpu": tokens
        * 1
        / steps_s,  # every token: pi_old forward + one forward/backward
        "mfu": 8 * act * tokens / steps_s / H200_BF16_PEAK,
        "static_gb": params * 16 / 1e9,
        "activation_gb": micro * act_per_token / 1e9,
    }


def test_grouped_gemm_equals_the_loop_and_is_faster_in_bf16():
    r = grouped_vs_loop("cuda")
    print(
        f"\ngrouped expert GEMM, 32 local experts, 16384 rows, h 2048, I 768, bf16, fwd+bwd: "
        f"grouped {r['grouped_s'] * 1e3:.2f} ms ({r['grouped_tflops']:.0f} TFLOP/s), loop {r['loop_s'] * 1e3:.2f} ms "
        f"({r['loop_tflops']:.0f} TFLOP/s): x{r['loop_s'] / r['grouped_s']:.2f}; max rel diff {r['rel_diff']:.2e}"
    )
    assert r["rel_diff"] < 2e-2  # bf16: different accumulation order only
    assert r["grouped_s"] < r["loop_s"]


# samples, prompt, response tokens
SHAPE = (
    int(os.environ.get("MOERL_GPU_SAMPLES", 192)),
    128,
    896,
)
STEPS = 6  # optimizer steps: 32 sequences (32k tokens) each, past the first step's warm-up


@pytest.fixture(scope="module")
def scale_state(tmp_path_factory):
    return prepare(tmp_path_factory.mktemp("scale"), SCALE_MODEL, *SHAPE)


@pytest.mark.parametrize("ac", [False, True], ids=["no-ac", "ac"])
def test_fsdp2_ep_step_tokens_per_gpu_mfu_and_memory(scale_state, tmp_path, ac):
    samples, prompt, response = SHAPE
    r = fsdp_step(
        scale_state,
        tmp_path / "out",
        "cuda",
        SCALE_MODEL,
        samples,
        prompt,
        response,
        parallelism={"activation_checkpointing": ac, "micro_batch_tokens": 16384},
        optimizer={"optimizer_steps_per_iteration": STEPS},
    )
    print(
        f"\nfsdp2+ep bf16 one H200, {r['params'] / 1e9:.2f} B params ({r['active_params'] / 1e9:.3f} B active), "
        f"{samples} x {prompt + response} tokens, {STEPS} steps, activation checkpointing {ac}: "
        f"{r['tokens_per_s_per_gpu']:.0f} tokens/s/GPU, MFU {100 * r['mfu']:.1f} %, "
        f"peak {r['train/cuda_max_memory_gb']:.2f} GB vs static {r['static_gb']:.2f} + activations "
        f"{r['activation_gb']:.2f} GB (formula); load {r['timing/trainer_load_s']:.1f} s, steps "
        f"{r['timing/trainer_steps_s']:.1f} s, save {r['timing/trainer_save_s']:.1f} s"
    )
    assert r["train/steps"] == STEPS and r["train/skipped_steps"] == 0
    # the formula's static part is a floor; the peak stays within static + activations + a
    # one-layer allowance (gathered bf16 weights, the chunk of logits), x1.5 for the allocator
    assert (
        r["static_gb"]
        <= r["train/cuda_max_memory_gb"]
        <= 1.5 * (r["static_gb"] + r["activation_gb"]) + 1.0
    )


def _batch_file(root, n=16, vocab=64):
    g = torch.Generator().manual_seed(1)
    out = []
    for i in range(n):
        ids = torch.randint(5, min(vocab, 60), (9,), generator=g).tolist()
        out.append(
            TrainSample(
                prompt_token_ids=ids[:5],
                response_token_ids=ids[5:],
                response_logprobs=[-3.0] * 4,
                advantage=(1.0 + i / 8) * (-1) ** i,
                policy_version=0,
            )
        )
    write_records(root / "batch.jsonl", out)
    return root / "batch.jsonl"


def test_deepseek_v3_on_nccl_bf16_with_its_router_bias(tmp_path):
    """DeepSeek-V3 (MLA, shared experts, sigmoid router with grouped top-k) on the mesh over NCCL
    with bf16 mixed precision: the loss is the float32 CPU trainer's within bf16 precision, and
    trainer.moe.router_bias_update_rate moves the bias by whole rates as on the CPU."""

    from moerl.components.policy_update.trainer import run_policy_update
    from tests.support.families import family

    path = family("deepseek_v3", tmp_path / "dsv3")
    batch = _batch_file(tmp_path)
    key = next(k for k in read_weights(path) if k.endswith("e_score_correction_bias"))
    out = {}
    for dev, extra in (("cpu", {}), ("cuda", {"launcher": "torchrun", "mixed_precision": "bf16"})):
        cfg = parse_config(
            {
                "trainer": {
                    "parallelism": {"device": dev, **extra},
                    "optimizer": {"optimizer_steps_per_iteration": 2, "learning_rate": 1e-3},
                    "moe": {"router_bias_update_rate": 0.01},
                }
            }
        )
        m = run_policy_update(cfg, batch, path, tmp_path / dev, iteration=0)
        out[dev] = (m, read_weights(tmp_path / dev)[key])
    (mc, bc), (mg, bg) = out["cpu"], out["cuda"]
    b0 = read_weights(path)[key]
    print(
        f"\ndeepseek-v3 tiny: loss cpu fp32 {mc['train/loss']:.5f}, cuda bf16 {mg['train/loss']:.5f}; bias steps cpu "
        f"{((bc - b0) / 0.01).round().tolist()}, cuda {((bg - b0) / 0.01).round().tolist()}"
    )
    assert mg["train/steps"] == 2 and mg["train/loss"] == pytest.approx(
        mc["train/loss"], rel=5e-2, abs=1e-3
    )
    steps = (bg - b0) / 0.01
    assert torch.allclose(steps, steps.round(), atol=1e-3) and steps.abs().sum() > 0


def test_a_single_process_version_continues_on_the_cuda_mesh(tmp_path):
    """optimizer.pt from the single-process trainer, resharded onto the mesh over NCCL (one GPU:
    the mesh path needs bf16 there): the step follows the single process's next one much more
    closely than a step with a fresh optimizer does (median over tensors, relative to the step)."""
    import shutil
    import statistics

    from moerl.components.policy_update.trainer import run_policy_update

    build_tiny_model(parse_config({}).model.tiny, tmp_path / "s0")
    batch = _batch_file(tmp_path, vocab=27)
    single = parse_config(
        {
            "trainer": {
                "parallelism": {"device": "cuda"},
                "optimizer": {"optimizer_steps_per_iteration": 2, "learning_rate": 1e-3},
            }
        }
    )
    mesh = parse_config(
        {
            "trainer": {
                "parallelism": {
                    "device": "cuda",
                    "launcher": "torchrun",
                    "mixed_precision": "bf16",
                },
                "optimizer": {"optimizer_steps_per_iteration": 2, "learning_rate": 1e-3},
            }
        }
    )
    run_policy_update(single, batch, tmp_path / "s0", tmp_path / "s1", iteration=0)
    run_policy_update(single, batch, tmp_path / "s1", tmp_path / "one", iteration=1)
    run_policy_update(mesh, batch, tmp_path / "s1", tmp_path / "mesh", iteration=1)
    shutil.copytree(
        tmp_path / "s1",
        tmp_path / "fresh",
        ignore=shutil.ignore_patterns("optimizer.pt", "state.json"),
    )
    run_policy_update(mesh, batch, tmp_path / "fresh", tmp_path / "control", iteration=1)
    w1, a, b, c = (read_weights(tmp_path / d) for d in ("s1", "one", "mesh", "control"))

    def off(x):
        return statistics.median(
            float((x[k] - a[k]).norm()) / (float((a[k] - w1[k]).norm()) + 1e-9) for k in a
        )

    print(
        f"\noptimizer.pt -> cuda mesh (bf16 compute): median tensor off the single process's step by "
        f"{100 * off(b):.1f} % of it; with a fresh optimizer {100 * off(c):.1f} %"
    )
    assert off(b) < 0.5 * off(c)
