"""Worker body for the persistent-mesh equivalence test (torch.multiprocessing spawn): one rank
that trains the same batches twice from the same start, as the async trainer's mesh does (one
`Session` for every version, nothing reloaded) and as the restarting path does (a new
`Session` loaded from the previous version's files each time), writing both series' versions."""

from __future__ import annotations

import os
from pathlib import Path


def mesh_cfg(dp: int, ep: int):
    """The (dp, ep) mesh config the persistent-mesh workers and the mesh tests train with."""
    from moerl.config import parse_config

    return parse_config(
        {
            "trainer": {
                "optimizer": {"optimizer_steps_per_iteration": 2, "learning_rate": 0.003},
                "parallelism": {
                    "micro_batch_tokens": 24,
                    "expert_parallel_size": ep,
                    "data_parallel_shard": dp,
                },
            }
        }
    )


def rank(rank, world, dp, ep, start, out_dir, batches):
    # a job of tests/support/gloo_world.py: the world's process group is already up
    from moerl.components.policy_update.ep_train import Session, run_version

    cfg = mesh_cfg(dp, ep)
    out = Path(out_dir)
    kept = Session.load(cfg, Path(start))
    for v, batch in enumerate(batches):
        run_version(cfg, kept, batch, v, out / "persistent" / f"v{v + 1}")
    prev = Path(start)
    for v, batch in enumerate(batches):
        fresh = Session.load(cfg, prev)
        prev = out / "restart" / f"v{v + 1}"
        run_version(cfg, fresh, batch, v, prev)


def lazy_rank(rank, world, dp, ep, full, partial, out_dir, batch):
    """Load a version laid out without its state shards, fetching (from `full`, as a rank
    fetches from the store) only the shards this rank's reads need, then train one version."""
    # a job of tests/support/gloo_world.py: the world's process group is already up
    import json
    import shutil
    import uuid

    from moerl.components.policy_update.ep_train import Session, run_version

    cfg = mesh_cfg(dp, ep)
    fetched: list[str] = []

    def fetch(rel: str) -> None:
        fetched.append(rel)
        dest = Path(partial) / rel
        tmp = dest.with_name(f".{dest.name}.{uuid.uuid4().hex[:6]}")
        shutil.copyfile(Path(full) / rel, tmp)
        os.replace(tmp, dest)

    session = Session.load(cfg, Path(partial), fetch)
    run_version(cfg, session, batch, 2, Path(out_dir) / "lazy-v3")
    (Path(out_dir) / f"fetched{rank}.json").write_text(json.dumps(fetched))
