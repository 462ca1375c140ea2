"""An engine group's placement and its keys on a real Valkey (components/rollout/group.py), and
the swap's read of each node's own copy (engine_worker.node_copy); the group end to end is
tests/rollout/test_engine_group.py."""

from __future__ import annotations

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
