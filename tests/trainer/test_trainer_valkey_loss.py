"""A Valkey that lost a run's data (FLUSHALL, or a restart without its append-only file), on a
real server and a real store: the running trainer stops with one line saying what was lost, and
the restarted one claims an epoch above the newest the store recorded, so it publishes again
(before, the epoch restarted at 1 while `latest.json` held 5, and every version it trained was
refused as "replaced by a newer trainer")."""

from __future__ import annotations

import pytest

from moerl.bus import EmbeddedValkey, FencedError, RunBus, connect
from moerl.components.policy_update.worker import _take_over
from moerl.store.runs import run_store
from tests.trainer.test_trainer_gather import _cfg


@pytest.fixture
def valkey(tmp_path):
    with EmbeddedValkey(tmp_path / "valkey", appendonly=False) as v:
        yield v


def _version(tmp_path, v: int):
    src = tmp_path / f"src{v}"
    src.mkdir()
    (src / "w.bin").write_bytes(bytes([v]) * 64)
    return src


def test_after_a_flushall_the_trainer_claims_an_epoch_above_the_stores_and_publishes(
    valkey, tmp_path
):
    cfg = _cfg()
    cfg = cfg.model_copy(
        update={"checkpoint": cfg.checkpoint.model_copy(update={"uri": str(tmp_path / "ckpt")})}
    )
    run_id = "flushed"
    store = run_store(cfg.checkpoint, run_id)
    store.publish(0, _version(tmp_path, 0), {})
    bus = RunBus(connect(valkey.url, 5), run_id)
    for _ in range(5):  # five trainers took the run over, each fencing the store
        epoch, _, latest = _take_over(cfg, run_id, bus)
    assert (epoch, store.latest_epoch(), latest) == (5, 5, 0)

    bus.ensure_groups()
    bus.issue_unit([{"id": "p0", "prompt": "x"}])
    stage = RunBus(connect(valkey.url, 5), run_id)  # a rollout worker's, say
    bus.r.flushall()
    # the stages go on (before: NOGROUP raised in every stage, the local supervisor included)
    assert stage.lease_unit("rollout-0", block_ms=10) is None and stage.backlog() == 0
    with pytest.raises(FencedError, match=r"Valkey lost this run's state \(its trainer epoch 5"):
        bus.check_epoch(5)  # the running trainer's next check: one line, what was lost

    epoch, tiers, latest = _take_over(cfg, run_id, bus)  # its restart, on the emptied server
    assert epoch == 6 and store.latest_epoch() == 6 and latest == 0
    tiers.publish(1, _version(tmp_path, 1), {}, exclusive=True)  # fenced by epoch 6: accepted
    assert store.latest() == 1
    assert bus.claim_trainer("next", floor=store.latest_epoch()) == 7  # and on from there
