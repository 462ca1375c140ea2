"""Child processes that die with their parent, in process groups their launcher can kill.

Design, details and limitations: docs/launch.md#moerllaunchprocspy.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import runpy
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Protocol


class Process(Protocol):
    """What the launchers need of a child: a `subprocess.Popen`, or a stage forked by a zygote
    (`moerl/launch/zygote.py`)."""

    pid: int
    returncode: int | None

    def poll(self) -> int | None: ...
    def wait(self, timeout: float | None = None) -> int: ...


PARENT_ENV = "MOERL_PARENT_PID"
# A comma-separated list of CPU ids the wrapped process is pinned to before it imports anything
# (so every thread it, torch or vLLM starts inherits the set).
CPUS_ENV = "MOERL_CPUS"
_PR_SET_PDEATHSIG, _PR_SET_NAME = 1, 15  # from <linux/prctl.h>
# The stage a process runs, which names it for ps and top (`set_title`): set by the launcher.
TITLE_ENV = "MOERL_TITLE"


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now (the OS picks it; a race with another binder is possible
    but short)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def process_age_s() -> float | None:
    """Seconds since this process began (Linux: /proc/self/stat's start time against the
    uptime); None elsewhere. A stage logs it as it enters its main: its import time when it
    started python anew, about 0 when forked from a zygote (`moerl/launch/zygote.py`)."""
    try:
        stat = Path("/proc/self/stat").read_text()
        uptime = float(Path("/proc/uptime").read_text().split()[0])
    except OSError:
        return None
    start_ticks = int(stat.rsplit(")", 1)[1].split()[19])  # field 22, starttime
    return max(0.0, uptime - start_ticks / os.sysconf("SC_CLK_TCK"))


def die_with_parent(parent_pid: int | None = None) -> None:
    """Ask the kernel to SIGKILL this process when the thread that started it exits.
    With `parent_pid`, exit at once if the parent is already someone else (it died before
    the signal was armed, and this process was re-parented)."""
    if not sys.platform.startswith("linux"):
        return
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"prctl(PR_SET_PDEATHSIG): {os.strerror(err)}")
    if parent_pid is not None and os.getppid() != parent_pid:
        os._exit(1)


def set_title(name: str) -> str:
    """Name this process `moerl: <name>` for ps and top: with setproctitle where installed
    (vLLM depends on it), which rewrites the command line and the kernel's name of the process;
    else prctl(PR_SET_NAME), the name top shows (its first 15 bytes). Returns the route."""
    title = f"moerl: {name}"
    try:
        import setproctitle
    except ImportError:
        if not sys.platform.startswith("linux"):
            return "none"
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_NAME, ctypes.c_char_p(title.encode()[:15]), 0, 0, 0)
        return "prctl"
    setproctitle.setproctitle(title)
    return "setproctitle"


def spawn(module: str, args: list[str], env: dict[str, str], **popen) -> subprocess.Popen:
    """Start `python -m module *args` in a new process group, dying with the calling thread.
    `popen` goes to subprocess.Popen (stdout=..., for example)."""
    return subprocess.Popen(
        [sys.executable, "-m", "moerl.launch.procs", module, *args],
        env={**env, PARENT_ENV: str(os.getpid())},
        process_group=0,
        **popen,
    )


def _signal_group(pgid: int, sig: int) -> None:
    # The group outlives its leader while any member lives, and its id is not reused until
    # the last member is gone, so signalling a reaped leader's group is safe.
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, sig)


def kill_groups(procs: Sequence[Process], grace_s: float = 0.0) -> None:
    """Kill each child's process group: SIGTERM first when `grace_s` > 0 (torchrun passes it
    on to its workers), SIGKILL once the grace is over; then reap the children. A SIGTERM
    that arrives meanwhile (see `sigterm_raises`) cuts the grace short, not the kill."""
    try:
        _kill_groups(procs, grace_s)
    except Terminated:
        _kill_groups(procs, 0.0)
        raise


def _kill_groups(procs: Sequence[Process], grace_s: float) -> None:
    if grace_s > 0:
        for p in procs:
            _signal_group(p.pid, signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        while time.monotonic() < deadline and any(p.poll() is None for p in procs):
            time.sleep(0.1)
    for p in procs:
        _signal_group(p.pid, signal.SIGKILL)
    for p in procs:
        p.wait()


class Terminated(Exception):
    """SIGTERM arrived while children were running (turned into an exception so that the
    launcher's cleanup runs; Python's default SIGTERM action skips every `finally`)."""


@contextlib.contextmanager
def sigterm_raises():
    """Within the block, the first SIGTERM raises `Terminated` and later ones are ignored, so
    that cleanup runs once and to the end (main thread only: Python runs signal handlers
    there; elsewhere the block runs unchanged and the death signal is the backstop)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    raised = []

    def _raise(signum, frame):
        if not raised:
            raised.append(signum)
            raise Terminated("received SIGTERM")

    previous = signal.signal(signal.SIGTERM, _raise)
    try:
        yield
    finally:
        # None: the previous handler was not set from Python; the default is the best guess
        signal.signal(signal.SIGTERM, signal.SIG_DFL if previous is None else previous)


def _main(argv: list[str]) -> None:
    if not argv:
        sys.exit("usage: python -m moerl.launch.procs MODULE [ARGS...]")
    parent = os.environ.pop(PARENT_ENV, None)
    die_with_parent(int(parent) if parent else None)
    os.environ[PARENT_ENV] = str(os.getpid())  # for children run through this wrapper in turn
    if title := os.environ.pop(TITLE_ENV, None):
        set_title(title)
    cpus = os.environ.get(CPUS_ENV)
    if cpus and hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, {int(c) for c in cpus.split(",")})
    sys.argv = argv
    runpy.run_module(argv[0], run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    _main(sys.argv[1:])
