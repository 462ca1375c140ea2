"""The collective weight path's wire: one policy version, sent by each trainer rank over its own
group to every engine rank, as frames (design: docs/weights.md, "Weights over the wire").

A group is a stateless process group (NCCL on cuda, gloo on cpu) of one trainer rank, at group
rank 0, and every engine rank. A frame is two broadcasts from rank 0: `meta` (int64 [kind,
header bytes, payload bytes]) and one uint8 buffer, the JSON header (the session and each
tensor's key, dtype and shape) then the tensors, each at a multiple of `ALIGN`. END carries the
totals the receiver checks. A frame of another session is refused; every operation has a
deadline, so a sender killed mid-version fails its receivers within it.
"""

from __future__ import annotations

import json
import socket
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch

from moerl.errors import WeightSyncError

BUCKET, END = 1, 2
ALIGN = 16  # the header and every tensor start at a multiple of this in a frame's buffer
DTYPES = {
    str(d).removeprefix("torch."): d
    for d in (torch.float32, torch.bfloat16, torch.float16, torch.float8_e4m3fn, torch.int64)
}


@dataclass(frozen=True)
class Session:
    """One version's transfer: what every frame must name. `epoch` is the trainer's fence
    (moerl/store/fence.py): a frame of an older trainer is refused."""

    version: int
    sha: str
    epoch: int = 0

    def tag(self) -> dict[str, Any]:
        return {"version": self.version, "sha": self.sha, "epoch": self.epoch}


@dataclass(frozen=True)
class GroupAddress:
    """Where group members meet: the trainer rank listens (TCPStore) at host:port."""

    host: str
    port: int
    world: int  # 1 trainer rank + the engine ranks

    def as_dict(self) -> dict[str, Any]:
        return {"host": self.host, "port": self.port, "world": self.world}


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def backend_for(device: torch.device | str) -> str:
    return "nccl" if torch.device(device).type == "cuda" else "gloo"


def wire_device(device: torch.device | str, backend: str | None) -> torch.device:
    """Where a group's buffers live: the device for NCCL, the host for gloo (which a CUDA rank
    may use by asking for it: a trainer and an engine sharing one GPU, as on a one-GPU check)."""
    device = torch.device(device)
    return device if (backend or backend_for(device)) == "nccl" else torch.device("cpu")


def open_group(
    address: GroupAddress,
    rank: int,
    device: torch.device | str,
    timeout_s: float,
    backend: str | None = None,
):
    """Join the group at `address` as `rank` (0: the trainer rank, which hosts the rendezvous),
    over `backend` (default: NCCL on cuda, gloo on cpu; every member must ask for the same).
    Bounded: a member that never comes fails every other within `timeout_s`."""
    from vllm.distributed.utils import stateless_init_torch_distributed_process_group

    try:
        return stateless_init_torch_distributed_process_group(
            address.host,
            address.port,
            rank,
            address.world,
            backend or backend_for(device),
            timeout=timedelta(seconds=timeout_s),
        )
    except Exception as err:  # noqa: BLE001 - one typed error naming the group
        raise WeightSyncError(
            f"weight transfer: joining the group at {address.host}:{address.port} as rank "
            f"{rank} of {address.world} failed within {timeout_s:.0f} s: {err}"
        ) from err


def close_group(pg) -> None:
    """Abort the group's communicator (NCCL: frees a peer stuck in a collective), then drop it."""
    for fn in ("abort", "shutdown"):
        call = getattr(pg, fn, None)
        if callable(call):
            try:
                call()
            except Exception:  # noqa: BLE001, S110 - best effort: the group is being dropped
                pass
            return


def _bcast(pg, t: torch.Tensor, timeout_s: float) -> None:
    pg.broadcast(t, 0, timeout=timedelta(seconds=max(timeout_s, 0.001))).wait()


@dataclass
class FrameSender:
    """A trainer rank's end of one group for one session: `add` tensors (cast to `dtype`),
    sent a bucket at a time once the next would pass `max_bytes`; `close` sends END. The
    `add`/`fallbacks` surface is ep_export's sink, so the export's plan decides what each rank
    sends, exactly what it would write to its files."""

    pg: Any
    session: Session
    device: torch.device
    dtype: torch.dtype | None
    max_bytes: int
    deadline: float  # time.monotonic() by which the session must be sent
    pending: list[tuple[str, torch.Tensor]] = field(default_factory=list)
    pending_bytes: int = 0
    sent_bytes: int = 0  # payload bytes (the tensors), what the counters compare
    sent_tensors: int = 0
    frames: int = 0
    keys: set[str] = field(default_factory=set)
    fallbacks: list[int] = field(default_factory=list)

    def add(self, key: str, t: torch.Tensor) -> None:
        t = t.detach().to(self.device)
        if self.dtype is not None:
            t = t.to(self.dtype)
        if key in self.keys:
            raise WeightSyncError(f"weight transfer: {key} sent twice (a moerl bug)")
        self.keys.add(key)
        n = t.numel() * t.element_size()
        if self.pending and self.pending_bytes + n > self.max_bytes:
            self.flush()
        self.pending.append((key, t.contiguous()))
        self.pending_bytes += n

    def _frame(self, kind: int, header: dict[str, Any], payload: torch.Tensor | None) -> None:
        left = self.deadline - time.monotonic()
        if left <= 0:
            raise WeightSyncError(
                f"weight transfer: version {self.session.version} passed its deadline while "
                f"sending (frame {self.frames})"
            )
        raw = json.dumps(header).encode()
        raw += b" " * (-len(raw) % ALIGN)  # JSON ignores the trailing blanks
        head = torch.frombuffer(bytearray(raw), dtype=torch.uint8)
        n_pay = 0 if payload is None else payload.numel()
        meta = torch.tensor([kind, head.numel(), n_pay], dtype=torch.int64, device=self.device)
        buf = (
            head.to(self.device) if payload is None else torch.cat([head.to(self.device), payload])
        )
        try:
            _bcast(self.pg, meta, left)
            _bcast(self.pg, buf, self.deadline - time.monotonic())
        except Exception as err:  # noqa: BLE001 - the peers' failure, typed and named
            raise WeightSyncError(
                f"weight transfer: sending version {self.session.version} failed at frame "
                f"{self.frames}: {err}"
            ) from err
        self.frames += 1

    def flush(self) -> None:
        if not self.pending:
            return
        header = {
            **self.session.tag(),
            "tensors": [
                [k, str(t.dtype).removeprefix("torch."), list(t.shape)] for k, t in self.pending
            ],
        }
        parts = []
        for _, t in self.pending:
            b = t.reshape(-1).view(torch.uint8)
            parts.append(b)
            if b.numel() % ALIGN:
                parts.append(b.new_zeros(-b.numel() % ALIGN))
        payload = torch.cat(parts)
        self._frame(BUCKET, header, payload)
        self.sent_bytes += self.pending_bytes
        self.sent_tensors += len(self.pending)
        self.pending, self.pending_bytes = [], 0

    def close(self) -> dict[str, int]:
        """Send what is pending, then END with the totals; returns them."""
        self.flush()
        totals = {"tensors": self.sent_tensors, "bytes": self.sent_bytes}
        self._frame(END, {**self.session.tag(), **totals}, None)
        return {**totals, "frames": self.frames}


def receive_frames(
    pg, session: Session, device: torch.device, deadline: float, where: str
) -> Iterator[tuple[str, torch.Tensor]]:
    """An engine rank's end of one group: every tensor the sender sends for `session`, as views
    of the received buffer; checks END's totals. Raises WeightSyncError naming `where` (the group)
    on a timeout, a lost peer, a frame of another session or totals that do not match."""
    got_tensors = got_bytes = 0
    while True:
        meta = torch.empty(3, dtype=torch.int64, device=device)
        try:
            _bcast(pg, meta, deadline - time.monotonic())
            kind, n_head, n_pay = (int(x) for x in meta.tolist())
            buf = torch.empty(n_head + n_pay, dtype=torch.uint8, device=device)
            _bcast(pg, buf, deadline - time.monotonic())
        except Exception as err:  # noqa: BLE001 - typed, naming the group
            raise WeightSyncError(
                f"weight transfer: {where}: receiving version {session.version} failed after "
                f"{got_tensors} tensors: {err}"
            ) from err
        header = json.loads(bytes(buf[:n_head].cpu().numpy()).decode())
        theirs = Session(int(header["version"]), str(header["sha"]), int(header["epoch"]))
        if theirs != session:
            raise WeightSyncError(
                f"weight transfer: {where}: a frame of {theirs} arrived in the session of "
                f"{session} (a stale or replaced trainer); refused"
            )
        if kind == END:
            if (int(header["tensors"]), int(header["bytes"])) != (got_tensors, got_bytes):
                raise WeightSyncError(
                    f"weight transfer: {where}: the sender sent {header['tensors']} tensors, "
                    f"{header['bytes']} bytes; {got_tensors} tensors, {got_bytes} bytes arrived"
                )
            return
        if kind != BUCKET:
            raise WeightSyncError(f"weight transfer: {where}: unknown frame kind {kind}")
        offset = n_head
        for key, dtype, shape in header["tensors"]:
            dt = DTYPES.get(dtype)
            if dt is None:
                raise WeightSyncError(
                    f"weight transfer: {where}: {key} has dtype {dtype}; allowed: "
                    f"{', '.join(DTYPES)}"
                )
            n = dt.itemsize
            for s in shape:
                n *= int(s)
            yield key, buf[offset : offset + n].view(dt).view(tuple(shape))
            offset += n + (-n % ALIGN)
            got_tensors += 1
            got_bytes += n
