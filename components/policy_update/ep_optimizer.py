"""The mesh trainer's Adam state: saved and loaded through Distributed Checkpoint, resharded
onto whatever mesh loads it, and the single-process trainer's `optimizer.pt` resharded onto a
mesh (a run that started on one process continues on many).

Dense entries are FSDP's shards as they are. Expert entries are re-expressed as parts of their
whole layer ([E, ...] split into E / ep blocks over ep, each split over dp as FSDP splits
it), so that the checkpoint is the same whatever the mesh.

Limitations: the reverse (a mesh's Distributed Checkpoint back to one process without a
mesh) is not built: a mesh of one rank (`trainer.parallelism.mixed_precision: bf16` with 1 x 1) reads it.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import torch

from moerl.errors import TrainingError

if TYPE_CHECKING:
    from torch.distributed.checkpoint.state_dict import OptimizerStateType

OPTIMIZER_DCP = "optimizer"  # trainer/optimizer/: a Distributed Checkpoint
MODEL_DCP = "model"  # trainer/model/: the master weights, a Distributed Checkpoint
# the ranks' data files of both (their `.metadata` is small and fetched with the version)
STATE_SHARDS = ("trainer/model/__", "trainer/optimizer/__")


def shard_reader(src: Path, fetch: Callable[[str], None] | None):
    """Distributed Checkpoint's reader of the folder `src`; with `fetch`, one that first asks
    `fetch` for each data file this rank's read plan needs (its path under `src`): a rank of a
    resumed mesh downloads only the shards it reads, not every rank's."""
    from torch.distributed.checkpoint import FileSystemReader

    if fetch is None:
        return FileSystemReader(str(src))

    class _Fetching(FileSystemReader):
        def read_data(self, plan, planner):
            needed = {self.storage_data[item.storage_index].relative_path for item in plan.items}
            for rel in sorted(needed):
                fetch(rel)
            return super().read_data(plan, planner)

    return _Fetching(str(src))


def _expert_mesh(mesh):
    """The same ranks as (ep, dp): the layout of one layer's experts, [E, ...] split into E / ep
    blocks over ep, each block split over dp as FSDP splits it."""
    from torch.distributed.device_mesh import DeviceMesh

    return DeviceMesh(mesh.device_type, mesh.mesh.t().contiguous(), mesh_dim_names=("ep", "dp"))


def _global_experts(shard: torch.Tensor, full_shape: tuple[int, ...], emesh):
    """An expert tensor's local shard as part of its layer's whole [E, ...] tensor, so that its
    checkpoint is the same whatever the mesh (Distributed Checkpoint reshards it)."""
    from torch.distributed.tensor import DTensor, Shard

    return DTensor.from_local(
        shard,
        emesh,
        (Shard(0), Shard(0)),
        run_check=False,
        shape=torch.Size(full_shape),
        stride=torch.empty(full_shape, device="meta").stride(),
    )


def _expert_states(model, ep_blocks) -> dict[str, tuple[int, ...]]:
    """Optimizer-state FQN of each expert parameter -> the full [E, ...] shape of its layer."""
    owner = {id(p): b for b in ep_blocks for p in (b.gate_up_proj_LIH, b.down_proj_LHI)}
    return {
        name: (owner[id(p)].num_experts, *p.shape[1:])
        for name, p in model.named_parameters()
        if id(p) in owner
    }


def _param_states(osd: OptimizerStateType) -> dict[str, dict[str, Any]]:
    """`osd["state"]`: each parameter's FQN -> its entries (Adam's step, exp_avg, exp_avg_sq).
    torch types an optimizer state dict's values as the union of every shape any of its keys
    holds; "state" is always this one."""
    return cast(dict[str, dict[str, Any]], osd["state"])


def _to_global(osd: OptimizerStateType, experts: dict[str, tuple[int, ...]], emesh) -> None:
    """Expert entries as parts of their whole layer, each in a new dict: the state dict's
    per-parameter dicts can be the optimizer's own, which a mesh that keeps training after
    saving must not see re-expressed."""
    state = _param_states(osd)
    for fqn, shape in experts.items():
        if fqn in state:
            state[fqn] = dict(state[fqn])
        for k, v in list(state.get(fqn, {}).items()):
            if torch.is_tensor(v) and v.dim() > 0:
                state[fqn][k] = _global_experts(local(v), shape, emesh)


def save_optimizer(model, opt, ep_blocks, mesh, out: Path) -> None:
    """Adam's state through Distributed Checkpoint: dense entries as FSDP's shards, expert
    entries as parts of their whole layer (`_global_experts`). A collective."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    osd = get_optimizer_state_dict(model, opt)
    _to_global(osd, _expert_states(model, ep_blocks), _expert_mesh(mesh))
    dcp.save({"optim": osd}, checkpoint_id=str(out))


def load_optimizer(
    model, opt, ep_blocks, mesh, src: Path, fetch: Callable[[str], None] | None = None
) -> None:
    """The inverse of `save_optimizer`, onto this rank's shards of this mesh. A collective."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        get_optimizer_state_dict,
        set_optimizer_state_dict,
    )
    from torch.distributed.tensor import DTensor

    # initialized by a zero step: the template to load into
    osd = get_optimizer_state_dict(model, opt)
    experts = _expert_states(model, ep_blocks)
    fsdp_form = {
        fqn: {k: v for k, v in _param_states(osd).get(fqn, {}).items() if isinstance(v, DTensor)}
        for fqn in experts
    }
    _to_global(osd, experts, _expert_mesh(mesh))
    try:
        dcp.load({"optim": osd}, storage_reader=shard_reader(src, fetch))
    except Exception as err:  # noqa: BLE001 - a missing or mismatched entry: one line naming it
        raise TrainingError(
            f"policy_update: cannot load the optimizer state in {src}: {type(err).__name__}: "
            f"{str(err)[:500]}"
        ) from None
    state = _param_states(osd)
    for fqn, entries in fsdp_form.items():
        for k, like in entries.items():
            state[fqn][k] = _like(local(state[fqn][k]), like)
    set_optimizer_state_dict(model, opt, osd)


def _experts_to_global(sd: dict[str, Any], experts: dict[str, tuple[int, ...]], emesh) -> dict:
    """Expert entries of a model state dict re-expressed as parts of their whole layer; returns
    each one's FSDP form (the template to put them back in)."""
    fsdp_form = {}
    for fqn, shape in experts.items():
        if fqn in sd:
            fsdp_form[fqn] = sd[fqn]
            sd[fqn] = _global_experts(local(sd[fqn]), shape, emesh)
    return fsdp_form


def save_model_state(model, ep_blocks, mesh, out: Path) -> None:
    """The master weights (and persistent buffers, e.g. a router's bias) through Distributed
    Checkpoint, every rank writing its own shard: dense entries as FSDP's shards, expert entries
    as parts of their whole layer, so that any mesh can load them (`load_model_state`). What a
    resumed mesh reads instead of an HF copy of the master weights: nothing is gathered. A
    collective."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    sd: dict[str, Any] = dict(get_model_state_dict(model))
    _experts_to_global(sd, _expert_states(model, ep_blocks), _expert_mesh(mesh))
    dcp.save({"model": sd}, checkpoint_id=str(out))


def load_model_state(
    model, ep_blocks, mesh, src: Path, fetch: Callable[[str], None] | None = None
) -> None:
    """The inverse of `save_model_state`, onto this rank's shards of this mesh (whatever mesh
    wrote it). A collective."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        set_model_state_dict,
    )

    sd: dict[str, Any] = dict(get_model_state_dict(model))
    fsdp_form = _experts_to_global(sd, _expert_states(model, ep_blocks), _expert_mesh(mesh))
    try:
        dcp.load({"model": sd}, storage_reader=shard_reader(src, fetch))
    except Exception as err:  # noqa: BLE001 - a missing or mismatched entry: one line naming it
        raise TrainingError(
            f"policy_update: cannot load the master weights in {src}: {type(err).__name__}: "
            f"{str(err)[:500]}"
        ) from None
    for fqn, like in fsdp_form.items():
        sd[fqn] = _like(local(sd[fqn]), like)
    set_model_state_dict(model, sd, options=StateDictOptions(strict=True))


def local(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard (a plain tensor as is)."""
    return t.to_local() if hasattr(t, "to_local") else t


def load_unsharded_optimizer(model, opt, ep_blocks, src: Path, state_in: Path) -> None:
    """The single-process trainer's AdamW state (`optimizer.pt`, numbered in the order of the
    transformers model's parameters) onto this rank's shards: each entry sliced to the rows
    this rank holds (an expert entry offset by its block's first expert). A collective (the
    template's zero step)."""
    from torch.distributed.checkpoint.state_dict import (
        get_optimizer_state_dict,
        set_optimizer_state_dict,
    )
    from transformers import AutoConfig, AutoModelForCausalLM

    from moerl.components.policy_update.ep_checkpoint import _rows

    saved = torch.load(src, map_location="cpu", mmap=True, weights_only=True)
    # the numbering AdamW gave the parameters: the unsharded model's order
    with torch.device("meta"):
        names = [
            n
            for n, _ in AutoModelForCausalLM.from_config(
                AutoConfig.from_pretrained(state_in)
            ).named_parameters()
        ]
    numbered = [i for g in saved["param_groups"] for i in g["params"]]
    if len(numbered) != len(names):
        raise TrainingError(
            f"policy_update: {src} holds state for {len(numbered)} parameters, the model has "
            f"{len(names)}; it was not written for this checkpoint"
        )
    full = {names[i]: saved["state"][i] for i in numbered if i in saved["state"]}
    first = {
        id(p): b.first_expert for b in ep_blocks for p in (b.gate_up_proj_LIH, b.down_proj_LHI)
    }
    first_by_name = {n: first[id(p)] for n, p in model.named_parameters() if id(p) in first}
    osd = get_optimizer_state_dict(model, opt)  # initialized by a zero step: the template to fill
    for fqn, entries in _param_states(osd).items():
        name = fqn.replace(".gate_up_proj_LIH", ".gate_up_proj").replace(
            ".down_proj_LHI", ".down_proj"
        )
        if name not in full:
            raise TrainingError(f"policy_update: {src} has no optimizer state for {name}")
        for k, like in entries.items():
            value = full[name][k]
            if not torch.is_tensor(like) or like.dim() == 0:
                entries[k] = value.clone() if torch.is_tensor(value) else value
                continue
            lo, hi = _rows(like)
            offset = first_by_name.get(fqn, 0)
            rows = value[offset + lo : offset + hi].to(like.device, like.dtype).contiguous()
            entries[k] = _like(rows, like)
    set_optimizer_state_dict(model, opt, osd)


def _like(rows: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """`rows` as this rank's part of a tensor shaped and placed like `like`."""
    from torch.distributed.tensor import DTensor

    if not isinstance(like, DTensor):
        return rows
    return DTensor.from_local(
        rows,
        like.device_mesh,
        like.placements,
        run_check=False,
        shape=like.shape,
        stride=like.stride(),
    )
