"""Export the HF checkpoint from the trainer's (dp, ep) mesh with every rank writing its own
files: no rank receives the whole model. Each dense tensor has one owner rank (balanced by
bytes, the same plan on every rank) that gathers it from its FSDP shards; each MoE layer's
experts are written by the ranks that hold them (per-expert keys) or gathered to one owner
(fused keys). Rank 0 then writes only the index, the config and the copied tokenizer files.
The same keys, dtypes and values as `ep_checkpoint.save_ep_checkpoint`; design and bytes per
rank: docs/expert-parallel.md, "Export without a gather".
"""

from __future__ import annotations

import json
import math
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import torch
import torch.distributed as dist

from moerl.components.policy_update.ep_checkpoint import (
    DEFAULT_SHARD_BYTES,
    INDEX_FILE,
    CheckpointLayout,
    ExpertKeys,
)
from moerl.components.policy_update.ep_moe import EPMoEBlock
from moerl.errors import CheckpointError
from moerl.models.policy import mark_dtype


@dataclass
class ExportStats:
    """What one `export_ep_checkpoint` call did; the per-rank lists are the same on every rank
    (index r: rank r of the mesh)."""

    rank: int
    bytes_written: list[int]  # tensor bytes in the rank's files (the written dtype)
    bytes_received: list[int]  # bytes the rank received by gathers (padding rows included)
    files: list[list[str]]  # the rank's weight files, in order
    seconds: list[float]  # each rank, from the call until its last file was closed
    fallbacks: list[int]  # tensors the rank took part in all-gathering (`full_tensor`)
    total_seconds: float = 0.0  # this rank, the whole call (index, config and barrier included)
    weight_map: dict[str, str] = field(default_factory=dict)  # key -> file, every rank's

    @property
    def total_bytes(self) -> int:
        return sum(self.bytes_written)


@dataclass(frozen=True)
class _Grid:
    """Where this rank sits on the (dp, ep) mesh; one process without a mesh is (1, 1)."""

    rank: int
    world: int
    dp: int
    ep: int
    d: int  # this rank's dp coordinate
    e: int  # this rank's ep coordinate
    mesh: Any

    def global_rank(self, d: int, e: int) -> int:
        return int(self.mesh.mesh[d, e]) if self.mesh is not None else 0

    def group(self, dim: str):
        return self.mesh.get_group(dim) if self.mesh is not None else None


def _grid(mesh) -> _Grid:
    initialized = dist.is_available() and dist.is_initialized()
    rank = dist.get_rank() if initialized else 0
    world = dist.get_world_size() if initialized else 1
    if mesh is None or mesh.size() == 1:
        if world != 1:
            raise CheckpointError(
                f"policy_update: export over {world} ranks needs their (dp, ep) device mesh"
            )
        return _Grid(0, 1, 1, 1, 0, 0, None)
    if mesh.ndim != 2 or mesh.size() != world:
        raise CheckpointError(
            f"policy_update: export needs the (dp, ep) mesh over all {world} ranks "
            f"(got a {mesh.ndim}-D mesh of {mesh.size()} ranks)"
        )
    coord = mesh.get_coordinate()
    return _Grid(rank, world, mesh.size(0), mesh.size(1), coord[0], coord[1], mesh)


def _nbytes(t: torch.Tensor, dtype: torch.dtype | None = None) -> int:
    return t.numel() * (dtype or t.dtype).itemsize


def _gather_to(
    t: torch.Tensor, owner: int, rank: int, fallbacks: list[int] | None = None
) -> tuple[torch.Tensor | None, int]:
    """(`t` whole on global rank `owner`, None elsewhere; bytes this rank received). A
    collective over the ranks of `t`'s mesh when `t` is a sharded DTensor: every one of them
    calls it. A plain tensor is whole on every rank already (replicated): nothing moves."""
    from torch.distributed.tensor import DTensor, Replicate, Shard

    t = t.detach()
    if not isinstance(t, DTensor):
        return (t if rank == owner else None), 0
    mesh, placements = t.device_mesh, t.placements
    local = t.to_local()
    if all(isinstance(p, Replicate) for p in placements):
        return (local if rank == owner else None), 0
    group = mesh.get_group() if mesh.ndim == 1 else None
    members = dist.get_process_group_ranks(group) if group is not None else []
    handled = placements == (Shard(0),) and t.dim() > 0 and owner in members
    if group is None or not handled:
        # a placement FSDP2 does not give our parameters (several mesh dims, a shard on another
        # dim, an owner outside the mesh): all-gathered to every rank, the owner keeps it
        whole = t.full_tensor()
        if fallbacks is not None:
            fallbacks.append(1)
        received = _nbytes(whole) - _nbytes(local)
        return (whole if rank == owner else None), received
    n, rows = len(members), t.shape[0]
    if n == 1:
        return (local if rank == owner else None), 0
    chunk = math.ceil(rows / n)  # FSDP2 shards like torch.chunk: every rank's rows fit in one
    padded = local.contiguous()
    if local.shape[0] != chunk:
        padded = local.new_zeros((chunk, *t.shape[1:]))
        padded[: local.shape[0]] = local
    dst = dist.get_group_rank(group, owner)
    if rank != owner:
        dist.gather(padded, None, group=group, group_dst=dst)
        return None, 0
    buf = local.new_empty((n * chunk, *t.shape[1:]))
    dist.gather(padded, list(buf.split(chunk)), group=group, group_dst=dst)
    # each member's real rows, in mesh order; the padding dropped
    pieces = [
        buf[r * chunk : r * chunk + Shard.local_shard_size_and_offset(rows, n, r)[0]]
        for r in range(n)
    ]
    return torch.cat(pieces), (n - 1) * _nbytes(padded)


def _gather_over_ep(
    block: EPMoEBlock, layer: tuple[torch.Tensor, torch.Tensor], owner_e: int, grid: _Grid
) -> tuple[list[torch.Tensor] | None, int]:
    """One layer's [E, 2I, H] and [E, H, I] on EP coordinate `owner_e` of this rank's EP group
    (None elsewhere), from each EP rank's whole local experts `layer`; bytes received."""
    if grid.ep == 1:
        return list(layer), 0
    group = grid.group("ep")
    out: list[torch.Tensor] = []
    received = 0
    for local in layer:
        local = local.contiguous()
        if grid.e != owner_e:
            dist.gather(local, None, group=group, group_dst=owner_e)
            continue
        full = local.new_empty((block.num_experts, *local.shape[1:]))
        # EP rank r holds experts [r*L, (r+1)*L) (EPMoEBlock.first_expert): rows land in place
        dist.gather(local, list(full.chunk(grid.ep)), group=group, group_dst=owner_e)
        out.append(full)
        received += (grid.ep - 1) * _nbytes(local)
    return (out if grid.e == owner_e else None), received


@dataclass
class _Writer:
    """This rank's files: tensors held until the next would pass `max_bytes`, then written."""

    out: Path
    rank: int
    max_bytes: int
    dtype: torch.dtype | None
    pending: dict[str, torch.Tensor] = field(default_factory=dict)
    pending_bytes: int = 0
    files: list[str] = field(default_factory=list)
    entries: dict[str, tuple[str, int]] = field(default_factory=dict)  # key -> (file, nbytes)
    fallbacks: list[int] = field(default_factory=list)  # one per `full_tensor` fallback

    def add(self, key: str, t: torch.Tensor) -> None:
        t = t.to("cpu").contiguous()  # the tensor alone: safetensors refuses shared storage
        if self.dtype is not None:
            t = t.to(self.dtype)
        if key in self.entries or key in self.pending:
            raise CheckpointError(f"policy_update: {key} exported twice (a moerl bug)")
        if self.pending and self.pending_bytes + _nbytes(t) > self.max_bytes:
            self.flush()
        self.pending[key] = t
        self.pending_bytes += _nbytes(t)

    def flush(self) -> None:
        from safetensors.torch import save_file

        if not self.pending:
            return
        name = f"model-r{self.rank:05d}-p{len(self.files):03d}.safetensors"
        save_file(self.pending, str(self.out / name), metadata={"format": "pt"})
        self.files.append(name)
        self.entries.update({k: (name, _nbytes(v)) for k, v in self.pending.items()})
        self.pending, self.pending_bytes = {}, 0


def _expert_writers(
    blocks: list[EPMoEBlock], layout: CheckpointLayout, grid: _Grid
) -> list[tuple[int, int | None]]:
    """Per MoE layer (in model order): the dp coordinate whose ranks write it and, for a fused
    layout, the EP coordinate of the one that does (per-expert: every EP rank its own)."""
    out: list[tuple[int, int | None]] = []
    for i, keys in enumerate(layout.experts):
        if keys.fused:  # one writer per layer, spread over all ranks
            w = i % grid.world
            out.append((w // grid.ep, w % grid.ep))
        else:
            out.append((i % grid.dp, None))
    return out


def _dense_owners(
    by_name: dict[str, torch.Tensor],
    blocks: list[EPMoEBlock],
    layout: CheckpointLayout,
    grid: _Grid,
    writers: list[tuple[int, int | None]],
) -> dict[str, int]:
    """Each dense tensor's owner rank: largest first onto the rank with the fewest bytes so
    far, counting the experts it writes (ties: lowest rank, then key order). Depends only on
    shapes and the mesh, so every rank computes the same plan."""
    load = [0] * grid.world
    for b, (d, e) in zip(blocks, writers):
        layer = sum(_nbytes(p) for p in (b.gate_up_proj_LIH, b.down_proj_LHI))  # global shape
        layer = layer * b.num_experts // b.gate_up_proj_LIH.shape[0]  # a plain local tensor
        if e is not None:
            load[grid.global_rank(d, e) if grid.mesh is not None else 0] += layer
        else:
            for ep in range(grid.ep):
                load[grid.global_rank(d, ep) if grid.mesh is not None else 0] += layer // grid.ep
    items = sorted(layout.names.items(), key=lambda nk: (-_nbytes(by_name[nk[0]]), nk[1]))
    owners: dict[str, int] = {}
    for name, _ in items:
        r = min(range(grid.world), key=lambda k: (load[k], k))
        owners[name] = r
        load[r] += _nbytes(by_name[name])
    return owners


def _export_experts(
    block: EPMoEBlock,
    keys: ExpertKeys,
    writer: tuple[int, int | None],
    grid: _Grid,
    out: Sink,
) -> int:
    """Write one MoE layer's experts from the ranks that hold them; bytes received here."""
    d_w, e_w = writer
    owner = grid.global_rank(d_w, grid.e) if grid.mesh is not None else 0
    received = 0
    layer: list[torch.Tensor] = []
    for p in (block.gate_up_proj_LIH, block.down_proj_LHI):  # this EP rank's, over dp
        whole, got = _gather_to(p, owner, grid.rank, out.fallbacks)
        received += got
        if whole is not None:
            layer.append(whole)
    if grid.d != d_w:
        return received
    if keys.fused:
        if e_w is None:
            raise CheckpointError("policy_update: a fused layer without its writer (a moerl bug)")
        full, got = _gather_over_ep(block, (layer[0], layer[1]), e_w, grid)
        if full is not None:
            out.add(keys.gate, full[0])
            out.add(keys.down, full[1])
        return received + got
    gu, dn = (t.to("cpu") for t in layer)
    i = gu.shape[1] // 2
    for j in range(gu.shape[0]):  # this EP rank's experts under their global numbers
        gate, up, down = keys.expert(block.first_expert + j)
        out.add(gate, gu[j, :i].clone())
        out.add(up, gu[j, i:].clone())
        out.add(down, dn[j].clone())
    return received


def _expected_keys(blocks: list[EPMoEBlock], layout: CheckpointLayout) -> set[str]:
    keys = set(layout.names.values())
    for b, k in zip(blocks, layout.experts):
        keys |= (
            {k.gate, k.down}
            if k.fused
            else {key for e in range(b.num_experts) for key in k.expert(e)}
        )
    return keys


def export_ep_checkpoint(
    model,
    blocks,
    layout: CheckpointLayout,
    state_in: Path,
    state_out: Path,
    mesh,
    dtype: torch.dtype | None = None,
    max_shard_bytes: int = DEFAULT_SHARD_BYTES,
) -> ExportStats:
    """Write the HF checkpoint into `state_out` (weights in `dtype` when given, the serving
    dtype; config; tokenizer and other files copied from `state_in`), every rank its own
    `model-r{rank:05d}-p{part:03d}.safetensors` files, rank 0 the index. A collective over
    every rank of `mesh` (ep_train.build_mesh's (dp, ep) mesh; None, or a 1-rank mesh, in one
    process). The directory is complete on every rank when it returns."""
    start = time.perf_counter()
    grid = _grid(mesh)
    state_out = Path(state_out)
    state_out.mkdir(parents=True, exist_ok=True)
    blocks = list(blocks)
    out = _Writer(state_out, grid.rank, max_shard_bytes, dtype)
    received = _share(model, blocks, layout, grid, out)
    out.flush()
    mine = (out.entries, received, time.perf_counter() - start, len(out.fallbacks))
    every: list[Any] = [mine]
    if grid.world > 1:
        every = [None] * grid.world
        dist.all_gather_object(every, mine)
    weight_map = _weight_map(every)
    files = [sorted({f for f, _ in entries.values()}) for entries, *_ in every]
    stats = ExportStats(
        rank=grid.rank,
        bytes_written=[sum(n for _, n in entries.values()) for entries, *_ in every],
        bytes_received=[r for _, r, *_ in every],
        files=files,
        seconds=[s for _, _, s, _ in every],
        fallbacks=[f for *_, f in every],
        weight_map=dict(sorted(weight_map.items())),
    )
    if grid.rank == 0:
        _write_index(model, blocks, layout, stats, Path(state_in), state_out, dtype)
    if grid.world > 1:
        dist.barrier()
    stats.total_seconds = time.perf_counter() - start
    return stats


class Sink(Protocol):
    """Where a rank's share goes: its files (`_Writer`) or the wire
    (redistribute_weights/wire.FrameSender)."""

    fallbacks: list[int]

    def add(self, key: str, t: torch.Tensor) -> None: ...


def _share(model, blocks: list[EPMoEBlock], layout: CheckpointLayout, grid: _Grid, out) -> int:
    """Hand this rank's share of the checkpoint to `out` (a `Sink`): the dense tensors it owns,
    gathered from their FSDP shards, and the experts it writes. A collective over the mesh, in
    the same order on every rank: dense tensors in layout order, then layers. Returns the bytes
    this rank received by gathers."""
    by_name = dict(model.state_dict(keep_vars=True))
    writers = _expert_writers(blocks, layout, grid)
    owners = _dense_owners(by_name, blocks, layout, grid, writers)
    received = 0
    for name, key in layout.names.items():
        whole, got = _gather_to(by_name[name], owners[name], grid.rank, out.fallbacks)
        received += got
        if whole is not None:
            out.add(key, whole)
        del whole
    for block, keys, writer in zip(blocks, layout.experts, writers):
        received += _export_experts(block, keys, writer, grid, out)
    return received


def send_ep_weights(model, blocks, layout: CheckpointLayout, mesh, sink: Sink) -> dict[str, Any]:
    """Send this rank's share of the serving checkpoint into `sink` (a wire.FrameSender on this
    rank's group): the same plan as `export_ep_checkpoint`, so each rank sends exactly the
    tensors it would write, and no rank holds the whole model. A collective over `mesh`; every
    rank calls it. Returns this rank's counts: what it sent, the bytes its gathers received,
    and every key it sent (the caller checks the union is the whole checkpoint)."""
    grid = _grid(mesh)
    received = _share(model, list(blocks), layout, grid, sink)
    return {"rank": grid.rank, "received": received, "fallbacks": len(sink.fallbacks)}


def expected_keys(blocks, layout: CheckpointLayout) -> set[str]:
    """Every key of the serving checkpoint (the union of every rank's share)."""
    return _expected_keys(list(blocks), layout)


def _weight_map(every: list[Any]) -> dict[str, str]:
    """Every rank's entries as one weight map; a tensor two ranks wrote is a bug, refused."""
    weight_map: dict[str, str] = {}
    for entries, *_ in every:
        for key, (fname, _) in entries.items():
            if key in weight_map:
                raise CheckpointError(
                    f"policy_update: {key} written by two ranks ({weight_map[key]}, {fname})"
                )
            weight_map[key] = fname
    return weight_map


def _write_index(
    model,
    blocks,
    layout: CheckpointLayout,
    stats: ExportStats,
    state_in: Path,
    state_out: Path,
    dtype: torch.dtype | None,
) -> None:
    """Rank 0's part: every tensor written once, then the index, the files copied from
    `state_in`, and the config (marked with the serving dtype)."""
    missing = _expected_keys(blocks, layout) ^ set(stats.weight_map)
    if missing:
        raise CheckpointError(
            f"policy_update: export wrote {len(stats.weight_map)} tensors; wrong or missing: "
            f"{', '.join(sorted(missing)[:5])} (a moerl bug)"
        )
    index = {
        "metadata": {"total_size": stats.total_bytes},
        "weight_map": stats.weight_map,
    }
    (state_out / INDEX_FILE).write_text(json.dumps(index, indent=2))
    for f in state_in.iterdir():  # tokenizer and generation config, unchanged
        if f.is_file() and not f.name.endswith(".safetensors") and f.name != INDEX_FILE:
            shutil.copy2(f, state_out / f.name)
    config: Any = model.config  # a transformers model's
    config.save_pretrained(state_out)
    if dtype is not None:
        mark_dtype(state_out, str(dtype).removeprefix("torch."))
