"""A process that imports the stages' heavy modules once and forks each stage process from itself.

Design, details and limitations: docs/launch.md#moerllaunchzygotepy.
"""

from __future__ import annotations

import contextlib
import importlib
import json
import os
import select
import signal
import subprocess
import sys
import threading
import time
import traceback
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from moerl.errors import MoerlError
from moerl.launch import procs

# What a local run's stage processes import before they do anything (measured on 2 cores: torch
# 1.2 s, vLLM and its engine, worker and model-runner modules 7 s, transformers' modeling 0.7 s;
# docs/launch.md). A module that is missing here is skipped and named in the ready message.
# One zygote imports both (STAGE_PRELOAD) and every stage of a local run forks from it: measured
# on 2 cores, one zygote for the rollout and one for the trainer started together were ready
# later (their imports and the run's own start contended for the cores), and a trainer whose
# zygote started after the rollout's was ready delayed the first batch (it issues the work).
ROLLOUT_PRELOAD = (
    "torch",
    "transformers",
    "vllm",
    "vllm.entrypoints.llm",
    "vllm.v1.engine.core",
    "vllm.v1.engine.llm_engine",
    "vllm.v1.worker.cpu_worker",
    "vllm.v1.worker.cpu_model_runner",
    "transformers.models.auto.modeling_auto",
    "moerl.components.rollout.worker",
    "moerl.components.rollout.engine",
    "moerl.components.rollout.cores",
    "moerl.components.publish_checkpoint.stage",
    "moerl.components.reward.worker",
    "moerl.orchestrate.initial",
    "mlflow",
)
TRAINER_PRELOAD = (
    "torch",
    "torch.distributed.fsdp",
    "torch.distributed.checkpoint",
    "torch.distributed.tensor",
    "transformers",
    "transformers.models.auto.modeling_auto",
    "moerl.components.policy_update.worker",
    "moerl.components.policy_update.mesh",
    "moerl.components.policy_update.ep_train",
    "moerl.components.policy_update.trainer",
    "moerl.components.publish_checkpoint.stage",
    "moerl.components.publish_checkpoint.publisher",
    "mlflow",
)
STAGE_PRELOAD = tuple(dict.fromkeys(ROLLOUT_PRELOAD + TRAINER_PRELOAD))
READY_TIMEOUT_S = 300.0
POLL_S = 0.05
# A SIGTERM to the zygote drains its stages (`_drain`): each gets SIGTERM, then this long (s)
# before SIGKILL. The launcher sets it from rollout.grace_seconds.
GRACE_ENV, GRACE_S = "MOERL_ZYGOTE_GRACE_S", 30.0


class ZygoteError(MoerlError):
    """The zygote could not start, or died; the message names it and its log."""


@dataclass
class _Request:
    module: str
    args: list[str]
    env: dict[str, str]
    log: str


# -- the zygote process ----------------------------------------------------------------------
_PROTO = [1]  # the fd the zygote reports on (its stdout at start; see `_serve`)
_TERM: list[int] = []  # the SIGTERM the zygote received (`_serve` drains its stages then)
_ENV_SET: dict[str, str] = {}  # what the preloaded modules set in the environment


def _flush() -> None:
    """Nothing buffered may be copied into a child (it would write it into its own log)."""
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()


def _send(msg: dict) -> None:
    data = (json.dumps(msg) + "\n").encode()
    while data:  # a pipe may take part of a write
        data = data[os.write(_PROTO[0], data) :]


def _preload(modules: Sequence[str]) -> tuple[list[str], list[str]]:
    loaded, missing = [], []
    for m in modules:
        try:
            importlib.import_module(m)
            loaded.append(m)
        except Exception as err:  # noqa: BLE001 - not installed here, or broken: named in `ready`
            missing.append(f"{m} ({type(err).__name__}: {err})"[:300])
    return loaded, missing


def _serve(modules: Sequence[str]) -> _Request:
    """The zygote's loop: preload, say ready, then fork a child per request and report each
    child's exit. Returns only in a forked child, with its request; exits when the parent closes
    the pipe (its children are killed then)."""
    import gc

    # the reports get a descriptor of their own: whatever a module prints while it is imported
    # goes to stderr (the zygote's log), never into the pipe the parent parses
    _PROTO[0] = os.dup(1)
    os.dup2(2, 1)
    t0 = time.perf_counter()
    before = dict(os.environ)
    loaded, missing = _preload(modules)
    # what the imports set in the environment (vLLM's env_override does), which a stage that
    # imported them itself would have: given to every child over its request's environment
    _ENV_SET.update({k: v for k, v in os.environ.items() if before.get(k) != v})
    # what the children inherit is never scanned again by the collector (and stays shared
    # copy-on-write): vLLM's start runs several full collections over the heap
    gc.collect()
    gc.freeze()
    _flush()
    _send({"ready": time.perf_counter() - t0, "loaded": loaded, "missing": missing})
    signal.signal(signal.SIGTERM, lambda signum, frame: _TERM.append(signum))
    children: set[int] = set()
    buf = b""
    while True:
        r, _, _ = select.select([0], [], [], POLL_S)
        _reap(children)
        if _TERM:
            _drain(children, float(os.environ.get(GRACE_ENV, GRACE_S)))
        if not r:
            continue
        chunk = os.read(0, 1 << 16)
        if not chunk:  # the parent is gone or done: so are the stages
            for pid in children:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(pid, signal.SIGKILL)
            _flush()
            os._exit(0)
        buf += chunk
        while b"\n" in buf:
            line, buf = buf.split(b"\n", 1)
            try:  # one bad request, or a fork the kernel refuses, fails that request alone
                req = _Request(**json.loads(line))
                _flush()
                pid = os.fork()
            except (ValueError, TypeError, OSError) as err:
                _send({"error": f"{type(err).__name__}: {err}"[:500]})
                continue
            if pid == 0:
                os.close(_PROTO[0])
                return req
            with contextlib.suppress(OSError):  # the child does it too; either wins the race
                os.setpgid(pid, pid)
            children.add(pid)
            _send({"pid": pid})


def _reap(children: set[int], block: bool = False) -> None:
    """Report every child that exited (its code; negative: the signal that killed it)."""
    while children:
        try:
            pid, status = os.waitpid(-1, 0 if block else os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        children.discard(pid)
        _send({"exit": pid, "code": os.waitstatus_to_exitcode(status)})


def _drain(children: set[int], grace_s: float) -> None:
    """A SIGTERM to the zygote, as a pod's kubelet sends it: every stage gets SIGTERM (to its
    process group) and `grace_s` to drain; what is left then is SIGKILLed. Each exit is
    reported, then the zygote exits 143 (killed by SIGTERM, as its shell would say)."""
    print(f"zygote: SIGTERM; draining {len(children)} stages ({grace_s:.0f} s)", flush=True)
    for pid in children:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pid, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while children and time.monotonic() < deadline:
        _reap(children)
        time.sleep(POLL_S)
    for pid in children:
        print(f"zygote: stage {pid} still ran after {grace_s:.0f} s: SIGKILL", flush=True)
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pid, signal.SIGKILL)
    _reap(children, block=True)
    _flush()
    os._exit(128 + int(signal.SIGTERM))


def _become(req: _Request, zygote_pid: int) -> None:
    """In the forked child: a process of its own, as `procs.spawn` would start it, named for
    its stage (`procs.TITLE_ENV`, else its log's name)."""
    signal.signal(signal.SIGTERM, signal.SIG_DFL)  # the stage's own, not the zygote's drain
    with contextlib.suppress(OSError):
        os.setpgid(0, 0)
    procs.set_title(req.env.get(procs.TITLE_ENV) or Path(req.log).stem)
    procs.die_with_parent(zygote_pid)
    fd = os.open(req.log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)
    os.environ.clear()
    os.environ.update(req.env)
    os.environ.update(_ENV_SET)
    os.environ.pop(procs.TITLE_ENV, None)  # not inherited by what the stage starts
    os.environ[procs.PARENT_ENV] = str(os.getpid())
    import logging

    root = logging.getLogger()  # the stage configures its own (basicConfig does nothing else)
    for h in list(root.handlers):
        root.removeHandler(h)
    import tempfile

    tempfile.tempdir = None  # read TMPDIR again: the stage's, not the zygote's
    cpus = req.env.get(procs.CPUS_ENV)
    if cpus and hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, {int(c) for c in cpus.split(",")})
    # OpenMP read OMP_NUM_THREADS when torch loaded in the zygote: set this process's own
    threads = req.env.get("OMP_NUM_THREADS")
    if threads and "torch" in sys.modules:
        sys.modules["torch"].set_num_threads(int(threads))
    import random

    random.seed()  # a fresh process's: not the zygote's state, shared by every sibling
    if "numpy" in sys.modules:
        sys.modules["numpy"].random.seed()


def main(argv: list[str] | None = None) -> int:
    """`python -m moerl.launch.zygote MODULE...`: preload MODULEs, then serve fork requests."""
    modules = list(sys.argv[1:] if argv is None else argv)
    parent = os.environ.pop(procs.PARENT_ENV, None)
    procs.die_with_parent(int(parent) if parent else None)
    procs.set_title("zygote")
    me = os.getpid()
    req = _serve(modules)
    _become(req, me)
    sys.argv = [req.module, *req.args]
    import runpy

    # a preloaded stage module runs its own `main()` (running it again as __main__ would make
    # a second copy of its classes); any other runs as `python -m` would run it
    entry = getattr(sys.modules.get(req.module), "main", None)
    try:
        if callable(entry):
            return _exit_code(entry())
        runpy.run_module(req.module, run_name="__main__", alter_sys=True)
    except SystemExit as e:
        return _exit_code(e.code)
    except BaseException:
        traceback.print_exc()
        return 1
    return 0


def _exit_code(code: object) -> int:
    """As `sys.exit(code)` exits: None 0, an int itself, anything else printed and 1."""
    if code is None:
        return 0
    if isinstance(code, int):
        return code
    print(code, file=sys.stderr, flush=True)
    return 1


# -- the parent's side -----------------------------------------------------------------------
class Forked:
    """A stage process forked by a zygote: the part of `subprocess.Popen` that the launchers
    use (pid, returncode, poll, wait). Its own process group, as `procs.spawn`'s."""

    def __init__(self, zygote: Zygote, pid: int) -> None:
        self.zygote, self.pid = zygote, pid
        self.returncode: int | None = None
        self.args = f"forked by {zygote.name} (pid {pid})"

    def poll(self) -> int | None:
        if self.returncode is None:
            self.returncode = self.zygote.exit_code(self.pid)
        return self.returncode

    def send_signal(self, sig: int) -> None:
        """Signal the process unless it has exited (the zygote reaps at once, so unlike a
        Popen's zombie its pid may already be free, even reused)."""
        self.zygote.signal(self.pid, sig)

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(self.args, timeout or 0.0)
            time.sleep(0.02)
        assert self.returncode is not None
        return self.returncode


class Zygote:
    """`python -m moerl.launch.zygote` started with `env`, importing `preload`; `spawn` forks a
    stage from it. Start it first thing: its imports overlap whatever the caller does next."""

    def __init__(self, name: str, preload: Sequence[str], env: dict[str, str], log: Path) -> None:
        self.name, self.log_path = name, log
        self._exits: dict[int, int] = {}
        self._pids: list[int] = []
        self._errors: list[str] = []
        self._spawning = threading.Lock()  # one request in flight: replies come in order
        self._ready: dict | None = None
        self._dead = False
        self._cond = threading.Condition()
        self.started = time.perf_counter()
        log.parent.mkdir(parents=True, exist_ok=True)
        with log.open("ab") as err:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "moerl.launch.zygote", *preload],
                env={**env, procs.PARENT_ENV: str(os.getpid())},
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=err,
                process_group=0,
            )
        self._reader = threading.Thread(target=self._read, name=f"zygote-{name}", daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        try:
            for line in self.proc.stdout:
                try:
                    msg = json.loads(line)
                except ValueError:
                    continue
                with self._cond:
                    if "ready" in msg:
                        self._ready = msg
                    elif "pid" in msg:
                        pid = int(msg["pid"])
                        self._exits.pop(pid, None)  # a reused pid: a new process
                        self._pids.append(pid)
                    elif "error" in msg:
                        self._errors.append(str(msg["error"]))
                    elif "exit" in msg:
                        self._exits[int(msg["exit"])] = int(msg["code"])
                    self._cond.notify_all()
        finally:
            with self._cond:  # the zygote is gone: its children died with it
                self._dead = True
                self._cond.notify_all()

    def ready(self, timeout_s: float = READY_TIMEOUT_S) -> dict:
        """Wait until the zygote has imported its modules: its ready message (`ready`: seconds,
        `loaded`, `missing`). Raises ZygoteError naming its log when it died or took longer."""
        with self._cond:
            if not self._cond.wait_for(lambda: self._ready or self._dead, timeout_s):
                raise ZygoteError(
                    f"the {self.name} zygote did not finish importing in {timeout_s:.0f} s; its "
                    f"log: {self.log_path}"
                )
            if self._ready is None:
                raise ZygoteError(
                    f"the {self.name} zygote exited while importing; its log: {self.log_path}"
                )
            return self._ready

    def spawn(self, module: str, args: list[str], env: dict[str, str], log: Path) -> Forked:
        """Fork `python -m module *args` with exactly `env`, stdout and stderr appended to `log`."""
        self.ready()
        req = {"module": module, "args": args, "env": env, "log": str(log)}
        assert self.proc.stdin is not None
        with self._spawning, self._cond:
            n, e = len(self._pids), len(self._errors)
            try:
                self.proc.stdin.write((json.dumps(req) + "\n").encode())
                self.proc.stdin.flush()
            except (BrokenPipeError, OSError) as err:
                raise ZygoteError(
                    f"the {self.name} zygote is gone ({err}); its log: {self.log_path}"
                ) from err
            done = lambda: len(self._pids) > n or len(self._errors) > e or self._dead  # noqa: E731
            if not self._cond.wait_for(done, 30.0):
                raise ZygoteError(f"the {self.name} zygote did not fork {module} within 30 s")
            if len(self._errors) > e:
                raise ZygoteError(
                    f"the {self.name} zygote could not fork {module}: {self._errors[e]}"
                )
            if len(self._pids) <= n:
                raise ZygoteError(f"the {self.name} zygote died; its log: {self.log_path}")
            return Forked(self, self._pids[n])

    def signal(self, pid: int, sig: int) -> None:
        """Send `sig` to child `pid` if it has not exited (checked under the reports' lock)."""
        with self._cond:
            if pid in self._exits or self._dead:
                return
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, sig)

    def exit_code(self, pid: int) -> int | None:
        """The child's exit code once it exited (negative: the signal that killed it); -9 for
        every child once the zygote itself is gone (its children die with it)."""
        with self._cond:
            if pid in self._exits:
                return self._exits[pid]
            if self._dead:
                return -int(signal.SIGKILL)
            return None

    def close(self) -> None:
        """Stop the zygote: closing its pipe makes it kill what it still runs and exit."""
        with contextlib.suppress(OSError):
            if self.proc.stdin is not None:
                self.proc.stdin.close()
        try:  # still importing, it reads no pipe: no grace then
            self.proc.wait(timeout=5 if self._ready is not None else 0.1)
        except subprocess.TimeoutExpired:
            procs.kill_groups([self.proc])
        self._reader.join(timeout=5)


if __name__ == "__main__":
    sys.exit(main())
