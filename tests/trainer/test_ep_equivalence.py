"""The real expert-parallel trainer (launcher, ranks, `train_ep`, optimizer shards, save) at
EP = 2 against the single-process trainer on the same batch and seed: micro-batches, several
optimizer steps, global-norm clipping that actually clips, and the same metrics."""

import math

import pytest
import torch

from moerl.components.policy_update.trainer import run_policy_update
from moerl.config import parse_config
from moerl.models.tiny import build_tiny_model
from moerl.records import TrainSample, write_records
from tests.support.oracles import reference_policy_update
from tests.support.weights import read_weights


def _cfg(ep: int, **sections):
    """Trainer sections (moe={...}, ...) merged over these, key by key."""
    base = {
        "optimizer": {
            "optimizer_steps_per_iteration": 4,
            "learning_rate": 0.003,
            "max_grad_norm": 0.05,
        },
        "parallelism": {"micro_batch_tokens": 12, "expert_parallel_size": ep},
    }
    return parse_config(
        {"trainer": {s: base.get(s, {}) | sections.get(s, {}) for s in base | sections}}
    )


def _batch(n=16):
    g = torch.Generator().manual_seed(1)
    out = []
    for i in range(n):
        plen, rlen = 3 + i % 3, 2 + i % 4
        ids = torch.randint(5, 20, (plen + rlen,), generator=g).tolist()
        out.append(
            TrainSample(
                prompt_token_ids=ids[:plen],
                response_token_ids=ids[plen:],
                response_logprobs=(-torch.rand(rlen, generator=g) * 3).tolist(),
                advantage=(1.0 + i / 8) * (-1) ** i,
                policy_version=0,
            )
        )
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("ep-equiv")
    build_tiny_model(_cfg(1).model.tiny, root / "s0")
    write_records(root / "batch.jsonl", _batch())
    out = {}
    for ep in (1, 2):  # EP 1: the single-process reference, no mesh
        update = reference_policy_update if ep == 1 else run_policy_update
        m = update(_cfg(ep), root / "batch.jsonl", root / "s0", root / f"ep{ep}", iteration=0)
        out[ep] = (m, read_weights(root / f"ep{ep}"))
    return root, out


@pytest.mark.slow
def test_ep2_trains_like_ep1(runs):
    root, out = runs
    (m1, w1), (m2, w2) = out[1], out[2]
    w0 = read_weights(root / "s0")
    # the same steps were taken, and clipping was active (the global norm exceeds max_grad_norm)
    assert m1["train/steps"] == m2["train/steps"] == 4 and m2["train/skipped_steps"] == 0
    assert m1["train/grad_norm"] > 0.05 and m2["train/grad_norm"] > 0.05
    # every mode logs the same train/* names, with the same values
    assert {k for k in m1 if k.startswith("train/")} == {k for k in m2 if k.startswith("train/")}
    for k in (
        "train/loss",
        "train/clip_fraction",
        "train/tis_truncated_fraction",
        "train/entropy",
        "train/grad_norm",
        "train/logprob_mismatch",
        "train/tokens",
        "train/aux_loss",
    ):
        assert m2[k] == pytest.approx(m1[k], rel=1e-3, abs=1e-6), (k, m1[k], m2[k])
    # the same weights: the two trajectories differ by a tiny fraction of how far they moved
    # (Adam turns float32 summation-order noise in near-zero gradients into lr-sized steps on
    # a few elements, so the comparison is relative to the update, per tensor)
    assert set(w1) == set(w2)
    moved = 0
    for name, a in w1.items():
        delta = float((a - w0[name]).norm())
        gap = float((w2[name] - a).norm())
        assert gap <= 0.05 * delta + 1e-6, (name, gap, delta)
        moved += delta > 0
    assert moved > len(w1) // 2


@pytest.mark.slow
def test_ep2_writes_optimizer_shards_and_counts(runs):
    root, out = runs
    dcp_dir = root / "ep2" / "trainer" / "optimizer"  # a Distributed Checkpoint: one file per rank
    assert (dcp_dir / ".metadata").is_file() and len(list(dcp_dir.glob("*.distcp"))) == 2
    assert not list((root / "ep2" / "trainer").glob("optimizer*.pt"))
    m2 = out[2][0]
    per_expert = [v for k, v in m2.items() if k.startswith("moe/tokens_expert_")]
    assert (
        len(per_expert) == 8
        and sum(per_expert) > 0
        and math.isfinite(m2["moe/expert_load_imbalance"])
    )


@pytest.mark.slow
def test_ep_nan_gradient_on_one_rank_skips_the_step_on_every_rank(runs, tmp_path, gloo_worlds):
    """A NaN in one expert gradient on rank 1 (finite loss everywhere) makes the global norm NaN:
    every rank skips, nothing moves, and K such steps in a row fail the update. The old
    `norm > max_norm` test was False for NaN and stepped."""
    import json

    from tests.support import ep_nonfinite_worker

    root, _ = runs
    gloo_worlds(2).run(
        ep_nonfinite_worker.rank_main, str(root / "s0"), str(root / "batch.jsonl"), str(tmp_path)
    )
    outs = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    for o in outs:
        assert "3 optimizer steps in a row had a non-finite loss or gradient" in o["error"]
        assert o["unchanged"] and o["finite"] and o["skipped_total"] == 3 and o["step"] == 0


def _routed_batch(root):
    """`_batch` with routes recorded from a router-perturbed copy of s0 (the "engine"), some
    samples stale (policy version -1), so replay, agreement and the own/stale split all matter."""
    from transformers import AutoModelForCausalLM

    from moerl.components.policy_update.replay import RouterReplay, routers
    from moerl.records import RoutedExperts

    engine = AutoModelForCausalLM.from_pretrained(root / "s0", dtype=torch.float32).eval()
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for gate in routers(engine):
            gate.weight.add_(torch.randn(gate.weight.shape, generator=g) * 0.3 * gate.weight.std())
    out = []
    for i, s in enumerate(_batch()):
        ids = s.prompt_token_ids + s.response_token_ids
        replay = RouterReplay(engine)
        try:
            replay.record(True)
            with torch.no_grad():
                engine(input_ids=torch.tensor([ids]))
            r = replay.live().numpy().copy()
        finally:
            replay.close()
        r[-1] = -1
        out.append(
            s.model_copy(
                update={
                    "routed_experts": RoutedExperts.from_ids(r, 8),
                    "policy_version": -1 if i % 4 == 0 else 0,
                }
            )
        )
    return out


@pytest.mark.slow
@pytest.mark.parametrize(
    "variant",
    [
        {"moe": {"router_replay": "R3"}},
        pytest.param(
            {
                "moe": {"router_replay": "R2"},
                "loss": {"policy_loss": "gspo"},
                "correction": {
                    "tis_mode": "sequence_mask",
                    "tis_cap": 3.0,
                    "rollout_rs": "geometric",
                    "rollout_rs_threshold": 1.5,
                },
            },
            marks=pytest.mark.nightly,  # a second replay and correction variant
        ),
    ],
)
def test_ep2_replays_routes_and_measures_the_mismatch_like_ep1(tmp_path, variant):
    """R3 (the engine's routes) and R2 + GSPO + masked sequence IS + geometric rejection: the
    expert-parallel block replays through the same router hooks, and the metrics reduced over
    the ranks equal the single process's."""
    build_tiny_model(_cfg(1).model.tiny, tmp_path / "s0")
    write_records(tmp_path / "batch.jsonl", _routed_batch(tmp_path))
    out = {}
    for ep in (1, 2):
        cfg = parse_config(
            {
                "trainer": {
                    "optimizer": {
                        "optimizer_steps_per_iteration": 4,
                        "learning_rate": 0.003,
                        "max_grad_norm": 0.05,
                    },
                    "parallelism": {"micro_batch_tokens": 12, "expert_parallel_size": ep},
                    **variant,
                },
                "rollout": {"return_routed_experts": True},
            }
        )
        out[ep] = run_policy_update(
            cfg, tmp_path / "batch.jsonl", tmp_path / "s0", tmp_path / f"ep{ep}", iteration=0
        )
    m1, m2 = out[1], out[2]
    assert m1["moe/routing_agreement"] < 1.0 and m1["rollout_corr/stale/tokens"] > 0
    keys = [
        k
        for k in m1
        if k.startswith(
            (
                "rollout_corr/",
                "moe/routing",
                "moe/replay",
                "train/loss",
                "train/clip_fraction",
                "train/tis_truncated_fraction",
            )
        )
    ]
    assert "rollout_corr/own/k3_kl" in keys and "moe/routing_agreement/layer_1" in keys
    if variant["moe"]["router_replay"] == "R3":
        assert m1["moe/replay_replaced_fraction"] > 0
    else:
        assert m1["rollout_corr/rs_masked_sequences"] >= 0
    for k in keys:
        assert m2[k] == pytest.approx(m1[k], rel=1e-4, abs=1e-7), (k, m1[k], m2[k])
