"""`moerl models import`: a local HF checkpoint (DeepSeek-V3's published FP8 one) into the
bf16/fp32 checkpoint the trainer loads, streamed one tensor at a time into bounded shards,
checked completely before anything is written, written into a temporary directory renamed into
place at the end. The tensor rules: `fp8.py`; docs/models.md, "DeepSeek-V3 from its FP8
checkpoint".
"""

from __future__ import annotations

import json
import logging
import os
import shutil
from collections.abc import Mapping
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from moerl.errors import ConfigError
from moerl.models import fp8
from moerl.models.families import SUPPORTED_MODEL_TYPES, family_of
from moerl.models.policy import (
    MAX_HF_CONFIG_BYTES,
    check_checkpoint,
    read_safetensors_header,
)
from moerl.userfiles import FileProblem, decode_text, read_bytes_capped, short_repr

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)

INDEX_FILE = "model.safetensors.index.json"
REPORT_FILE = "moerl_import.json"
# copied as they are: the tokenizer, the generation defaults, the chat template, the licence
COPIED_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "tokenizer.model",
    "vocab.json",
    "merges.txt",
    "special_tokens_map.json",
    "added_tokens.json",
    "generation_config.json",
    "chat_template.jinja",
    "chat_template.json",
)
DEFAULT_SHARD_BYTES = 5 * 2**30
DTYPE_BYTES = {"bfloat16": 2, "float32": 4}
ST_BYTES = {"F64": 8, "F32": 4, "BF16": 2, "F16": 2, "F8_E4M3": 1, "F8_E5M2": 1, "I64": 8,
            "I32": 4, "I16": 2, "I8": 1, "U8": 1, "BOOL": 1}  # fmt: skip


@dataclass(frozen=True)
class ImportResult:
    """What `import_checkpoint` wrote: the directory and its moerl_import.json record."""

    path: Path
    record: dict[str, Any]


def import_checkpoint(
    src: str | Path,
    dst: str | Path,
    dtype: str = "bfloat16",
    shard_bytes: int = DEFAULT_SHARD_BYTES,
) -> ImportResult:
    """Convert the checkpoint at `src` into a `dtype` one at `dst` (which must not exist):
    FP8 weights dequantized with their block scales, the multi-token-prediction layer dropped
    and recorded, config.json without quantization_config, tokenizer files copied. Every input
    problem is a ConfigError raised before anything is written."""
    if dtype not in fp8.OUT_DTYPES:
        raise ConfigError(f"--dtype {short_repr(dtype)}; allowed: {', '.join(fp8.OUT_DTYPES)}")
    if shard_bytes < 1:
        raise ConfigError(f"shard size {shard_bytes} bytes; allowed: a positive size")
    src, dst = Path(src).expanduser(), Path(dst).expanduser()
    hf, tensors, where = _read_source(src)
    scheme = fp8.fp8_scheme(hf)
    plan = fp8.plan_import(tensors, hf, scheme)
    if not plan.output_keys():
        raise ConfigError(f"{src}: no tensors to import")
    out_bytes = sum(_out_bytes(tensors[k], dtype) for k in plan.output_keys())
    _check_destination(dst, out_bytes)
    out_config = _output_config(hf, dtype, plan)
    record = _record(src, dtype, scheme, plan, tensors, out_bytes, hf)

    tmp = dst.parent / f".{dst.name}.importing-{os.getpid()}"
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    try:
        record["shards"] = _write_tensors(src, tmp, plan, where, scheme, dtype, shard_bytes)
        (tmp / "config.json").write_text(json.dumps(out_config, indent=2, sort_keys=True) + "\n")
        record["files_copied"] = [n for n in COPIED_FILES if (src / n).is_file()]
        for name in record["files_copied"]:
            shutil.copyfile(src / name, tmp / name)
        (tmp / REPORT_FILE).write_text(json.dumps(record, indent=2, sort_keys=True) + "\n")
        check_checkpoint(tmp)
        os.rename(tmp, dst)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    log.info(
        "imported %s into %s: %d tensors dequantized, %d copied, %s",
        src,
        dst,
        len(plan.dequantize),
        len(plan.copy),
        _mtp_line(plan),
    )
    return ImportResult(dst, record)


def _read_source(
    src: Path,
) -> tuple[dict[str, Any], dict[str, fp8.TensorInfo], dict[str, str]]:
    """config.json, every tensor's header entry and the file holding each key."""
    if not src.is_dir():
        raise ConfigError(f"{src}: not a directory; expected a local HF checkpoint directory")
    cfg_file = src / "config.json"
    try:
        hf = json.loads(decode_text(read_bytes_capped(cfg_file, MAX_HF_CONFIG_BYTES)))
    except FileProblem as problem:
        raise ConfigError(f"{cfg_file} {problem}") from None
    except (ValueError, RecursionError) as err:
        raise ConfigError(f"{cfg_file} is not a JSON config ({err})") from None
    if not isinstance(hf, dict):
        raise ConfigError(f"{cfg_file} must hold a JSON object")
    model_type = hf.get("model_type")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ConfigError(
            f"{cfg_file}: model_type {short_repr(model_type)} is not supported; allowed: "
            f"{', '.join(SUPPORTED_MODEL_TYPES)}"
        )
    limit = family_of(str(model_type)).config_limits(hf)
    if limit:
        raise ConfigError(f"{cfg_file}: {limit}")
    files = sorted(src.glob("*.safetensors"))
    if not files:
        raise ConfigError(f"{src} has no *.safetensors weights")
    tensors: dict[str, fp8.TensorInfo] = {}
    where: dict[str, str] = {}
    for f in files:
        for key, entry in read_safetensors_header(f, "import").items():
            if key == "__metadata__":
                continue
            if key in where:
                raise ConfigError(f"{key}: in both {where[key]} and {f.name}; allowed: one file")
            tensors[key] = _tensor_info(f, key, entry)
            where[key] = f.name
    index = src / INDEX_FILE
    if index.is_file():
        _check_index(index, where)
    return hf, tensors, where


def _tensor_info(f: Path, key: str, entry: Any) -> fp8.TensorInfo:
    dtype, shape, offsets = entry.get("dtype"), entry.get("shape"), entry["data_offsets"]
    if dtype not in ST_BYTES or not (
        isinstance(shape, list) and all(isinstance(d, int) and d >= 0 for d in shape)
    ):
        raise ConfigError(
            f"{f.name}: {key} has dtype {short_repr(dtype)} and shape {short_repr(shape)}; "
            f"allowed dtypes: {', '.join(ST_BYTES)}"
        )
    nbytes = offsets[1] - offsets[0]
    numel = 1
    for d in shape:
        numel *= d
    if nbytes != numel * ST_BYTES[dtype]:
        raise ConfigError(
            f"{f.name}: {key} holds {nbytes} bytes, its {dtype} shape {shape} needs "
            f"{numel * ST_BYTES[dtype]}; copy the checkpoint again"
        )
    return fp8.TensorInfo(dtype, tuple(shape), nbytes)


def _check_index(index: Path, where: Mapping[str, str]) -> None:
    try:
        weight_map = json.loads(index.read_text())["weight_map"]
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise ConfigError(f"{index}: not a safetensors index ({err})") from None
    if not isinstance(weight_map, dict) or weight_map != dict(where):
        missing = sorted(set(weight_map or {}) - set(where))[:3]
        extra = sorted(set(where) - set(weight_map or {}))[:3]
        raise ConfigError(
            f"{index}: its weight_map does not match the *.safetensors files (listed but not "
            f"found or in another file: {missing or '-'}; found but not listed: {extra or '-'}); "
            "copy the checkpoint again"
        )


def _out_bytes(info: fp8.TensorInfo, dtype: str) -> int:
    numel = 1
    for d in info.shape:
        numel *= d
    return numel * (
        DTYPE_BYTES[dtype]
        if info.dtype in (*fp8.FLOAT_DTYPES, fp8.FP8_DTYPE)
        else ST_BYTES[info.dtype]
    )


def _check_destination(dst: Path, out_bytes: int) -> None:
    if dst.exists():
        raise ConfigError(f"{dst} exists; allowed: a new directory (nothing is overwritten)")
    parent = dst.parent
    if not parent.is_dir():
        raise ConfigError(f"{parent} is not a directory; create it first")
    free = shutil.disk_usage(parent).free
    if free < out_bytes + (1 << 20):
        raise ConfigError(
            f"{parent} has {free / 2**30:.1f} GiB free; the imported checkpoint needs "
            f"{out_bytes / 2**30:.1f} GiB"
        )


def _output_config(hf: dict[str, Any], dtype: str, plan: fp8.ImportPlan) -> dict[str, Any]:
    out = {k: v for k, v in hf.items() if k not in ("quantization_config", "auto_map")}
    if hf.get("num_nextn_predict_layers"):
        out["num_nextn_predict_layers"] = 0
    out["torch_dtype"] = dtype
    if "dtype" in out:
        out["dtype"] = dtype
    return out


def _mtp_line(plan: fp8.ImportPlan) -> str:
    if not plan.mtp_dropped:
        return "no multi-token-prediction layer"
    return (
        f"dropped {len(plan.mtp_dropped)} tensors ({plan.mtp_bytes / 2**30:.2f} GiB) of the "
        f"multi-token-prediction layer(s) {plan.mtp_layers}: {fp8.MTP_WHY}"
    )


def _record(
    src: Path,
    dtype: str,
    scheme: fp8.Fp8Scheme | None,
    plan: fp8.ImportPlan,
    tensors: Mapping[str, fp8.TensorInfo],
    out_bytes: int,
    hf: Mapping[str, Any],
) -> dict[str, Any]:
    if plan.mtp_dropped:
        log.warning("import: %s", _mtp_line(plan))
    return {
        "source": str(src),
        "dtype": dtype,
        "quantization": None
        if scheme is None
        else {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": list(scheme.block)},
        "dequantized_tensors": len(plan.dequantize),
        "copied_tensors": len(plan.copy),
        "source_bytes": sum(t.nbytes for t in tensors.values()),
        "output_bytes": out_bytes,
        "config_changes": [
            c
            for c, present in (
                ("quantization_config removed", "quantization_config" in hf),
                (
                    "auto_map removed (transformers' own DeepseekV3 classes load it)",
                    "auto_map" in hf,
                ),
                ("num_nextn_predict_layers set to 0", bool(hf.get("num_nextn_predict_layers"))),
                (f"torch_dtype set to {dtype}", True),
            )
            if present
        ],
        "mtp": {
            "layers": plan.mtp_layers,
            "dropped_keys": len(plan.mtp_dropped),
            "dropped_bytes": plan.mtp_bytes,
            "why": fp8.MTP_WHY if plan.mtp_dropped else None,
            "first_keys": plan.mtp_dropped[:10],
        },
    }


@dataclass
class _Shards:
    """Output tensors gathered into shard files of about `shard_bytes` each, in `tmp`."""

    tmp: Path
    shard_bytes: int
    parts: list[str] = field(default_factory=list)  # written so far, as part-0000i names
    weight_map: dict[str, str] = field(default_factory=dict)  # key -> part name
    buffer: dict[str, torch.Tensor] = field(default_factory=dict)  # the shard being filled
    held: int = 0  # bytes in `buffer`
    total: int = 0  # bytes of every tensor added

    def add(self, key: str, t: torch.Tensor) -> None:
        size = t.numel() * t.element_size()
        if self.buffer and self.held + size > self.shard_bytes:
            self.flush()
        self.buffer[key] = t
        self.held += size
        self.total += size

    def flush(self) -> None:
        from safetensors.torch import save_file

        if not self.buffer:
            return
        name = f"part-{len(self.parts):05d}.safetensors"
        save_file(self.buffer, str(self.tmp / name), metadata={"format": "pt"})
        self.parts.append(name)
        self.weight_map.update({k: name for k in self.buffer})
        self.buffer, self.held = {}, 0

    def finish(self) -> int:
        """Give the parts their final names and write the index if there are several."""
        n = len(self.parts)
        names = (
            {self.parts[0]: "model.safetensors"}
            if n == 1
            else {p: f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i, p in enumerate(self.parts)}
        )
        for old, new in names.items():
            os.rename(self.tmp / old, self.tmp / new)
        if n > 1:
            index = {
                "metadata": {"total_size": self.total},
                "weight_map": {k: names[v] for k, v in sorted(self.weight_map.items())},
            }
            (self.tmp / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")
        return n


@dataclass
class _Sources:
    """The source checkpoint's files, each opened once on first use and kept open by `stack`."""

    src: Path
    where: Mapping[str, str]  # key -> source file
    stack: ExitStack
    handles: dict[str, Any] = field(default_factory=dict)

    def get(self, key: str) -> torch.Tensor:
        from safetensors import safe_open

        fname = self.where[key]
        if fname not in self.handles:
            self.handles[fname] = self.stack.enter_context(
                safe_open(str(self.src / fname), framework="pt", device="cpu")
            )
        return self.handles[fname].get_tensor(key)


def _output_tensor(
    key: str,
    sources: _Sources,
    plan: fp8.ImportPlan,
    scheme: fp8.Fp8Scheme | None,
    torch_dtype: torch.dtype,
) -> torch.Tensor:
    """The tensor `key` as it is written: dequantized, or cast down to `torch_dtype`."""
    import torch

    if key in plan.dequantize:
        assert scheme is not None  # plan_import refuses FP8 without a scheme
        t = fp8.dequantize(
            key, sources.get(key), sources.get(plan.dequantize[key]), scheme.block, torch_dtype
        )
    else:
        t = sources.get(key)
        if t.is_floating_point():
            # never below what the source kept: DeepSeek-V3 stores its router's
            # e_score_correction_bias in float32 (vLLM keeps it so), and bf16 rounding
            # could change which experts are picked
            if t.element_size() <= torch.tensor([], dtype=torch_dtype).element_size():
                t = t.to(torch_dtype)
            fp8.check_finite(key, t)
    return t.contiguous()


def _write_tensors(
    src: Path,
    tmp: Path,
    plan: fp8.ImportPlan,
    where: Mapping[str, str],
    scheme: fp8.Fp8Scheme | None,
    dtype: str,
    shard_bytes: int,
) -> int:
    """Stream every output tensor into shards of about `shard_bytes`; writes model.safetensors,
    or model-0000i-of-0000n.safetensors and the index. Returns the shard count."""
    import torch

    torch_dtype = getattr(torch, dtype)
    shards = _Shards(tmp, shard_bytes)
    with ExitStack() as stack:
        sources = _Sources(src, where, stack)
        # source order (file by file) keeps each shard's pages hot while it is read
        for key in sorted(plan.output_keys(), key=lambda k: (where[k], k)):
            shards.add(key, _output_tensor(key, sources, plan, scheme, torch_dtype))
        shards.flush()
    return shards.finish()
