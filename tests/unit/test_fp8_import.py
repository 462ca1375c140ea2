"""`moerl models import` on a tiny DeepSeek-V3 FP8 checkpoint built here in DeepSeek-V3's
published layout: float8_e4m3fn linear weights with a float32 `weight_scale_inv` per block,
the scales in another shard than their weights, an index, and a multi-token-prediction layer
stored as layer `num_hidden_layers`."""

from __future__ import annotations

import json
import logging
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from moerl.cli import main
from moerl.config import TinyMoeConfig
from moerl.errors import ConfigError
from moerl.models import fp8
from moerl.models.importer import REPORT_FILE, import_checkpoint
from moerl.models.policy import check_checkpoint, load_policy
from moerl.models.tiny import build_tiny_model

E4M3_MAX = 448.0
NOT_QUANTIZED = ("embed_tokens", "lm_head", "mlp.gate.weight", "norm", "layernorm")


def quantize(w: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-block amax scaling to float8_e4m3fn: (q, scale_inv) with w ~ q * scale_inv."""
    rows, cols = w.shape
    nr, nc = -(-rows // block[0]), -(-cols // block[1])
    q = torch.empty(rows, cols, dtype=torch.float8_e4m3fn)
    s = torch.empty(nr, nc, dtype=torch.float32)
    for i in range(nr):
        for j in range(nc):
            r, c = slice(i * block[0], (i + 1) * block[0]), slice(j * block[1], (j + 1) * block[1])
            scale = w[r, c].abs().max().clamp(min=1e-12) / E4M3_MAX
            s[i, j] = scale
            q[r, c] = (w[r, c] / scale).to(torch.float8_e4m3fn)
    return q, s


def dequant_loop(q: torch.Tensor, s: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """The reference dequantization, block by block."""
    out = torch.empty(q.shape, dtype=torch.float32)
    for i in range(s.shape[0]):
        for j in range(s.shape[1]):
            r, c = slice(i * block[0], (i + 1) * block[0]), slice(j * block[1], (j + 1) * block[1])
            out[r, c] = q[r, c].float() * s[i, j]
    return out


def read_all(path: Path) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for f in sorted(path.glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as h:
            out.update({k: h.get_tensor(k) for k in h.keys()})
    return out


def is_quantized(key: str, t: torch.Tensor) -> bool:
    return t.dim() == 2 and key.endswith(".weight") and not any(n in key for n in NOT_QUANTIZED)


class Fp8Source:
    """The tiny model's fp32 reference and its FP8 checkpoint's tensors and config."""

    def __init__(self, ref_dir: Path, block: tuple[int, int]):
        self.ref_dir, self.block = ref_dir, block
        self.reference = read_all(ref_dir)
        self.config = json.loads((ref_dir / "config.json").read_text())
        self.config["quantization_config"] = {
            "activation_scheme": "dynamic",
            "fmt": "e4m3",
            "quant_method": "fp8",
            "weight_block_size": list(block),
        }
        n_layers = self.config["num_hidden_layers"]
        assert self.config["num_nextn_predict_layers"] == 1
        self.weights: dict[str, torch.Tensor] = {}
        self.scales: dict[str, torch.Tensor] = {}
        last = f"model.layers.{n_layers - 1}."
        mtp = f"model.layers.{n_layers}."
        hidden = self.config["hidden_size"]
        extra = {  # the MTP module's own tensors, beside a copy of the last decoder layer
            mtp + "enorm.weight": torch.ones(hidden),
            mtp + "hnorm.weight": torch.ones(hidden),
            mtp + "eh_proj.weight": torch.randn(hidden, 2 * hidden) * 0.02,
            mtp + "embed_tokens.weight": self.reference["model.embed_tokens.weight"].clone(),
            mtp + "shared_head.norm.weight": torch.ones(hidden),
            mtp + "shared_head.head.weight": self.reference["lm_head.weight"].clone(),
        }
        extra.update(
            {mtp + k[len(last) :]: v for k, v in self.reference.items() if k.startswith(last)}
        )
        for key, t in [*self.reference.items(), *extra.items()]:
            if is_quantized(key, t):
                q, s = quantize(t, block)
                self.weights[key], self.scales[key + "_scale_inv"] = q, s
            elif key.endswith("e_score_correction_bias"):
                self.weights[key] = t.clone()  # float32 in the published checkpoint
            else:
                self.weights[key] = t.to(torch.bfloat16)
        self.mtp_keys = sorted(k for k in [*self.weights, *self.scales] if k.startswith(mtp))

    def write(
        self,
        out: Path,
        mutate: Callable[[dict, dict[str, torch.Tensor], dict[str, torch.Tensor]], None]
        | None = None,
    ) -> Path:
        """The checkpoint: weights in one shard, scales in the other, an index, the tokenizer."""
        config = json.loads(json.dumps(self.config))
        weights, scales = dict(self.weights), dict(self.scales)
        if mutate:
            mutate(config, weights, scales)
        out.mkdir(parents=True)
        files = {
            "model-00001-of-00002.safetensors": weights,
            "model-00002-of-00002.safetensors": scales,
        }
        for name, tensors in files.items():
            save_file(tensors, str(out / name), metadata={"format": "pt"})
        index = {"weight_map": {k: n for n, ts in files.items() for k in ts}}
        (out / "model.safetensors.index.json").write_text(json.dumps(index))
        (out / "config.json").write_text(json.dumps(config))
        for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
            shutil.copyfile(self.ref_dir / name, out / name)
        return out


@pytest.fixture(scope="module")
def ref_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(
        TinyMoeConfig(architecture="deepseek_v3"), tmp_path_factory.mktemp("ref") / "tiny"
    )


@pytest.fixture(scope="module")
def source(ref_dir: Path) -> Fp8Source:
    return Fp8Source(ref_dir, (128, 128))


@pytest.fixture(scope="module")
def imported_bf16(source: Fp8Source, tmp_path_factory: pytest.TempPathFactory):
    """The published-shaped checkpoint imported to bf16 in small shards (an index)."""
    base = tmp_path_factory.mktemp("bf16")
    src = source.write(base / "fp8")
    return import_checkpoint(src, base / "out", shard_bytes=200_000)


def test_edge_blocks_exist(source: Fp8Source) -> None:
    """The tiny model has weights whose dims are no multiple of the block: edge blocks."""
    shapes = {tuple(source.weights[k[: -len("_scale_inv")]].shape) for k in source.scales}
    assert any(r % 128 or c % 128 for r, c in shapes), shapes


@pytest.mark.parametrize("block", [(128, 128), (48, 40)])
def test_float32_import_equals_reference_dequantization(
    ref_dir: Path, tmp_path: Path, block: tuple[int, int]
) -> None:
    source = Fp8Source(ref_dir, block)
    done = import_checkpoint(source.write(tmp_path / "fp8"), tmp_path / "out", dtype="float32")
    out = read_all(done.path)
    # every tensor of the model, nothing else: the trainer's loader has a place for each
    assert set(out) == set(source.reference)
    n_quantized = 0
    for key, ref in source.reference.items():
        got = out[key]
        assert got.dtype == torch.float32, key
        if key + "_scale_inv" in source.scales:
            n_quantized += 1
            q, s = source.weights[key], source.scales[key + "_scale_inv"]
            assert torch.equal(got, dequant_loop(q, s, block)), key
            # within FP8 e4m3 rounding of the reference: half a step (2^-4 relative) or, for
            # subnormals, half the smallest step (2^-10 of the block's scale)
            spread = s.repeat_interleave(block[0], 0)[: ref.shape[0]]
            spread = spread.repeat_interleave(block[1], 1)[:, : ref.shape[1]]
            bound = ref.abs() * 2**-4 + spread * 2**-9 + 1e-9
            assert bool(((got - ref).abs() <= bound).all()), key
            assert not torch.equal(got, ref), key  # it was quantized, not copied
        else:
            assert torch.equal(got, source.weights[key].float()), key
    assert n_quantized == done.record["dequantized_tensors"] > 20
    assert done.record["quantization"]["weight_block_size"] == list(block)


def test_bf16_import_is_the_dequantization_in_bf16(source: Fp8Source, imported_bf16) -> None:
    out = read_all(imported_bf16.path)
    assert set(out) == set(source.reference)
    for key in source.reference:
        want = (
            dequant_loop(source.weights[key], source.scales[key + "_scale_inv"], source.block)
            if key + "_scale_inv" in source.scales
            else source.weights[key].float()
        )
        # a float32 source tensor (the router's bias) keeps its precision; the rest is bf16
        kept = (
            source.weights[key].dtype == torch.float32 and key + "_scale_inv" not in source.scales
        )
        dtype = torch.float32 if kept else torch.bfloat16
        assert out[key].dtype == dtype, key
        assert torch.equal(out[key], want.to(dtype)), key
    assert any(v.dtype == torch.float32 for v in out.values())  # the bias is float32 at source


def test_bf16_import_is_a_checkpoint_the_trainer_loads(
    source: Fp8Source, imported_bf16, ref_dir: Path
) -> None:
    path = imported_bf16.path
    assert imported_bf16.record["shards"] > 1
    assert (path / "model.safetensors.index.json").is_file()
    config = json.loads((path / "config.json").read_text())
    assert "quantization_config" not in config
    assert config["num_nextn_predict_layers"] == 0
    assert config["torch_dtype"] == "bfloat16"
    assert (path / "tokenizer.json").read_bytes() == (ref_dir / "tokenizer.json").read_bytes()
    assert check_checkpoint(path) == "deepseek_v3"
    model, tokenizer = load_policy(path)
    ref_model, _ = load_policy(ref_dir)
    ids = torch.tensor([tokenizer("12+34=46").input_ids])
    with torch.no_grad():
        logits = model(ids).logits
        ref_logits = ref_model(ids).logits
    assert logits.shape == (1, ids.shape[1], len(tokenizer))
    assert bool(torch.isfinite(logits).all())
    # FP8 and bf16 rounding move the logits of the random-init model a little (measured: 6 %
    # of their norm), not a lot
    assert float((logits - ref_logits).norm() / ref_logits.norm()) < 0.2
    assert not any(path.parent.glob(".*importing*"))


def test_mtp_layer_is_dropped_and_recorded(
    source: Fp8Source, imported_bf16, caplog: pytest.LogCaptureFixture
) -> None:
    out = read_all(imported_bf16.path)
    n_layers = source.config["num_hidden_layers"]
    assert not [k for k in out if k.startswith(f"model.layers.{n_layers}.")]
    mtp = imported_bf16.record["mtp"]
    assert mtp["layers"] == [n_layers]
    assert mtp["dropped_keys"] == len(source.mtp_keys) > 10
    all_src = {**source.weights, **source.scales}
    assert mtp["dropped_bytes"] == sum(
        all_src[k].numel() * all_src[k].element_size() for k in source.mtp_keys
    )
    assert "speculative" in mtp["why"]
    on_disk = json.loads((imported_bf16.path / REPORT_FILE).read_text())
    assert on_disk["mtp"] == mtp


def test_mtp_drop_is_logged(source: Fp8Source, tmp_path: Path, caplog) -> None:
    with caplog.at_level(logging.INFO, logger="moerl.models.importer"):
        import_checkpoint(source.write(tmp_path / "fp8"), tmp_path / "out")
    lines = [r.getMessage() for r in caplog.records if "multi-token-prediction" in r.getMessage()]
    assert lines and f"dropped {len(source.mtp_keys)} tensors" in lines[0]


def test_cli_imports_and_refuses(source: Fp8Source, tmp_path: Path, capsys) -> None:
    src = source.write(tmp_path / "fp8")
    assert main(["models", "import", str(src), str(tmp_path / "out"), "--dtype", "float32"]) == 0
    assert "multi-token-prediction tensors dropped" in capsys.readouterr().out
    assert check_checkpoint(tmp_path / "out") == "deepseek_v3"
    assert main(["models", "import", str(src), str(tmp_path / "out")]) == 2  # exists
    assert "exists" in capsys.readouterr().err
    assert main(["models", "import", str(tmp_path / "nope"), str(tmp_path / "o2")]) == 2
    assert not (tmp_path / "o2").exists()


def test_check_checkpoint_sends_an_fp8_checkpoint_to_import(
    source: Fp8Source, tmp_path: Path
) -> None:
    src = source.write(tmp_path / "fp8")
    with pytest.raises(ConfigError, match="moerl models import"):
        check_checkpoint(src)


def _drop_scale(c, w, s):
    del s["model.layers.0.self_attn.o_proj.weight_scale_inv"]


def _bad_scale_shape(c, w, s):
    s["model.layers.0.self_attn.o_proj.weight_scale_inv"] = torch.ones(2, 2)


def _scale_without_weight(c, w, s):
    s["model.norm.weight_scale_inv"] = torch.ones(1, 1)


def _method(c, w, s):
    c["quantization_config"]["quant_method"] = "gptq"


def _fmt(c, w, s):
    c["quantization_config"]["fmt"] = "e5m2"


def _static(c, w, s):
    c["quantization_config"]["activation_scheme"] = "static"


def _block(c, w, s):
    c["quantization_config"]["weight_block_size"] = [128]


def _no_mtp_in_config(c, w, s):
    c["num_nextn_predict_layers"] = 0


def _e5m2(c, w, s):
    key = "model.layers.0.self_attn.o_proj.weight"
    w[key] = w[key].float().to(torch.float8_e5m2)


@pytest.mark.parametrize(
    ("mutate", "match"),
    [
        (_drop_scale, r"o_proj.weight: an FP8 weight without its scale .*_scale_inv"),
        (_bad_scale_shape, r"o_proj.weight_scale_inv: shape \[2, 2\] .* allowed: \[1, 1\]"),
        (_scale_without_weight, r"model.norm.weight_scale_inv: a scale without an FP8 weight"),
        (_method, r"quant_method 'gptq' .* allowed: fp8"),
        (_fmt, r"fmt 'e5m2' .* allowed: e4m3"),
        (_static, r"activation_scheme 'static' .* allowed: dynamic"),
        (_block, r"weight_block_size \[128\] .* allowed: two positive integers"),
        (_no_mtp_in_config, r"model.layers.2.*layer 2 is past the model's 2 layers"),
        (_e5m2, r"o_proj.weight: dtype F8_E5M2 cannot be imported; allowed FP8 format: e4m3"),
    ],
)
def test_bad_input_is_refused_before_writing(
    source: Fp8Source, tmp_path: Path, mutate, match: str
) -> None:
    src = source.write(tmp_path / "fp8", mutate)
    with pytest.raises(ConfigError, match=match):
        import_checkpoint(src, tmp_path / "out")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["fp8"]


def test_non_finite_weight_is_refused_and_nothing_is_left(
    source: Fp8Source, tmp_path: Path
) -> None:
    def inf_scale(c, w, s):
        s["model.layers.1.mlp.experts.3.down_proj.weight_scale_inv"] = torch.full(
            (1, 1), float("inf")
        )

    src = source.write(tmp_path / "fp8", inf_scale)
    with pytest.raises(
        ConfigError, match=r"experts.3.down_proj.weight: \d+ of 8192 values are not finite"
    ):
        import_checkpoint(src, tmp_path / "out")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["fp8"]


def test_dequantize_refuses_what_it_cannot_dequantize() -> None:
    q = torch.zeros(5, 7).to(torch.float8_e4m3fn)
    assert fp8.dequantize("w", q, torch.ones(3, 2), (2, 4), torch.float32).shape == (5, 7)
    with pytest.raises(ConfigError, match=r"w_scale_inv: shape \[2, 2\]; allowed: \[3, 2\]"):
        fp8.dequantize("w", q, torch.ones(2, 2), (2, 4), torch.float32)
    with pytest.raises(ConfigError, match="allowed: a 2-D torch.float8_e4m3fn weight"):
        fp8.dequantize("w", torch.zeros(5, 7), torch.ones(3, 2), (2, 4), torch.float32)
