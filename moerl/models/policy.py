"""The policy: a transformers MoE causal LM of a registered family (moerl/models/README.md),
the embedded tiny model or a user's local HF checkpoint (`model.path`), checked before any work
starts (`check_checkpoint`); both go through the same `load_policy`.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from pathlib import Path

from moerl.errors import ConfigError
from moerl.models.families import SUPPORTED_MODEL_TYPES, family_of
from moerl.userfiles import FileProblem, decode_text, read_bytes_capped, short_repr

log = logging.getLogger(__name__)

HF_FILES = (
    "config.json",
    "generation_config.json",
    "model.safetensors",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
)


# A HF config.json is a few KiB; a safetensors header a few MiB at most for a large model.
MAX_HF_CONFIG_BYTES = 1 << 20
MAX_SAFETENSORS_HEADER_BYTES = 100 << 20
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json")


def check_checkpoint(path: str | Path) -> str:
    """Fail early, naming the field, when `model.path` is not a supported local MoE checkpoint:
    a directory with a readable config.json of a supported model_type, readable *.safetensors
    headers and tokenizer files. Returns the model_type."""
    p = Path(path).expanduser()
    if not p.exists():
        raise ConfigError(
            f"model.path: {p} does not exist; expected a local HF checkpoint directory"
        )
    if not p.is_dir():
        raise ConfigError(
            f"model.path: {p} is a file; expected the checkpoint's directory (config.json, "
            "*.safetensors, tokenizer)"
        )
    weights = sorted(p.glob("*.safetensors"))
    return check_model_files(
        p, str(p), [w.name for w in weights], lambda name: _check_safetensors_header(p / name)
    )


def check_model_files(
    p: Path, where: str, weights: list[str], check_header: Callable[[str], object]
) -> str:
    """The checks of `check_checkpoint` on a checkpoint whose small files (config.json, the
    tokenizer) are in folder `p` and whose weights are elsewhere (`where`: the local folder or
    the source's URI, for the messages); `check_header(name)` reads and checks one safetensors
    header. Returns the model_type."""
    cfg_file = p / "config.json"
    cfg_name = f"{where.rstrip('/')}/config.json"
    if not cfg_file.is_file():
        raise ConfigError(f"model.path: {where} is not a HF checkpoint (no config.json)")
    hf = _read_hf_config(cfg_file, cfg_name)
    model_type = hf.get("model_type")
    if not isinstance(model_type, str) or model_type not in SUPPORTED_MODEL_TYPES:
        raise ConfigError(
            f"model.path: model_type {short_repr(model_type)} is not supported; "
            f"allowed: {', '.join(SUPPORTED_MODEL_TYPES)} (in {cfg_name})"
        )
    problem = family_of(model_type).config_limits(hf)
    if problem:
        raise ConfigError(f"model.path: {problem} (in {cfg_name})")
    _refuse_quantized(where, hf, cfg_name)
    if not weights:
        raise ConfigError(f"model.path: {where} has no *.safetensors weights")
    for w in weights:
        _check_shapes(hf, check_header(w), f"{where.rstrip('/')}/{w}", cfg_name)
    if not any((p / name).is_file() for name in TOKENIZER_FILES):
        raise ConfigError(
            f"model.path: {where} has no tokenizer (one of {', '.join(TOKENIZER_FILES)}); save it "
            "with tokenizer.save_pretrained"
        )
    return model_type


# the tensors whose shape config.json fixes in every family: [vocab_size, hidden_size]
_VOCAB_TENSORS = ("embed_tokens.weight", "lm_head.weight")


def _check_shapes(hf: dict, header: object, w: str, cfg_name: str) -> None:
    """The embedding and output tensors in a safetensors `header` have the shape config.json
    gives them: a config from another model beside these weights is refused before any load."""
    vocab, hidden = hf.get("vocab_size"), hf.get("hidden_size")
    if not isinstance(header, dict) or not isinstance(vocab, int) or not isinstance(hidden, int):
        return
    for name, t in header.items():
        if name.endswith(_VOCAB_TENSORS) and isinstance(t, dict):
            shape = t.get("shape")
            if shape != [vocab, hidden]:
                raise ConfigError(
                    f"model.path: tensor {name} in {w} has shape {shape}, but {cfg_name} gives "
                    f"[vocab_size, hidden_size] = [{vocab}, {hidden}]; the config and the weights "
                    "are from different models"
                )


def _refuse_quantized(p: str, hf: dict, cfg_file: str) -> None:
    """The trainer loads bf16/fp32 weights: a quantized checkpoint is imported first."""
    quant = hf.get("quantization_config")
    if quant is None:
        return
    method = quant.get("quant_method") if isinstance(quant, dict) else None
    if method == "fp8":
        raise ConfigError(
            f"model.path: {p} is an FP8 checkpoint (quantization_config quant_method fp8 in "
            f"{cfg_file}); the trainer loads bf16/fp32 weights: convert it once with "
            f"`moerl models import {p} DST` and set model.path to DST (rollout.quantization: "
            "fp8 serves it in FP8 again on cuda; docs/models.md)"
        )
    raise ConfigError(
        f"model.path: {p} is quantized (quantization_config quant_method "
        f"{short_repr(method)} in {cfg_file}); allowed: an unquantized bf16/fp32 checkpoint, "
        "or an FP8 one converted with `moerl models import`"
    )


def read_safetensors_header(w: Path, field: str = "model.path") -> dict:
    """The parsed JSON header of safetensors file `w` (tensor name -> dtype, shape,
    data_offsets; and `__metadata__`), checked like `check_checkpoint` checks it: a readable
    header whose tensors all lie inside the file. ConfigError (starting with `field`) otherwise."""
    return _check_safetensors_header(w, field)


def _read_hf_config(path: Path, cfg_file: str) -> dict:
    """`path`'s JSON object; errors name it as `cfg_file` (the local path, or the source's URI)."""
    try:
        obj = json.loads(decode_text(read_bytes_capped(path, MAX_HF_CONFIG_BYTES)))
    except FileProblem as problem:
        raise ConfigError(f"model.path: {cfg_file} {problem}") from None
    except json.JSONDecodeError as err:
        raise ConfigError(
            f"model.path: {cfg_file} is not JSON ({err.msg} at line {err.lineno}, "
            f"column {err.colno})"
        ) from None
    except RecursionError:
        raise ConfigError(
            f"model.path: {cfg_file} is nested too deeply to be a model config"
        ) from None
    if not isinstance(obj, dict):
        raise ConfigError(
            f"model.path: {cfg_file} must hold a JSON object, got {type(obj).__name__}"
        )
    return obj


def _check_safetensors_header(w: Path, field: str = "model.path") -> dict:
    """A safetensors file starts with an 8-byte little-endian header length and a JSON header
    giving each tensor's byte range. Reading just that catches an empty, truncated or foreign
    file before any work starts."""
    try:
        size = w.stat().st_size
        with w.open("rb") as f:

            def read_at(start: int, n: int) -> bytes:
                f.seek(start)
                return f.read(n)

            return check_safetensors_header(read_at, size, str(w), field)
    except OSError as err:
        raise ConfigError(f"{field}: {w} cannot be read ({err.strerror or err})") from None


def check_safetensors_header(
    read_at: Callable[[int, int], bytes], size: int, w: str, field: str = "model.path"
) -> dict:
    """`_check_safetensors_header` on any bytes: `read_at(start, n)` reads the file `w` of
    `size` bytes (a local file, or ranged GETs of an object)."""
    header, n = None, 0
    try:
        n = int.from_bytes(read_at(0, 8), "little") if size >= 8 else 0
        if 2 <= n <= min(MAX_SAFETENSORS_HEADER_BYTES, size - 8):
            header = json.loads(read_at(8, n))
    except (ValueError, RecursionError):  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        header = None
    ends = _tensor_ends(header)
    if ends is None:
        raise ConfigError(f"{field}: {w} is not a safetensors file (no readable header)")
    if 8 + n + max(ends, default=0) > size:
        raise ConfigError(
            f"{field}: {w} is truncated ({size} bytes; its header describes "
            f"{8 + n + max(ends)}); copy the checkpoint again"
        )
    assert isinstance(header, dict)  # _tensor_ends returned a list
    return header


def _tensor_ends(header: object) -> list[int] | None:
    """The end offset of every tensor in a parsed safetensors header; None if it is not one."""
    if not isinstance(header, dict):
        return None
    ends = []
    for name, t in header.items():
        if name == "__metadata__":
            continue
        offsets = t.get("data_offsets") if isinstance(t, dict) else None
        if not (
            isinstance(offsets, list)
            and len(offsets) == 2
            and all(isinstance(o, int) for o in offsets)
        ):
            return None
        ends.append(offsets[1])
    return ends


def mark_dtype(hf_dir: str | Path, dtype: str) -> None:
    """Record `dtype` as the checkpoint's in its config.json (what a reader loading with "auto"
    gets; transformers writes `torch_dtype`, newer versions `dtype` too)."""
    path = Path(hf_dir) / "config.json"
    conf = json.loads(path.read_text())
    conf["torch_dtype"] = dtype
    if "dtype" in conf:
        conf["dtype"] = dtype
    path.write_text(json.dumps(conf, indent=2, sort_keys=True) + "\n")


def load_policy(path: str | Path, dtype: str = "float32", device: str = "cpu"):
    """Load (model, tokenizer) for training from a local HF checkpoint directory."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    check_checkpoint(path)
    torch_dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[dtype]
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch_dtype)
    # transformers' `to` is a functools.wraps wrapper whose stub loses the bound self
    model = model.to(device)  # type: ignore[arg-type]
    tokenizer = AutoTokenizer.from_pretrained(path)
    return model, tokenizer
