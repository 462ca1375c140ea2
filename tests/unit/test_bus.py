"""The bus's and the buffer's pure rules, no server: admission under the staleness bound,
issuance, backpressure, each group's disposition, a response that crossed versions, the
servable pointer and the sha a sample carries. The bus on a real Valkey is in
tests/bus/test_bus.py."""

from __future__ import annotations

from moerl.components.buffer.worker import Batch, batch_metrics, classify, prompts_to_issue
from moerl.config import BufferConfig
from moerl.records import ScoredSample

CFG = BufferConfig(high_watermark=8, low_watermark=4)


def _issue(**kw):
    base = dict(
        used=0,
        in_flight=0,
        version=0,
        batch_prompts=4,
        versions=10,
        max_staleness=1,
        backlog=0,
        paused=False,
        cfg=CFG,
    )
    return prompts_to_issue(**{**base, **kw})


def test_admission_follows_the_staleness_bound():
    assert _issue() == (8, False)  # (k + v + 1) * B = 2 * 4
    assert _issue(in_flight=8) == (0, False)
    assert _issue(used=4, in_flight=4, version=1) == (4, False)  # version 1: room for (1+1+1)*4 - 8
    assert _issue(max_staleness=0) == (4, False)  # synchronous: one version's prompts at a time


def test_issuance_never_exceeds_what_the_run_still_needs():
    assert _issue(used=36, in_flight=2, version=9, versions=10) == (2, False)
    assert _issue(used=40, version=10, versions=10) == (0, False)


def test_backpressure_has_hysteresis():
    assert _issue(backlog=8) == (0, True)  # at the high watermark: pause
    assert _issue(backlog=5, paused=True) == (0, True)  # still above the low watermark
    assert _issue(backlog=3, paused=True) == (8, False)  # below it: resume


def _scored(version: int, rewards: list[float], failed: bool = False) -> list[ScoredSample]:
    return [
        ScoredSample(
            prompt_id="p",
            task="copy",
            prompt="x",
            answer="1",
            sample_index=j,
            prompt_token_ids=[1],
            response_token_ids=[2],
            response_logprobs=[-0.1],
            response_text="1",
            finish_reason="stop",
            policy_version=version,
            reward=r,
            reward_failed=failed and j == 0,
        )
        for j, r in enumerate(rewards)
    ]


def test_every_group_gets_exactly_one_disposition():
    assert classify("g", _scored(3, [0, 1]), 3, 1, seen={"g"}) == "duplicate"
    assert classify("g", _scored(1, [0, 1]), 3, 1, seen=set()) == "stale"
    assert classify("g", _scored(2, [0, 1]), 3, 1, seen=set()) == "used"
    assert classify("g", _scored(3, [0, 1], failed=True), 3, 1, seen=set()) == "failed"
    assert classify("g", _scored(3, [0.5, 0.5]), 3, 1, seen=set()) == "filtered"


def test_a_response_that_crossed_versions_is_admitted_by_its_oldest_token_and_refused_by_a_lost_one():
    def crossed(
        start: int, later: int
    ) -> list[ScoredSample]:  # in-flight update after the first token
        return [
            s.model_copy(
                update={
                    "response_token_ids": [2, 3],
                    "response_logprobs": [-0.1, -0.2],
                    "token_versions": [(0, start), (1, later)],
                }
            )
            for s in _scored(start, [0, 1])
        ]

    assert classify("g", crossed(2, 3), 3, 1, seen=set()) == "used"  # oldest token 1 version behind
    # oldest token 2 behind, newest current
    assert classify("g", crossed(1, 3), 3, 1, seen=set()) == "stale"
    # a token from a version the trainer lost
    assert classify("g", crossed(3, 4), 3, 1, seen=set()) == "stale"
    m = batch_metrics(Batch(groups=[crossed(2, 3)], used=[crossed(2, 3)]), 3)
    assert m["buffer/staleness_mean"] == 1.0 and m["buffer/token_staleness_mean"] == 0.5
    assert m["rollout/mixed_version_fraction"] == 1.0


def test_the_servable_pointer_moves_by_version_sha_and_epoch_not_the_number():
    from moerl.bus.run import Registered
    from moerl.components.rollout.worker import pointer_moved

    assert pointer_moved(Registered(3, "u", "a", 1), 3, "a", 1) is None
    assert pointer_moved(Registered(4, "u", "b", 1), 3, "a", 1) == "forward"
    assert pointer_moved(Registered(0, "u", "z", 0), None, None, 0) == "forward"
    # a newer trainer rolled back to 2, or published 3 again with other weights: lost weights
    assert pointer_moved(Registered(2, "u", "c", 2), 3, "a", 1) == "back"
    assert pointer_moved(Registered(3, "u", "d", 2), 3, "a", 1) == "back"
    # behind, with no newer epoch: lost writes on the bus (a failover), the engine stays
    assert pointer_moved(Registered(2, "u", "c", 1), 3, "a", 1) is None
    # an engine that took version 3 over the wire serves the pointer's version 3 (its files)
    from moerl.bus.weights import wire_sha

    assert pointer_moved(Registered(3, "u", "d", 2), 3, wire_sha(2, 3), 2) is None
    assert pointer_moved(Registered(4, "u", "e", 2), 3, wire_sha(2, 3), 2) == "forward"


def test_a_sample_from_weights_lost_under_a_republished_number_is_stale():
    """After a rollback the trainer publishes version 3 again with other weights: a sample an
    engine generated under the lost version 3 carries that version's sha and is dropped, while
    one from the version 3 the trainer published is used."""
    lost, ours = _scored(3, [0, 1]), _scored(3, [0, 1])
    for s in lost:
        s.policy_shas = {3: "lost-sha"}
    for s in ours:
        s.policy_shas = {3: "our-sha"}
    known = {2: "sha-2", 3: "our-sha"}
    # by the number alone it looked on-policy
    assert classify("g", lost, 3, 1, seen=set()) == "used"
    assert classify("g", lost, 3, 1, seen=set(), known=known) == "stale"
    assert classify("g", ours, 3, 1, seen=set(), known=known) == "used"
    # no sha: by number
    assert classify("g", _scored(3, [0, 1]), 3, 1, seen=set(), known=known) == "used"
    # over the wire: a version is known by its files' sha and its wire name (moerl.bus.weights)
    from moerl.bus.weights import wire_sha

    wire, old_wire = _scored(3, [0, 1]), _scored(3, [0, 1])
    for s in wire:
        s.policy_shas = {3: wire_sha(7, 3)}
    for s in old_wire:
        s.policy_shas = {3: wire_sha(6, 3)}  # a replaced trainer's version 3
    both = {2: "sha-2", 3: frozenset({"our-sha", wire_sha(7, 3)})}
    assert classify("g", wire, 3, 1, seen=set(), known=both) == "used"
    assert classify("g", ours, 3, 1, seen=set(), known=both) == "used"
    assert classify("g", old_wire, 3, 1, seen=set(), known=both) == "stale"


def test_an_engines_samples_carry_the_sha_of_every_version_that_sampled_them():
    from types import SimpleNamespace

    from moerl.components.rollout.worker import group_samples

    prompt = {"id": "p", "task": "copy", "prompt": "x", "answer": "1"}
    comps = [
        SimpleNamespace(
            token_ids=[5, 6],
            logprobs=[-0.1, -0.2],
            text="ab",
            finish_reason="stop",
            version=None,
            token_versions=None,
        ),
        SimpleNamespace(
            token_ids=[5, 6],
            logprobs=[-0.1, -0.2],
            text="ab",
            finish_reason="stop",
            version=2,
            token_versions=[(0, 2), (1, 3)],
        ),
    ]
    a, b = group_samples("run", "u1/0:p", prompt, [1], comps, 3, shas={2: "s2", 3: "s3"})
    assert a["policy_shas"] == {3: "s3"} and b["policy_shas"] == {2: "s2", 3: "s3"}
