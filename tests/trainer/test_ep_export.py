"""The parallel HF export (components/policy_update/ep_export.py), on real spawned gloo ranks
and the FSDP2-sharded model as the trainer holds it: at (dp, ep) = (1, 2), (2, 2), (2, 1),
for every family the tests build and both expert layouts, in float32 and bfloat16,

- the checkpoint every rank writes equals the one rank 0 writes alone (`save_ep_checkpoint`),
  tensor for tensor: keys, dtypes, values;
- its index names every key once and only files that exist, and transformers loads it;
- each rank wrote its own files: with dp 1 an EP rank's files hold only its own experts (no
  expert byte moved), and with ep 2 at least two ranks wrote.

And the one-process case, no process group.
"""

import json

import pytest
import torch
from safetensors import safe_open

from moerl.config import parse_config
from moerl.models.tiny import build_tiny_model
from tests.support import export_worker
from tests.support.families import family as _family
from tests.trainer.test_ep_checkpoint import _fused_copy

pytestmark = pytest.mark.slow
EXPERT_PARTS = (".gate_proj.", ".up_proj.", ".down_proj.", ".w1.", ".w2.", ".w3.")


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("export_models")
    tiny = parse_config({}).model.tiny
    qwen = build_tiny_model(tiny, root / "qwen3_moe")
    return {
        "qwen3_moe": qwen,
        "qwen3_moe_fused": _fused_copy(qwen, root / "qwen3_moe_fused"),
        "mixtral": build_tiny_model(
            tiny.model_copy(update={"architecture": "mixtral"}), root / "mixtral"
        ),
        "qwen2_moe": _family("qwen2_moe", root / "qwen2_moe"),
        "deepseek_v3": _family("deepseek_v3", root / "deepseek_v3"),
        "olmoe": _family("olmoe", root / "olmoe"),
    }


def _labels(models) -> dict[str, tuple[str, str]]:
    """What each mesh exports: every family in float32, the embedded Qwen3-MoE (both layouts)
    also loaded in bfloat16 (bf16 rows through the gathers)."""
    out = {k: (str(v), "float32") for k, v in models.items()}
    for k in ("qwen3_moe", "qwen3_moe_fused"):
        out[f"{k}_bf16"] = (str(models[k]), "bfloat16")
    return out


def _tensors(path) -> dict[str, tuple[str, torch.Tensor]]:
    """Every tensor of a checkpoint dir: key -> (file, tensor); a key twice is an error."""
    out: dict[str, tuple[str, torch.Tensor]] = {}
    for f in sorted(path.glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as h:
            for k in h.keys():
                assert k not in out, f"{k} in {out[k][0]} and {f.name}"
                out[k] = (f.name, h.get_tensor(k))
    return out


def _expert_of(key: str) -> int | None:
    """The expert number of a per-expert key (`...experts.<e>.<proj>...`), else None."""
    parts = key.split(".")
    if "experts" in parts:
        nxt = parts[parts.index("experts") + 1]
        return int(nxt) if nxt.isdigit() else None
    return None


def _check_export(exported, saved, dtype):
    from transformers import AutoModelForCausalLM

    got, ref = _tensors(exported), _tensors(saved)
    assert set(got) == set(ref)
    for k, (_, t) in ref.items():
        assert got[k][1].dtype == t.dtype == dtype, k
        assert torch.equal(got[k][1], t), k
    index = json.loads((exported / "model.safetensors.index.json").read_text())
    weight_map = index["weight_map"]
    assert list(weight_map) == sorted(got)  # every key once, sorted
    assert {k: f for k, (f, _) in got.items()} == weight_map  # and in the file it names
    assert all((exported / f).is_file() for f in weight_map.values())
    assert index["metadata"]["total_size"] == sum(
        t.numel() * t.element_size() for _, t in got.values()
    )
    loaded = AutoModelForCausalLM.from_pretrained(exported, dtype="auto")
    assert {p.dtype for p in loaded.parameters()} == {dtype}
    return got


@pytest.mark.parametrize("dp, ep", [(1, 2), (2, 2), (2, 1)])
def test_every_rank_writes_its_files_and_the_export_equals_rank_0s_save(
    models, tmp_path, dp, ep, gloo_worlds
):
    world = dp * ep
    gloo_worlds(world).run(export_worker.export_rank, dp, ep, _labels(models), str(tmp_path))
    ranks = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(world)]
    for fam, (_, model_dtype) in _labels(models).items():
        for name in export_worker.DTYPES:
            dtype = export_worker.DTYPES[name] or getattr(torch, model_dtype)
            exported = tmp_path / fam / f"export_{name}"
            got = _check_export(exported, tmp_path / fam / f"save_{name}", dtype)
            stats = [r[fam]["stats"][name] for r in ranks]
            assert all(s.files == stats[0].files for s in stats)  # the same on every rank
            assert stats[0].fallbacks == [0] * world  # FSDP2's shards gathered to the owner only
            for r, files in enumerate(stats[0].files):  # each rank's own files, named for it
                assert all(f.startswith(f"model-r{r:05d}-p") for f in files)
                assert stats[0].bytes_written[r] == sum(
                    t.numel() * t.element_size() for f, t in got.values() if f in files
                )
            if ep == 2:
                assert sum(1 for files in stats[0].files if files) >= 2, stats[0].files
            fused = ranks[0][fam]["fused"]
            if not any(fused):  # per-expert keys: a rank writes only its EP rank's experts
                for r, files in enumerate(stats[0].files):
                    lo, n_local = ranks[r][fam]["first_expert"], ranks[r][fam]["n_local"]
                    mine = {_expert_of(k) for k, (f, _) in got.items() if f in files} - {None}
                    assert mine <= set(range(lo, lo + n_local)), (r, mine)
                    assert ep == 1 or len(mine) < n_local * ep  # no rank wrote all experts
            if dp == 1 and not any(fused):  # no expert byte moved: only dense tensors gathered
                assert sum(stats[0].bytes_received) <= ranks[0][fam]["dense_bytes"]


def test_one_process_without_a_process_group(models, tmp_path):
    from moerl.components.policy_update.ep_checkpoint import load_ep_model, save_ep_checkpoint
    from moerl.components.policy_update.ep_export import export_ep_checkpoint
    from moerl.kernels import make_dispatcher

    for fam in ("qwen3_moe", "qwen3_moe_fused"):
        model, blocks, layout = load_ep_model(
            models[fam], make_dispatcher("local", 8), torch.float32, "cpu"
        )
        for dtype in (None, torch.bfloat16):
            out, ref = tmp_path / fam / f"export_{dtype}", tmp_path / fam / f"save_{dtype}"
            stats = export_ep_checkpoint(
                model, blocks, layout, models[fam], out, None, dtype=dtype, max_shard_bytes=50_000
            )
            save_ep_checkpoint(model, blocks, layout, models[fam], ref, dtype=dtype)
            got = _check_export(out, ref, dtype or torch.float32)
            assert stats.bytes_received == [0]
            assert len(stats.files[0]) > 1 and stats.total_bytes == sum(
                t.numel() * t.element_size() for _, t in got.values()
            )
            assert {f for f, _ in got.values()} == set(stats.files[0])
