"""The collective weight path, engine side: moerl's weight-transfer backend for vLLM
(`MoerlTransferEngine`, registered as `BACKEND` "moerl" when the worker extension is imported,
selected by `rollout.weight_sync`), and the driver that runs one version's session on a live
engine through vLLM's own lifecycle (`init_weight_transfer_engine`, `start_weight_update`,
`update_weights`, `finish_weight_update`, by name through `collective_rpc`).

Each engine rank joins every trainer rank's group and receives all of them at once (one thread
per group: the trainer ranks interleave their sends with their mesh's gathers, so receiving the
groups one after another would deadlock them), loading through hotswap.load_in_worker, the
file swap's load. A failure drops the groups and raises; the caller loads files instead.
Design and faults: docs/weights.md, "Weights over the wire".
"""

from __future__ import annotations

import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import torch
from vllm.distributed.weight_transfer.base import (
    WeightTransferEngine,
    WeightTransferInitInfo,
    WeightTransferUpdateInfo,
)

from moerl.components.redistribute_weights.wire import (
    GroupAddress,
    Session,
    close_group,
    open_group,
    receive_frames,
    wire_device,
)
from moerl.errors import WeightSyncError

BACKEND = "moerl"
_QUEUE = 64  # tensors in flight between the receiver threads and the loader


@dataclass
class MoerlTransferInit(WeightTransferInitInfo):
    groups: list[dict[str, Any]]  # GroupAddress.as_dict per trainer rank, in trainer rank order
    first_rank: int  # this engine's first rank among the engine ranks of every group
    timeout_s: float = 120.0
    backend: str | None = None  # None: NCCL on cuda, gloo on cpu (wire.open_group)


@dataclass
class MoerlTransferUpdate(WeightTransferUpdateInfo):
    version: int
    sha: str
    epoch: int = 0
    deadline_s: float = 120.0
    inplace: bool = True


@dataclass
class _Last:
    session: Session | None = None
    stats: dict[str, Any] = field(default_factory=dict)


class MoerlTransferEngine(WeightTransferEngine[MoerlTransferInit, MoerlTransferUpdate]):
    init_info_cls = MoerlTransferInit
    update_info_cls = MoerlTransferUpdate
    supports_draft_weight_update = False

    def __init__(self, config, vllm_config, device, model) -> None:
        super().__init__(config, vllm_config, device, model)
        self.groups: list[Any] = []
        self.rank_in_groups = 0
        self.wire_device = device
        self.last = _Last()

    def init_transfer_engine(self, init_info: MoerlTransferInit) -> None:
        self.shutdown()
        pc = self.parallel_config
        per_core = int(pc.world_size)  # tp x pp ranks of one engine core
        dp = int(getattr(pc, "data_parallel_index", 0) or 0)
        self.rank_in_groups = 1 + init_info.first_rank + dp * per_core + int(pc.rank)
        self.wire_device = wire_device(self.device, init_info.backend)
        for g in init_info.groups:
            address = GroupAddress(str(g["host"]), int(g["port"]), int(g["world"]))
            if self.rank_in_groups >= address.world:
                raise WeightSyncError(
                    f"weight transfer: engine rank {self.rank_in_groups} does not fit the group "
                    f"at {address.host}:{address.port} of {address.world}"
                )
            self.groups.append(
                open_group(
                    address,
                    self.rank_in_groups,
                    self.device,
                    init_info.timeout_s,
                    init_info.backend,
                )
            )

    def start_weight_update(self) -> None:
        if not self.groups:
            raise WeightSyncError("weight transfer: update started before the groups were joined")

    def finish_weight_update(self) -> None:
        pass  # the load ends inside update_weights (hotswap.load_in_worker's finish step)

    def update_weights(self, update_info: dict[str, Any]) -> None:
        self.receive_weights(self.parse_update_info(update_info))
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def receive_weights(self, update_info: MoerlTransferUpdate) -> None:
        from vllm.model_executor.model_loader.reload.inplace import reload_weights

        from moerl.components.redistribute_weights.hotswap import RELOAD_LOCK, load_in_worker

        session = Session(update_info.version, update_info.sha, update_info.epoch)
        deadline = time.monotonic() + update_info.deadline_s
        self.last = _Last(session=None)

        def reload(it) -> None:
            reload_weights(
                self.vllm_config,
                self.model,
                weights_iterator=it,
                weights_path=None,
                is_checkpoint_format=True,
            )

        stream = self._merged(session, deadline)

        def tensors(stats: dict[str, int], timers) -> Any:
            for key, t in stream:
                stats["tensors"] += 1
                stats["bytes"] += t.numel() * t.element_size()
                yield key, t

        try:
            if not RELOAD_LOCK.acquire(blocking=False):
                # another engine of this process is loading (in-process engines only: tests and
                # benches): take the version off the wire first, so the trainer's broadcasts,
                # which that engine is also receiving, are never held up by this one
                stream = iter(list(stream))
                RELOAD_LOCK.acquire()
            try:
                stats = load_in_worker(
                    self.model, reload, tensors, None, update_info.inplace, self.model_config
                )
            finally:
                RELOAD_LOCK.release()
        except BaseException:
            self.shutdown()  # the groups' state is unknown: the next session joins afresh
            raise
        stats["buckets"] = 0
        self.last = _Last(session=session, stats=stats)

    def _merged(self, session: Session, deadline: float):
        """Every group's tensors as they arrive, in one stream; raises the first failure."""
        q: queue.Queue = queue.Queue(maxsize=_QUEUE)
        stop = threading.Event()

        def put(item) -> None:
            while not stop.is_set():
                try:
                    q.put(item, timeout=0.5)
                    return
                except queue.Full:
                    if time.monotonic() > deadline:
                        return

        def pump(i: int, pg) -> None:
            try:
                frames = receive_frames(pg, session, self.wire_device, deadline, f"group {i}")
                for item in frames:
                    put(("tensor", item))
                put(("done", i))
            except BaseException as err:  # noqa: BLE001 - handed to the loader's thread
                put(("error", err))

        threads = [
            threading.Thread(target=pump, args=(i, pg), name=f"moerl-recv-{i}", daemon=True)
            for i, pg in enumerate(self.groups)
        ]
        for th in threads:
            th.start()
        out = set(range(len(threads)))
        try:
            while out:
                try:
                    kind, x = q.get(timeout=max(0.001, deadline - time.monotonic()) + 1.0)
                except queue.Empty:
                    raise WeightSyncError(
                        f"weight transfer: version {session.version} not received by its "
                        f"deadline; still waiting on trainer groups {sorted(out)}"
                    ) from None
                if kind == "tensor":
                    yield x
                elif kind == "done":
                    out.discard(x)
                else:
                    raise x
        finally:
            stop.set()

    def report(self) -> dict[str, Any]:
        s = self.last.session
        return {"session": None if s is None else s.tag(), **self.last.stats}

    def shutdown(self) -> None:
        for pg in self.groups:
            close_group(pg)
        self.groups = []


def register() -> None:
    """Register the backend with vLLM's factory (once per process)."""
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

    if BACKEND not in WeightTransferEngineFactory._registry:
        WeightTransferEngineFactory.register_engine(BACKEND, MoerlTransferEngine)


# -- the driver: one engine's side of a session, from the process that holds the engine --------


def ranks_of(core) -> int:
    """Engine ranks of one engine: every (dp, rank) that holds weights."""
    pc = core.vllm_config.parallel_config
    return (
        int(pc.tensor_parallel_size) * int(pc.pipeline_parallel_size) * int(pc.data_parallel_size)
    )


def join(
    core,
    groups: list[GroupAddress],
    first_rank: int,
    timeout_s: float,
    backend: str | None = None,
) -> None:
    """Every rank of the engine joins every trainer rank's group (bounded by `timeout_s`); the
    engines of one session join at once (each call blocks until its groups are formed)."""
    info = {
        "groups": [g.as_dict() for g in groups],
        "first_rank": first_rank,
        "timeout_s": timeout_s,
        "backend": backend,
    }
    try:
        core.collective_rpc("init_weight_transfer_engine", args=(info,))
    except Exception as err:  # noqa: BLE001 - one typed error for the caller's fallback
        raise WeightSyncError(
            f"weight transfer: joining the trainer's groups failed: {err}"
        ) from err


def receive(core, session: Session, deadline_s: float, inplace: bool = True):
    """Run `session` on every rank of the engine through vLLM's weight-transfer API, then check
    what every rank reports (hotswap.check_ranks: each loaded the version, replicas agree).
    Returns hotswap.SwapStats; raises WeightSyncError, the engine's weights then unknown (the
    caller unlabels it and loads the version from files)."""
    from moerl.components.redistribute_weights.hotswap import check_ranks, swap_stats

    t0 = time.perf_counter()
    info = {**session.tag(), "deadline_s": deadline_s, "inplace": inplace}
    try:
        core.collective_rpc("start_weight_update")
        core.collective_rpc("update_weights", args=(info,))
        core.collective_rpc("finish_weight_update")
    except Exception as err:  # noqa: BLE001 - whatever a rank raised, one typed error
        raise WeightSyncError(
            f"weight transfer of version {session.version} failed: {type(err).__name__}: {err}"
        ) from err
    results = core.collective_rpc("moerl_transfer_report", args=(session.version,))
    check_ranks(results, session.version, core.vllm_config.parallel_config, "the wire")
    return swap_stats(results, time.perf_counter() - t0)
