"""`valkey.run_quota_mb` on a real Valkey: the trainer's issuer issues nothing while the run's
streams hold more than the run's share of a shared server, and issues again once they are back
under it (before, nothing bounded a run's bytes but admission, so one run could fill maxmemory
for every run on the server)."""

from __future__ import annotations

import pytest

from moerl.bus import GENERATED, SCORED
from moerl.components.policy_update import gather as gather_mod
from moerl.components.policy_update.gather import Issuer, TrainerState
from tests.support.valkey_server import server, stage_bus  # noqa: F401 (server: a module fixture)
from tests.trainer.test_trainer_gather import _cfg


@pytest.fixture
def bus(server, request, monkeypatch):
    return stage_bus(server, request, monkeypatch, visibility_timeout_s=30)


def test_the_issuer_pauses_while_the_runs_streams_exceed_its_quota(bus, monkeypatch):
    monkeypatch.setattr(gather_mod, "QUOTA_EVERY_S", 0.0)
    cfg = _cfg()
    cfg = cfg.model_copy(update={"valkey": cfg.valkey.model_copy(update={"run_quota_mb": 16})})
    issuer = Issuer(cfg, bus, TrainerState(version=0, committed=0), bus.claim_trainer("t"))
    big = [{"response_token_ids": [7] * 150_000}] * 2  # 600 kB a group as JSON
    for i in range(32):
        bus.publish_group(f"u{i + 1:07d}/0:p{i}", big)
    assert bus.stream_bytes() > 16 << 20
    assert issuer.step() == 0 and bus.counters()["prompts_issued"] == 0
    bus.r.xtrim(bus.key(GENERATED), maxlen=0)  # consumed: the streams are small again
    assert bus.stream_bytes() < 16 << 20 and bus.depth()[SCORED] == 0
    assert issuer.step() > 0 and bus.counters()["prompts_issued"] > 0
