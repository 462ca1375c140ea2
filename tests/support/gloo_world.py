"""One gloo world per world size, kept for the test session: its ranks are spawned and joined
once, then given jobs, so the comparison modules (tests/trainer/test_ep_*.py, tests/kernels/)
do not each pay for spawning ranks, importing torch and transformers in them, and a rendezvous.

A job is a module-level function `fn(rank, world_size, *args)` run on every rank inside the
default process group (the ranks call `init_process_group`; a job never does). Each job ends in
a barrier, so no job's collectives mix with the next one's. Every wait is bounded: a job that
does not finish in `timeout_s`, or a rank that dies, fails the call naming the job and the ranks
still out, and the world is torn down (the next `world(n)` spawns a fresh one). A job that
raises on some rank fails the call with that rank's traceback; its peers' collectives time out
within the process group's timeout, so the world is torn down then too.

The fixture (`gloo_worlds`, registered in tests/conftest.py) is per pytest-xdist worker: each
module that uses it runs on whichever worker takes it and reuses that worker's worlds (grouping
the modules on one worker would serialize them: measured, the longer wait).
"""

from __future__ import annotations

import importlib
import multiprocessing as mp
import os
import queue
import tempfile
import time
import traceback
from collections.abc import Callable, Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest

GROUP = "gloo-worlds"  # a TEST_GROUP for modules that must share one worker's worlds
JOB_TIMEOUT_S = 600.0
PG_TIMEOUT_S = 120  # a collective left waiting by a failed peer gives up after this


def _rank_main(rank: int, size: int, rendezvous: str, jobs: Any, results: Any) -> None:
    import torch.distributed as dist

    os.environ["GLOO_SOCKET_IFNAME"] = "lo"  # loopback only
    dist.init_process_group(
        "gloo",
        init_method=f"file://{rendezvous}",
        rank=rank,
        world_size=size,
        timeout=timedelta(seconds=PG_TIMEOUT_S),
    )
    try:
        while (job := jobs.get()) is not None:
            module, name, args = job
            try:
                out = getattr(importlib.import_module(module), name)(rank, size, *args)
                dist.barrier()
                results.put((rank, True, out))
            except BaseException:  # noqa: BLE001 - reported to the test with its traceback
                results.put((rank, False, traceback.format_exc()))
    finally:
        dist.destroy_process_group()


class GlooWorld:
    """`size` ranks in one gloo process group; `run(fn, *args)` runs a job on every rank."""

    def __init__(self, size: int) -> None:
        ctx = mp.get_context("spawn")
        self.size = size
        self._dir = tempfile.TemporaryDirectory(prefix=f"gloo-world-{size}-")
        rendezvous = str(Path(self._dir.name) / "rendezvous")
        self._results = ctx.Queue()
        self._jobs = [ctx.Queue() for _ in range(size)]
        self._procs = [
            ctx.Process(
                target=_rank_main,
                args=(r, size, rendezvous, self._jobs[r], self._results),
                name=f"gloo-world-{size}-rank{r}",
                daemon=True,
            )
            for r in range(size)
        ]
        for p in self._procs:
            p.start()
        self.broken = False

    def run(
        self, fn: Callable[..., Any], *args: Any, timeout_s: float = JOB_TIMEOUT_S
    ) -> list[Any]:
        """fn(rank, size, *args) on every rank; returns what each rank returned, by rank."""
        what = f"{fn.__module__}.{fn.__qualname__} on a {self.size}-rank gloo world"
        if self.broken:
            raise RuntimeError(f"{what}: the world was torn down by an earlier failure")
        for q in self._jobs:
            q.put((fn.__module__, fn.__qualname__, args))
        got: dict[int, Any] = {}
        errors: list[str] = []
        deadline = time.monotonic() + timeout_s
        while len(got) + len(errors) < self.size:
            try:
                rank, ok, out = self._results.get(timeout=1.0)
            except queue.Empty:
                dead = [p.name for p in self._procs if not p.is_alive()]
                late = time.monotonic() > deadline
                if dead or late:
                    self.close()
                    out_ranks = sorted(set(range(self.size)) - set(got))
                    why = f"ranks {dead} died" if dead else f"not done in {timeout_s:.0f} s"
                    raise RuntimeError(f"{what}: {why}; waiting on ranks {out_ranks}") from None
                continue
            if ok:
                got[rank] = out
            else:
                errors.append(f"rank {rank}:\n{out}")
        if errors:
            self.close()
            raise RuntimeError(f"{what} failed:\n" + "\n".join(errors))
        return [got[r] for r in range(self.size)]

    def close(self) -> None:
        self.broken = True
        for q in self._jobs:
            q.put(None)
        for p in self._procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
                p.join(timeout=10)
        self._dir.cleanup()


class GlooWorlds:
    """The session's worlds, by size; a torn-down world is replaced on the next request."""

    def __init__(self) -> None:
        self._worlds: dict[int, GlooWorld] = {}

    def __call__(self, size: int) -> GlooWorld:
        w = self._worlds.get(size)
        if w is None or w.broken:
            w = self._worlds[size] = GlooWorld(size)
        return w

    def close(self) -> None:
        for w in self._worlds.values():
            if not w.broken:
                w.close()
        self._worlds.clear()


@pytest.fixture(scope="session")
def gloo_worlds() -> Iterator[GlooWorlds]:
    worlds = GlooWorlds()
    try:
        yield worlds
    finally:
        worlds.close()
