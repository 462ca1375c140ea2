"""The trainer on a 2-D mesh (data_parallel_shard x expert_parallel_size) with FSDP2: at
(1, 4), (2, 2) and (4, 1) on four gloo ranks, one step's loss and every gradient equal the
single-process model's, each rank holds a 1/world share of the weights, gradients and Adam
state, and a version saved at (2, 2) resumes at (1, 4) with its optimizer state resharded."""

import pytest
import torch

from moerl.components.policy_update.trainer import run_policy_update
from moerl.config import parse_config
from moerl.models.tiny import build_tiny_model
from moerl.records import write_records
from tests.support import ep_worker, mesh_worker
from tests.support.families import family as _family
from tests.support.oracles import reference_policy_update
from tests.support.persistent_worker import mesh_cfg
from tests.support.weights import read_weights
from tests.trainer.test_ep_equivalence import _batch

pytestmark = pytest.mark.slow
TOL = 1e-5  # float32, a different summation order
MESHES = [(1, 4), (2, 2), (4, 1)]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return build_tiny_model(parse_config({}).model.tiny, tmp_path_factory.mktemp("mesh") / "model")


@pytest.fixture(scope="module")
def reference(tiny):
    model = ep_worker.tiny_model(tiny)
    packed = ep_worker.batch_tensors()
    n = packed.input_ids_NL.shape[0]
    loss = ep_worker.step_loss_and_grads(
        model, packed, torch.arange(n), n_tokens=float(packed.mask_NL1.sum())
    )
    grads = {name: p.grad for name, p in model.named_parameters()}
    total = sum(p.numel() for p in model.parameters()) * 4  # float32
    return loss.detach(), grads, total


@pytest.mark.parametrize("dp, ep", MESHES)
def test_a_step_on_the_mesh_equals_the_single_process_step_and_each_rank_holds_its_share(
    tiny, reference, tmp_path, dp, ep, gloo_worlds
):
    ref_loss, ref_grads, total_bytes = reference
    world = dp * ep
    gloo_worlds(world).run(mesh_worker.mesh_rank, dp, ep, str(tiny), str(tmp_path))
    outs = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(world)]
    assert abs(outs[0]["loss"].item() - ref_loss.item()) <= TOL
    for o in outs:
        assert set(o["grads"]) == set(ref_grads)
        for name, g in o["grads"].items():
            scale = max(1.0, float(ref_grads[name].abs().max()))
            assert (g - ref_grads[name]).abs().max() <= TOL * scale, name
    # dense weights are sharded over every rank, experts over dp within their EP group
    placed = outs[0]["placements"]
    assert all("dp_ep" in v for k, v in placed.items() if "experts" not in k)
    assert all("('dp',)" in v for k, v in placed.items() if "experts" in k)
    # weights + gradients + Adam's two moments, all float32: 4 copies of the model over world ranks
    share = 4 * total_bytes / world
    for o in outs:
        assert o["held_bytes"] <= 1.1 * share, (o["held_bytes"], share)
    assert sum(o["held_bytes"] for o in outs) >= 4 * total_bytes  # nothing missing


@pytest.mark.parametrize(
    "trainer, tol",
    [
        ({"activation_checkpointing": True}, TOL),
        pytest.param({"mixed_precision": "bf16"}, 3e-2, marks=pytest.mark.nightly),
        pytest.param(
            {"logprob_chunk_tokens": 7, "activation_checkpointing": True},
            TOL,
            marks=pytest.mark.nightly,
        ),
    ],
)
def test_activation_checkpointing_and_bf16_mixed_precision_on_the_mesh(
    tiny, reference, tmp_path, trainer, tol, gloo_worlds
):
    """Recomputed activations, and the logprob in chunks of 7 positions (recomputed in the
    backward under FSDP's gathered head), give the same gradients; bf16 compute gives gradients within
    bf16's precision of float32 ones, while the master weights and Adam state stay float32."""
    ref_loss, ref_grads, _ = reference
    gloo_worlds(4).run(mesh_worker.mesh_rank, 2, 2, str(tiny), str(tmp_path), trainer)
    outs = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(4)]
    assert abs(outs[0]["loss"].item() - ref_loss.item()) <= tol * max(1.0, abs(ref_loss.item()))
    flat_ref = torch.cat([g.flatten() for g in ref_grads.values()])
    flat_got = torch.cat([outs[0]["grads"][n].flatten() for n in ref_grads])
    rel = float((flat_got - flat_ref).norm() / flat_ref.norm())
    assert rel <= tol, rel
    # pi_old (no grad) and the loss's forward; with checkpointing a third, in the backward
    assert outs[0]["layer_forwards"] == (3 if trainer.get("activation_checkpointing") else 2)
    if trainer.get("mixed_precision") == "bf16":
        assert rel > 0  # bf16 did run: not bit-equal to float32
    assert outs[0]["dtypes"] == {"torch.float32"}  # master weights and Adam moments


_cfg = mesh_cfg  # the workers' config


@pytest.mark.nightly  # a resume across meshes: second order
def test_a_version_saved_at_2x2_resumes_at_1x4_with_its_optimizer_state(tmp_path):
    """The second iteration from a (2, 2) version gives the same weights at (1, 4) as at (2, 2):
    Adam's moments were resharded onto the other mesh, not lost (a fresh optimizer moves the
    weights differently, checked as the control)."""
    build_tiny_model(_cfg(1, 1).model.tiny, tmp_path / "s0")
    write_records(tmp_path / "batch.jsonl", _batch())
    run_policy_update(
        _cfg(2, 2), tmp_path / "batch.jsonl", tmp_path / "s0", tmp_path / "s1", iteration=0
    )
    assert (tmp_path / "s1" / "trainer" / "optimizer" / ".metadata").is_file()
    run_policy_update(
        _cfg(2, 2), tmp_path / "batch.jsonl", tmp_path / "s1", tmp_path / "same", iteration=1
    )
    run_policy_update(
        _cfg(1, 4), tmp_path / "batch.jsonl", tmp_path / "s1", tmp_path / "other", iteration=1
    )
    # the same weights without the optimizer state (and counters: a trained version without
    # state is refused, so the control is laid out as a fresh start)
    fresh = tmp_path / "s1-fresh"
    import shutil

    shutil.copytree(
        tmp_path / "s1", fresh, ignore=shutil.ignore_patterns("optimizer", "state.json")
    )
    run_policy_update(
        _cfg(1, 4), tmp_path / "batch.jsonl", fresh, tmp_path / "control", iteration=1
    )
    _follows(tmp_path, "s1", reference="same", candidate="other", control="control")


def _follows(root, start: str, reference: str, candidate: str, control: str) -> None:
    """`candidate`'s step from `start` equals `reference`'s (within 5 % of how far each tensor
    moved), while `control` (the same weights without the Adam moments) takes another step."""
    w1 = read_weights(root / start)
    ref, cand, ctrl = (read_weights(root / d) for d in (reference, candidate, control))
    far = 0
    for name, a in ref.items():
        moved = float((a - w1[name]).norm())
        assert float((cand[name] - a).norm()) <= 0.05 * moved + 1e-6, name
        far += float((ctrl[name] - a).norm()) > 0.2 * moved + 1e-6
    assert far > len(ref) // 4  # without the moments the step is a different one


@pytest.mark.nightly  # a resume across layouts: second order
def test_a_single_process_version_continues_on_the_mesh_with_its_adam_state(tmp_path):
    """A run that an older moerl trained one iteration in one process (optimizer.pt) continues at (2, 2): the
    step equals the single process's second iteration (Adam's moments sliced onto the mesh's
    shards, experts offset by their EP rank), where a fresh optimizer does not."""
    import shutil

    build_tiny_model(_cfg(1, 1).model.tiny, tmp_path / "s0")
    write_records(tmp_path / "batch.jsonl", _batch())
    # the single-process form older runs published (every stage now runs a mesh, of one rank
    # at least): the reference trainer writes it
    reference_policy_update(
        _cfg(1, 1), tmp_path / "batch.jsonl", tmp_path / "s0", tmp_path / "s1", iteration=0
    )
    assert (tmp_path / "s1" / "trainer" / "optimizer.pt").is_file()
    reference_policy_update(
        _cfg(1, 1), tmp_path / "batch.jsonl", tmp_path / "s1", tmp_path / "single", iteration=1
    )
    run_policy_update(
        _cfg(2, 2), tmp_path / "batch.jsonl", tmp_path / "s1", tmp_path / "mesh", iteration=1
    )
    assert (
        tmp_path / "mesh" / "trainer" / "optimizer" / ".metadata"
    ).is_file()  # the mesh's own form from here
    shutil.copytree(
        tmp_path / "s1",
        tmp_path / "s1-fresh",
        ignore=shutil.ignore_patterns("optimizer.pt", "state.json"),
    )
    run_policy_update(
        _cfg(2, 2),
        tmp_path / "batch.jsonl",
        tmp_path / "s1-fresh",
        tmp_path / "control",
        iteration=1,
    )
    _follows(tmp_path, "s1", reference="single", candidate="mesh", control="control")


@pytest.mark.parametrize(
    "arch",
    [
        "qwen2_moe",
        pytest.param("deepseek_v3", marks=pytest.mark.nightly),
        pytest.param("olmoe", marks=pytest.mark.nightly),
    ],
)
def test_families_with_shared_experts_step_on_the_mesh_like_the_single_process(
    tmp_path, arch, gloo_worlds
):
    """At (2, 2) the loss and every gradient, shared experts and the router included, equal
    the transformers model's: no weight dropped, the family's router used as it is (OLMoE:
    the plain top-k family, for contrast)."""
    path = _family(arch, tmp_path / arch)
    ref = ep_worker.tiny_model(path)
    packed = ep_worker.batch_tensors()
    n = packed.input_ids_NL.shape[0]
    ref_loss = ep_worker.step_loss_and_grads(
        ref, packed, torch.arange(n), n_tokens=float(packed.mask_NL1.sum())
    )
    ref_grads = {name: p.grad for name, p in ref.named_parameters()}
    assert any("shared_expert" in name for name in ref_grads) == (arch != "olmoe")
    gloo_worlds(4).run(mesh_worker.mesh_rank, 2, 2, str(path), str(tmp_path))
    out = torch.load(tmp_path / "rank0.pt", weights_only=False)
    assert abs(out["loss"].item() - ref_loss.item()) <= TOL
    assert set(out["grads"]) == set(ref_grads)
    for name, g in out["grads"].items():
        assert (g - ref_grads[name]).abs().max() <= TOL * max(
            1.0, float(ref_grads[name].abs().max())
        ), name


@pytest.mark.nightly
def test_deepseek_router_bias_moves_towards_balance_the_same_on_the_mesh(tmp_path):
    """trainer.moe.router_bias_update_rate on DeepSeek-V3 (sigmoid router with bias correction): two
    steps move every expert's bias by a whole number of rates, against its load, and the mesh
    (2, 2), whose ranks each route their own tokens, moves it as the single process does: the
    loads are summed over the ranks before the sign is taken."""
    path = _family("deepseek_v3", tmp_path / "dsv3")
    write_records(tmp_path / "batch.jsonl", _batch())
    key = next(k for k in read_weights(path) if k.endswith("e_score_correction_bias"))
    b0 = read_weights(path)[key]
    out = {}
    for name, (dp, ep) in (("single", (1, 1)), ("mesh", (2, 2))):
        cfg = _cfg(dp, ep)
        cfg = cfg.model_copy(
            update={
                "trainer": cfg.trainer.model_copy(
                    update={
                        "moe": cfg.trainer.moe.model_copy(update={"router_bias_update_rate": 0.01})
                    }
                )
            }
        )
        m = run_policy_update(cfg, tmp_path / "batch.jsonl", path, tmp_path / name, iteration=0)
        assert m["train/steps"] == 2 and m["moe/router_max_load_ratio"] >= 1.0
        out[name] = read_weights(tmp_path / name)[key]
    steps = (out["single"] - b0) / 0.01
    assert torch.allclose(steps, steps.round(), atol=1e-4), (steps - steps.round()).abs().max()
    assert steps.round().abs().max() <= 2 and steps.abs().sum() > 0
    assert torch.equal(out["mesh"], out["single"])
