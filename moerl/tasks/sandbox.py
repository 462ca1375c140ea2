"""The sandboxed execution pool: each verifier call runs in a fresh process (each episode of an
environment in one of its own), forked from the pool's template process, with a wall-clock
limit, a memory limit summed over its processes, no credentials and a tmpfs scratch, so that
code that hangs, spins, allocates, forks, crashes or forges replies costs its own sample, never
another's, the stage or the run.

Design, details and limitations: docs/tasks.md#moerltaskssandboxpy.
"""

from __future__ import annotations

import itertools
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
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
    pids: int = 128
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
            "RAYON_NUM_THREADS": "1",  # tokenizers: threads count against the pids limit
            "TOKENIZERS_PARALLELISM": "false",
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
            "spares": limits.workers,  # set up ahead, so a call waits only for its own work
        }
        mine, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self.proc = subprocess.Popen(
            iso.command(limits.isolation)
            + [sys.executable, "-m", "moerl.tasks.sandbox_child", json.dumps(lim)],
            stdin=theirs.fileno(),
            stdout=theirs.fileno(),
            env=child_env(self.scratch),
            cwd=self.scratch,
            close_fds=True,
        )
        theirs.close()
        self.ctl = mine
        self.enforced = ""

    def start(self) -> None:
        if self.isolated:
            from moerl.tasks.isolation_calls import write_maps

            why = write_maps(self.proc.pid)
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


class SandboxPool:
    """Runs [(target, args), ...] calls, at most `workers` at once, each in a fresh process
    forked from one template (an episode's calls, keyed, in one process of its own)."""

    def __init__(self, limits: Limits):
        iso.validate(limits.isolation)
        self.limits = limits
        self.template: _Template | None = None
        self.started = 0  # templates started over the pool's life (replacements included)
        self.procs: dict[str, Any] = {}  # key -> the episode's process (sandbox_run.Proc)
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
        self._lost_template()

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
        """End every call's and episode's process, and the template."""
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
            from moerl.tasks.sandbox_run import Run

            return Run(self, calls, keys or [None] * len(calls)).go()


_announced: dict[str, bool] = {}
# targets whose first argument names the code they run (config, never sample data): the
# template imports it too, so each call's process starts with it imported
WARM_FIRST_ARG = {
    "moerl.tasks.verifiers:call_verifier",
    "moerl.tasks.environments:env_reset",
    f"{__name__}:check_callable",
}


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
