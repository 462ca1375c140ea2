"""The collective weight path's control plane (moerl/bus/weights.py) on a real Valkey, as a stage
user: who takes part, a session fenced by the trainer's epoch, the engines' reports and what
they decide; and the names a version goes by (pure)."""

from __future__ import annotations

import time

import pytest

from moerl.bus import FencedError
from moerl.bus.run import Registered
from moerl.bus.weights import (
    Report,
    WeightSessions,
    outcome,
    same_weights,
    sha_agrees,
    wire_sha,
)
from tests.support.valkey_server import server, stage_bus  # noqa: F401 (server: a module fixture)

GROUPS = [{"host": "127.0.0.1", "port": 1234, "world": 5}]


@pytest.fixture
def bus(server, request, monkeypatch):
    return stage_bus(server, request, monkeypatch)


def test_members_are_the_enrolled_engines_alive_now_in_name_order(bus):
    ws = WeightSessions(bus)
    for name, ranks in (("rollout-1", 2), ("rollout-0", 2), ("rollout-2", 4)):
        ws.enroll(name, ranks)
    bus.heartbeat("rollout-1")
    bus.heartbeat("rollout-0")
    bus.heartbeat("scorer-0")  # alive, not an engine
    assert list(ws.members().items()) == [("rollout-0", 2), ("rollout-1", 2)]
    ws.withdraw("rollout-0")
    assert ws.members() == {"rollout-1": 2}


def test_a_session_is_opened_only_by_the_runs_trainer(bus):
    ws = WeightSessions(bus)
    old = bus.claim_trainer("old")
    new = bus.claim_trainer("new")
    deadline = time.time() + 30
    s = ws.open(new, 3, GROUPS, {"rollout-0": 0, "rollout-1": 2}, deadline)
    assert ws.current() == s and s.sha == wire_sha(new, 3)
    assert s.first_rank("rollout-1") == 2 and s.first_rank("rollout-9") is None
    with pytest.raises(FencedError):
        ws.open(old, 4, GROUPS, {"rollout-0": 0}, deadline)
    assert ws.current() == s  # the replaced trainer changed nothing


def test_reports_decide_the_session(bus):
    ws = WeightSessions(bus)
    epoch = bus.claim_trainer("t")
    members = {"rollout-0": 0, "rollout-1": 2}
    s = ws.open(epoch, 1, GROUPS, members, time.time() + 0.5)
    t0 = time.monotonic()
    got = ws.wait_reports(s, grace_s=0.5)  # nobody reports: bounded by the deadline and grace
    assert got == {} and 0.8 < time.monotonic() - t0 < 5
    assert outcome(s, got) == (False, "no report by the deadline from rollout-0, rollout-1")

    s = ws.open(epoch, 2, GROUPS, members, time.time() + 30)
    ws.report(s, "rollout-0", Report(True, ["a", "b"], 0.1))
    ws.report(s, "rollout-1", Report(True, ["a", "b"], 0.2))
    assert outcome(s, ws.wait_reports(s)) == (True, "")
    ws.report(s, "rollout-1", Report(True, ["a", "c"], 0.2))  # a rank loaded other weights
    assert outcome(s, ws.reports(s)) == (False, "the engines' digests disagree (2 different sets)")
    ws.report(s, "rollout-1", Report(False, [], 0.2, "WeightSyncError: deadline"))
    assert outcome(s, ws.reports(s)) == (False, "rollout-1: WeightSyncError: deadline")
    # the reports of another version, or of another epoch's session, are their own
    assert ws.reports(ws.open(epoch, 3, GROUPS, members, time.time() + 30)) == {}


def test_a_version_over_the_wire_and_its_files_are_one_version():
    reg = Registered(5, "s3://b/v5", "f" * 64, epoch=3)
    served = (5, wire_sha(3, 5))
    assert same_weights(reg.version, reg.manifest_sha256, reg.epoch, *served)
    assert same_weights(reg.version, reg.manifest_sha256, reg.epoch, 5, "f" * 64)
    # another epoch's wire version under that number was other weights (rolled back)
    assert not same_weights(reg.version, reg.manifest_sha256, reg.epoch, 5, wire_sha(2, 5))
    assert not same_weights(reg.version, reg.manifest_sha256, reg.epoch, 4, wire_sha(3, 4))
    known = frozenset({"f" * 64, wire_sha(3, 5)})
    assert sha_agrees(known, wire_sha(3, 5)) and sha_agrees(known, "f" * 64)
    assert not sha_agrees(known, wire_sha(2, 5)) and not sha_agrees("f" * 64, wire_sha(3, 5))
    assert sha_agrees(None, "anything")  # a version the trainer does not know: no verdict


def test_one_member_per_version_checks_the_wire_against_the_durable_copy(bus):
    from moerl.components.rollout.wire_receive import WireReceiver

    w0, w1 = WireReceiver(bus, "rollout-0", 0), WireReceiver(bus, "rollout-1", 0)
    for v in (2, 3):
        sha = wire_sha(1, v)
        # as `take` records it: the checker of version v is member v % 2 in name order
        w0.delivered[v] = (sha, ("a", "b"), v % 2 == 0)
        w1.delivered[v] = (sha, ("a", "b"), v % 2 == 1)
    assert w0.to_verify(2, wire_sha(1, 2), "f" * 64) and not w1.to_verify(2, wire_sha(1, 2), "f")
    assert w1.to_verify(3, wire_sha(1, 3), "f" * 64) and not w0.to_verify(3, wire_sha(1, 3), "f")
    # not before the files exist (the pointer still names the wire), nor for another version
    assert not w0.to_verify(2, wire_sha(1, 2), wire_sha(1, 2))
    assert not w0.to_verify(4, wire_sha(1, 4), "f" * 64)
    assert w0.verified(2, ("a", "b")) == ""
    assert not w0.to_verify(2, wire_sha(1, 2), "f" * 64)  # once
    wrong = w1.verified(3, ("a", "c"))
    assert "version 3 over the wire differs from its durable copy" in wrong and "'c'" in wrong


def test_a_worker_that_missed_the_sessions_asks_once_for_the_delivered_version(bus):
    from moerl.components.rollout.wire_receive import WireReceiver

    ws = WeightSessions(bus)
    epoch = bus.claim_trainer("t")
    joiner = WireReceiver(bus, "rollout-2", 0, timeout_s=0.5)
    joiner.enrolled, joiner.ranks = True, 2  # as `enroll` leaves it once its engine is up
    assert not joiner.catching_up(None, 0)  # nothing delivered over the wire yet: files
    s = ws.open(epoch, 4, GROUPS, {"rollout-0": 0}, time.time() + 30)
    ws.set_delivered(s)
    assert ws.delivered() == (epoch, 4)
    joiner.current(fresh=True)  # the worker reads the keys afresh at every idle check
    assert joiner.catching_up(None, 0)
    assert joiner.catching_up(None, 0)  # asked once, waited on
    assert ws.requests() == {"rollout-2": (2, 4, joiner.nonce)}
    assert not joiner.catching_up(4, epoch)  # it serves it already
    time.sleep(0.6)
    assert not joiner.catching_up(None, 0)  # nobody answered within the timeout: files
    # the trainer's catch-up names it; its reports are apart from the session's
    c = ws.open(epoch, 4, GROUPS, {"rollout-2": 0}, time.time() + 30, "catchup", {"rollout-2": "x"})
    assert joiner.waiting(None, 0, fresh=True) is None  # named, as another process: not it
    c = ws.open(
        epoch, 4, GROUPS, {"rollout-2": 0}, time.time() + 30, "catchup", {"rollout-2": joiner.nonce}
    )
    assert ws.current("catchup") == c and ws.current() == s
    assert joiner.waiting(None, 0, fresh=True) == c
    ws.report(c, "rollout-2", Report(True, ["a"], 0.1))
    assert ws.reports(s) == {} and list(ws.reports(c)) == ["rollout-2"]
    ws.answered(["rollout-2"])
    assert ws.requests() == {}
