"""The collective weight path, trainer side: each rank of the (dp, ep) mesh sends its share of a
version straight to the engine ranks over its own group (docs/weights.md, "Weights over the
wire"; the engine side is redistribute_weights/collective.py, the wire wire.py).

The share is `ep_export`'s plan (each dense tensor gathered to one owner from its FSDP shards,
each MoE layer's experts from the ranks that hold them), so a rank sends exactly what it would
write to its files, cast to the serving dtype on its device; no rank holds the whole model, and
the groups run at once (one per trainer rank: on the cluster, its own EFA rail).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import torch

from moerl.components.policy_update.ep_export import send_ep_weights
from moerl.components.redistribute_weights.wire import (
    FrameSender,
    GroupAddress,
    Session,
    close_group,
    open_group,
    wire_device,
)
from moerl.errors import WeightSyncError

DEFAULT_BUCKET_BYTES = 256 * 2**20


@dataclass
class SendStats:
    rank: int
    tensors: int
    bytes: int  # payload this rank sent (its share, in the serving dtype)
    frames: int
    received: int  # bytes this rank's gathers received from its mesh peers
    seconds: float
    keys: list[str]


class WeightSender:
    """One trainer rank's group: `join` once (rank 0 of the group: it hosts the rendezvous),
    then `send` every version; `close` aborts the group. A failed send closes the group: the
    next version joins afresh (the engines do the same)."""

    def __init__(
        self,
        address: GroupAddress,
        device: torch.device | str,
        timeout_s: float,
        backend: str | None = None,
    ) -> None:
        self.address = address
        self.device = torch.device(device)
        self.backend = backend
        self.timeout_s = timeout_s
        self.pg: Any = None

    def join(self) -> None:
        self.close()
        self.pg = open_group(self.address, 0, self.device, self.timeout_s, self.backend)

    def send(
        self,
        model,
        blocks,
        layout,
        mesh,
        session: Session,
        dtype: torch.dtype | None,
        bucket_bytes: int = DEFAULT_BUCKET_BYTES,
        deadline_s: float | None = None,
    ) -> SendStats:
        """Send this rank's share of `session`'s version; a collective over `mesh` too (the
        share's gathers), so every trainer rank calls it for every version."""
        if self.pg is None:
            raise WeightSyncError("weight transfer: send before the group was joined")
        t0 = time.perf_counter()
        sink = self._sink(session, dtype, bucket_bytes, deadline_s)
        try:
            info = send_ep_weights(model, blocks, layout, mesh, sink)
            totals = sink.close()
        except BaseException:
            self.close()
            raise
        return _stats(totals, sink.keys, t0, int(info["rank"]), int(info["received"]))

    def send_in_step(
        self,
        model,
        blocks,
        layout,
        mesh,
        session: Session,
        dtype: torch.dtype | None,
        bucket_bytes: int = DEFAULT_BUCKET_BYTES,
        deadline_s: float | None = None,
        keep: list[tuple[str, torch.Tensor]] | None = None,
    ) -> tuple[SendStats | None, str]:
        """`send` that never leaves the mesh's gathers early: a group that failed to form, or
        failed mid-send, stops this rank's writes to it but not its part in the share's
        collectives, so every trainer rank ends the session together (a run's ranks go on to
        the next step). `keep`: the share as sent (serving dtype, host memory) is appended to
        it, whatever the group did, for catch-ups (`send_kept`). Returns (stats, "") or (None,
        why it failed)."""
        if self.pg is None:
            _Discard.send(model, blocks, layout, mesh, keep, dtype)
            return None, "the group did not form"
        t0 = time.perf_counter()
        sink = _Guarded(self._sink(session, dtype, bucket_bytes, deadline_s), keep, dtype)
        info = send_ep_weights(model, blocks, layout, mesh, sink)
        totals = sink.close()
        if sink.error is not None:
            self.close()
            return None, f"{type(sink.error).__name__}: {sink.error}"
        return _stats(totals, sink.sink.keys, t0, int(info["rank"]), int(info["received"])), ""

    def send_kept(
        self,
        session: Session,
        kept: list[tuple[str, torch.Tensor]],
        bucket_bytes: int = DEFAULT_BUCKET_BYTES,
        deadline_s: float | None = None,
    ) -> tuple[SendStats | None, str]:
        """A catch-up: the share this rank kept of an earlier session (`send_in_step`'s
        `keep`), sent as it was; no collective over the mesh. Returns as `send_in_step`."""
        if self.pg is None:
            return None, "the group did not form"
        t0 = time.perf_counter()
        sink = self._sink(session, None, bucket_bytes, deadline_s)
        try:
            for key, t in kept:
                sink.add(key, t)
            totals = sink.close()
        except Exception as err:  # noqa: BLE001 - the catch-up fails, the run goes on
            self.close()
            return None, f"{type(err).__name__}: {err}"
        return _stats(totals, sink.keys, t0, rank=-1, received=0), ""

    def _sink(
        self,
        session: Session,
        dtype: torch.dtype | None,
        bucket_bytes: int,
        deadline_s: float | None,
    ) -> FrameSender:
        """This group's sender for one session, bounded by `deadline_s` (default the timeout)."""
        if self.pg is None:
            raise WeightSyncError("weight transfer: send before the group was joined")
        return FrameSender(
            self.pg,
            session,
            wire_device(self.device, self.backend),
            dtype,
            bucket_bytes,
            time.monotonic() + (deadline_s or self.timeout_s),
        )

    def close(self) -> None:
        if self.pg is not None:
            close_group(self.pg)
            self.pg = None


def _stats(totals: dict[str, int], keys, t0: float, rank: int, received: int) -> SendStats:
    return SendStats(
        rank=rank,
        tensors=totals["tensors"],
        bytes=totals["bytes"],
        frames=totals["frames"],
        received=received,
        seconds=time.perf_counter() - t0,
        keys=sorted(keys),
    )


def _keep(keep: list | None, dtype: torch.dtype | None, key: str, t: torch.Tensor) -> None:
    if keep is not None:  # as the wire sends it: the serving dtype, in host memory
        keep.append((key, t.detach().to("cpu", dtype or t.dtype, copy=True)))


class _Guarded:
    """A FrameSender that keeps its first failure instead of raising it, and drops every write
    after it (the share's gathers go on: `WeightSender.send_in_step`); `keep` gets every
    tensor of the share either way."""

    def __init__(self, sink: FrameSender, keep: list | None, dtype: torch.dtype | None) -> None:
        self.sink = sink
        self.keep, self.dtype = keep, dtype
        self.fallbacks = sink.fallbacks
        self.error: BaseException | None = None

    def add(self, key: str, t: torch.Tensor) -> None:
        _keep(self.keep, self.dtype, key, t)
        if self.error is None:
            try:
                self.sink.add(key, t)
            except Exception as err:  # noqa: BLE001 - kept, reported by send_in_step
                self.error = err

    def close(self) -> dict[str, int]:
        if self.error is None:
            try:
                return self.sink.close()
            except Exception as err:  # noqa: BLE001 - kept, reported by send_in_step
                self.error = err
        return {}


class _Discard:
    """A rank whose group did not form: its part in the share's gathers, nothing written
    (`keep` gets the share still)."""

    def __init__(self, keep: list | None, dtype: torch.dtype | None) -> None:
        self.fallbacks: list[int] = []
        self.keep, self.dtype = keep, dtype

    def add(self, key: str, t: torch.Tensor) -> None:
        _keep(self.keep, self.dtype, key, t)

    @classmethod
    def send(cls, model, blocks, layout, mesh, keep=None, dtype=None) -> None:
        send_ep_weights(model, blocks, layout, mesh, cls(keep, dtype))
