"""The rollout worker's outbox (`_Outbox` in components/rollout/worker.py), as pure logic: a fake
bus records each round trip, so what is batched with what, in which order, and when each
hand-over's `always` runs can be asserted exactly. tests/bus/test_bus.py drives it on a real Valkey."""

from __future__ import annotations

import threading

import pytest

from moerl.bus import BusWrite
from moerl.components.rollout.worker import _Outbox


class FakeBus:
    """Records each `write_many` round trip (the writes' names); `gate` holds the first one."""

    def __init__(self, fail_on: str | None = None):
        self.trips: list[list[str]] = []
        self.fail_on = fail_on
        self.gate = threading.Event()
        self.gate.set()

    def write_many(self, writes: list[BusWrite]) -> None:
        self.gate.wait()
        names = [w.script for w in writes]
        if self.fail_on in names:
            raise ConnectionError(f"refused {self.fail_on}")
        self.trips.append(names)


def w(name: str, size: int = 1) -> BusWrite:
    return BusWrite(name, (), (), size)


def held(bus: FakeBus) -> _Outbox:
    """An outbox whose thread is busy with a first write until `bus.gate` is set, so what is
    handed over meanwhile waits together."""
    bus.gate.clear()
    out = _Outbox("t", bus)  # a fake with RunBus's write_many only
    out.put(w("first"))
    while out._q.qsize():  # the thread took it and waits in its round trip
        pass
    return out


def test_waiting_writes_share_a_round_trip_and_a_call_or_flush_splits_them():
    bus = FakeBus()
    out = held(bus)
    log: list[str] = []
    out.put([w("g1"), w("g2")])  # one step's groups
    out.put(w("ack"), always=lambda: log.append(f"released after {bus.trips[-1]}"))
    out.put(lambda: log.append("call"))
    out.put(w("g3"))
    bus.gate.set()
    out.flush()
    assert bus.trips == [["first"], ["g1", "g2", "ack"], ["g3"]]
    assert log == ["released after ['g1', 'g2', 'ack']", "call"]
    assert (out.writes, out.round_trips) == (5, 3)  # the call is no bus write
    out.close()


def test_a_round_trip_holds_at_most_batch_writes_or_about_batch_bytes():
    bus = FakeBus()
    out = held(bus)
    out.put([w(f"g{i}") for i in range(_Outbox.BATCH_WRITES + 2)])
    bus.gate.set()
    out.flush()
    assert [len(t) for t in bus.trips] == [1, _Outbox.BATCH_WRITES, 2]
    bus.trips.clear()
    bus.gate.clear()
    out.put(w("x"))
    while out._q.qsize():
        pass
    big = _Outbox.BATCH_BYTES // 2
    out.put([w("b1", big), w("b2", big), w("b3", 1)])  # the batch closes at BATCH_BYTES
    bus.gate.set()
    out.flush()
    assert bus.trips == [["x"], ["b1", "b2"], ["b3"]]
    out.close()


def test_after_a_failed_round_trip_nothing_is_sent_and_every_always_still_runs():
    bus = FakeBus(fail_on="g2")
    out = _Outbox("t", bus)
    released: list[str] = []
    bus.gate.clear()  # every hand-over is made before the failure is known
    out.put([w("g1"), w("g2")], always=lambda: released.append("u1"))
    out.put(w("g3"), always=lambda: released.append("u2"))
    out.put([], always=lambda: released.append("u3"))  # nothing to write: `always` alone
    bus.gate.set()
    with pytest.raises(ConnectionError, match="refused g2"):
        out.flush()
    assert bus.trips == [] and released == ["u1", "u2", "u3"]
    assert (out.writes, out.round_trips) == (0, 0)
    with pytest.raises(ConnectionError):
        out.put(w("g4"))
    out.close()


def test_hand_overs_it_cannot_make_are_refused_at_once():
    with pytest.raises(RuntimeError, match="no bus"):
        _Outbox("nobus").put(w("g"))
    with pytest.raises(TypeError, match="bus writes only"):
        _Outbox("mixed", FakeBus()).put([w("g"), lambda: None])
    closed = _Outbox("closed")
    closed.close()
    with pytest.raises(RuntimeError, match="closed"):
        closed.put(lambda: None)
