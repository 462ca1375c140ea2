"""The trainer's intake (components/policy_update/intake.py) on a real Valkey, as the stages' ACL
user: a malformed or forged scored entry is dead-lettered, counted, and the gather goes on with
the good groups; an entry the trainer's restarts keep reading back is dead-lettered at its cap."""

from __future__ import annotations

import json

import pytest

from moerl.bus import DEAD, SCORED
from moerl.components.policy_update.gather import CONSUMER, Inbox, gather
from moerl.components.policy_update.intake import EntryCheck
from moerl.records import ScoredSample
from tests.support.valkey_server import server, stage_bus  # noqa: F401 (server: a module fixture)
from tests.trainer.test_trainer_gather import B, _cfg, _issuer, _score

VOCAB = 27  # the tiny model's tokenizer


@pytest.fixture
def bus(server, request, monkeypatch):
    b = stage_bus(server, request, monkeypatch, visibility_timeout_s=30)
    b.restore_positions(0, 100)  # units u1..u100 issued
    return b


def _check(bus) -> EntryCheck:
    cfg = _cfg()
    return EntryCheck(bus, 2, VOCAB, cfg.units.max_prompts, 2 * cfg.units.max_attempts)


def _samples(n: int = 2, **change) -> list[dict]:
    out = []
    for j in range(n):
        s = ScoredSample(
            prompt_id="q",
            task="copy",
            prompt="x",
            answer="1",
            sample_index=j,
            prompt_token_ids=[1],
            response_token_ids=[2, 3],
            response_logprobs=[-0.1, -0.2],
            response_text="1",
            finish_reason="stop",
            policy_version=0,
            reward=float(j),
        ).model_dump()
        if j == 1:
            s.update(change)
        out.append(s)
    return out


BAD = {
    "no group_id": {"samples": _samples()},
    "a list id": {"group_id": ["u0000001/0:q"], "samples": _samples()},
    "token id -5": {"group_id": "u0000001/0:q", "samples": _samples(response_token_ids=[2, -5])},
    "token id 1e12": {
        "group_id": "u0000001/0:q",
        "samples": _samples(prompt_token_ids=[10**12]),
    },
    "NaN logprob": {
        "group_id": "u0000001/0:q",
        "samples": _samples(response_logprobs=[-0.1, float("nan")]),
    },
    "inf reward": {"group_id": "u0000001/0:q", "samples": _samples(reward=float("inf"))},
    "wrong G": {"group_id": "u0000001/0:q", "samples": _samples(3)},
    "unit never issued": {"group_id": "u0005000/0:q", "samples": _samples()},
    "prompt not the id's": {"group_id": "u0000001/0:other", "samples": _samples()},
}


@pytest.mark.parametrize("name", list(BAD), ids=[n.replace(" ", "_").replace("'", "") for n in BAD])
def test_a_malformed_scored_entry_is_dead_lettered_and_the_trainer_goes_on(bus, name):
    """Each of these passed the old check (or raised past it) and reached the trainer: a token
    id outside the vocabulary or a NaN is trained on (or crashes an embedding lookup at every
    restart, the entry pending and read first). Now each is dead-lettered, counted, and the
    version gathers its B good groups."""
    cfg = _cfg()
    # first in line; NaN and Infinity go out as JSON's
    bus.r.xadd(bus.key(SCORED), {"group": json.dumps(BAD[name])})
    good = _score(bus, B, start=1)
    epoch = bus.claim_trainer("t")
    issuer = _issuer(cfg, bus, epoch)
    try:
        batch, _ = gather(bus, cfg, 0, Inbox(bus, _check(bus)), epoch, issuer)
    finally:
        issuer.stop_event.set()
    assert batch.group_ids == good
    [(_, dead)] = bus.r.xrange(bus.key(DEAD))
    assert dead["stream"] == SCORED and dead["reason"].startswith("malformed"), dead["reason"]
    c = bus.counters()
    assert (c["entries_dead"], c["groups_dead"]) == (1, 1)


def test_the_good_groups_pass_the_whole_check(bus):
    # the check refuses what it should, not everything: a well-formed group of an issued unit
    _check(bus)({"group_id": "u0000001/0:q", "samples": _samples()})


def test_an_entry_the_trainers_restarts_keep_reading_back_is_dead_lettered_at_its_cap(bus):
    """A group that parses but kills the trainer after it was read (the old intake set no cap on
    the pending list): each restart reads it back first. Past 2 x units.max_attempts deliveries
    it is dead-lettered and the next restart goes on without it."""
    [gid] = _score(bus, 1, start=1)
    check = _check(bus)
    assert [g["group_id"] for _, g in bus.take_scored(CONSUMER, 1, block_ms=50)] == [gid]
    for restart in range(1, check.max_deliveries):  # deliveries 2..cap: still handed over
        got = Inbox(bus, check).take(1, set())
        assert [g["group_id"] for _, g in got] == [gid], restart
    assert Inbox(bus, check).take(1, set()) == []  # delivery cap + 1
    [(_, dead)] = bus.r.xrange(bus.key(DEAD))
    assert dead["reason"].startswith(f"delivered {check.max_deliveries + 1} times")
    assert bus.pending_count(SCORED, CONSUMER) == 0


def test_the_vocabulary_is_the_continued_versions_own(tmp_path):
    """The trainer checks token ids against the embeddings it trains: the config.json of the
    version it continues from (a multimodal one's text_config), else model.path's, else the
    tiny model's tokenizer."""
    import json as _json

    from moerl.components.policy_update.intake import model_vocab

    cfg = _cfg()
    assert model_vocab(cfg) == VOCAB  # the tiny model, no folder
    (tmp_path / "config.json").write_text(_json.dumps({"text_config": {"vocab_size": 151936}}))
    assert model_vocab(cfg, tmp_path) == 151936
