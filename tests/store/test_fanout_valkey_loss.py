"""The fan-out's chunk token across a Valkey that lost the run's keys (FLUSHALL), on a real server
and real chunk servers: a worker started after the loss makes a new token, and the workers that
were running take it up at their next refresh, so old and new admit each other again. Before,
each side refused the other (403) until the old workers were restarted."""

from __future__ import annotations

from pathlib import Path

import pytest
import requests

from moerl.bus import EmbeddedValkey, RunBus, connect
from moerl.config import CheckpointConfig
from moerl.store.fanout import Swarm
from moerl.store.fanout_book import TOKEN_KEY


@pytest.fixture
def valkey(tmp_path):
    with EmbeddedValkey(tmp_path / "valkey", appendonly=False) as v:
        yield v


def _status(server: Swarm, token: str) -> int:
    url = f"{server.url}/chunk/1/{'0' * 64}/0"  # a chunk nobody holds: 404 once admitted
    return requests.get(url, headers={"Authorization": f"Bearer {token}"}, timeout=5).status_code


def test_old_and_new_workers_agree_on_the_chunk_token_after_a_flushall(valkey, tmp_path: Path):
    cfg = CheckpointConfig(
        uri=str(tmp_path / "durable"), cache_dir=str(tmp_path / "node"), fanout=True
    )
    bus = RunBus(connect(valkey.url, 5.0), "run")
    old = [Swarm(bus, f"rollout-{i}", cfg) for i in range(2)]
    new: Swarm | None = None
    try:
        for s in old:
            s.serve()
        assert _status(old[0], old[1].token) == 404  # one run, one token
        bus.r.flushall()  # the run's keys are gone, the old workers still run
        new = Swarm(bus, "rollout-2", cfg)
        new.serve()
        assert new.token != old[0].token
        assert _status(old[0], new.token) == 403 and _status(new, old[0].token) == 403
        for s in old:  # their keep-alive's next round (every ALIVE_TTL_S / 3)
            s.rejoin()
        assert {s.token for s in [*old, new]} == {bus.r.get(bus.key(TOKEN_KEY))}
        assert _status(old[0], new.token) == 404 and _status(new, old[1].token) == 404
        # and the old workers are peers again: their addresses are back in the run's list
        assert set(bus.r.hgetall(bus.key("fanout:peers"))) == {
            "rollout-0",
            "rollout-1",
            "rollout-2",
        }
    finally:
        for s in [*old, *([new] if new else [])]:
            s.stop()


def test_a_worker_alone_after_the_loss_puts_its_own_token_back(valkey, tmp_path: Path):
    cfg = CheckpointConfig(
        uri=str(tmp_path / "durable"), cache_dir=str(tmp_path / "node"), fanout=True
    )
    bus = RunBus(connect(valkey.url, 5.0), "run")
    old = Swarm(bus, "rollout-0", cfg)
    try:
        old.serve()
        token = old.token
        bus.r.flushall()
        old.rejoin()  # no newer worker: its token is the run's again, for whoever starts next
        assert bus.r.get(bus.key(TOKEN_KEY)) == token == old.token
    finally:
        old.stop()
