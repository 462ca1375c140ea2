"""Load and save an expert-parallel policy without any rank holding every expert: each rank
reads only its rows of every tensor, and rank 0 writes the HF checkpoint one shard at a time in
the layout it was loaded from. Design and the layouts read: docs/expert-parallel.md,
"Loading reads only a rank's shard" and "Checkpoint layouts"; the key names per family:
moerl/models/README.md.
"""

from __future__ import annotations

import json
import logging
import shutil
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from moerl.components.policy_update.ep_moe import EPMoEBlock, parallelize_experts
from moerl.errors import CheckpointError
from moerl.models.families import Family, family_of
from moerl.models.policy import mark_dtype

log = logging.getLogger(__name__)

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
# Bounds what rank 0 holds while saving; small enough to matter, big enough that the tiny
# policy stays one `model.safetensors` as `save_pretrained` writes it.
DEFAULT_SHARD_BYTES = 256 * 2**20


@dataclass(frozen=True)
class ExpertKeys:
    """Where one MoE layer's experts live in the checkpoint: fused keys, or per-expert
    templates with an `{e}` field."""

    fused: bool
    gate: str  # fused: the gate_up_proj key
    up: str | None  # per expert only
    down: str

    def expert(self, e: int) -> tuple[str, str, str]:
        """The (gate, up, down) keys of expert `e` in a per-expert layout."""
        if self.up is None:
            raise CheckpointError(
                "policy_update: fused experts have no per-expert keys (a moerl bug)"
            )
        return self.gate.format(e=e), self.up.format(e=e), self.down.format(e=e)


@dataclass
class CheckpointLayout:
    weight_map: dict[str, str]  # checkpoint key -> file name
    names: dict[str, str]  # model state-dict name -> checkpoint key (everything but experts)
    experts: list[ExpertKeys]  # one per EP block, in model order


def _weight_map(path: Path) -> dict[str, str]:
    from safetensors import safe_open

    index = path / INDEX_FILE
    if index.is_file():
        return dict(json.loads(index.read_text())["weight_map"])
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"policy_update: {path} has no *.safetensors weights")
    found: dict[str, str] = {}
    for f in files:
        with safe_open(str(f), framework="pt") as handle:
            found.update({k: f.name for k in handle.keys()})
    return found


def _expert_keys(family: Family, block_name: str, keys: dict[str, str]) -> ExpertKeys:
    """Where the experts of the model's block `block_name` are on disk: fused, or one tensor
    per expert, under the names the family's checkpoints use."""
    for (gate_up, down), (gate, up, per_down) in zip(
        family.fused_expert_keys(block_name), family.expert_templates(block_name)
    ):
        if gate_up in keys:
            return ExpertKeys(True, gate_up, None, down)
        if gate.format(e=0) in keys:
            return ExpertKeys(False, gate, up, per_down)
    n = family.expert_names
    raise CheckpointError(
        f"policy_update: no experts for {block_name} in the checkpoint (looked for "
        f"{block_name}.experts.gate_up_proj and {block_name}.experts.<e>.{n.gate}.weight, "
        f"the {family.name} layouts)"
    )


def read_layout(path: Path, model: nn.Module, blocks: list[EPMoEBlock]) -> CheckpointLayout:
    """Map every tensor of `model` (after the EP swap) to its checkpoint key(s)."""
    family = family_of(model.config)
    keys = _weight_map(path)
    expert_params = {id(p) for b in blocks for p in (b.gate_up_proj_LIH, b.down_proj_LHI)}
    by_param = _names_by_tensor(model)
    names: dict[str, str] = {}
    for tensor_names, t in by_param.values():
        if id(t) in expert_params:
            continue
        # tied weights (lm_head = embed_tokens) are one tensor: load it from whichever name is on disk
        hit = next(
            ((n, k) for n in tensor_names for k in family.checkpoint_names(n) if k in keys), None
        )
        if hit is None:
            raise CheckpointError(f"policy_update: {path} has no tensor for {tensor_names[0]}")
        names[hit[0]] = hit[1]
    block_names = {id(m): n for n, m in model.named_modules()}
    experts = [_expert_keys(family, block_names[id(b)], keys) for b in blocks]
    used = set(names.values())
    for b, k in zip(blocks, experts):
        used |= (
            {k.gate, k.down}
            if k.fused
            else {key for e in range(b.num_experts) for key in k.expert(e)}
        )
    unused = sorted(set(keys) - used)
    if unused:  # from_pretrained's unexpected keys: never trained, never saved; a weight is never dropped silently
        raise CheckpointError(
            f"policy_update: {path} holds {len(unused)} tensors the expert-parallel model has no "
            f"place for ({', '.join(unused[:5])}); the next version would lose them"
        )
    return CheckpointLayout(keys, names, experts)


def _names_by_tensor(model: nn.Module) -> dict[int, tuple[list[str], torch.Tensor]]:
    """Every parameter and persistent buffer, once, with all the names it has (ties)."""
    out: dict[int, tuple[list[str], torch.Tensor]] = {}
    for name, t in model.named_parameters(remove_duplicate=False):
        out.setdefault(id(t), ([], t))[0].append(name)
    for mod_name, module in model.named_modules():
        for leaf, b in module._buffers.items():
            if b is not None and leaf not in module._non_persistent_buffers_set:
                out.setdefault(id(b), ([], b))[0].append(f"{mod_name}.{leaf}" if mod_name else leaf)
    return out


class _Reader:
    """Open safetensors files lazily; read whole tensors or row ranges on the CPU."""

    def __init__(self, path: Path, weight_map: dict[str, str], stack: ExitStack):
        self.path, self.weight_map, self.stack = path, weight_map, stack
        self.open: dict[str, Any] = {}  # file name -> safetensors handle

    def _file(self, key: str):
        from safetensors import safe_open

        fname = self.weight_map.get(key)
        if fname is None:
            raise CheckpointError(f"policy_update: {self.path} has no tensor {key}")
        if fname not in self.open:
            self.open[fname] = self.stack.enter_context(
                safe_open(str(self.path / fname), framework="pt")
            )
        return self.open[fname]

    def get(
        self, key: str, shape: tuple[int, ...], lo: int | None = None, hi: int | None = None
    ) -> torch.Tensor:
        """Tensor `key` (rows [lo, hi) only, when given), checked against the full `shape`."""
        sl = self._file(key).get_slice(key)
        if tuple(sl.get_shape()) != tuple(shape):
            raise CheckpointError(
                f"policy_update: {self.path / self.weight_map[key]}: {key} has shape "
                f"{list(sl.get_shape())}, the model expects {list(shape)}"
            )
        return sl[:] if lo is None else sl[lo:hi]


def _load_experts(block: EPMoEBlock, keys: ExpertKeys, reader: _Reader, dtype, device) -> None:
    n_local, two_i, h = block.gate_up_proj_LIH.shape  # on meta still: shapes only
    lo, e, i = block.first_expert, block.num_experts, two_i // 2
    if keys.fused:
        gu = reader.get(keys.gate, (e, two_i, h), lo, lo + n_local).to(device, dtype)
        dn = reader.get(keys.down, (e, h, i), lo, lo + n_local).to(device, dtype)
    else:
        gu = torch.empty((n_local, two_i, h), dtype=dtype, device=device)
        dn = torch.empty((n_local, h, i), dtype=dtype, device=device)
        for j in range(n_local):  # one expert at a time: only this rank's experts are ever read
            gate, up, down = keys.expert(lo + j)
            gu[j, :i] = reader.get(gate, (i, h))
            gu[j, i:] = reader.get(up, (i, h))
            dn[j] = reader.get(down, (h, i))
    block.experts.gate_up_proj_LIH = nn.Parameter(gu)
    block.experts.down_proj_LHI = nn.Parameter(dn)


def _assign(model: nn.Module, names: list[str], value: torch.Tensor, is_param: bool) -> None:
    param = nn.Parameter(value) if is_param else None
    for name in names:  # every tied name gets the same new tensor
        mod_name, _, leaf = name.rpartition(".")
        module = model.get_submodule(mod_name)
        if param is not None:
            module._parameters[leaf] = param
        else:
            module._buffers[leaf] = value


def _rebuild_rotary(model: nn.Module, device) -> None:
    """Rotary `inv_freq` buffers are computed in __init__, not stored: build them again off meta."""
    for name, module in list(model.named_modules()):
        if "RotaryEmbedding" in type(module).__name__ and any(b.is_meta for b in module.buffers()):
            model.set_submodule(name, type(module)(config=module.config).to(device))
    left = [n for n, t in [*model.named_parameters(), *model.named_buffers()] if t.is_meta]
    if left:
        raise CheckpointError(
            f"policy_update: cannot initialize {', '.join(left[:5])} for expert-parallel loading "
            "(only rotary-embedding buffers are rebuilt)"
        )


def load_ep_model(
    path: str | Path,
    dispatcher,
    dtype: torch.dtype,
    device: str,
    aux_loss_coef: float = 0.0,
    shard=None,
):
    """(model, ep_blocks, layout): the policy at `path` with this rank's experts only.

    `shard(model, blocks)`: shard the model while it is still on `meta` (FSDP2's
    `fully_shard`, `ep_train.apply_fsdp`), then read from the files only the rows of each
    tensor this rank holds (`_load_shards`): no rank ever holds a weight whole. Without it,
    the dense weights are read whole and this rank's experts are read (the unsharded model)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    path = Path(path)
    config = AutoConfig.from_pretrained(path)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
        blocks = parallelize_experts(model, dispatcher, aux_loss_coef)  # meta: allocates nothing
    layout = read_layout(path, model, blocks)
    if shard is not None:
        shard(model, blocks)
        _load_shards(model, blocks, layout, path, device)
        return model, blocks, layout
    by_tensor = _names_by_tensor(model)
    for block, keys in zip(blocks, layout.experts):
        # files are memory-mapped and the pages read count in this rank's RSS until unmapped:
        # reopening per layer keeps that to one layer's experts instead of the whole checkpoint
        with ExitStack() as stack:
            _load_experts(block, keys, _Reader(path, layout.weight_map, stack), dtype, device)
    with ExitStack() as stack:
        reader = _Reader(path, layout.weight_map, stack)
        for tensor_names, t in by_tensor.values():
            name = next((n for n in tensor_names if n in layout.names), None)
            if name is None:
                continue  # an expert slice, loaded above
            value = reader.get(layout.names[name], tuple(t.shape)).to(device, t.dtype)
            _assign(model, tensor_names, value, isinstance(t, nn.Parameter))
    _rebuild_rotary(model, device)
    return model, blocks, layout


def _rows(param: torch.Tensor) -> tuple[int, int]:
    """The rows [lo, hi) of dim 0 that this rank holds of a (possibly FSDP-sharded) parameter."""
    from torch.distributed.tensor import DTensor

    if not isinstance(param, DTensor):
        return 0, param.shape[0] if param.dim() else 0
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    if any(getattr(p, "dim", 0) != 0 for p in param.placements if p.is_shard()):
        raise CheckpointError(
            f"policy_update: a parameter sharded on a dimension other than 0 ({param.placements})"
        )
    shape, offset = compute_local_shape_and_global_offset(
        param.shape, param.device_mesh, param.placements
    )
    return (offset[0], offset[0] + shape[0]) if param.dim() else (0, 0)


def _fill(param: torch.Tensor, value: torch.Tensor) -> None:
    with torch.no_grad():
        local = param.to_local() if hasattr(param, "to_local") else param
        local.copy_(value.reshape(local.shape))


def _load_shards(
    model: nn.Module, blocks, layout: CheckpointLayout, path: Path, device: str
) -> None:
    """Materialize a model sharded on `meta` (`load_ep_model(shard=...)`): each parameter's local
    rows read from the files (an expert tensor's rows offset by the block's first expert),
    persistent buffers read whole (they are not sharded), rotary buffers rebuilt."""
    model.to_empty(device=device)
    experts = {id(b.gate_up_proj_LIH): (b, k, "gate") for b, k in zip(blocks, layout.experts)}
    experts |= {id(b.down_proj_LHI): (b, k, "down") for b, k in zip(blocks, layout.experts)}
    done: set[int] = set()
    with ExitStack() as stack:
        unit: list[str] | None = None
        reader = _Reader(path, layout.weight_map, stack)
        for name, t in [
            *model.named_parameters(remove_duplicate=False),
            *model.named_buffers(remove_duplicate=False),
        ]:
            if id(t) in done:
                continue
            # files reopened per layer: mapped pages count in RSS until unmapped
            if name.split(".")[:3] != unit:
                stack.close()
                reader, unit = _Reader(path, layout.weight_map, stack), name.split(".")[:3]
            if id(t) in experts:
                block, keys, which = experts[id(t)]
                lo, hi = _rows(t)
                _fill(
                    t,
                    _read_experts(
                        block, keys, which, reader, block.first_expert + lo, block.first_expert + hi
                    ),
                )
            elif name in layout.names:
                lo, hi = _rows(t)
                full = tuple(t.shape)
                _fill(
                    t,
                    reader.get(layout.names[name], full, *((lo, hi) if t.dim() else (None, None))),
                )
            else:
                continue  # a non-persistent buffer (rotary), or a tied name loaded under another
            done.add(id(t))
    _rebuild_rotary_in_place(model, device)


def _read_experts(
    block: EPMoEBlock, keys: ExpertKeys, which: str, reader: _Reader, lo: int, hi: int
) -> torch.Tensor:
    """Experts [lo, hi) of one layer's gate_up ([n, 2I, H]) or down ([n, H, I]) tensor."""
    _, two_i, h = block.gate_up_proj_LIH.shape
    e, i = block.num_experts, two_i // 2
    if keys.fused:
        key, shape = (keys.gate, (e, two_i, h)) if which == "gate" else (keys.down, (e, h, i))
        return reader.get(key, shape, lo, hi)
    if which == "down":
        return (
            torch.stack([reader.get(keys.expert(j)[2], (h, i)) for j in range(lo, hi)])
            if hi > lo
            else torch.empty((0, h, i))
        )
    return (
        torch.stack(
            [
                torch.cat([reader.get(key, (i, h)) for key in keys.expert(j)[:2]])
                for j in range(lo, hi)
            ]
        )
        if hi > lo
        else torch.empty((0, two_i, h))
    )


def _rebuild_rotary_in_place(model: nn.Module, device) -> None:
    """Rotary buffers after `to_empty`: computed again and copied in (the module stays, FSDP's)."""
    for module in model.modules():
        if "RotaryEmbedding" in type(module).__name__:
            fresh = type(module)(config=module.config).to(device)
            for leaf, b in fresh._buffers.items():
                if b is not None:
                    module._buffers[leaf] = b


# ------------------------------------------------------------------------------------ save


def _whole(t: torch.Tensor) -> torch.Tensor:
    """A DTensor gathered whole (a collective over its mesh); a plain tensor as is."""
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def gather_experts(block: EPMoEBlock, group=None) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The full [E, 2I, H] and [E, H, I] expert tensors of one layer on rank 0 of the EP
    `group` (None elsewhere). A collective: every rank calls it for the same block. Under FSDP
    each EP rank first gathers its experts from its dp peers."""
    world = dist.get_world_size(group) if dist.is_initialized() else 1
    rank = dist.get_rank(group) if dist.is_initialized() else 0
    out = []
    for local in (block.gate_up_proj_LIH, block.down_proj_LHI):
        t = _whole(local.detach()).contiguous()
        if world == 1:
            out.append(t)
            continue
        full = (
            torch.empty((block.num_experts, *t.shape[1:]), dtype=t.dtype, device=t.device)
            if rank == 0
            else None
        )
        # rank r's rows land in full[r*L:(r+1)*L] directly: no second copy for a torch.cat
        dist.gather(
            t, list(full.chunk(world)) if full is not None else None, group=group, group_dst=0
        )
        if full is not None:
            out.append(full)
    return (out[0], out[1]) if rank == 0 else None


def _expert_tensors(block: EPMoEBlock, keys: ExpertKeys, group=None) -> dict[str, torch.Tensor]:
    full = gather_experts(block, group)
    if full is None or (dist.is_initialized() and dist.get_rank() != 0):
        return {}
    gu, dn = (t.to("cpu") for t in full)
    if keys.fused:
        return {keys.gate: gu.contiguous(), keys.down: dn.contiguous()}
    i = gu.shape[1] // 2
    out: dict[str, torch.Tensor] = {}
    for e in range(gu.shape[0]):  # copies: safetensors refuses tensors that share storage
        gate, up, down = keys.expert(e)
        out[gate] = gu[e, :i].clone()
        out[up] = gu[e, i:].clone()
        out[down] = dn[e].clone()
    return out


def _plan_shards(
    by_name: dict[str, torch.Tensor],
    blocks,
    layout: CheckpointLayout,
    max_shard_bytes: int,
) -> list[list]:
    """Greedy, in order: replicated tensors one by one, then whole MoE layers. The same plan on
    every rank, so the gathers inside happen in the same order everywhere."""
    items: list[tuple[int, object]] = [
        (by_name[n].numel() * by_name[n].element_size(), (n, k)) for n, k in layout.names.items()
    ]
    for b, keys in zip(blocks, layout.experts):
        per_rank = sum(p.numel() * p.element_size() for p in (b.gate_up_proj_LIH, b.down_proj_LHI))
        items.append((per_rank * b.num_experts // b.gate_up_proj_LIH.shape[0], (b, keys)))
    shards: list[list] = [[]]
    size = 0
    for nbytes, item in items:
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(item)
        size += nbytes
    return shards


def _shard_tensors(
    by_name: dict[str, torch.Tensor], shard: list, rank: int, group=None
) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for item in shard:
        if isinstance(item[0], EPMoEBlock):
            block, keys = item
            out.update(_expert_tensors(block, keys, group=group))
            continue
        whole = _whole(by_name[item[0]].detach())  # every rank takes part in the gather of a shard
        if rank == 0:
            out[item[1]] = whole.to("cpu").contiguous()
        del whole
    return out


def save_ep_checkpoint(
    model: nn.Module,
    blocks,
    layout: CheckpointLayout,
    state_in: Path,
    state_out: Path,
    max_shard_bytes: int = DEFAULT_SHARD_BYTES,
    ep_group=None,
    dtype: torch.dtype | None = None,
) -> list[str]:
    """Write the HF checkpoint (weights, config; tokenizer and other files copied from
    `state_in`) into `state_out`, in `dtype` when given (the serving dtype). A collective over
    every rank (`ep_group`: the EP group the experts are split over, default all ranks); rank 0
    writes. Returns the weight files."""
    from safetensors.torch import save_file

    rank = dist.get_rank() if dist.is_initialized() else 0
    by_name = dict(model.state_dict(keep_vars=True))
    shards = _plan_shards(by_name, blocks, layout, max_shard_bytes)
    n = len(shards)
    files = (
        [SINGLE_FILE] if n == 1 else [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]
    )
    weight_map: dict[str, str] = {}
    total = 0
    if rank == 0:
        state_out.mkdir(parents=True, exist_ok=True)
    for fname, shard in zip(files, shards):
        tensors = _shard_tensors(by_name, shard, rank, ep_group)
        if dtype is not None:
            tensors = {k: v.to(dtype) for k, v in tensors.items()}
        if rank == 0:
            save_file(tensors, str(state_out / fname), metadata={"format": "pt"})
            weight_map.update({k: fname for k in tensors})
            total += sum(t.numel() * t.element_size() for t in tensors.values())
        del tensors  # before the next shard's gathers
    if rank == 0:
        if n > 1:
            index = {
                "metadata": {"total_size": total},
                "weight_map": dict(sorted(weight_map.items())),
            }
            (state_out / INDEX_FILE).write_text(json.dumps(index, indent=2))
        for f in state_in.iterdir():  # tokenizer and generation config come along unchanged
            if f.is_file() and not f.name.endswith(".safetensors") and f.name != INDEX_FILE:
                shutil.copy2(f, state_out / f.name)
        config: Any = model.config  # a transformers model's
        config.save_pretrained(state_out)
        if dtype is not None:
            mark_dtype(state_out, str(dtype).removeprefix("torch."))
    return files
