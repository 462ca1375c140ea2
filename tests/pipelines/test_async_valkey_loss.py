"""A run whose Valkey loses every key mid-run (FLUSHALL: what a restart without its append-only
file, or an operator's mistake, leaves), as local processes on real parts (nightly tier; the
harness: tests/support/fault_runs.py). The trainer stops with one line saying what was lost;
its restart claims an epoch above the newest the store recorded (before, the epoch restarted at
1 while `latest.json` held a newer one, and every version it trained was refused as "replaced
by a newer trainer"), rebuilds the registry from the store, and the run publishes every version.
"""

from __future__ import annotations

import pytest

from moerl.store.runs import run_store
from tests.support.fault_runs import Harness, versions_of

pytestmark = pytest.mark.nightly


def test_a_valkey_flushed_mid_run_publishes_again_and_says_what_was_lost(tmp_path):
    import valkey

    h = Harness(tmp_path, "pipeline.versions=6")
    store = run_store(h.cfg.checkpoint, h.run_id)
    state: dict[str, int] = {}

    def fault(run):
        reg = run.bus.registry()
        if "flushed" not in state and reg is not None and reg.version >= 2:
            state["epoch"] = store.latest_epoch() or 0
            # the server's admin (the stages' ACL user may not flush)
            valkey.Valkey.from_url(h.valkey.url).flushall()
            state["flushed"] = reg.version

    c = h.go(fault)
    assert "flushed" in state, "the run ended before the flush"
    assert versions_of(h)[-1] == h.cfg.pipeline.versions  # it published again, to the end
    assert store.latest_epoch() > state["epoch"]  # the restarted trainer's, above the store's
    log = "\n".join(h.run.tail(name, 4000) for name in ("trainer",))
    assert "Valkey lost this run's state" in log  # one line, what was lost
    trainer = h.run.children["trainer"]
    assert trainer.exits[-1] == 0 and trainer.starts >= 2
    # the rebuilt counters: the versions before the flush counted from the store, the rest as
    # they were committed, each version B groups
    assert c["groups_used"] == h.cfg.pipeline.versions * h.cfg.task.prompts_per_iteration, c
