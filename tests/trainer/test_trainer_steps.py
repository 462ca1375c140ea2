"""The single-process trainer's step machinery on a real tiny Qwen3-MoE: non-finite gradients,
micro-batching with gradient accumulation, the exact step count, the router aux loss, and the
device every tensor is created on."""

import math

import pytest
import torch

from moerl.components.policy_update.ep_moe import load_balancing_loss, sparse_blocks
from moerl.components.policy_update.steps import minibatches
from moerl.components.policy_update.trainer import load_state, train_on_batch
from moerl.config import parse_config
from moerl.errors import TrainingError
from moerl.models.tiny import build_tiny_model
from moerl.records import TrainSample


def _cfg(**sections):
    """Trainer sections (optimizer={...}, ...) merged over these, key by key."""
    base = {"optimizer": {"optimizer_steps_per_iteration": 4, "learning_rate": 0.01}}
    return parse_config(
        {"trainer": {s: base.get(s, {}) | sections.get(s, {}) for s in base | sections}}
    )


@pytest.fixture(scope="module")
def state0(tmp_path_factory):
    root = tmp_path_factory.mktemp("state0")
    build_tiny_model(_cfg().model.tiny, root)
    return root


def _batch(n=16):
    g = torch.Generator().manual_seed(0)
    out = []
    for i in range(n):
        plen, rlen = 3 + i % 4, 2 + i % 3  # uneven lengths: padding inside every micro-batch
        ids = torch.randint(5, 20, (plen + rlen,), generator=g).tolist()
        lp = (-torch.rand(rlen, generator=g) * 3).tolist()
        out.append(
            TrainSample(
                prompt_token_ids=ids[:plen],
                response_token_ids=ids[plen:],
                response_logprobs=lp,
                advantage=1.0 if i % 2 else -1.0,
                policy_version=0,
            )
        )
    return out


def test_nan_gradient_with_finite_loss_skips_the_step(state0):
    cfg = _cfg(optimizer={"max_consecutive_skipped_steps": 10})
    model, opt, ctr = load_state(state0, cfg)
    before = [p.detach().clone() for p in model.parameters()]
    # a real backward that yields a NaN gradient in one parameter while the loss stays finite
    handle = next(model.parameters()).register_hook(lambda g: torch.full_like(g, float("nan")))
    m = train_on_batch(model, opt, ctr, _batch(), cfg, seed=0)
    handle.remove()
    assert math.isfinite(m["train/loss"]) or m["train/steps"] == 0
    assert m["train/skipped_steps"] == 4 and m["train/steps"] == 0 and ctr.skipped_total == 4
    # nothing moved, nothing NaN
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))


def test_consecutive_nan_gradients_fail_the_run(state0):
    cfg = _cfg(optimizer={"max_consecutive_skipped_steps": 2})
    model, opt, ctr = load_state(state0, cfg)
    next(model.parameters()).register_hook(lambda g: g * float("inf"))
    with pytest.raises(
        TrainingError, match="2 optimizer steps in a row had a non-finite loss or gradient"
    ):
        train_on_batch(model, opt, ctr, _batch(), cfg, seed=0)


def test_micro_batches_equal_the_unchunked_step(state0):
    """Gradient accumulation over micro-batches gives the unchunked gradient (to float32
    rounding) and the same metrics. Weights after Adam steps are not compared element-wise:
    Adam turns a 1e-9 difference in a near-zero gradient into a full lr-sized step."""
    runs = {}
    # 16 positions = 1-2 rows per micro-batch here, vs the whole minibatch at once
    for mbt in (
        0,
        16,
    ):
        cfg = _cfg(
            parallelism={"micro_batch_tokens": mbt}, optimizer={"optimizer_steps_per_iteration": 1}
        )
        model, opt, ctr = load_state(state0, cfg)
        metrics = train_on_batch(model, opt, ctr, _batch(), cfg, seed=3)
        runs[mbt] = (metrics, {n: p.grad.clone() for n, p in model.named_parameters()})
    (m0, g0), (m1, g1) = runs[0], runs[16]
    assert m0["train/steps"] == m1["train/steps"] == 1
    for k in (
        "train/loss",
        "train/clip_fraction",
        "train/entropy",
        "train/grad_norm",
        "train/logprob_mismatch",
        "train/tis_truncated_fraction",
    ):
        assert m1[k] == pytest.approx(m0[k], rel=1e-5, abs=1e-7), k
    for name, g in g0.items():
        assert torch.allclose(g1[name], g, rtol=1e-4, atol=1e-7), name
    # over several steps the trajectories stay together
    cfgs = [_cfg(parallelism={"micro_batch_tokens": mbt}) for mbt in (0, 16)]
    ms = []
    for cfg in cfgs:
        model, opt, ctr = load_state(state0, cfg)
        ms.append(train_on_batch(model, opt, ctr, _batch(), cfg, seed=3))
    assert ms[0]["train/steps"] == ms[1]["train/steps"] == 4
    assert ms[1]["train/loss"] == pytest.approx(ms[0]["train/loss"], rel=1e-3, abs=1e-5)


@pytest.mark.parametrize(
    "n,steps,world,expected",
    [(10, 6, 1, 6), (10, 4, 1, 4), (3, 8, 1, 3), (10, 4, 2, 4), (10, 8, 2, 5), (1, 4, 2, 0)],
)
def test_minibatch_count_is_exact(n, steps, world, expected):
    chunks = minibatches(n, steps, seed=0, world=world, device=torch.device("cpu"))
    assert len(chunks) == expected  # torch.chunk(10 rows, 6) gives 5
    if chunks:
        assert sorted(torch.cat(chunks).tolist()) == list(range(n))
        assert (
            min(len(c) for c in chunks) >= world
            and max(len(c) for c in chunks) - min(len(c) for c in chunks) <= 1
        )


def test_aux_loss_is_applied_and_logged_without_expert_parallelism(state0):
    grads = {}
    for coef in (0.0, 0.5):
        cfg = _cfg(
            moe={"aux_loss_coef": coef},
            optimizer={"optimizer_steps_per_iteration": 1, "max_grad_norm": 1e9},
        )
        model, opt, ctr = load_state(state0, cfg)
        gate = sparse_blocks(model)[0][2].gate
        metrics = train_on_batch(model, opt, ctr, _batch(), cfg, seed=0)
        grads[coef] = (metrics, gate.weight.grad.clone())
    (m0, g0), (m1, g1) = grads[0.0], grads[0.5]
    assert m0["train/aux_loss"] == 0.0
    assert m1["train/aux_loss"] > 0.5 * 0.9 * 2  # two layers, each E * sum f*P >= ~1 near balance
    assert not torch.allclose(g0, g1)  # the router's gradient now includes the balancing term
    logits = torch.randn(12, 8)
    assert float(load_balancing_loss(logits, logits.topk(2).indices)) >= 1.0 - 1e-6


def test_no_tensor_is_created_on_the_default_device(state0):
    """With torch's default device set to `meta`, any tensor created without an explicit device=
    would land on meta and meet the CPU model: the step only runs if every tensor is placed
    explicitly on the model's device (what trainer.parallelism.device: cuda needs)."""
    cfg = _cfg(parallelism={"micro_batch_tokens": 16}, moe={"aux_loss_coef": 0.1})
    model, opt, ctr = load_state(state0, cfg)
    batch = _batch()
    torch.set_default_device("meta")
    try:
        m = train_on_batch(model, opt, ctr, batch, cfg, seed=0)
    finally:
        torch.set_default_device(None)
    assert m["train/steps"] == 4 and all(p.device.type == "cpu" for p in model.parameters())


def test_truncated_sampling_trains_with_finite_statistics(state0):
    cfg = parse_config(
        {
            "trainer": {"optimizer": {"optimizer_steps_per_iteration": 2}},
            "rollout": {"top_k": 5, "top_p": 0.9},
        }
    )
    model, opt, ctr = load_state(state0, cfg)
    m = train_on_batch(model, opt, ctr, _batch(), cfg, seed=0)
    assert m["train/steps"] == 2 and all(math.isfinite(v) for v in m.values())
    assert m["train/entropy"] < math.log(5) + 1e-6  # at most 5 tokens are left at every position


@pytest.mark.parametrize("rollout", [{}, {"top_k": 5, "top_p": 0.9, "temperature": 0.7}])
def test_the_chunked_logprob_equals_the_whole_projection_and_bounds_the_logits(state0, rollout):
    """trainer.parallelism.logprob_chunk_tokens: the same metrics and gradients as the whole-vocabulary
    projection (truncated sampling included), while no logits tensor larger than the chunk is
    ever made, in the forward or the backward."""
    from moerl.components.policy_update import steps

    runs, widest = {}, {}
    for chunk in (0, 5):
        cfg = parse_config(
            {
                "rollout": rollout,
                "trainer": {
                    "optimizer": {"optimizer_steps_per_iteration": 1, "learning_rate": 0.01},
                    "parallelism": {"logprob_chunk_tokens": chunk},
                },
            }
        )
        model, opt, ctr = load_state(state0, cfg)
        vocab = model.config.vocab_size
        seen = []
        head = model.get_output_embeddings()
        head.register_forward_hook(
            lambda m, a, out, seen=seen, v=vocab: seen.append(out.numel() // v)
        )
        metrics = train_on_batch(model, opt, ctr, _batch(), cfg, seed=3)
        assert metrics["train/steps"] == 1 and metrics["train/skipped_steps"] == 0, (chunk, metrics)
        runs[chunk] = (metrics, {n: p.grad.clone() for n, p in model.named_parameters()})
        widest[chunk] = max(seen)
        assert model.get_output_embeddings() is head  # the head is back after every call
    (m0, g0), (m1, g1) = runs[0], runs[5]
    for k in ("train/loss", "train/entropy", "train/clip_fraction", "train/logprob_mismatch"):
        assert m1[k] == pytest.approx(m0[k], rel=1e-5, abs=1e-7), k
    for name, g in g0.items():
        assert torch.allclose(g1[name], g, rtol=1e-4, atol=1e-7), name
    assert widest[5] <= 5 < widest[0]  # positions projected at once
    assert isinstance(steps.ChunkedLogprobHead, type)
