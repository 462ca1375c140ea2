"""An engine group's placement and its keys on a real Valkey (components/rollout/group.py), and
the swap's read of each node's own copy (engine_worker.node_copy); the group end to end is
tests/rollout/test_engine_group.py."""

from __future__ import annotations

from pathlib import Path

import pytest

from moerl.components.rollout.engine_worker import node_copy
from moerl.components.rollout.group import ENV_NODE_CACHE, GroupBus, GroupSpec
from moerl.config import parse_config
from moerl.errors import ConfigError
from moerl.store.nodecache import MARKER
from tests.support.valkey_server import server, stage_bus  # noqa: F401 (server: a fixture)


def _cfg(nodes=2, dp=4):
    return parse_config(
        {
            "rollout": {"device": "cuda", "data_parallel_size": dp},
            "cluster": {"launch": {"rollout_nodes_per_worker": nodes}},
        }
    )


def _env(rank, size=2, **kw):
    return {
        "MOERL_GROUP_SIZE": str(size),
        "MOERL_NODE_RANK": str(rank),
        "MOERL_LEADER_ADDRESS": "g-leader-0-0.g",
        **kw,
    }


def test_placement_from_the_environment():
    cfg = _cfg()
    assert GroupSpec.from_env(cfg, {}) is None  # an engine of its own
    assert GroupSpec.from_env(cfg, _env(0, size=1)) is None
    lead = GroupSpec.from_env(cfg, _env(0, MOERL_GROUP_ID="g"))
    fol = GroupSpec.from_env(cfg, _env(1))
    assert lead is not None and fol is not None
    assert lead.is_leader and not fol.is_leader
    assert (lead.group_id, fol.group_id) == ("g", "g-leader-0-0.g")  # default: the leader
    assert lead.engine_kwargs(4) == {
        "data_parallel_size_local": 2,
        "data_parallel_address": "g-leader-0-0.g",
        "data_parallel_rpc_port": 29550,
    }
    assert fol.engine_kwargs(4)["data_parallel_start_rank"] == 2
    # on EKS the leader binds on its pod IP; the followers reach it by its DNS name
    lead_ip = GroupSpec.from_env(cfg, _env(0, MOERL_POD_IP="10.0.0.7"))
    fol_ip = GroupSpec.from_env(cfg, _env(1, MOERL_POD_IP="10.0.0.8"))
    assert lead_ip is not None and fol_ip is not None
    assert lead_ip.engine_kwargs(4)["data_parallel_address"] == "10.0.0.7"
    assert fol_ip.engine_kwargs(4)["data_parallel_address"] == "g-leader-0-0.g"


@pytest.mark.parametrize(
    "cfg,env,match",
    [
        (
            _cfg(),
            _env(0, size=3),
            "MOERL_GROUP_SIZE 3 but cluster.launch.rollout_nodes_per_worker is 2",
        ),
        (_cfg(), _env(2), r"MOERL_NODE_RANK 2: allowed 0..1"),
        (_cfg(dp=3), _env(0), "rollout.data_parallel_size 3 over 2 nodes"),
        (_cfg(), {**_env(1), "MOERL_LEADER_ADDRESS": ""}, "MOERL_LEADER_ADDRESS is unset"),
        (_cfg(), _env("x"), "both must be integers"),
    ],
)
def test_bad_placements_are_refused_naming_the_variable(cfg, env, match):
    with pytest.raises(ConfigError, match=match):
        GroupSpec.from_env(cfg, env)


def test_group_keys(server, request, monkeypatch):  # noqa: F811
    bus = stage_bus(server, request, monkeypatch)
    spec = GroupSpec.from_env(_cfg(nodes=3, dp=3), _env(0, size=3, MOERL_GROUP_ID="a"))
    assert spec is not None
    g = GroupBus(bus, "rollout-0", spec)
    assert g.missing(1, "s1") == [1, 2]
    g.report_holds(1, 1, "s1")
    g.report_holds(2, 1, "other")  # the same version number under another manifest
    assert g.missing(1, "s1") == [2]
    g.report_holds(2, 1, "s1")
    assert g.missing(1, "s1") == []
    # the first drain's reason stays; another incarnation of the group does not see it
    g.ask_drain(2, "SIGTERM")
    g.ask_drain(0, "later")
    assert g.drain_asked() == "node 2: SIGTERM"
    again = GroupBus(bus, "rollout-0", GroupSpec(0, 3, "l", "b", 29550))
    assert again.drain_asked() is None and again.holds(1) is None
    assert g.target() is None and not g.leader_starting()
    g.set_target(3)
    g.starting()
    assert g.target() == 3 and g.leader_starting()
    assert 0 < bus.r.ttl(bus.key("group:rollout-0:a:holds:1")) <= 7 * 86400  # keys expire
    assert g.ended() is None
    g.end(75)
    assert g.ended() == 75
    g.beat(1, ttl_s=0.2)
    assert g.alive(1) and not g.alive(2)


def test_a_swap_reads_its_own_nodes_verified_copy(tmp_path, monkeypatch):
    monkeypatch.delenv(ENV_NODE_CACHE, raising=False)
    assert node_copy("/abs/v000001") == "/abs/v000001"  # one node: the path as given
    with pytest.raises(RuntimeError, match="MOERL_NODE_CACHE is unset"):
        node_copy("run/v000001")
    monkeypatch.setenv(ENV_NODE_CACHE, str(tmp_path))
    copy = tmp_path / "run" / "v000001"
    copy.mkdir(parents=True)
    with pytest.raises(RuntimeError, match="not in this node's verified cache"):
        node_copy("run/v000001", "abc")  # fetched, never verified
    (copy / MARKER).write_text("abc\n")
    assert node_copy("run/v000001", "abc") == str(copy)
    with pytest.raises(RuntimeError, match="expected 'def'"):
        node_copy("run/v000001", "def")  # another manifest under the same version number


def test_a_relative_cache_dir_swaps_in_the_copy_the_worker_fetched(tmp_path, monkeypatch):
    """`checkpoint.cache_dir` relative (each pod's own folder, as on EKS): the rollout worker's
    swap (`RolloutWorker._load`, an engine of its own) reaches the engine's rank
    (`RolloutEngine.swap_weights` -> `hot_swap` -> `MoerlWorker.moerl_swap`, vLLM left out)
    naming the verified copy the worker fetched and holds, whatever the rank's working
    directory. A relative copy was taken by the rank for a path under the node cache root,
    doubled, so every swap failed with "not in this node's verified cache (marker None ...)"
    and the workers crash-looped."""
    import time
    from types import SimpleNamespace

    import moerl.components.redistribute_weights.hotswap as hotswap
    from moerl.components.rollout.engine import RolloutEngine
    from moerl.components.rollout.engine_worker import MoerlWorker
    from moerl.components.rollout.worker import RolloutWorker
    from moerl.store.runs import run_cache, run_store

    pod = tmp_path / "pod"
    pod.mkdir()
    monkeypatch.chdir(pod)
    cfg = parse_config(
        {"checkpoint": {"uri": str(tmp_path / "store"), "cache_dir": ".moerl/cache"}}
    )
    src = tmp_path / "src"
    src.mkdir()
    (src / "config.json").write_text('{"v": 1}')
    sha = run_store(cfg.checkpoint, "r1").publish(1, src).sha256()
    # what `_new_engine` gives the engine's ranks
    monkeypatch.setenv(ENV_NODE_CACHE, str(run_cache(cfg.checkpoint, "r1")))
    read: list[str] = []

    def load(rank, model_dir, bucket_bytes, inplace):  # this rank's shard, read
        assert (Path(model_dir) / MARKER).read_text().startswith(sha)
        read.append(model_dir)
        stats = ("bytes", "tensors", "buckets", "moe_layers_repacked", "moe_layers_inplace")
        return {**dict.fromkeys(stats, 0), "read_s": 0.0, "reload_s": 0.0, "repack_s": 0.0}

    monkeypatch.setattr(hotswap, "swap_in_worker", load)
    parallel = SimpleNamespace(
        tensor_parallel_size=1, pipeline_parallel_size=1, data_parallel_size=1
    )
    rank = SimpleNamespace(
        vllm_config=SimpleNamespace(parallel_config=parallel),
        model_runner=SimpleNamespace(get_model=lambda: SimpleNamespace(named_parameters=list)),
    )

    class Core:  # the engine core: the rank runs in a process of its own
        vllm_config = rank.vllm_config

        def collective_rpc(self, method, args):
            monkeypatch.chdir(tmp_path)  # started from another working directory
            bound = SimpleNamespace(**vars(rank))
            bound.moerl_param_digests = lambda: MoerlWorker.moerl_param_digests(bound)
            return [getattr(MoerlWorker, method)(bound, *args)]

        def reset_prefix_cache(self):
            return True

        def set_version(self, label):
            pass

    engine = object.__new__(RolloutEngine)
    engine._core, engine._inflight, engine.swap_faults, engine.version = Core(), {}, [], 0
    quiet = SimpleNamespace(incr=lambda **_: None, heartbeat=lambda *_, **__: None)
    worker = SimpleNamespace(
        cfg=cfg,
        run_id="r1",
        name="rollout-0",
        engine=engine,
        group=None,
        version=0,
        bus=quiet,
        _swarm=lambda: None,
        _prefetched={},
    )
    reg = SimpleNamespace(version=1, manifest_sha256=sha)
    RolloutWorker._load(worker, reg, [], time.perf_counter())  # type: ignore[arg-type]
    assert read == [str(pod / ".moerl" / "cache" / "r1" / "v000001")]
    assert engine.version == 1


def test_a_follower_keeps_what_the_leader_may_swap_in(tmp_path, server, request, monkeypatch):  # noqa: F811
    """A follower's node cache (checkpoint.cache_keep 1 here) never prunes the version the leader
    targets, nor anything newer, while newer versions keep arriving: a swap that takes longer
    than two publications still finds its copy on every node."""
    from moerl.components.rollout.follower import Follower
    from moerl.store.runs import run_cache, run_store, version_uri

    bus = stage_bus(server, request, monkeypatch)
    cfg = parse_config(
        {
            "checkpoint": {
                "uri": str(tmp_path / "store"),
                "cache_dir": str(tmp_path / "node1"),
                "cache_keep": 1,
            },
            "valkey": {"url": server.url, "username": server.stage_user},
        }
    )
    spec = GroupSpec(1, 2, "127.0.0.1", "keep", 29550)
    f = Follower(cfg, bus.run_id, "rollout-0", bus, spec)
    store = run_store(cfg.checkpoint, bus.run_id)
    src = tmp_path / "src"
    src.mkdir()
    cache = run_cache(cfg.checkpoint, bus.run_id)

    def publish(v: int) -> None:
        (src / "config.json").write_text(f'{{"v": {v}}}')
        m = store.publish(v, src)
        bus.register(v, version_uri(store, v), m.sha256())
        f._fetch_servable()

    try:
        publish(0)
        f.gbus.set_target(0)  # the leader swaps version 0 in
        publish(1)
        publish(2)
        assert sorted(f._holds) == [0, 1, 2]
        assert all((cache / f"v{v:06d}").is_dir() for v in (0, 1, 2))
        assert f.gbus.holds(1) == (2, f.held[1])  # the newest is reported
        f.gbus.set_target(2)  # the leader moved on: the older copies may go
        f._release_older()
        assert sorted(f._holds) == [2]
        publish(3)
        assert sorted(f._holds) == [2, 3]
        assert not (cache / "v000000").exists() and not (cache / "v000001").exists()
        assert (cache / "v000002").is_dir() and (cache / "v000003").is_dir()
    finally:
        f.close()


def test_a_follower_holds_the_copy_it_fetched_last_after_a_rollback(
    tmp_path,
    server,  # noqa: F811
    request,
    monkeypatch,
):
    """After a trainer rollback the servable pointer names a lower number than one the follower
    already holds: the copy just fetched is the one the leader swaps in next, so it stays held
    (a neighbour's prune on the node spares it), though it is not the highest number held."""
    from moerl.components.rollout.follower import Follower
    from moerl.store.nodecache import prune_cache
    from moerl.store.runs import run_cache, run_store, version_uri

    bus = stage_bus(server, request, monkeypatch)
    cfg = parse_config(
        {
            "checkpoint": {
                "uri": str(tmp_path / "store"),
                "cache_dir": str(tmp_path / "node1"),
                "cache_keep": 1,
            },
            "valkey": {"url": server.url, "username": server.stage_user},
        }
    )
    f = Follower(cfg, bus.run_id, "rollout-0", bus, GroupSpec(1, 2, "127.0.0.1", "rb", 29550))
    store = run_store(cfg.checkpoint, bus.run_id)
    src = tmp_path / "src"
    src.mkdir()
    cache = run_cache(cfg.checkpoint, bus.run_id)

    def publish(v: int) -> str:
        (src / "config.json").write_text(f'{{"v": {v}}}')
        sha = store.publish(v, src).sha256()
        bus.register(v, version_uri(store, v), sha)
        f._fetch_servable()
        return sha

    try:
        sha2 = publish(2)
        f.gbus.set_target(2)
        publish(3)  # servable before it is durable
        f.gbus.set_target(3)  # the leader serves version 3
        f._release_older()
        assert sorted(f._holds) == [3]
        # version 3 was lost: the new trainer sets the pointer back to its durable version 2
        bus.register(2, version_uri(store, 2), sha2)
        f._fetch_servable()
        assert f.held == (2, sha2) and f.gbus.holds(1) == (2, sha2)
        assert sorted(f._holds) == [2, 3]  # 2 is the leader's next swap; 3 its target
        # another process on the node prunes its cache down to the newest copy: a held copy stays
        assert prune_cache(cache, 1) == []
        assert (cache / "v000002" / MARKER).read_text().split("\n")[0] == sha2
        f.gbus.set_target(2)  # the leader swapped 2 in; 3 is above its target, still kept
        f._release_older()
        assert sorted(f._holds) == [2, 3]
    finally:
        f.close()


def _leader(bus, monkeypatch, timeout_s: float = 30.0):
    """A rollout worker as the leader of a group of three nodes (no engine started: what is
    checked here is the group's control, on the real bus)."""
    from moerl.components.rollout.worker import RolloutWorker

    for k, v in _env(0, size=3, MOERL_GROUP_ID="lead").items():
        monkeypatch.setenv(k, v)
    cfg = parse_config(
        {
            "rollout": {
                "device": "cuda",
                "data_parallel_size": 3,
                "group_fetch_timeout_s": timeout_s,
            },
            "cluster": {"launch": {"rollout_nodes_per_worker": 3}},
        }
    )
    return RolloutWorker(cfg, bus.run_id, "rollout-0", bus)


def test_the_leader_swaps_only_once_every_node_holds_the_version(server, request, monkeypatch):  # noqa: F811
    """`_group_holds`, the leader's check before a swap: refused while any follower lacks the
    version (or holds another manifest under its number); allowed, and the version named as the
    followers' target, once every node holds it; the wait reported in the worker's stats."""
    bus = stage_bus(server, request, monkeypatch)
    w = _leader(bus, monkeypatch)
    try:
        g = w.gbus
        assert g is not None
        bus.register(1, "file:///v1", "s1")
        reg = bus.servable()
        assert reg is not None and reg.version == 1
        assert not w._group_holds(reg)  # nobody holds it
        assert g.target() is None  # the followers keep what they have
        g.report_holds(1, 1, "s1")
        g.report_holds(2, 1, "other")  # version 1 under another manifest
        assert not w._group_holds(reg)
        g.report_holds(2, 0, "s0")  # node 2 still on the version before
        assert not w._group_holds(reg)
        g.report_holds(2, 1, "s1")
        assert w._group_holds(reg)
        assert g.target() == 1
        assert bus.stats()["rollout-0"]["group_wait_s"] > 0
        assert w._group_wait is None  # the clock stops with the swap
    finally:
        w.close()


def test_a_node_that_never_holds_the_version_fails_the_leader_naming_it(
    server,  # noqa: F811
    request,
    monkeypatch,
):
    """rollout.group_fetch_timeout_s: the leader's wait for a version that one node never holds
    ends in WeightSyncError naming that node and what it holds; the clock runs across newer
    versions (a node that always lags one behind fails too)."""
    import time

    from moerl.errors import WeightSyncError

    bus = stage_bus(server, request, monkeypatch)
    w = _leader(bus, monkeypatch, timeout_s=0.6)
    try:
        g = w.gbus
        assert g is not None
        w.version = 0  # serving version 0 meanwhile (no sleep in the check)
        bus.register(1, "file:///v1", "s1")
        g.report_holds(1, 1, "s1")
        g.report_holds(2, 0, "s0")
        assert not w._group_holds(bus.servable())
        time.sleep(0.4)
        bus.register(2, "file:///v2", "s2")  # a newer version: node 2 lags behind again
        g.report_holds(1, 2, "s2")
        g.report_holds(2, 1, "s1")
        assert not w._group_holds(bus.servable())
        time.sleep(0.4)
        with pytest.raises(WeightSyncError) as err:
            w._group_holds(bus.servable())
        msg = str(err.value)
        assert "nodes [2] of the engine group do not hold version 2" in msg
        assert "rollout.group_fetch_timeout_s" in msg and "{2: (1, 's1')}" in msg
    finally:
        w.close()


def test_a_follower_whose_beat_lapses_fails_the_group(server, request, monkeypatch):  # noqa: F811
    """NODE_LOST_S: a follower the leader saw beating, then not for longer than that, fails the
    leader at its next check between units (RuntimeError naming the node); a drain any node asks
    for drains the leader."""
    import time

    from moerl.bus import TrainerWatch
    from moerl.components.rollout import worker as worker_mod

    monkeypatch.setattr(worker_mod, "NODE_LOST_S", 0.5)
    bus = stage_bus(server, request, monkeypatch)
    w = _leader(bus, monkeypatch)
    try:
        g = w.gbus
        assert g is not None
        watch = TrainerWatch(bus, w.cfg.pipeline.trainer_lost_s)
        g.beat(1, ttl_s=0.3)
        g.beat(2, ttl_s=60.0)
        w._group_watch()
        assert w._group_failure is None and w._exit_code(watch) is None
        assert g.alive(0)  # the leader beats too
        time.sleep(0.4)  # node 1's beat lapsed, not for NODE_LOST_S yet
        w._group_watch()
        assert w._group_failure is None
        time.sleep(0.3)
        w._group_watch()
        assert w._group_failure is not None and w._group_failure.startswith(
            "node 1 of the engine group has not beaten for"
        )
        with pytest.raises(RuntimeError, match="rollout-0: node 1 of the engine group"):
            w._exit_code(watch)
    finally:
        w.close()
    w2 = _leader(bus, monkeypatch)
    try:
        assert w2.gbus is not None
        w2.gbus.ask_drain(2, "SIGTERM (a Spot notice)")
        w2._group_watch()
        assert w2.drain.asked
        assert w2._exit_code(TrainerWatch(bus, w2.cfg.pipeline.trainer_lost_s)) == 75
    finally:
        w2.close()


class _RanksUp:
    """Stands in for the follower's headless engine ranks, alive throughout: what is checked is
    the follower's loop reading the leader's state on the bus."""

    def dead(self) -> dict[str, int]:
        return {}

    def close(self) -> None:
        pass


def test_a_follower_leaves_a_lost_or_ended_leader(tmp_path, server, request, monkeypatch):  # noqa: F811
    """The follower's side: a leader that never starts its engine fails it after
    rollout.group_fetch_timeout_s (TimeoutError naming the leader and the field); a leader that
    beat, then stopped for LEADER_LOST_S, ends it with 1; a leader's end code is its own."""
    import time

    from moerl.components.rollout import follower as follower_mod
    from moerl.components.rollout.follower import Follower

    monkeypatch.setattr(follower_mod, "LEADER_LOST_S", 0.6)
    monkeypatch.setattr(follower_mod, "POLL_S", 0.05)
    bus = stage_bus(server, request, monkeypatch)
    cfg = parse_config(
        {
            "checkpoint": {"uri": str(tmp_path / "store"), "cache_dir": str(tmp_path / "n1")},
            "rollout": {"group_fetch_timeout_s": 0.5},
        }
    )

    def follower(group: str) -> Follower:
        return Follower(cfg, bus.run_id, "rollout-0", bus, GroupSpec(1, 2, "leader-0", group, 1))

    f = follower("never")
    with pytest.raises(TimeoutError) as err:
        f._wait_leader_starting()
    assert "the leader leader-0 did not start its engine in 0.5 s" in str(err.value)
    assert "(rollout.group_fetch_timeout_s)" in str(err.value)

    f = follower("lost")
    f.engine = _RanksUp()  # type: ignore[assignment]
    f.gbus.beat(0, ttl_s=0.3)
    t0 = time.monotonic()
    assert f._loop(75) == 1
    assert 0.6 < time.monotonic() - t0 < 5

    f = follower("ended")
    f.engine = _RanksUp()  # type: ignore[assignment]
    f.gbus.beat(0)
    f.gbus.end(75)
    assert f._loop(75) == 75
    f = follower("failed")
    f.engine = _RanksUp()  # type: ignore[assignment]
    f.gbus.end(3)
    assert f._loop(75) == 1
