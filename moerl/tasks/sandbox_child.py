"""The child side of the sandboxed pool (moerl/tasks/sandbox.py): `python -m
moerl.tasks.sandbox_child MEMORY_MB PARENT_PID ISOLATION` sets its limits, watches for the pool
to go, and answers one JSON call per line on a private copy of its stdin/stdout. With isolation
`namespaces` it first enters them (`isolation.enter`, run as pid 1 of its pid namespace), and
serves from the process that forks off.

Limitations: see sandbox.py and isolation.py (what the child can still read and reach).
"""

from __future__ import annotations

import json
import os
import sys
import threading
from typing import Any

from moerl.tasks.sandbox import resolve

_NOFILE = 256
_FSIZE = 64 << 20


def _limit(memory_mb: int) -> None:
    import resource

    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    resource.setrlimit(resource.RLIMIT_NOFILE, (_NOFILE, _NOFILE))
    resource.setrlimit(resource.RLIMIT_FSIZE, (_FSIZE, _FSIZE))
    cap = memory_mb << 20
    resource.setrlimit(resource.RLIMIT_AS, (cap, cap))


def _watch_parent(parent: int, proto_fd: int) -> None:
    """Exit once the pool is gone: its end of the protocol pipe closed (the parent pid is 0, not
    comparable, from inside a pid namespace) or, when given, the parent pid changed."""
    import select

    poll = select.poll()
    poll.register(proto_fd, select.POLLHUP)

    def loop() -> None:
        while True:
            hup = any(ev & (select.POLLHUP | select.POLLERR) for _, ev in poll.poll(1000))
            if hup or (parent and os.getppid() != parent):
                os._exit(1)

    threading.Thread(target=loop, name="moerl-sandbox-watchdog", daemon=True).start()


def _serve(memory_mb: int, parent: int) -> None:
    proto_in = os.fdopen(os.dup(0), "rb")
    proto_out = os.fdopen(os.dup(1), "wb")
    devnull = os.open(os.devnull, os.O_RDWR)
    os.dup2(devnull, 0)
    os.dup2(2, 1)  # a verifier's print goes to stderr, never into the protocol
    sys.stdin, sys.stdout = open(os.devnull), sys.stderr
    _watch_parent(parent, proto_in.fileno())
    _limit(memory_mb)
    cache: dict[str, Any] = {}

    def reply(msg: dict) -> None:
        proto_out.write(json.dumps(msg, allow_nan=False).encode() + b"\n")
        proto_out.flush()

    reply({"ready": os.getpid()})
    for line in proto_in:
        req = json.loads(line)
        try:
            fn = cache.get(req["target"]) or cache.setdefault(req["target"], resolve(req["target"]))
            value = fn(*req["args"])
            json.dumps(value, allow_nan=False)  # a reply the pool can read, or an error here
            reply({"id": req["id"], "ok": value})
        except MemoryError:
            reply(
                {
                    "id": req["id"],
                    "err": f"MemoryError: over the sandbox's {memory_mb} MiB",
                    "memory": True,
                }
            )
            os._exit(3)  # the heap may be unusable: the pool starts a fresh child
        except BaseException as err:  # noqa: BLE001 - reported for this call, the child goes on
            reply({"id": req["id"], "err": f"{type(err).__name__}: {err}"})


if __name__ == "__main__":
    if sys.argv[3:] == ["namespaces"]:
        from moerl.tasks import isolation

        isolation.enter(os.getcwd())  # returns in the process that serves, inside the namespaces
    _serve(int(sys.argv[1]), int(sys.argv[2]))
