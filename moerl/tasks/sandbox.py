"""The sandboxed execution pool: verifiers (and, later, environments) run in child processes
with a wall-clock limit per call, a memory limit, no credentials and a scratch directory of
their own, so that a verifier that hangs, spins, allocates without bound or crashes costs one
sample, never the stage or the run.

Design, details and limitations: docs/tasks.md#moerltaskssandboxpy.
"""

from __future__ import annotations

import itertools
import json
import os
import selectors
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from typing import Any, Literal

from moerl.tasks import isolation as iso

# Variables a child keeps from the parent's environment; everything else is dropped.
ENV_ALLOW = ("PATH", "LANG", "LC_ALL", "LC_CTYPE", "TZ", "SYSTEMROOT")
MAX_REPLY_BYTES = 1 << 20  # one call's JSON answer
START_TIMEOUT_S = 60.0  # a child's interpreter start, on a loaded 2-core machine

Kind = Literal["ok", "error", "timeout", "memory", "crashed"]


@dataclass(frozen=True)
class Limits:
    """What one call may use: `timeout_s` of wall-clock time, `memory_mb` resident over all its
    processes (and of address space in each), `pids` processes and threads, `scratch_mb` of
    files; `workers` calls run at once."""

    timeout_s: float = 10.0
    memory_mb: int = 2048
    workers: int = 1
    isolation: str = "namespaces"  # or "none" (moerl/tasks/isolation.py)
    pids: int = 64
    scratch_mb: int = 64


@dataclass(frozen=True)
class Outcome:
    kind: Kind
    value: Any = None
    error: str = ""

    @property
    def ok(self) -> bool:
        return self.kind == "ok"


class SandboxError(RuntimeError):
    """The pool itself cannot work (a child that does not start)."""


def child_env(scratch: str) -> dict[str, str]:
    """The environment a child gets: the allow-list, the parent's import path (what this
    process can import, the child can: an installed package, or a module on PYTHONPATH), its scratch
    directory as HOME and TMPDIR, and one thread per numeric library."""
    env = {k: os.environ[k] for k in ENV_ALLOW if k in os.environ}
    from moerl.secrets import secret_dirs
    from moerl.tasks.isolation import HIDE_ENV

    env.update(
        {
            # the stage's credential files' directories: an isolated child mounts them away
            HIDE_ENV: os.pathsep.join(secret_dirs()),
            # '' is the caller's cwd
            "PYTHONPATH": os.pathsep.join(p or os.getcwd() for p in sys.path),
            "HOME": scratch,
            "TMPDIR": scratch,
            "OMP_NUM_THREADS": "1",
            "OPENBLAS_NUM_THREADS": "1",
            "MKL_NUM_THREADS": "1",
            "PYTHONUNBUFFERED": "1",
        }
    )
    return env


class _Template:
    """The pool's template process (moerl/tasks/sandbox_child.py) and its control socket."""

    def __init__(self, limits: Limits):
        self.scratch = tempfile.mkdtemp(prefix="moerl-sandbox-")
        self.isolated = limits.isolation != "none"
        lim = {
            "memory_mb": limits.memory_mb,
            "pids": limits.pids,
            "scratch_mb": limits.scratch_mb,
            "isolation": limits.isolation,
        }
        mine, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self.proc = subprocess.Popen(
            iso.command(limits.isolation)
            + [sys.executable, "-m", "moerl.tasks.sandbox_child", json.dumps(lim)],
            stdin=theirs,
            stdout=theirs,
            env=child_env(self.scratch),
            cwd=self.scratch,
            close_fds=True,
        )
        theirs.close()
        self.ctl = mine
        self.enforced = ""

    def start(self) -> None:
        if self.isolated:
            why = iso.write_maps(self.proc.pid)
            if why:
                raise SandboxError(f"{iso.FIELDS}: namespaces: the pids limit cannot hold: {why}")
            self.send({"go": 1})
        self.ctl.settimeout(START_TIMEOUT_S)
        try:
            msg = json.loads(self.ctl.recv(65536) or b"{}")
        except (OSError, ValueError) as err:
            raise SandboxError(f"sandbox template did not start: {err}") from None
        self.ctl.setblocking(False)
        if msg.get("refused"):
            raise SandboxError(str(msg["refused"]))
        if "ready" not in msg:
            raise SandboxError(f"sandbox template exited at start ({self.died()})")
        self.enforced = msg.get("enforced", "")

    def send(self, msg: dict, fd: int | None = None) -> None:
        data = json.dumps(msg).encode()
        if fd is None:
            self.ctl.send(data)
        else:
            socket.send_fds(self.ctl, [data], [fd])

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()
        self.ctl.close()
        shutil.rmtree(self.scratch, ignore_errors=True)

    def died(self) -> str:
        try:
            code = self.proc.wait(5)
        except subprocess.TimeoutExpired:
            return "still running"
        return f"signal {signal.Signals(-code).name}" if code < 0 else f"exit code {code}"


class _Proc:
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


class SandboxPool:
    """Runs [(target, args), ...] calls, at most `workers` at once, each in a fresh process
    forked from one template (an episode's calls, keyed, in one process of its own)."""

    def __init__(self, limits: Limits):
        iso.validate(limits.isolation)
        self.limits = limits
        self.template: _Template | None = None
        self.started = 0  # templates started over the pool's life (replacements included)
        self.procs: dict[str, _Proc] = {}  # key -> the episode's process
        self.forged_replies = 0  # calls failed for a reply that was not theirs (counted)
        self._handles = itertools.count(1)
        self._seq = itertools.count(1)
        self._lock = threading.Lock()

    def __enter__(self) -> SandboxPool:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    @property
    def enforced(self) -> str:
        """What holds each call (the template's line; "" before the first call)."""
        return self.template.enforced if self.template else ""

    def close(self) -> None:
        for p in self.procs.values():
            p.sock.close()
        self.procs = {}
        if self.template is not None:
            self.template.kill()
            self.template = None

    def _ensure(self) -> _Template:
        if self.template is not None and self.template.proc.poll() is None:
            return self.template
        if self.template is not None:
            self._lost_template()
        iso.prepare(self.limits.isolation)  # the stage non-dumpable; namespaces checked once
        t = _Template(self.limits)
        self.started += 1
        try:
            t.start()
        except BaseException:
            t.kill()
            raise
        if not _announced.get(t.enforced):
            _announced[t.enforced] = True
            print(f"[moerl] sandbox: {t.enforced}", file=sys.stderr, flush=True)
        self.template = t
        return t

    def _lost_template(self) -> None:
        for p in self.procs.values():
            p.sock.close()
        self.procs = {}
        if self.template is not None:
            self.template.kill()
        self.template = None

    def release(self, keys) -> None:
        """End the processes of the episodes `keys` (their state was closed in them)."""
        with self._lock:
            for k in keys:
                p = self.procs.pop(k, None)
                if p is not None:
                    p.sock.close()

    def run(
        self, calls: list[tuple[str, list]], keys: list[str | None] | None = None
    ) -> list[Outcome]:
        """One Outcome per call, in order. `keys[i]`: call i's episode (None: a process of its
        own); a key's calls run in order in its process. Thread-safe (callers take turns)."""
        if keys is not None and len(keys) != len(calls):
            raise ValueError(f"{len(keys)} keys for {len(calls)} calls")
        with self._lock:
            return _Run(self, calls, keys or [None] * len(calls)).go()


_announced: dict[str, bool] = {}
# targets whose first argument names the code they run (config, never sample data): the
# template imports it too, so each call's process starts with it imported
WARM_FIRST_ARG = {
    "moerl.tasks.verifiers:call_verifier",
    "moerl.tasks.environments:env_reset",
    f"{__name__}:check_callable",
}


class _Run:
    """One `SandboxPool.run`: dispatch, select, deadlines."""

    def __init__(self, pool: SandboxPool, calls: list[tuple[str, list]], keys: list[str | None]):
        self.pool, self.calls, self.keys = pool, calls, keys
        self.out: list[Outcome | None] = [None] * len(calls)
        self.todo = list(range(len(calls)))
        self.busy: dict[int, _Proc] = {}  # fd -> process running a call
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
                p = _Proc(next(pool._handles), mine, key)
                imports = [target] + ([args[0]] if target in WARM_FIRST_ARG and args else [])
                t.send(
                    {"fork": p.handle, "keep": key is not None, "imports": imports}, theirs.fileno()
                )
                theirs.close()
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
        for p in list(self.busy.values()):
            if now >= p.deadline:
                self._finish(
                    p,
                    Outcome(
                        "timeout",
                        error=f"timeout: the call took longer than "
                        f"{self.pool.limits.timeout_s:g} s and was killed",
                    ),
                    kill=True,
                )

    def _control(self, t: _Template) -> None:
        """The template's reports: a call's end (or the template's own)."""
        while True:
            try:
                msg = t.ctl.recv(65536)
            except (BlockingIOError, InterruptedError):
                return
            except OSError:
                msg = b""
            if not msg:  # the template died: every call on it fails, the next run starts another
                why = f"crashed: the sandbox's template process died ({t.died()})"
                self.sel.unregister(t.ctl.fileno())
                for p in list(self.busy.values()):
                    self._finish(p, Outcome("crashed", error=why))
                self.pool._lost_template()
                self.todo and self.sel.register(
                    self.pool._ensure().ctl.fileno(), selectors.EVENT_READ
                )
                return
            end = json.loads(msg)
            for p in self.busy.values():
                if p.handle == end.get("exit"):
                    p.exit = end
                    self._settle(p)
                    break

    def _settle(self, p: _Proc) -> None:
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
        if p.lines and p.eof:
            return self._finish(p, _outcome(p.lines[0]))
        if p.exit is not None and p.eof:
            return self._finish(p, _ended(p.exit, self.pool.limits))
        if p.exit is not None and p.key is not None:
            return self._finish(p, _ended(p.exit, self.pool.limits))

    def _ours(self, p: _Proc) -> bool:
        if len(p.lines) > 1:
            return False
        try:
            return json.loads(p.lines[0]).get("id") == p.seq
        except (ValueError, AttributeError):
            return False

    def _finish(self, p: _Proc, o: Outcome, kill: bool = False) -> None:
        assert p.call is not None
        self.out[p.call] = o
        self._drop(p, kill=kill or o.kind in ("memory", "crashed") or p.key is None)

    def _drop(self, p: _Proc, kill: bool) -> None:
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


# ------------------------------------------- called in the child (sandbox_child.py serves calls)


def resolve(target: str):
    """`package.module:function` (dots allowed after the colon) to the callable it names."""
    import importlib

    mod_name, sep, qual = target.partition(":")
    if not sep or not mod_name or not qual:
        raise ValueError(f"{target!r} is not an import path of the form package.module:function")
    obj = importlib.import_module(mod_name)
    for part in qual.split("."):
        obj = getattr(obj, part)
    if not callable(obj):
        raise TypeError(f"{target} is a {type(obj).__name__}, not a function")
    return obj


def check_callable(target: str, n_args: int) -> bool:
    """Run inside the sandbox before any work: `target` imports, and takes `n_args` positional
    arguments (raises, naming the problem, if not)."""
    import inspect

    fn = resolve(target)
    try:
        inspect.signature(fn).bind(*([""] * n_args))
    except TypeError as err:
        raise TypeError(
            f"{target} cannot be called with {n_args} positional arguments: {err}"
        ) from None
    except ValueError:  # no signature to read (a builtin): the first real call will tell
        pass
    return True


def check_target(target: str, n_args: int, limits: Limits | None = None) -> str:
    """ "" if `target` can be called with `n_args` arguments in the sandbox, else the reason."""
    with SandboxPool(limits or Limits(timeout_s=60.0)) as pool:
        got = pool.run([(f"{__name__}:check_callable", [target, n_args])])[0]
    return "" if got.ok else got.error
