"""The async trainer's persistent mesh (`components/policy_update/mesh.py`) trains with the
restarting path's code, so its versions must equal that path's: four gloo ranks at (2, 2) train
three batches once with one session kept in memory and once reloading every version from the
previous version's files (master weights and Adam's state from their per-rank Distributed
Checkpoints), and every version's engine weights agree. A version whose state was written per
rank at (2, 2) then continues at (1, 4) as it does at (2, 2)."""

import pytest
import torch

from moerl.components.policy_update.trainer import run_policy_update
from moerl.models.tiny import build_tiny_model
from moerl.records import write_records
from tests.support import persistent_worker
from tests.support.persistent_worker import mesh_cfg
from tests.support.weights import read_weights
from tests.trainer.test_ep_equivalence import _batch

pytestmark = pytest.mark.slow
TOL = 1e-5  # float32; the same code, so in practice bit for bit


_cfg = mesh_cfg  # the workers' config


@pytest.fixture(scope="module")
def series(tmp_path_factory, gloo_worlds):
    root = tmp_path_factory.mktemp("persistent")
    build_tiny_model(_cfg(1, 1).model.tiny, root / "s0")
    batches = [_batch(16), _batch(12), _batch(16)[::-1]]
    gloo_worlds(4).run(persistent_worker.rank, 2, 2, str(root / "s0"), str(root), batches)
    return root, batches


def _close(a: dict, b: dict) -> float:
    assert set(a) == set(b)
    return max(float((a[k] - b[k]).abs().max()) for k in a)


def test_versions_kept_in_memory_equal_versions_reloaded_from_files(series):
    root, batches = series
    w0 = read_weights(root / "s0")
    for v in range(1, len(batches) + 1):
        kept = read_weights(root / "persistent" / f"v{v}")
        reloaded = read_weights(root / "restart" / f"v{v}")
        assert _close(kept, reloaded) <= TOL, v
        # every version carries its state, every rank's shard: the master weights and Adam
        for d in ("model", "optimizer"):
            shards = list((root / "persistent" / f"v{v}" / "trainer" / d).glob("*.distcp"))
            assert len(shards) == 4, (v, d, shards)
    assert _close(read_weights(root / "persistent" / "v3"), w0) > 1e-4  # it trained


@pytest.mark.nightly  # a resume across meshes: second order
def test_a_version_written_per_rank_continues_on_another_mesh(series, tmp_path):
    """v2's state, written by four ranks at (2, 2), continues at (1, 4): the third update equals
    the (2, 2) mesh's own third version."""
    root, batches = series
    write_records(tmp_path / "batch.jsonl", batches[2])
    run_policy_update(
        _cfg(1, 4), tmp_path / "batch.jsonl", root / "persistent" / "v2", tmp_path / "v3", 2
    )
    other = read_weights(tmp_path / "v3")
    same = read_weights(root / "persistent" / "v3")
    v2 = read_weights(root / "persistent" / "v2")
    moved = max(float((same[k] - v2[k]).abs().max()) for k in same)
    assert _close(other, same) <= 0.05 * moved + 1e-6
    assert torch.is_floating_point(next(iter(other.values())))


@pytest.mark.nightly  # a resume across dtypes: second order
def test_a_bf16_served_version_resumes_from_its_float32_master_shards(series, tmp_path):
    """rollout.dtype bfloat16: the engines' copy is bf16, and the next update starts from the
    float32 master weights the ranks wrote (trainer/model), not from the rounded copy: it
    equals the update from the same version served in float32."""
    root, batches = series
    write_records(tmp_path / "b.jsonl", batches[0])
    bf16 = _cfg(1, 2).model_copy(
        update={"rollout": _cfg(1, 2).rollout.model_copy(update={"dtype": "bfloat16"})}
    )
    run_policy_update(bf16, tmp_path / "b.jsonl", root / "s0", tmp_path / "v1-bf16", 0)
    served = read_weights(tmp_path / "v1-bf16")
    assert {t.dtype for t in served.values()} == {torch.bfloat16}
    run_policy_update(_cfg(1, 2), tmp_path / "b.jsonl", root / "s0", tmp_path / "v1", 0)
    f32 = read_weights(tmp_path / "v1")
    assert _close({k: v.float() for k, v in served.items()}, f32) > 0  # rounded
    write_records(tmp_path / "b2.jsonl", batches[1])
    for name in ("v1-bf16", "v1"):
        run_policy_update(
            _cfg(1, 2), tmp_path / "b2.jsonl", tmp_path / name, tmp_path / f"{name}-next", 1
        )
    assert (
        _close(read_weights(tmp_path / "v1-bf16-next"), read_weights(tmp_path / "v1-next")) <= TOL
    )


def test_a_resumed_rank_fetches_only_the_state_shards_it_reads(series, tmp_path, gloo_worlds):
    """A version laid out without its ranks' Distributed Checkpoint data files (as a resumed
    mesh fetches it: `STATE_SHARDS` left in the store): each of four ranks at (2, 2) asks for the
    shards its read plan needs, not every rank's, and the next version equals the one the mesh
    trained with everything in memory."""
    import json
    import shutil

    from moerl.components.policy_update.ep_optimizer import STATE_SHARDS

    root, batches = series
    full = root / "persistent" / "v2"
    partial = tmp_path / "v2"
    shutil.copytree(full, partial)
    shards = sorted(
        p.relative_to(partial).as_posix()
        for p in partial.rglob("*.distcp")
        if p.relative_to(partial).as_posix().startswith(STATE_SHARDS)
    )
    assert len(shards) == 8  # 4 ranks x (master weights, Adam)
    for rel in shards:
        (partial / rel).unlink()
    gloo_worlds(4).run(
        persistent_worker.lazy_rank, 2, 2, str(full), str(partial), str(tmp_path), batches[2]
    )
    fetched = [set(json.loads((tmp_path / f"fetched{r}.json").read_text())) for r in range(4)]
    assert all(f and f <= set(shards) for f in fetched), fetched
    assert all(len(f) < len(shards) for f in fetched), fetched  # not every rank's
    assert set().union(*fetched) == set(shards)
    assert (
        _close(read_weights(tmp_path / "lazy-v3"), read_weights(root / "persistent" / "v3")) <= TOL
    )
