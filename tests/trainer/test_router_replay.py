"""Routing replay (components/policy_update/replay.py) on tiny models of every family the
trainer supports: replaying routes recorded from the same weights is bit-exact; a perturbed
router disagrees, and R3 restores the routes while its gradient stays alive; the trainer's
R2 / R3 paths and their metrics run end to end on `train_on_batch`."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from moerl.components.policy_update.replay import Agreement, RouterReplay, routers
from moerl.config import TinyMoeConfig, parse_config
from moerl.errors import TrainingError
from moerl.records import RoutedExperts, TrainSample

FAMILIES = ["qwen3_moe", "mixtral", "qwen2_moe", "olmoe", "deepseek_v3"]


def _model(arch: str, tmp_path_factory, layers: int = 2):
    from transformers import AutoModelForCausalLM

    from moerl.models.tiny import build_tiny_model

    t = TinyMoeConfig(
        architecture=arch,
        num_layers=layers,
        hidden_size=64,
        num_experts=8,
        experts_per_token=2,
        moe_intermediate_size=32,
        head_dim=32,
    )
    path = build_tiny_model(t, tmp_path_factory.mktemp(arch) / "m")
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    model.eval()
    return model


@pytest.fixture(scope="module", params=FAMILIES)
def family_model(request, tmp_path_factory):
    return request.param, _model(request.param, tmp_path_factory)


def _ids(model, b=3, length=12, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(4, model.config.vocab_size, (b, length), generator=g)


def _record(model, ids):
    replay = RouterReplay(model)
    try:
        replay.record(True)
        with torch.no_grad():
            logits = model(input_ids=ids).logits
        return logits, replay.live()
    finally:
        replay.close()


def test_replaying_the_models_own_routes_is_bit_exact(family_model):
    arch, model = family_model
    ids = _ids(model)
    plain, routes = _record(model, ids)
    replay = RouterReplay(model)
    try:
        replay.force(routes)
        replay.record(True)
        with torch.no_grad():
            again = model(input_ids=ids).logits
    finally:
        replay.close()
    # every (token, layer) was forced
    assert replay.forced_slots == routes.shape[0] * routes.shape[1]
    assert replay.replaced == 0
    assert torch.equal(plain, again), f"{arch}: replayed forward differs from the plain one"


def _perturb_routers(model, scale=0.3, seed=1):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for gate in routers(model):
            gate.weight.add_(
                torch.randn(gate.weight.shape, generator=g) * scale * gate.weight.std()
            )


def test_a_perturbed_router_disagrees_and_r3_restores_the_routes_with_gradient(
    family_model, tmp_path_factory
):
    arch, model = family_model
    import copy

    ids = _ids(model, seed=3)
    _, engine_routes = _record(model, ids)  # the "engine": the unperturbed weights
    trainer = copy.deepcopy(model)
    _perturb_routers(trainer)
    trainer_logits, live = _record(trainer, ids)
    valid = torch.ones(live.shape[0], dtype=torch.bool)
    agree = Agreement(live.shape[1], "cpu")
    agree.add(live, engine_routes, valid)
    m = Agreement.metrics(agree.flat(), live.shape[1])
    assert m["moe/routing_agreement"] < 1.0 and m["moe/token_any_layer_mismatch_fraction"] > 0.0

    replay = RouterReplay(trainer)
    try:
        replay.force(engine_routes)
        replay.record(True)
        out = trainer(input_ids=ids).logits
        forced_live = replay.live()
        # what the router now routes to: the engine's ids, everywhere
        agree = Agreement(live.shape[1], "cpu")
        agree.add(_routes_used(trainer, ids, engine_routes), engine_routes, valid)
        assert Agreement.metrics(agree.flat(), live.shape[1])["moe/routing_agreement"] == 1.0
        assert replay.replaced > 0  # the live choice differed somewhere and was replaced
        assert forced_live.shape == engine_routes.shape
        out.logsumexp(-1).sum().backward()
        grads = [g.weight.grad for g in routers(trainer)]
        assert all(gr is not None and gr.abs().sum() > 0 for gr in grads), (
            f"{arch}: router lost its gradient"
        )
    finally:
        replay.close()
    # the replayed trainer is closer to the engine than the live one
    with torch.no_grad():
        engine_logits = model(input_ids=ids).logits
    live_gap = (trainer_logits - engine_logits).abs().mean()
    replay_gap = (out.detach() - engine_logits).abs().mean()
    assert replay_gap < live_gap


def _routes_used(model, ids, forced):
    """The ids the routers returned (after replay) in one forward: hooks registered after the
    replay's see its output."""
    seen = []
    replay = RouterReplay(model)
    handles = [
        g.register_forward_hook(lambda m, a, o: seen.append(o[2].detach())) for g in routers(model)
    ]
    try:
        replay.force(forced)
        with torch.no_grad():
            model(input_ids=ids)
    finally:
        replay.close()
        for h in handles:
            h.remove()
    return torch.stack(seen, dim=1)


def test_positions_without_a_route_route_live(family_model):
    _, model = family_model
    ids = _ids(model, seed=5)
    plain, routes = _record(model, ids)
    wrong = (routes + 1) % 8  # every recorded route wrong ...
    wrong[::2] = -1  # ... except every other token, which has none and must route live
    replay = RouterReplay(model)
    try:
        replay.force(wrong)
        replay.record(True)
        with torch.no_grad():
            model(input_ids=ids)
    finally:
        replay.close()
    assert replay.forced_slots == (wrong[:, :, 0] >= 0).sum().item()


def test_routes_of_the_wrong_shape_are_refused(tmp_path_factory):
    model = _model("qwen3_moe", tmp_path_factory)
    replay = RouterReplay(model)
    try:
        with pytest.raises(TrainingError, match="MoE layers x top-2"):
            replay.force(torch.zeros(4, 3, 2, dtype=torch.long))
    finally:
        replay.close()


def test_an_unknown_router_is_refused():
    class Gate(torch.nn.Module):
        top_k = 2

        def __init__(self):
            super().__init__()
            self.weight = torch.nn.Parameter(torch.zeros(4, 4))

    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.gate = Gate()

    with pytest.raises(TrainingError, match="does not know the router Gate"):
        routers(torch.nn.Sequential(Block()))


def test_routed_experts_round_trip_and_validation():
    a = np.array([[[0, 7], [3, -1]], [[-1, -1], [5, 6]]])
    r = RoutedExperts.from_ids(a, 8)
    assert r.dtype == "uint8" and np.array_equal(r.ids(), a)
    big = RoutedExperts.from_ids(np.array([[[300, 2]]]), 384)  # more than 255 experts: uint16
    assert big.dtype == "uint16" and big.ids()[0, 0, 0] == 300
    with pytest.raises(ValueError, match=">= 8 experts"):
        RoutedExperts.from_ids(np.array([[[8, 1]]]), 8)
    with pytest.raises(ValueError, match="needs 4"):
        RoutedExperts(dtype="uint8", shape=(1, 2, 2), data="AAA=")
    with pytest.raises(ValueError, match="covers 2 tokens"):
        TrainSample(
            prompt_token_ids=[1, 2],
            response_token_ids=[3],
            response_logprobs=[-1.0],
            advantage=1.0,
            policy_version=0,
            routed_experts=RoutedExperts.from_ids(np.zeros((2, 1, 2)), 8),
        )


def _batch(model, routes_from=None, n=8, seed=0):
    """Samples of random tokens with advantages; routes recorded from `routes_from` (the engine)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        prompt = torch.randint(4, model.config.vocab_size, (4,), generator=g).tolist()
        resp = torch.randint(4, model.config.vocab_size, (6,), generator=g).tolist()
        routes = None
        if routes_from is not None:
            _, r = _record(routes_from, torch.tensor([prompt + resp]))
            r = r.numpy().copy()
            r[-1] = -1  # the engine never feeds the last token
            routes = RoutedExperts.from_ids(r, 8)
        with torch.no_grad():
            lp = torch.log_softmax(
                model(input_ids=torch.tensor([prompt + resp])).logits[0, 3:-1], -1
            )
        eng = lp.gather(-1, torch.tensor(resp)[:, None])[:, 0].tolist()
        out.append(
            TrainSample(
                prompt_token_ids=prompt,
                response_token_ids=resp,
                response_logprobs=eng,
                advantage=float((-1) ** i),
                policy_version=0,
                routed_experts=routes,
            )
        )
    return out


@pytest.mark.parametrize("mode", ["disabled", "R2", "R3"])
def test_train_on_batch_with_replay_reports_agreement_and_mismatch(mode, tmp_path_factory):
    import copy

    from moerl.components.policy_update.trainer import Counters, train_on_batch

    engine = _model("qwen3_moe", tmp_path_factory)
    trainer = copy.deepcopy(engine)
    _perturb_routers(trainer)
    batch = _batch(engine, routes_from=engine)
    cfg = parse_config(
        {
            "rollout": {"return_routed_experts": True},
            "trainer": {
                "moe": {"router_replay": mode},
                "optimizer": {"optimizer_steps_per_iteration": 2, "learning_rate": 1e-3},
            },
        }
    )
    opt = torch.optim.AdamW(trainer.parameters(), lr=1e-3)
    m = train_on_batch(trainer, opt, Counters(), batch, cfg, seed=0)
    assert m["train/steps"] == 2.0
    assert m["moe/routing_agreement"] < 1.0  # the live router (before any replacement) disagrees
    assert m["rollout_corr/tokens"] == 6 * 8 and m["rollout_corr/stale_token_fraction"] == 0.0
    if mode == "R3":
        assert m["moe/replay_forced_fraction"] > 0.8 and m["moe/replay_replaced_fraction"] > 0.0
        # pi_old under the engine's routes is closer to the engine's logprobs than the live one
        live = train_on_batch(
            copy.deepcopy(trainer),
            torch.optim.AdamW(trainer.parameters()),
            Counters(),
            batch,
            parse_config({"trainer": {"optimizer": {"optimizer_steps_per_iteration": 1}}}),
            seed=0,
        )
        assert m["rollout_corr/log_ratio_abs_mean"] < live["rollout_corr/log_ratio_abs_mean"]
        assert m["rollout_corr/k3_kl"] < live["rollout_corr/k3_kl"]
    else:
        assert "moe/replay_forced_fraction" not in m


def test_r3_needs_the_engines_routes():
    from moerl.errors import ConfigError

    with pytest.raises(ConfigError, match="rollout.return_routed_experts"):
        parse_config({"trainer": {"moe": {"router_replay": "R3"}}})
