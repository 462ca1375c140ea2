"""One `SandboxPool.run` (moerl/tasks/sandbox.py): hand calls to fresh processes through the
pool's template, at most `workers` at once (an episode's calls in order, in its own process),
read each reply off the call's own socket and check it is that call's (one line, its id),
enforce each call's deadline, and turn the template's reports into outcomes.

Design, details and limitations: docs/tasks.md#moerltaskssandboxpy.
"""

from __future__ import annotations

import json
import selectors
import signal
import socket
import time
from typing import TYPE_CHECKING

from moerl.tasks.sandbox import MAX_REPLY_BYTES, WARM_FIRST_ARG, Kind, Limits, Outcome

if TYPE_CHECKING:
    from moerl.tasks.sandbox import SandboxPool, _Template


class Proc:
    """One call's process (or one episode's): the pool's end of its socket."""

    def __init__(self, handle: int, sock: socket.socket, key: str | None):
        self.handle, self.sock, self.key = handle, sock, key
        self.buf = b""
        self.lines: list[bytes] = []
        self.eof = False
        self.exit: dict | None = None  # the template's report of its end
        self.call: int | None = None  # the index of the call it runs
        self.seq = 0  # that call's id
        self.deadline = 0.0
        self.forked = False  # the template said it forked the process

    def read(self) -> None:
        try:
            chunk = self.sock.recv(65536)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            chunk = b""
        if not chunk:
            self.eof = True
            return
        self.buf += chunk
        *lines, self.buf = self.buf.split(b"\n")
        self.lines += lines
        if len(self.buf) > MAX_REPLY_BYTES:
            raise ValueError(f"reply over {MAX_REPLY_BYTES} bytes")


class Run:
    """One `SandboxPool.run`: dispatch, select, deadlines."""

    def __init__(self, pool: SandboxPool, calls: list[tuple[str, list]], keys: list[str | None]):
        self.pool, self.calls, self.keys = pool, calls, keys
        self.out: list[Outcome | None] = [None] * len(calls)
        self.todo = list(range(len(calls)))
        self.busy: dict[int, Proc] = {}  # fd -> process running a call
        self.n = max(1, min(pool.limits.workers, len(calls)))
        self.sel = selectors.DefaultSelector()

    def go(self) -> list[Outcome]:
        t = self.pool._ensure()
        self.sel.register(t.ctl.fileno(), selectors.EVENT_READ)
        try:
            while self.todo or self.busy:
                while self.todo and len(self.busy) < self.n and self._dispatch():
                    pass
                if self.busy:
                    self._wait()
        finally:
            for p in list(self.busy.values()):  # interrupted: nothing half-done is kept
                self._drop(p, kill=True)
            self.sel.close()
        return self.out  # type: ignore[return-value]

    def _dispatch(self) -> bool:
        ahead: set[str] = set()
        for pos, i in enumerate(self.todo):
            key = self.keys[i]
            if key is not None and (key in ahead or self._running(key)):
                ahead.add(key)
                continue
            del self.todo[pos]
            self._start(i, key)
            return True
        return False

    def _running(self, key: str) -> bool:
        p = self.pool.procs.get(key)
        return p is not None and p.call is not None

    def _start(self, i: int, key: str | None) -> None:
        pool, (target, args) = self.pool, self.calls[i]
        t = pool.template
        assert t is not None
        p = pool.procs.get(key) if key is not None else None
        try:
            if p is None:
                mine, theirs = socket.socketpair()
                p = Proc(next(pool._handles), mine, key)
                imports = [target] + ([args[0]] if target in WARM_FIRST_ARG and args else [])
                try:
                    msg = {"fork": p.handle, "keep": key is not None, "imports": imports}
                    t.send(msg, theirs.fileno())
                finally:
                    theirs.close()  # the template holds its own copy now
                if key is not None:
                    pool.procs[key] = p
            p.call, p.seq = i, next(pool._seq)
            p.deadline = time.monotonic() + pool.limits.timeout_s
            p.sock.settimeout(pool.limits.timeout_s)
            p.sock.sendall(
                json.dumps({"id": p.seq, "target": target, "args": args}).encode() + b"\n"
            )
            p.sock.setblocking(False)
        except OSError as err:
            assert p is not None
            self.out[i] = Outcome("crashed", error=f"crashed: the call could not be sent ({err})")
            self._drop(p, kill=True)
            return
        self.busy[p.sock.fileno()] = p
        self.sel.register(p.sock.fileno(), selectors.EVENT_READ)

    def _wait(self) -> None:
        wait = max(0.0, min(p.deadline for p in self.busy.values()) - time.monotonic())
        t = self.pool.template
        for sk, _ in self.sel.select(wait):
            if t is not None and sk.fd == t.ctl.fileno():
                self._control(t)
                continue
            p = self.busy.get(sk.fd)
            if p is None:
                continue
            try:
                p.read()
            except ValueError as err:
                self._finish(
                    p, Outcome("crashed", error=f"crashed: its reply was {err}"), kill=True
                )
                continue
            self._settle(p)
        now = time.monotonic()
        wedged = False
        for p in list(self.busy.values()):
            if now >= p.deadline:
                wedged = wedged or not p.forked
                self._finish(
                    p,
                    Outcome(
                        "timeout",
                        error=f"timeout: the call took longer than "
                        f"{self.pool.limits.timeout_s:g} s and was killed",
                    ),
                    kill=True,
                )
        if wedged:  # the template never forked a call (an import in it that does not return)
            self._template_lost("the sandbox's template did not start the call within its time")

    def _template_lost(self, why: str) -> None:
        """Every call on the template fails; the next call starts another."""
        t = self.pool.template
        if t is not None:
            self.sel.unregister(t.ctl.fileno())
        for p in list(self.busy.values()):
            self._finish(p, Outcome("crashed", error=f"crashed: {why}"))
        self.pool._lost_template()
        if self.todo:
            self.sel.register(self.pool._ensure().ctl.fileno(), selectors.EVENT_READ)

    def _control(self, t: _Template) -> None:
        """The template's reports: a call's end (or the template's own)."""
        while True:
            try:
                msg = t.ctl.recv(65536)
            except (BlockingIOError, InterruptedError):
                return
            except OSError:
                msg = b""
            if not msg:
                return self._template_lost(f"the sandbox's template process died ({t.died()})")
            end = json.loads(msg)
            if "forked" in end:
                for p in [*self.busy.values(), *self.pool.procs.values()]:
                    if p.handle == end["forked"]:
                        p.forked = True
                continue
            for p in self.busy.values():
                if p.handle == end.get("exit"):
                    p.exit = end
                    self._settle(p)
                    break

    def _settle(self, p: Proc) -> None:
        """Decide p's call if what came back is enough: one line with its id (an episode's
        process, at once; a call's own, once all its processes are gone: end of file)."""
        if p.lines and not self._ours(p):
            self.pool.forged_replies += 1
            return self._finish(
                p,
                Outcome(
                    "crashed",
                    error=f"forged: the call's process sent {len(p.lines)} lines or "
                    f"another call's id ({p.lines[0][:120]!r}); killed",
                ),
                kill=True,
            )
        if p.key is not None and p.lines:
            return self._finish(p, _outcome(p.lines[0]))
        if not p.eof and p.exit is None:
            return
        # without namespaces a call's leftovers may hold its socket: its own end is enough
        if p.lines and (p.eof or (p.exit is not None and self.pool.limits.isolation == "none")):
            return self._finish(p, _outcome(p.lines[0]))
        if p.exit is not None and p.eof:
            return self._finish(p, _ended(p.exit, self.pool.limits))
        if p.exit is not None and p.key is not None:
            return self._finish(p, _ended(p.exit, self.pool.limits))

    def _ours(self, p: Proc) -> bool:
        if len(p.lines) > 1:
            return False
        try:
            return json.loads(p.lines[0]).get("id") == p.seq
        except (ValueError, AttributeError):
            return False

    def _finish(self, p: Proc, o: Outcome, kill: bool = False) -> None:
        assert p.call is not None
        self.out[p.call] = o
        self._drop(p, kill=kill or o.kind in ("memory", "crashed") or p.key is None)

    def _drop(self, p: Proc, kill: bool) -> None:
        """p's call is over; its process goes too unless it is an episode's that lives on."""
        fd = p.sock.fileno()
        if fd in self.busy:
            del self.busy[fd]
            self.sel.unregister(fd)
        p.call, p.lines = None, []
        if not kill and p.key is not None:
            return
        t = self.pool.template
        if t is not None and not p.eof:
            try:
                t.send({"kill": p.handle})
            except OSError:
                pass
        p.sock.close()
        if p.key is not None and self.pool.procs.get(p.key) is p:
            del self.pool.procs[p.key]  # a later call with the key gets a fresh process


def _outcome(line: bytes) -> Outcome:
    try:
        msg = json.loads(line)
    except ValueError:
        return Outcome("crashed", error=f"crashed: unreadable reply {line[:200]!r}")
    if "ok" in msg:
        return Outcome("ok", value=msg["ok"])
    kind: Kind = "memory" if msg.get("memory") else "error"
    prefix = "memory: " if kind == "memory" else ""
    return Outcome(kind, error=prefix + str(msg.get("err", "unknown error"))[:2000])


def _ended(end: dict, limits: Limits) -> Outcome:
    if end.get("memory"):
        return Outcome(
            "memory",
            error=f"memory: the call's processes held over the sandbox's {limits.memory_mb} MiB "
            "together and were killed",
        )
    if end.get("signal"):
        try:
            name = signal.Signals(end["signal"]).name
        except ValueError:
            name = str(end["signal"])
        return Outcome("crashed", error=f"crashed: the sandboxed process died (signal {name})")
    return Outcome(
        "crashed", error=f"crashed: the sandboxed process died (exit code {end.get('code')})"
    )
