"""An S3 brownout in an async run (nightly tier): the run's checkpoint store (a real `weed mini`)
stopped for three minutes mid-run, then started again on the same address and data. The
publisher waits on it with backoff (checkpoint.outage_s) while checkpoint.max_unpublished holds
the trainer back, each wait said in the trainer's log; the run then publishes every version and
its counters balance. The harness and the balance: tests/support/fault_runs.py.
"""

from __future__ import annotations

import os
import time

import pytest

from tests.support.fault_runs import FLOOR_S, Harness, balanced, mlflow_balanced, versions_of
from tests.support.s3server import S3Process

pytestmark = pytest.mark.nightly
OUTAGE_S = 180.0


def test_the_checkpoint_store_stopped_for_three_minutes_mid_run_costs_time_not_the_run(
    tmp_path, monkeypatch
):
    weed = S3Process(tmp_path / "weed")
    server = weed.start()
    server.client().create_bucket(Bucket="ckpt")
    # every stage finds the keys through the standard AWS chain, as IRSA gives them on EKS
    for k in [k for k in os.environ if k.startswith("AWS_")]:
        monkeypatch.delenv(k)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", server.access_key)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", server.secret_key)
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    state: dict[str, float] = {}
    try:
        h = Harness(
            tmp_path,
            "pipeline.versions=6",
            "checkpoint.uri=s3://ckpt/moerl",
            f"checkpoint.endpoint_url={server.endpoint_url}",
            "checkpoint.region=us-east-1",
            "checkpoint.max_attempts=2",
            "checkpoint.outage_s=600",
        )

        def fault(run) -> None:
            cur = run.bus.servable()
            now = time.monotonic()
            if "stopped" not in state and cur is not None and cur.version >= 2:
                weed.stop()
                state.update(stopped=now, at=cur.version)
            elif "stopped" in state and "restarted" not in state:
                if now - state["stopped"] < OUTAGE_S:
                    return
                after = run.bus.servable()
                state["during"] = after.version if after is not None else -1
                weed.start()
                weed.wait_writable("ckpt")
                state["restarted"] = time.monotonic()

        c = h.go(fault, floor_s=FLOOR_S + OUTAGE_S + 180)
    finally:
        weed.stop()
    assert {"stopped", "restarted"} <= state.keys()
    assert state["restarted"] - state["stopped"] >= OUTAGE_S
    # nothing became servable while the store was away (at most one version it had finished)
    assert state["during"] <= state["at"] + 1
    weed.start()
    try:
        assert versions_of(h)[-1] == h.cfg.pipeline.versions  # every version durable after all
    finally:
        weed.stop()
    balanced(c, h.cfg)
    mlflow_balanced(h)
    log = (h.run.logs / "trainer.log").read_text()
    assert "publisher: version" in log and "waiting on the checkpoint store" in log, log[-3000:]
