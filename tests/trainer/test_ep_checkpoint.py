"""Expert-parallel loading and saving (components/policy_update/ep_checkpoint.py), on real
spawned gloo ranks and real checkpoints written by transformers:

- each rank holds exactly the replicated weights and its own experts, equal to the matching
  slice of the full model, and no tensor anywhere in the rank holds a whole layer of experts;
- the checkpoint the ranks save loads with `AutoModelForCausalLM.from_pretrained` and equals
  the weights the ranks held, in the tensor names and files of the checkpoint they loaded.
"""

import json

import pytest
import torch
from safetensors import safe_open

from moerl.config import parse_config
from moerl.models.tiny import build_tiny_model
from tests.support import ep_worker


def _keys(path):
    index = path / "model.safetensors.index.json"
    if index.is_file():
        return set(json.loads(index.read_text())["weight_map"])
    keys = set()
    for f in path.glob("*.safetensors"):
        with safe_open(str(f), framework="pt") as h:
            keys |= set(h.keys())
    return keys


def _fused_copy(src, dst):
    """The same policy saved with fused expert tensors ([E, 2I, H], [E, H, I]), the other layout
    the loader reads (safetensors.save_file of the in-memory state dict)."""
    import shutil

    from safetensors.torch import save_file

    dst.mkdir()
    for f in src.iterdir():
        if not f.name.endswith(".safetensors"):
            shutil.copy2(f, dst / f.name)
    save_file(
        {k: v.contiguous() for k, v in ep_worker.tiny_model(src).state_dict().items()},
        str(dst / "model.safetensors"),
        metadata={"format": "pt"},
    )
    return dst


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("ckpt")
    tiny = parse_config({}).model.tiny
    qwen = build_tiny_model(tiny, root / "qwen3_moe")
    from tests.support.families import family as _family

    return {
        "qwen3_moe": qwen,
        "mixtral": build_tiny_model(
            tiny.model_copy(update={"architecture": "mixtral"}), root / "mixtral"
        ),
        "qwen3_moe_fused": _fused_copy(qwen, root / "qwen3_moe_fused"),
        # shared experts kept and saved under their own names; DeepSeek-V3's dense first layer
        "qwen2_moe": _family("qwen2_moe", root / "qwen2_moe"),
        "deepseek_v3": _family("deepseek_v3", root / "dsv3"),
    }


@pytest.mark.slow
@pytest.mark.parametrize(
    "world, arch, shard_bytes",
    [
        (2, "qwen3_moe", None),
        (4, "mixtral", 200_000),
        (2, "qwen3_moe_fused", 200_000),
        pytest.param(2, "qwen2_moe", None, marks=pytest.mark.nightly),
        pytest.param(2, "deepseek_v3", 20_000, marks=pytest.mark.nightly),
    ],
)
def test_ep_rank_holds_only_its_experts_and_saves_hf_checkpoint(
    checkpoints, tmp_path, world, arch, shard_bytes, gloo_worlds
):
    from transformers import AutoModelForCausalLM

    src = checkpoints[arch]
    serving = "bfloat16" if arch == "qwen3_moe" else None  # the engines' dtype, once
    gloo_worlds(world).run(
        ep_worker.ep_load_save_rank, str(src), str(tmp_path), shard_bytes, serving
    )
    ranks = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(world)]
    ref = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
    named_layers = [(n, m) for n, m in ref.named_modules() if n.endswith("mlp.experts")]
    layers = [m for _, m in named_layers]
    n_experts = layers[0].gate_up_proj.shape[0]
    n_local = n_experts // world
    expert_numel = sum(p.numel() for m in layers for p in m.parameters())
    replicated = {n: p for n, p in ref.named_parameters() if ".experts." not in n}

    for r, out in enumerate(ranks):
        # no whole layer of experts anywhere in the rank (the old loader kept full copies alive)
        assert out["full_expert_tensors"] == 0
        assert out["numel"] == sum(p.numel() for p in replicated.values()) + expert_numel // world
        # sharded by FSDP (dp 1 x ep world): the dense weights split over the ranks as well
        dense = sum(p.numel() for p in replicated.values())
        assert out["sharded_numel"] <= dense / world * 1.1 + expert_numel // world
        assert out["first_expert"] == r * n_local
        for name, p in replicated.items():
            assert torch.equal(out["loaded"][name], p.detach()), name
        lo = r * n_local
        for layer, m in named_layers:
            for mine, full in (
                ("gate_up_proj_LIH", m.gate_up_proj),
                ("down_proj_LHI", m.down_proj),
            ):
                assert torch.equal(
                    out["loaded"][f"{layer}.{mine}"], full.detach()[lo : lo + n_local]
                )
        for name, b in ref.named_buffers():  # rotary inv_freq, rebuilt off the meta device
            assert torch.equal(out["buffers"][name], b), name

    saved_dir = tmp_path / "saved"
    saved = AutoModelForCausalLM.from_pretrained(saved_dir, dtype=torch.float32)
    got = dict(saved.named_parameters())
    for name in replicated:
        assert torch.equal(got[name].detach(), ranks[0]["saved"][name]), name
    for layer, _ in named_layers:
        for mine, full in (("gate_up_proj_LIH", "gate_up_proj"), ("down_proj_LHI", "down_proj")):
            gathered = torch.cat([out["saved"][f"{layer}.{mine}"] for out in ranks])
            assert torch.equal(got[f"{layer}.{full}"].detach(), gathered)
    assert _keys(saved_dir) == _keys(src)  # same tensor names as the checkpoint it came from
    weight_files = sorted(f.name for f in saved_dir.glob("*.safetensors"))
    if shard_bytes is None:
        assert weight_files == ["model.safetensors"]
    else:  # a small budget: one file per MoE layer at least, and the index transformers reads
        assert (
            len(weight_files) >= len(layers) + 1
            and (saved_dir / "model.safetensors.index.json").is_file()
        )
    assert {f.name for f in src.iterdir()} - {"model.safetensors"} <= {
        f.name for f in saved_dir.iterdir()
    }
    if serving:  # the serving-dtype copy: the same tensors, rounded once on the way out
        rounded = AutoModelForCausalLM.from_pretrained(tmp_path / f"saved_{serving}", dtype="auto")
        assert _keys(tmp_path / f"saved_{serving}") == _keys(src)
        for name, p in rounded.named_parameters():
            assert p.dtype == torch.bfloat16
            assert torch.equal(p.detach(), got[name].detach().to(torch.bfloat16)), name


def _copy_without(src, dst, drop=None, reshape=None):
    import shutil

    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst)
    tensors = load_file(str(src / "model.safetensors"))
    tensors.pop(drop, None)
    if reshape:
        tensors[reshape] = tensors[reshape][:-1].contiguous()
    save_file(tensors, str(dst / "model.safetensors"), metadata={"format": "pt"})
    return dst


@pytest.mark.parametrize(
    "drop, reshape, message",
    [
        (
            "model.layers.1.mlp.experts.7.up_proj.weight",
            None,
            r"has no tensor model\.layers\.1\.mlp\.experts\.7\.up_proj",
        ),
        (
            "model.layers.0.self_attn.q_proj.weight",
            None,
            r"has no tensor for model\.layers\.0\.self_attn\.q_proj\.weight",
        ),
        (
            None,
            "model.layers.0.mlp.experts.2.down_proj.weight",
            r"experts\.2\.down_proj\.weight has shape \[127, 64\], "
            r"the model expects \[128, 64\]",
        ),
    ],
)
def test_bad_checkpoint_is_a_one_line_checkpoint_error(
    checkpoints, tmp_path, drop, reshape, message
):
    from moerl.components.policy_update.ep_checkpoint import load_ep_model
    from moerl.errors import CheckpointError
    from moerl.kernels import make_dispatcher

    bad = _copy_without(checkpoints["qwen3_moe"], tmp_path / "bad", drop, reshape)
    with pytest.raises(CheckpointError, match=message):
        load_ep_model(bad, make_dispatcher("local", 8), torch.float32, "cpu")
