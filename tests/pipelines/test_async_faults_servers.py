"""Second-order fault tests of the async mode, about servers and engines (nightly tier): the
cache tier's server killed and restarted; a Valkey outage longer than the visibility timeout;
a worker on the AsyncLLM core swapping in flight; an elastic fleet that grows, loses a worker
and drains one. The harness and the balance every test checks: tests/support/fault_runs.py.
"""

from __future__ import annotations

import signal
import time
from typing import Any

import pytest

from moerl import tracking
from moerl.components.rollout.worker import EXIT_DRAINED
from tests.support.fault_runs import (
    FLOOR_S,
    Harness,
    balanced,
    cache_server,
    mlflow_balanced,
    trained_groups,
    versions_of,
)

pytestmark = pytest.mark.nightly


def test_a_cache_server_killed_and_restarted_mid_run_sends_engines_to_s3_and_the_run_completes(
    tmp_path, monkeypatch
):
    cache = cache_server(tmp_path, monkeypatch)
    try:
        h = Harness(
            tmp_path,
            "pipeline.versions=8",
            "checkpoint.cache_tier.uri=s3://moerl-cache/ckpt",
            f"checkpoint.cache_tier.endpoint_url={cache.server.endpoint_url}",
        )
        state: dict[str, int] = {}

        def fault(run):
            # the servable pointer, not the registry: a version is committed (and counted
            # failed) only once durable, well after its servable copy, so on a fast run the
            # registry lags the publisher by versions
            cur = run.bus.servable()
            if cur is None:
                return
            if "killed" not in state and cur.version >= 1:
                cache.kill()
                state["killed"] = cur.version
            elif (
                "killed" in state
                and "restarted" not in state
                and (
                    run.bus.counters()["cache_tier_failed"] >= 1
                    or cur.version >= state["killed"] + 2
                )
            ):
                # down until a version begun after the kill was published to S3 first; the
                # trainer is paused while the server comes back (seconds on a loaded machine),
                # so versions remain to be published to it afterwards
                run.signal("trainer", signal.SIGSTOP)
                try:
                    cache.start()
                    cache.wait_writable("moerl-cache")
                finally:
                    run.signal("trainer", signal.SIGCONT)
                state["restarted"] = cur.version
                state["cache_reads_before"] = run.bus.counters()["weights_from_cache"]

        c = h.go(fault)
        assert state.keys() == {"killed", "restarted", "cache_reads_before"}
        assert versions_of(h)[-1] == h.cfg.pipeline.versions  # every version durable
        balanced(c, h.cfg)
        # while it was down the publisher went to S3 first, counted per version and on the bus;
        # after the restart the cache tier is used again (an engine that met the outage read S3
        # or kept its version: tests/store/test_tiers.py covers the reader's fallback itself)
        by_version = {
            step + 1: v
            for step, v in tracking.metric_history(h.uri, h.run_id, "weights/cache_tier_failed")
        }
        # every version says where it went
        assert sorted(by_version) == list(range(1, h.cfg.pipeline.versions + 1))
        assert c["cache_tier_failed"] == sum(by_version.values()) >= 1
        # every version begun after the restart (the trainer was stopped while the server came
        # back) went to the cache tier first; there are such versions
        after = [v for version, v in by_version.items() if version >= state["restarted"] + 2]
        assert after and all(v == 0.0 for v in after), by_version
        # engines read the cache tier again after its restart (it held versions before the kill
        # too, so a count from before proves nothing about after)
        assert c["weights_from_cache"] > state["cache_reads_before"]
        assert all(code == 0 for code in h.run.children["rollout-0"].exits)
    finally:
        cache.stop()


def test_a_valkey_outage_longer_than_the_visibility_timeout_is_survived_by_every_stage(tmp_path):
    """Valkey crashes while the worker holds a unit and comes back after 1.5 visibility
    timeouts: on its return every lease looks idle. Nobody takes a live holder's unit (the
    worker, leasing its next unit beside the held one, touches it instead of claiming it back:
    before, it claimed its own unit and crashed on the first attempt's request ids), nothing
    acknowledged is lost, and every stage ends cleanly."""
    h = Harness(tmp_path, "rollout.units_in_flight=2")
    sent = []
    outage_s = 1.5 * h.cfg.units.visibility_timeout_s

    def fault(run):
        reg = run.bus.registry()
        # any unit held, from version 0 on
        if not sent and reg is not None and h.holds_unit("rollout-0"):
            h.valkey.kill()  # a crash: only the fsynced append-only file survives
            time.sleep(outage_s)
            h.valkey.start()
            sent.append(True)

    c = h.go(fault)
    assert sent
    # no stage crashed, every one ended cleanly
    assert all(ch.exits == [0] for ch in h.run.children.values())
    assert versions_of(h)[-1] == h.cfg.pipeline.versions
    balanced(c, h.cfg)
    assert c["units_reclaimed"] == 0  # the held unit stayed with its live holder


def test_a_worker_on_the_asyncllm_core_swaps_in_flight_and_the_run_balances(tmp_path):
    """rollout.engine_api async (vLLM's AsyncLLM, the core a data-parallel engine needs), in the
    real worker: early start on dummy weights, version 0 swapped in, later versions swapped with
    sequences running (pause "keep", swap by name, resume); every sample accounted for."""
    h = Harness(
        tmp_path,
        "rollout.engine_api=async",
        "rollout.weight_update=in_flight",
        "rollout.max_new_tokens=24",
        "pipeline.versions=4",
    )
    c = h.go()
    balanced(c, h.cfg)
    # measured: 2 swaps, both with sequences running (whether one is in flight depends on
    # timing; tests/rollout/test_async_engine.py checks the in-flight swap on this core itself)
    assert c["swaps"] >= 1 and c["failed"] == 0, c
    log = h.run.tail("rollout-0", 400)
    assert "hot-swapped to version" in log
    assert "Traceback" not in log


def test_an_elastic_fleet_grows_loses_a_worker_and_drains_one_and_the_run_balances(tmp_path):
    """rollout.min_workers 1, max_workers 2 (components/rollout/fleet.py): generation made slow
    (one sequence at a time, longer answers), so the units issued for a version would outlast a
    new engine's load time and the controller adds a worker on its own. The joined worker is
    SIGKILLed while it holds a unit (restarted, its unit reclaimed); once it runs again the
    fleet is resized down to one (the rule's shrink decisions are unit-tested; here the drain
    itself): it drains with SIGTERM, exits 75 and is not restarted, and the controller
    may grow the fleet again with a new worker. Nothing is trained twice."""
    h = Harness(
        tmp_path,
        "pipeline.versions=8",
        "task.prompts_per_iteration=16",
        "rollout.max_num_seqs=1",
        # long answers and up to four versions' units issued ahead: a backlog that outlasts a
        # new engine's load time however slow the machine is (the rule scales with both, but a
        # loaded machine stretches an engine's load more than a unit's generation: with 24
        # tokens and three versions ahead, a CI run under load finished before it grew)
        "rollout.max_new_tokens=48",
        "buffer.max_staleness=3",
        "rollout.min_workers=1",
        "rollout.max_workers=2",
        "rollout.fleet_interval_s=1",
        "rollout.fleet_scale_down_after_s=600",  # no automatic shrink: the test drains one below
        "units.visibility_timeout_s=4",
    )
    seen: dict[str, Any] = {}

    def tick(run):
        if "killed" not in seen and "rollout-1" in run.children and h.holds_unit("rollout-1"):
            run.signal("rollout-1", signal.SIGKILL)
            seen["killed"] = time.time()
        st = run.bus.stats().get("rollout-1", {})
        if (
            "killed" in seen
            and "shrunk" not in seen
            and run.children["rollout-1"].starts > 1
            # restarted and running again: its heartbeat thread, started once its SIGTERM drain
            # is installed, reports the new process's start (its name still holds the killed
            # one's lease until the visibility timeout, so the pending list alone would not say)
            and st.get("started_unix", 0.0) > seen["killed"]
        ):
            run.resize(1, "the test's scale-down")
            seen["shrunk"] = [c.name for c in run.children.values() if c.retired]
        if run.fleet is not None:  # read while the run's Valkey is up
            seen["kept"] = run.bus.fleet()
            seen["metrics"] = run.fleet.metrics(run.bus, time.perf_counter())

    c = h.go(tick, floor_s=2 * FLOOR_S)  # two engines and a restart on two shared cores
    f = h.run.fleet
    assert f is not None and f.ups >= 1, "the controller never grew the fleet"
    assert "killed" in seen and -signal.SIGKILL in h.run.children["rollout-1"].exits
    assert seen.get("shrunk"), "the run ended before the test's scale-down"
    retired = [h.run.children[n] for n in seen["shrunk"]]
    # drained, not failed and not restarted
    exits = {ch.name: (ch.exits, ch.starts) for ch in retired}
    assert all(ch.exits[-1:] in ([EXIT_DRAINED], [0]) and ch.handled for ch in retired), exits
    kept = seen["kept"]
    assert kept["lag_count"] >= 1 and kept["load_s"] > 0  # measured, on the bus
    groups = trained_groups(h)
    assert len(groups) == len(set(groups))  # no group in two versions
    balanced(c, h.cfg)
    mlflow_balanced(h)
    m = seen["metrics"]
    assert m["fleet/workers_max"] == 2 and m["fleet/scale_downs"] >= 1
    assert 0 < m["fleet/idle_worker_s"] < m["fleet/worker_s"]
