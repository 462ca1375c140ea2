"""The dispatcher contract, run on every backend available here.

One shared contract (tests/support/kernels_worker.check_contract) per (backend, world size, scenario):
identity experts give x * sum of non-dropped weights; an expert-wise function matches the
naive reference MoE; counts and rows per local expert match the routing; gradients w.r.t. x
and topk_weights match autograd through the reference within 1e-5. Scenarios: uniform,
Zipf-skewed with dropped slots (-1) and experts (a whole rank at world 4) that get nothing,
and T = 0 on rank 1.

Multi-rank worlds are spawned once per world size (module fixtures): gloo on loopback. The
deepep backend is skipped with the reason unless CUDA, deep_ep and 2 GPUs are present; its
import guard and the fallback to all_to_all are tested here.
"""

from __future__ import annotations

import logging

import pytest
import torch

from moerl.errors import ConfigError
from moerl.kernels import make_dispatcher
from moerl.kernels.deepep import DeepEPUnavailable, import_deep_ep
from tests.support.kernels_worker import SCENARIOS, E, check_contract, run_world


def _deepep_available() -> tuple[bool, str]:
    """(available, reason) without raising, for the skips below."""
    try:
        import_deep_ep()
    except DeepEPUnavailable as exc:
        return False, str(exc)
    return True, ""


DEEPEP_OK, DEEPEP_REASON = _deepep_available()

WORLD2 = [
    {"id": "all_to_all", "backend": "all_to_all"},
    {"id": "hierarchical_rpn1", "backend": "hierarchical", "ranks_per_node": 1},
    {"id": "hierarchical_rpn2", "backend": "hierarchical", "ranks_per_node": 2},
    {
        "id": "deepep_fallback",
        "backend": "deepep",
        "allow_fallback": True,
        "scenarios": ["uniform"],
    },
    # inside a world: still ep_size 1
    {
        "id": "local",
        "backend": "local",
        "scenarios": ["uniform"],
    },
]
WORLD4 = [
    {
        "id": "all_to_all",
        "backend": "all_to_all",
        "ranks_per_node": 2,
        "scenarios": [*SCENARIOS, "remote_node_repeat"],
    },
    {
        "id": "hierarchical_rpn2",
        "backend": "hierarchical",
        "ranks_per_node": 2,
        "scenarios": [*SCENARIOS, "remote_node_repeat"],
    },
    {"id": "hierarchical_rpn1", "backend": "hierarchical", "ranks_per_node": 1},
    # two EP groups of 2 inside the 4-rank world: group ranks != world ranks
    {"id": "all_to_all_ep2", "backend": "all_to_all", "ep_size": 2},
    {"id": "hierarchical_ep2", "backend": "hierarchical", "ranks_per_node": 1, "ep_size": 2},
]
# (world, config id): the contract cases; world 1 runs in this process without torch.distributed
CASES = [
    (1, "local"),
    (1, "all_to_all"),
    (1, "hierarchical_rpn1"),
    (2, "all_to_all"),
    (2, "hierarchical_rpn1"),
    (2, "hierarchical_rpn2"),
    (4, "all_to_all"),
    (4, "hierarchical_rpn2"),
    (4, "hierarchical_rpn1"),
    (4, "all_to_all_ep2"),
    (4, "hierarchical_ep2"),
    (2, "deepep"),
]
TOL = 1e-5


@pytest.fixture(scope="module")
def worlds(tmp_path_factory) -> dict[int, dict[str, list[dict]]]:
    """Spawn the 2- and 4-rank gloo worlds once; results keyed by 'config|scenario'."""
    return {
        2: run_world(2, WORLD2, tmp_path_factory.mktemp("w2")),
        4: run_world(4, WORLD4, tmp_path_factory.mktemp("w4")),
    }


def _in_process(config_id: str, scenario: str) -> list[dict]:
    backend = config_id.split("_rpn")[0]
    return [check_contract(make_dispatcher(backend, E), scenario, rank=0)]


def _assert_contract(per_rank: list[dict], tol: float, label: str) -> None:
    for rank, r in enumerate(per_rank):
        where = f"{label} rank {rank}"
        assert r["counts_ok"], f"{where}: tokens_per_local_expert differs from the routing"
        assert r["rows_err"] <= tol, (
            f"{where}: received rows differ from the reference ({r['rows_err']})"
        )
        assert r["identity_err"] <= tol, (
            f"{where}: combine(dispatch(x)) != x * sum(w) ({r['identity_err']})"
        )
        assert r["out_err"] <= tol, (
            f"{where}: MoE output differs from the reference ({r['out_err']})"
        )
        assert r["grad_x_err"] <= tol, (
            f"{where}: d/dx differs from the reference ({r['grad_x_err']})"
        )
        assert r["grad_w_err"] <= tol, (
            f"{where}: d/dtopk_weights differs from the reference ({r['grad_w_err']})"
        )


@pytest.mark.parametrize("scenario", SCENARIOS)
@pytest.mark.parametrize("world,config_id", CASES, ids=[f"{c}-w{w}" for w, c in CASES])
def test_contract(worlds, world, config_id, scenario, tmp_path):
    if config_id == "deepep":
        if not DEEPEP_OK:
            pytest.skip(DEEPEP_REASON)
        if torch.cuda.device_count() < 2:
            pytest.skip("the deepep contract needs 2 CUDA GPUs (an NCCL world of 2)")
        per_rank = run_world(
            2,
            [{"id": "deepep", "backend": "deepep", "scenarios": [scenario]}],
            tmp_path,
            device="cuda",
        )[f"deepep|{scenario}"]
        _assert_contract(per_rank, tol=5e-2, label=f"deepep w2 {scenario}")  # bf16 on the wire
        return
    per_rank = (
        _in_process(config_id, scenario) if world == 1 else worlds[world][f"{config_id}|{scenario}"]
    )
    assert len(per_rank) == world
    _assert_contract(per_rank, TOL, f"{config_id} w{world} {scenario}")


def test_local_inside_a_world_keeps_every_expert(worlds):
    per_rank = worlds[2]["local|uniform"]
    _assert_contract(per_rank, TOL, "local w2")
    assert all(r["bytes"]["actual_sent"] == 0 and r["bytes"]["per_expert"] == 0 for r in per_rank)


def test_edge_scenarios_exercise_what_they_claim(worlds):
    """Guard the scenarios themselves: a rank with T = 0 and a rank that receives nothing."""
    t0 = worlds[2]["all_to_all|t0_on_rank1"]
    assert t0[1]["num_tokens"] == 0 and t0[1]["num_rows"] > 0  # sends nothing, still receives
    zipf = worlds[4]["all_to_all|zipf_dropped_empty"]
    assert zipf[3]["num_rows"] == 0  # rank 3 owns experts 6 and 7, which nobody picks
    assert all(r["num_rows"] > 0 for r in zipf[:3])


def test_bytes_are_counted_the_same_way_for_every_backend(worlds):
    for world, a2a, hier in [
        (2, "all_to_all", "hierarchical_rpn1"),
        (4, "all_to_all", "hierarchical_rpn2"),
    ]:
        for scenario in SCENARIOS:
            for ra, rh in zip(
                worlds[world][f"{a2a}|{scenario}"], worlds[world][f"{hier}|{scenario}"]
            ):
                for key in ("per_expert", "per_rank_dedup", "per_node_dedup"):
                    assert ra["bytes"][key] == rh["bytes"][key], (world, scenario, key)
                # all_to_all sends one row per remote (token, expert) pair: exactly per_expert
                assert ra["bytes"]["actual_sent"] == ra["bytes"]["per_expert"]


def test_hierarchical_moves_fewer_inter_node_bytes(worlds):
    """Every token picks 4 experts on the other node (2 per rank there): all_to_all sends 4
    copies across nodes, hierarchical 1, then forwards 1 copy inside the destination node."""
    a2a = worlds[4]["all_to_all|remote_node_repeat"]
    hier = worlds[4]["hierarchical_rpn2|remote_node_repeat"]
    _assert_contract(a2a, TOL, "all_to_all remote_node_repeat")
    _assert_contract(hier, TOL, "hierarchical remote_node_repeat")
    row_bytes = 16 * 4  # H * float32
    for ra, rh in zip(a2a, hier):
        T = ra["num_tokens"]
        assert ra["bytes"]["actual_sent_inter_node"] == 4 * T * row_bytes
        assert (
            rh["bytes"]["actual_sent_inter_node"] == T * row_bytes == rh["bytes"]["per_node_dedup"]
        )
    # hop 2 runs on the landing rank, so intra-node rows are forwards of the peer's tokens:
    # compare the totals (one forward per token, to the landing rank's neighbour)
    assert (
        sum(r["bytes"]["actual_sent_intra_node"] for r in hier)
        == sum(r["num_tokens"] for r in hier) * row_bytes
    )
    total = {
        name: sum(r["bytes"]["actual_sent_inter_node"] for r in res)
        for name, res in [("a2a", a2a), ("hier", hier)]
    }
    assert total["hier"] < total["a2a"]


def test_deepep_without_fallback_is_a_clear_config_error():
    if DEEPEP_OK:
        pytest.skip("deep_ep and CUDA are present: the guard does not fire here")
    with pytest.raises(
        ConfigError, match="deepep backend needs a CUDA GPU and the deep_ep package"
    ):
        make_dispatcher("deepep", E)


def test_deepep_fallback_returns_all_to_all_with_a_warning(caplog, worlds):
    if DEEPEP_OK:
        pytest.skip("deep_ep and CUDA are present: no fallback happens")
    with caplog.at_level(logging.WARNING, logger="moerl.kernels"):
        d = make_dispatcher("deepep", E, allow_fallback=True)
    assert d.name == "all_to_all" and d.fallback_from == "deepep"
    assert "needs a CUDA GPU" in d.fallback_reason
    assert any("falling back to all_to_all" in rec.getMessage() for rec in caplog.records)
    # and in a real 2-rank world, where it must still honour the contract
    per_rank = worlds[2]["deepep_fallback|uniform"]
    assert all(
        r["name"] == "all_to_all" and r["fallback_from"] == "deepep" and r["warnings"]
        for r in per_rank
    )
    _assert_contract(per_rank, TOL, "deepep fallback w2")


def test_invalid_deepep_options_never_fall_back():
    with pytest.raises(ConfigError, match="invalid deepep_options"):
        make_dispatcher("deepep", E, allow_fallback=True, deepep_options={"mode": "turbo"})
    with pytest.raises(ConfigError, match="invalid deepep_options"):
        make_dispatcher("deepep", E, allow_fallback=True, deepep_options={"num_smss": 24})


def test_config_errors_name_the_problem():
    with pytest.raises(ConfigError, match="unknown dispatcher backend"):
        make_dispatcher("nccl_ep", E)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="ranks_per_node"):
        make_dispatcher("hierarchical", E, ranks_per_node=2)  # world 1 here


def test_dispatch_rejects_bad_routing():
    d = make_dispatcher("local", E)
    x = torch.randn(3, 4)
    with pytest.raises(ValueError, match="topk_idx must be in"):
        d.dispatch(x, torch.tensor([[0], [E], [1]]), torch.ones(3, 1))
    with pytest.raises(ValueError, match="expected x"):
        d.dispatch(x, torch.zeros(2, 1, dtype=torch.int64), torch.ones(2, 1))


@pytest.fixture
def fake_deep_ep(monkeypatch):
    """Route the deepep backend to a one-rank fake Buffer (the adapter's logic, not DeepEP's)."""
    import types

    import moerl.kernels.deepep as deepep_mod
    from tests.support.kernels_worker import FakeDeepEPBuffer

    fake = types.SimpleNamespace(Buffer=FakeDeepEPBuffer, topk_idx_t=torch.int64)
    monkeypatch.setattr(deepep_mod, "import_deep_ep", lambda: fake)
    monkeypatch.delenv("DEEPEP_VARIANT", raising=False)
    fake_dist = types.SimpleNamespace(
        is_initialized=lambda: True, group=types.SimpleNamespace(WORLD=None)
    )
    monkeypatch.setattr(deepep_mod, "dist", fake_dist)
    FakeDeepEPBuffer.created.clear()
    return FakeDeepEPBuffer


@pytest.fixture
def fake_deep_ep_v2(monkeypatch):
    """A deep_ep that exports both APIs, as DeepEP 2.x does: V1 Buffer and v2 ElasticBuffer fakes."""
    import types

    import moerl.kernels.deepep as deepep_mod
    from tests.support.kernels_worker import FakeDeepEPBuffer, FakeElasticBuffer

    fake = types.SimpleNamespace(
        Buffer=FakeDeepEPBuffer,
        ElasticBuffer=FakeElasticBuffer,
        topk_idx_t=torch.int64,
        __version__="2.1.0",
    )
    monkeypatch.setattr(deepep_mod, "import_deep_ep", lambda: fake)
    fake_dist = types.SimpleNamespace(
        is_initialized=lambda: True, group=types.SimpleNamespace(WORLD=None)
    )
    monkeypatch.setattr(deepep_mod, "dist", fake_dist)
    monkeypatch.delenv("DEEPEP_VARIANT", raising=False)
    FakeDeepEPBuffer.created.clear()
    FakeElasticBuffer.created.clear()
    return fake


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_deepep_v2_adapter_against_a_fake_elastic_buffer(fake_deep_ep_v2, scenario):
    d = make_dispatcher("deepep", E, deepep_options={"num_max_tokens_per_rank": 64})
    # auto: the newest API
    assert d.api == "v2" and d.describe() == "deepep v2 (ElasticBuffer) normal"
    per_rank = [check_contract(d, scenario, rank=0)]
    # padding rows never leak in
    _assert_contract(per_rank, tol=5e-2, label=f"deepep v2(fake) {scenario}")
    (buf,) = fake_deep_ep_v2.ElasticBuffer.created
    assert (buf.hidden, buf.num_topk, buf.num_max_tokens_per_rank, buf.use_fp8_dispatch) == (
        16,
        3,
        64,
        False,
    )
    assert not fake_deep_ep_v2.Buffer.created
    d.close()
    assert buf.destroyed


def test_deepep_api_choice_is_explicit_and_never_silent(fake_deep_ep_v2, monkeypatch):
    import types

    import moerl.kernels.deepep as deepep_mod

    assert make_dispatcher("deepep", E, deepep_options={"api": "v1"}).api == "v1"
    monkeypatch.setenv("DEEPEP_VARIANT", "v1")  # the kernel image says what it was built for
    assert make_dispatcher("deepep", E).api == "v1"
    monkeypatch.setenv("DEEPEP_VARIANT", "v3")
    with pytest.raises(ConfigError, match=r"\$DEEPEP_VARIANT='v3': must be one of v1, v2"):
        make_dispatcher("deepep", E)
    monkeypatch.delenv("DEEPEP_VARIANT")
    # a V1-only deep_ep asked for v2 is a config error, not a fallback to V1 (nor to all_to_all)
    v1_only = types.SimpleNamespace(
        Buffer=fake_deep_ep_v2.Buffer, topk_idx_t=torch.int64, __version__="1.2.1"
    )
    monkeypatch.setattr(deepep_mod, "import_deep_ep", lambda: v1_only)
    with pytest.raises(
        ConfigError, match=r"asks for DeepEP v2 \(deep_ep.ElasticBuffer\).*it has v1"
    ):
        make_dispatcher("deepep", E, allow_fallback=True, deepep_options={"api": "v2"})
    assert make_dispatcher("deepep", E).api == "v1"  # auto on a V1-only deep_ep


def test_deepep_v2_refuses_what_only_v1_has_and_oversized_dispatches(fake_deep_ep_v2):
    with pytest.raises(ConfigError, match="low_latency is DeepEP V1's"):
        make_dispatcher("deepep", E, deepep_options={"api": "v2", "mode": "low_latency"})
    with pytest.raises(ConfigError, match="num_sms sets V1's"):
        make_dispatcher("deepep", E, deepep_options={"api": "v2", "num_sms": 24})
    d = make_dispatcher("deepep", E, deepep_options={"num_max_tokens_per_rank": 4})
    with pytest.raises(
        ConfigError,
        match=r"5 tokens on one dispatch > deepep_options.num_max_tokens_per_rank \(4\)",
    ):
        d.dispatch(torch.randn(5, 16), torch.zeros(5, 3, dtype=torch.int64), torch.ones(5, 3))


def test_in_rank_layout_matches_the_routing_bytes_formula():
    from moerl.kernels.deepep import _in_rank
    from moerl.kernels.dispatcher import routing_bytes

    g = torch.Generator().manual_seed(0)
    idx = torch.randint(-1, 16, (50, 4), generator=g)
    for rank in range(4):
        in_rank = _in_rank(idx, 4, 4)
        assert in_rank.shape == (50, 4)
        want = routing_bytes(idx, 4, rank, 4, 1, row_bytes=1)["per_rank_dedup"]
        assert int(in_rank.sum() - in_rank[:, rank].sum()) == want


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_deepep_adapter_against_a_fake_buffer(fake_deep_ep, scenario):
    d = make_dispatcher("deepep", E)
    per_rank = [check_contract(d, scenario, rank=0)]
    _assert_contract(per_rank, tol=5e-2, label=f"deepep(fake) {scenario}")  # bf16 on the wire
    # it really went through bf16
    assert per_rank[0]["identity_err"] > 0 or per_rank[0]["num_tokens"] == 0
    assert not fake_deep_ep.created[0].low_latency_mode


def test_deepep_low_latency_adapter_against_a_fake_buffer(fake_deep_ep):
    from moerl.kernels.reference import reference_moe
    from tests.support.kernels_worker import expert_fn, make_inputs

    d = make_dispatcher(
        "deepep", E, deepep_options={"mode": "low_latency", "num_max_dispatch_tokens_per_rank": 16}
    )
    x, idx, w = make_inputs("zipf_dropped_empty", rank=0)
    with pytest.raises(ConfigError, match="inference-only"):
        d.dispatch(x.requires_grad_(True), idx, w)
    with torch.no_grad():
        recv_x, counts, handle = d.dispatch(x, idx, w)
        out = d.combine(expert_fn(recv_x, torch.repeat_interleave(torch.arange(E), counts)), handle)
    assert counts.tolist() == torch.bincount(idx[idx >= 0], minlength=E).tolist()
    assert (out - reference_moe(x.detach(), idx, w, expert_fn)).abs().max() < 5e-2
    assert (
        fake_deep_ep.created[0].low_latency_mode and fake_deep_ep.created[0].num_qps_per_rank == E
    )
    with pytest.raises(ConfigError, match="num_max_dispatch_tokens_per_rank"), torch.no_grad():
        d.dispatch(torch.randn(17, 16), torch.zeros(17, 3, dtype=torch.int64), torch.ones(17, 3))
