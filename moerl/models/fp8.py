"""Block-quantized FP8 checkpoints (DeepSeek-V3's published layout): the scheme read from
config.json, the plan that sorts every tensor (dequantize, copy, drop the multi-token-prediction
layer) and the dequantization itself. Pure functions; the importer that streams files is
`importer.py`. docs/models.md, "DeepSeek-V3 from its FP8 checkpoint".
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from moerl.errors import ConfigError
from moerl.userfiles import short_repr

if TYPE_CHECKING:
    import torch

# safetensors dtype names
FP8_DTYPE = "F8_E4M3"
FP8_OTHER = ("F8_E5M2", "F8_E4M3FNUZ", "F8_E5M2FNUZ", "F8_E8M0")
SCALE_DTYPES = ("F32", "BF16", "F16")
FLOAT_DTYPES = ("F64", "F32", "BF16", "F16")
SCALE_SUFFIX = "_scale_inv"
OUT_DTYPES = ("bfloat16", "float32")
_LAYER = re.compile(r"^model\.layers\.(\d+)\.")

MTP_WHY = (
    "multi-token-prediction layer: transformers' DeepseekV3ForCausalLM has no module for it, so "
    "the trainer cannot train it, and vLLM uses it only for speculative decoding "
    "(speculative_config method deepseek_mtp), which moerl's rollout does not enable"
)


@dataclass(frozen=True)
class TensorInfo:
    """One tensor as a safetensors header describes it."""

    dtype: str  # safetensors name: F8_E4M3, F32, BF16, ...
    shape: tuple[int, ...]
    nbytes: int


@dataclass(frozen=True)
class Fp8Scheme:
    """The quantization_config of a block-FP8 checkpoint: e4m3 weights, one scale per block of
    `block` = (rows, columns), activations quantized dynamically at run time."""

    block: tuple[int, int]


@dataclass
class ImportPlan:
    """What the importer does with every tensor of the source checkpoint."""

    dequantize: dict[str, str] = field(default_factory=dict)  # weight key -> its scale's key
    copy: list[str] = field(default_factory=list)  # keys written as they are (cast if float)
    mtp_dropped: list[str] = field(default_factory=list)  # keys of the MTP layer(s), scales too
    mtp_layers: list[int] = field(default_factory=list)
    mtp_bytes: int = 0  # their bytes in the source

    def output_keys(self) -> list[str]:
        """The keys the imported checkpoint holds, sorted."""
        return sorted([*self.dequantize, *self.copy])


def fp8_scheme(hf: Mapping[str, Any]) -> Fp8Scheme | None:
    """The checkpoint's block-FP8 scheme from its config.json; None without a
    quantization_config. Refuses (ConfigError) any quantization it cannot dequantize."""
    quant = hf.get("quantization_config")
    if quant is None:
        return None
    if not isinstance(quant, Mapping):
        raise ConfigError(
            f"config.json: quantization_config must be an object, got {type(quant).__name__}"
        )
    method = quant.get("quant_method")
    if method != "fp8":
        raise ConfigError(
            f"config.json: quantization_config.quant_method {short_repr(method)} cannot be "
            "imported; allowed: fp8 (block-quantized e4m3 with weight_scale_inv, DeepSeek-V3's "
            "layout)"
        )
    fmt = quant.get("fmt", "e4m3")
    if fmt != "e4m3":
        raise ConfigError(
            f"config.json: quantization_config.fmt {short_repr(fmt)} cannot be imported; "
            "allowed: e4m3"
        )
    act = quant.get("activation_scheme", "dynamic")
    if act != "dynamic":
        raise ConfigError(
            f"config.json: quantization_config.activation_scheme {short_repr(act)} cannot be "
            "imported (static activation scales have no place in a bf16 checkpoint); allowed: "
            "dynamic"
        )
    block = quant.get("weight_block_size")
    if not (
        isinstance(block, list)
        and len(block) == 2
        and all(isinstance(b, int) and not isinstance(b, bool) and b > 0 for b in block)
    ):
        raise ConfigError(
            f"config.json: quantization_config.weight_block_size {short_repr(block)} cannot be "
            "imported; allowed: two positive integers [rows, columns], e.g. [128, 128] (a "
            "per-tensor FP8 checkpoint is not supported)"
        )
    return Fp8Scheme(block=(block[0], block[1]))


def scale_shape(shape: tuple[int, ...], block: tuple[int, int]) -> tuple[int, int]:
    """The shape of a weight's scale tensor: one scale per block, partial edge blocks included."""
    return (math.ceil(shape[0] / block[0]), math.ceil(shape[1] / block[1]))


def mtp_layer_ids(hf: Mapping[str, Any]) -> range:
    """The decoder-layer indices DeepSeek-V3 stores its multi-token-prediction modules under:
    `num_hidden_layers` onwards, `num_nextn_predict_layers` of them."""
    n_layers = hf.get("num_hidden_layers")
    n_mtp = hf.get("num_nextn_predict_layers", 0) or 0
    if not isinstance(n_layers, int) or not isinstance(n_mtp, int) or n_mtp < 0:
        raise ConfigError(
            "config.json: num_hidden_layers must be an integer and num_nextn_predict_layers a "
            f"non-negative integer; got {short_repr(n_layers)} and {short_repr(n_mtp)}"
        )
    return range(n_layers, n_layers + n_mtp)


def layer_id(key: str) -> int | None:
    """The decoder-layer index of a `model.layers.<i>.` key, else None."""
    m = _LAYER.match(key)
    return int(m.group(1)) if m else None


def plan_import(
    tensors: Mapping[str, TensorInfo], hf: Mapping[str, Any], scheme: Fp8Scheme | None
) -> ImportPlan:
    """Sort every tensor: an FP8 weight with its scale is dequantized, the MTP layer's keys are
    dropped, everything else is copied. Refuses (ConfigError, naming the tensor) an FP8 tensor
    without its scale or of another format, a scale of the wrong shape or dtype or without its
    weight, and a layer past the model's and its MTP layers."""
    mtp = mtp_layer_ids(hf)
    n_layers = mtp.start
    plan = ImportPlan()
    scales = {k for k in tensors if k.endswith(SCALE_SUFFIX)}
    for key in sorted(tensors):
        info = tensors[key]
        layer = layer_id(key)
        if layer is not None and layer >= n_layers:
            if layer not in mtp:
                raise ConfigError(
                    f"{key}: layer {layer} is past the model's {n_layers} layers "
                    f"(num_hidden_layers) and its {len(mtp)} multi-token-prediction layer(s) "
                    "(num_nextn_predict_layers); allowed: layers below "
                    f"{n_layers + len(mtp)}"
                )
            plan.mtp_dropped.append(key)
            plan.mtp_bytes += info.nbytes
            if layer not in plan.mtp_layers:
                plan.mtp_layers.append(layer)
            continue
        if key in scales:
            weight = key[: -len(SCALE_SUFFIX)]
            if tensors.get(weight, TensorInfo("", (), 0)).dtype != FP8_DTYPE:
                raise ConfigError(
                    f"{key}: a scale without an FP8 weight {weight}; allowed: a "
                    f"*.weight{SCALE_SUFFIX} beside its float8_e4m3fn *.weight"
                )
            continue  # checked with its weight
        if info.dtype in FP8_OTHER:
            raise ConfigError(
                f"{key}: dtype {info.dtype} cannot be imported; allowed FP8 format: e4m3 "
                f"({FP8_DTYPE})"
            )
        if info.dtype != FP8_DTYPE:
            plan.copy.append(key)
            continue
        plan.dequantize[key] = _check_scale(key, info, tensors, scheme)
    return plan


def _check_scale(
    key: str, info: TensorInfo, tensors: Mapping[str, TensorInfo], scheme: Fp8Scheme | None
) -> str:
    if scheme is None:
        raise ConfigError(
            f"{key}: an FP8 tensor in a checkpoint whose config.json has no quantization_config; "
            "allowed: FP8 weights only with quantization_config quant_method fp8 and "
            "weight_block_size"
        )
    if not key.endswith(".weight") or len(info.shape) != 2:
        raise ConfigError(
            f"{key}: an FP8 tensor of shape {list(info.shape)}; allowed: 2-D *.weight tensors "
            "(linear layers) with a block scale"
        )
    scale_key = key + SCALE_SUFFIX
    scale = tensors.get(scale_key)
    if scale is None:
        raise ConfigError(
            f"{key}: an FP8 weight without its scale {scale_key}; allowed: every "
            f"float8_e4m3fn weight with a *{SCALE_SUFFIX} tensor"
        )
    want = scale_shape(info.shape, scheme.block)
    if scale.shape != want:
        raise ConfigError(
            f"{scale_key}: shape {list(scale.shape)} does not cover {key} {list(info.shape)} in "
            f"blocks of {list(scheme.block)}; allowed: {list(want)}"
        )
    if scale.dtype not in SCALE_DTYPES:
        raise ConfigError(f"{scale_key}: dtype {scale.dtype}; allowed: {', '.join(SCALE_DTYPES)}")
    return scale_key


def dequantize(
    name: str,
    weight: torch.Tensor,
    scale_inv: torch.Tensor,
    block: tuple[int, int],
    dtype: torch.dtype,
) -> torch.Tensor:
    """`weight.float() * scale_inv` with each scale spread over its block (edge blocks cut to
    the weight's shape), in `dtype`. Refuses (ConfigError naming `name`) a weight that is not
    2-D float8_e4m3fn, a scale of the wrong shape, and a non-finite result."""
    import torch

    if weight.dtype != torch.float8_e4m3fn or weight.dim() != 2:
        raise ConfigError(
            f"{name}: {weight.dtype} of shape {list(weight.shape)}; allowed: a 2-D "
            "torch.float8_e4m3fn weight"
        )
    rows, cols = weight.shape
    want = scale_shape((rows, cols), block)
    if tuple(scale_inv.shape) != want:
        raise ConfigError(
            f"{name}{SCALE_SUFFIX}: shape {list(scale_inv.shape)}; allowed: {list(want)} for a "
            f"[{rows}, {cols}] weight in blocks of {list(block)}"
        )
    s = scale_inv.float().repeat_interleave(block[0], dim=0)[:rows]
    s = s.repeat_interleave(block[1], dim=1)[:, :cols]
    out = (weight.float() * s).to(dtype)
    check_finite(name, out)
    return out


def check_finite(name: str, t: torch.Tensor) -> None:
    """Refuse (ConfigError naming `name`) a floating tensor holding a NaN or an infinity."""
    import torch

    if t.is_floating_point() and not bool(torch.isfinite(t).all()):
        bad = int((~torch.isfinite(t)).sum())
        raise ConfigError(
            f"{name}: {bad} of {t.numel()} values are not finite after import; allowed: finite "
            "weights only (the source checkpoint is damaged: copy it again)"
        )
