"""The sandboxed execution pool: verifiers (and, later, environments) run in child processes
with a wall-clock limit per call, a memory limit, no credentials and a scratch directory of
their own, so that a verifier that hangs, spins, allocates without bound or crashes costs one
sample, never the stage or the run.

Design, details and limitations: docs/tasks.md#moerltaskssandboxpy.
"""

from __future__ import annotations

import json
import os
import selectors
import shutil
import signal
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
    """What one call may use: `timeout_s` of wall-clock time, `memory_mb` of address space."""

    timeout_s: float = 10.0
    memory_mb: int = 2048
    workers: int = 1
    isolation: str = "namespaces"  # or "none" (moerl/tasks/isolation.py)


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


class _Child:
    """One sandboxed process and its half-read reply."""

    def __init__(self, limits: Limits):
        self.scratch = tempfile.mkdtemp(prefix="moerl-sandbox-")
        self.isolated = limits.isolation != "none"
        self.proc = subprocess.Popen(
            iso.command(limits.isolation)
            + [
                sys.executable,
                "-m",
                "moerl.tasks.sandbox_child",
                str(limits.memory_mb),
                str(0 if self.isolated else os.getpid()),
                limits.isolation,
            ],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            env=child_env(self.scratch),
            cwd=self.scratch,
            close_fds=True,
        )
        stdin, stdout = self.proc.stdin, self.proc.stdout
        assert stdin is not None and stdout is not None  # both subprocess.PIPE
        self.stdin, self.stdout = stdin, stdout
        self.fd = stdout.fileno()
        os.set_blocking(self.fd, False)
        self.buf = b""
        self.call: int | None = None  # index of the call it is running
        self.keys: set[str] = set()  # the keyed (stateful) calls bound to this child
        self.deadline = 0.0

    def send(self, msg: dict) -> None:
        self.stdin.write(json.dumps(msg).encode() + b"\n")
        self.stdin.flush()

    def read(self) -> list[bytes] | None:
        """Complete lines read so far; None at end of file (the child died)."""
        try:
            chunk = os.read(self.fd, 65536)
        except BlockingIOError:
            return []
        if not chunk:
            return None
        self.buf += chunk
        *lines, self.buf = self.buf.split(b"\n")
        if len(self.buf) > MAX_REPLY_BYTES:
            raise ValueError(f"reply over {MAX_REPLY_BYTES} bytes")
        return lines

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()
        for f in (self.stdin, self.stdout):
            try:
                f.close()
            except OSError:
                pass
        shutil.rmtree(self.scratch, ignore_errors=True)

    def died(self) -> str:
        code = self.proc.wait()
        # pid 1 of its namespace: 128 + the signal
        if self.isolated and 128 < code < 128 + signal.NSIG:
            code = 128 - code
        try:
            return f"signal {signal.Signals(-code).name}" if code < 0 else f"exit code {code}"
        except ValueError:
            return f"signal {-code}"


class SandboxPool:
    """`workers` sandboxed children; `run(calls)` runs [(target, args), ...] on them."""

    def __init__(self, limits: Limits):
        iso.validate(limits.isolation)
        self.limits = limits
        self.children: list[_Child] = []
        self.started = 0  # children started over the pool's life (replacements included)
        self.owner: dict[str, _Child] = {}  # key -> the child that holds its state
        self._lock = threading.Lock()

    def __enter__(self) -> SandboxPool:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        for c in self.children:
            c.kill()
        self.children = []

    def _start(self) -> _Child:
        iso.prepare(self.limits.isolation)  # the stage non-dumpable; namespaces checked once
        c = _Child(self.limits)
        self.started += 1
        deadline = time.monotonic() + START_TIMEOUT_S
        sel = selectors.DefaultSelector()
        sel.register(c.fd, selectors.EVENT_READ)
        try:
            while time.monotonic() < deadline:
                sel.select(max(0.0, deadline - time.monotonic()))
                lines = c.read()
                if lines is None:
                    raise SandboxError(f"sandboxed verifier process exited at start ({c.died()})")
                if lines:
                    first = json.loads(lines[0])
                    if first.get("ready"):
                        return c
                    if first.get("refused"):
                        raise SandboxError(str(first["refused"]))
                    raise SandboxError(
                        f"sandboxed verifier process sent {lines[0][:200]!r} at start"
                    )
            raise SandboxError(
                f"sandboxed verifier process did not start within {START_TIMEOUT_S:g} s"
            )
        except BaseException:
            c.kill()
            raise
        finally:
            sel.close()

    def _replace(self, c: _Child) -> None:
        c.kill()
        self.children.remove(c)
        for k in c.keys:  # its state is gone: a later call with the key fails on another child
            self.owner.pop(k, None)

    def release(self, keys) -> None:
        """Forget the bindings of `keys` (their state was closed in the child)."""
        with self._lock:
            for k in keys:
                c = self.owner.pop(k, None)
                if c is not None:
                    c.keys.discard(k)

    def run(
        self, calls: list[tuple[str, list]], keys: list[str | None] | None = None
    ) -> list[Outcome]:
        """One Outcome per call, in order. `keys[i]`: call i's key (None: any child; see the
        module docstring). Thread-safe (calls from two threads take turns)."""
        if keys is not None and len(keys) != len(calls):
            raise ValueError(f"{len(keys)} keys for {len(calls)} calls")
        with self._lock:
            return self._run(calls, keys or [None] * len(calls))

    def _next(
        self, todo: list[int], keys: list[str | None], n_busy: int, n: int
    ) -> tuple[int, _Child] | None:
        """The first waiting call that can start now and its child (an idle one, the key's
        owner, or a new one while fewer than `workers` run), removed from `todo`; None if none."""
        ahead: set[str] = set()  # keys with an earlier call still waiting: order within a key holds
        idle = [c for c in self.children if c.call is None]
        for pos, i in enumerate(todo):
            key = keys[i]
            if key is not None and key in ahead:
                continue
            owner = self.owner.get(key) if key is not None else None
            if key is not None and owner is not None:  # owner is only ever found by a key
                if owner.call is not None:
                    ahead.add(key)
                    continue
                c = owner
            elif key is not None and len(self.children) >= self.limits.workers:
                # a new episode goes to the child holding the fewest (their later calls must go
                # there too), waiting for it if it is busy
                c = min(self.children, key=lambda ch: (len(ch.keys), ch.call is not None))
                if c.call is not None:
                    ahead.add(key)
                    continue
            elif idle and key is None:
                c = idle[0]
            elif len(self.children) < self.limits.workers and n_busy < n:
                c = self._start()
                self.children.append(c)
            else:
                if key is not None:
                    ahead.add(key)
                continue
            if key is not None and owner is None:
                self.owner[key] = c
                c.keys.add(key)
            del todo[pos]
            return i, c
        return None

    def _run(self, calls: list[tuple[str, list]], keys: list[str | None]) -> list[Outcome]:
        out: list[Outcome | None] = [None] * len(calls)
        todo = list(range(len(calls)))
        busy: dict[int, _Child] = {}  # fd -> child running a call
        n = max(1, min(self.limits.workers, len(calls)))
        sel = selectors.DefaultSelector()
        try:
            while todo or busy:
                while todo and len(busy) < n:  # hand each idle child (or a new one) a call
                    got = self._next(todo, keys, len(busy), n)
                    if got is None:
                        break
                    i, c = got
                    target, args = calls[i]
                    c.call, c.deadline = i, time.monotonic() + self.limits.timeout_s
                    try:
                        c.send({"id": i, "target": target, "args": args})
                    except (BrokenPipeError, OSError):
                        out[i] = Outcome(
                            "crashed", error=f"crashed: the sandboxed process died ({c.died()})"
                        )
                        c.call = None
                        self._replace(c)
                        continue
                    busy[c.fd] = c
                    sel.register(c.fd, selectors.EVENT_READ)
                if not busy:
                    continue
                wait = max(0.0, min(c.deadline for c in busy.values()) - time.monotonic())
                for key, _ in sel.select(wait):
                    c = busy[key.fd]
                    at = c.call
                    assert at is not None  # every child in busy runs a call
                    try:
                        lines = c.read()
                    except ValueError as err:
                        lines, big = None, str(err)
                    else:
                        big = ""
                    if lines is None:
                        why = (
                            f"its reply was {big}"
                            if big
                            else f"the sandboxed process died ({c.died()})"
                        )
                        done = out[at] = Outcome("crashed", error=f"crashed: {why}")
                    elif lines:
                        done = out[at] = _outcome(lines[0])
                    else:
                        continue
                    sel.unregister(c.fd)
                    del busy[c.fd]
                    if lines is None or done.kind == "memory":
                        self._replace(c)
                    c.call = None
                now = time.monotonic()
                for fd, c in list(busy.items()):
                    if now >= c.deadline:
                        assert c.call is not None  # every child in busy runs a call
                        out[c.call] = Outcome(
                            "timeout",
                            error=f"timeout: the call took longer than "
                            f"{self.limits.timeout_s:g} s and was killed",
                        )
                        sel.unregister(fd)
                        del busy[fd]
                        c.call = None
                        self._replace(c)
        finally:
            sel.close()
            for c in busy.values():  # interrupted (KeyboardInterrupt): nothing half-done is kept
                c.call = None
                self._replace(c)
        return out  # type: ignore[return-value]


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
