"""The trainer's watchdog (components/policy_update/watchdog.py) on a real Valkey: groups the
producer refuses (too large for the bus) are not progress. Before, every refused group moved a
counter the watchdog read, so a run whose groups were all refused generated for ever without
training (probe: refused every 2 s, still gathering after 45 s with a 10 s watchdog)."""

from __future__ import annotations

import logging
import threading
import time

import pytest

from moerl.bus import run as bus_run
from moerl.components.policy_update import watchdog as wd
from moerl.components.policy_update.gather import Inbox, gather
from moerl.components.policy_update.watchdog import Watchdog
from moerl.errors import DataError
from tests.support.valkey_server import server, stage_bus  # noqa: F401 (server: a module fixture)
from tests.trainer.test_trainer_gather import B, _cfg, _issuer


@pytest.fixture
def bus(server, request, monkeypatch):
    return stage_bus(server, request, monkeypatch, visibility_timeout_s=30)


def _refusing_producer(bus, monkeypatch, every_s: float = 0.1):
    """A producer whose every group is over the entry cap, refused through the bus's own
    script (the cap lowered to 1 kB, so the groups stay small here). Stops with its event."""
    monkeypatch.setattr(bus_run, "MAX_ENTRY_BYTES", 1024)
    stop = threading.Event()

    def run() -> None:
        i = 0
        while not stop.wait(every_s):
            i += 1
            sample = {"response_token_ids": list(range(400)), "prompt_id": f"p{i}"}
            bus.write_many([bus.group_write(f"u{i:07d}/0:p{i}", [sample, sample])])

    threading.Thread(target=run, daemon=True).start()
    return stop


def _gather_refused(bus, monkeypatch, **pipeline):
    cfg = _cfg(**pipeline)
    epoch = bus.claim_trainer("t")
    issuer = _issuer(cfg, bus, epoch)
    stop = _refusing_producer(bus, monkeypatch)
    t0 = time.monotonic()
    try:
        with pytest.raises(DataError) as err:
            gather(bus, cfg, 0, Inbox(bus), epoch, issuer)
    finally:
        stop.set()
        issuer.stop_event.set()
    assert bus.counters()["groups_dead"] >= B  # they were refused, and counted
    return str(err.value), time.monotonic() - t0


def test_refused_groups_fail_the_run_within_its_dropped_budget(bus, monkeypatch):
    line, took = _gather_refused(bus, monkeypatch, stall_timeout_s=30.0)
    assert "over pipeline.max_dropped_fraction 0.8" in line and "dead " in line, line
    assert took < 10  # by the budget, long before the 30 s watchdog


def test_refused_groups_are_no_progress_for_the_stall_watchdog(bus, monkeypatch):
    # no budget: the watchdog alone, which refused groups no longer keep quiet
    line, took = _gather_refused(bus, monkeypatch, stall_timeout_s=1.0, max_dropped_fraction=1.0)
    assert "no progress for" in line and "(pipeline.stall_timeout_s)" in line, line
    assert "groups dead" in line and took < 10


def test_a_publication_in_flight_is_progress_and_the_status_line_is_logged(
    bus, monkeypatch, caplog
):
    """Streamed, the next version's prompts wait for the publication: a publication in flight
    is progress (its own budgets bound it), and the wait is reported every STATUS_EVERY_S."""
    monkeypatch.setattr(wd, "STATUS_EVERY_S", 0.0)
    now = [0.0]
    in_flight = [1]
    dog = Watchdog(bus, _cfg(stall_timeout_s=10.0), 0, B, lambda: in_flight[0], lambda: now[0])
    with caplog.at_level(logging.INFO, logger=wd.__name__):
        for t in range(0, 65, 5):  # a minute of publishing: never a stall
            now[0] = float(t)
            dog.look(0)
    assert "1 publication(s) in flight" in caplog.text
    in_flight[0] = 0
    now[0] = 65.0
    dog.look(0)  # published at 60 s: quiet from then on
    now[0] = 71.0
    with pytest.raises(DataError, match="no progress for 11 s"):
        dog.look(0)
