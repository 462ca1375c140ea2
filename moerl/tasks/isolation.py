"""What keeps a sandboxed child (moerl/tasks/sandbox.py) away from the stage that starts it: the
stage's credentials, its memory, the network and the node's files.

Design, details and limitations: docs/tasks.md#moerltasksisolationpy.
"""

from __future__ import annotations

import ctypes
import json
import os
import re
import shutil
import subprocess
import sys
import threading
from typing import NoReturn

from moerl.errors import ConfigError
from moerl.tasks import seccomp

ISOLATIONS = ("namespaces", "none")
# Directories (os.pathsep-separated) an isolated child hides under an empty read-only tmpfs: the
# stage's credential files (moerl.secrets.secret_dirs; the pod's Secret volumes among them), set
# by the pool in the child's environment. A path, never a credential.
HIDE_ENV = (
    "SANDBOX_HIDE"  # not MOERL_*: a child holds no moerl variable (tests/tasks/test_sandbox.py)
)
FIELDS = "reward.sandbox.isolation / task.sandbox.isolation"
# the sandbox's namespaces (its uid/gid maps are written by the pool: `write_maps`)
UNSHARE_ARGS = ("--user", "--net", "--pid", "--mount", "--ipc", "--kill-child")
SHM_MB = 64
# what the pod mounts for its identities (the Kubernetes API token, IRSA, EKS Pod Identity):
# hidden from every isolated child, like the stage's own credential files
POD_TOKEN_DIRS = ("/var/run/secrets", "/run/secrets")
_CALL_NS = 0x10000000 | 0x20000 | 0x08000000 | 0x20000000  # NEWUSER NEWNS NEWIPC NEWPID
_MS_NOSYMFOLLOW = 256
NOBODY = (
    65534  # the host uid a root stage's calls run as (their real uid: what RLIMIT_NPROC counts)
)

_PR_GET_DUMPABLE, _PR_SET_DUMPABLE = 3, 4
_PR_SET_PDEATHSIG = 1
_PR_CAPBSET_DROP, _PR_SET_NO_NEW_PRIVS, _PR_CAP_AMBIENT, _PR_CAP_AMBIENT_CLEAR_ALL = 24, 38, 47, 4
_MS_RDONLY, _MS_NOSUID, _MS_NODEV, _MS_NOEXEC, _MS_REMOUNT, _MS_BIND = 1, 2, 4, 8, 32, 4096
_MS_NOATIME, _MS_NODIRATIME, _MS_RELATIME, _MS_REC, _MS_PRIVATE = (
    1024,
    2048,
    1 << 21,
    16384,
    1 << 18,
)
# locked in a user ns
_KEEP = _MS_NOSUID | _MS_NODEV | _MS_NOEXEC | _MS_NOATIME | _MS_NODIRATIME | _MS_RELATIME

_lock = threading.Lock()
_checked: dict[str, str] = {}  # isolation -> "" (works) or why not, once per process
_warned = False


def _libc():
    return ctypes.CDLL(None, use_errno=True)


def _check(ret: int, what: str) -> None:
    if ret != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")


def validate(isolation: str) -> str:
    if isolation not in ISOLATIONS:
        raise ConfigError(f"{FIELDS}: {isolation!r} is not one of {', '.join(ISOLATIONS)}")
    return isolation


def make_nondumpable() -> bool:
    """This process non-dumpable (idempotent). False where there is no prctl (not Linux)."""
    if not sys.platform.startswith("linux"):
        return False
    libc = _libc()
    if libc.prctl(_PR_GET_DUMPABLE, 0, 0, 0, 0) != 0:
        _check(libc.prctl(_PR_SET_DUMPABLE, 0, 0, 0, 0), "prctl(PR_SET_DUMPABLE, 0)")
    return True


def dumpable() -> bool:
    return bool(_libc().prctl(_PR_GET_DUMPABLE, 0, 0, 0, 0))


def command(isolation: str) -> list[str]:
    """The prefix a child's command line starts with."""
    if isolation == "none":
        return []
    return [shutil.which("unshare") or "unshare", *UNSHARE_ARGS, "--"]


def prepare(isolation: str) -> None:
    """Before a pool starts children: the stage non-dumpable; the isolation checked (or, for
    `none`, announced), once per process."""
    global _warned
    validate(isolation)
    make_nondumpable()
    with _lock:
        if isolation == "none":
            if not _warned:
                _warned = True
                print(
                    f"[moerl] WARNING: {FIELDS} is none: sandboxed verifiers and environments run in the "
                    "stage's network, pid and mount namespaces (they can open connections and write the "
                    "stage's files); the run is tagged moerl.sandbox.isolation.*=none",
                    file=sys.stderr,
                    flush=True,
                )
            return
        if isolation not in _checked:
            _checked[isolation] = _probe()
        why = _checked[isolation]
    if why:
        raise ConfigError(
            f"{FIELDS}: namespaces cannot be made here ({why}); give the pod what docs/tasks.md "
            "lists (seccomp Unconfined or a profile allowing unshare, a kernel with unprivileged "
            "user namespaces), or set the field to none (no isolation, recorded on the run)"
        )


def _probe() -> str:
    if not sys.platform.startswith("linux"):
        return f"namespaces need Linux, this is {sys.platform}"
    if shutil.which("unshare") is None:
        return "no unshare on PATH (util-linux)"
    try:
        got = subprocess.run(
            [shutil.which("unshare") or "unshare", "--map-root-user", *UNSHARE_ARGS, "--", "true"],
            capture_output=True,
            text=True,
            timeout=60,
        )
    except (OSError, subprocess.SubprocessError) as err:
        return f"unshare did not run: {err}"
    return (
        ""
        if got.returncode == 0
        else f"unshare exited {got.returncode}: {got.stderr.strip()[:300]}"
    )


# What holds a call under each isolation (a pool that cannot have all of it refuses to start)
LIMITS = {
    "namespaces": "per call: user, pid, mount, ipc namespaces; RLIMIT_NPROC; resident memory "
    "summed over its processes; tmpfs scratch; seccomp and max_user_namespaces 0",
    "none": "per call: a process; resident memory summed over its processes",
}


def tags(reward: str, task: str) -> dict[str, str]:
    """The provenance tags a run carries for its sandboxes."""
    return {
        "moerl.sandbox.isolation.reward": reward,
        "moerl.sandbox.isolation.task": task,
        "moerl.sandbox.limits.reward": LIMITS.get(reward, ""),
        "moerl.sandbox.limits.task": LIMITS.get(task, ""),
    }


# ---------------------------------------------------------------------------- the child side


def _mount(
    libc, src: str | None, target: str, fstype: str | None, flags: int, data: str | None = None
) -> None:
    def enc(s: str | None) -> bytes | None:
        return None if s is None else s.encode()

    _check(
        libc.mount(enc(src), enc(target), enc(fstype), ctypes.c_ulong(flags), enc(data)),
        f"mount {target}",
    )


def _mountpoints() -> list[str]:
    out = []
    with open("/proc/self/mountinfo") as f:
        for line in f:
            # \040: a space
            out.append(re.sub(r"\\([0-7]{3})", lambda m: chr(int(m[1], 8)), line.split()[4]))
    return out


def _hide_tempdir(libc, scratch: str) -> list[str]:
    """An empty tmpfs over the stage's temp directory (the scratch directory's parent: the
    stage's temp files and pathname sockets, vLLM's ipc sockets among them), with the scratch
    directory and the import path's entries under it bound back. Returns the mounts to make
    read-only; none where the temp directory is itself on the import path (then it stays
    visible, read-only)."""
    tmp = os.path.dirname(scratch)
    path = [os.path.realpath(p) for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    path += [os.path.realpath(p) for p in (sys.prefix, sys.base_prefix, sys.exec_prefix)]
    # and whatever this interpreter imports from: sys.path, and the folders of the packages it
    # has loaded (an editable install maps moerl's packages to the checkout through a finder, not
    # sys.path: a checkout and its venv under /tmp, as a CI clone may be, would vanish otherwise)
    path += [os.path.realpath(p) for p in sys.path if p]
    path += [
        os.path.realpath(p)
        for m in list(sys.modules.values())
        for p in (getattr(m, "__path__", None) or [])
        if isinstance(p, str)
    ]
    if tmp in path or tmp == "/":
        return []
    under = sorted({p for p in path if p.startswith(tmp + os.sep) and os.path.exists(p)})
    keep = [(p, os.path.isdir(p), os.open(p, os.O_PATH)) for p in [scratch, *under]]
    _mount(libc, "tmpfs", tmp, "tmpfs", _MS_NOSUID | _MS_NODEV, "size=1m,mode=0755")
    for p, is_dir, fd in keep:
        if is_dir:
            os.makedirs(p, exist_ok=True)
        else:
            os.makedirs(os.path.dirname(p), exist_ok=True)
            open(p, "a").close()
        _mount(libc, f"/proc/self/fd/{fd}", p, None, _MS_BIND | _MS_REC)
        os.close(fd)
    return [tmp, *under]


def _readonly(libc, mp: str) -> None:
    try:
        flags = os.statvfs(mp).f_flag & _KEEP
        _mount(libc, None, mp, None, _MS_REMOUNT | _MS_BIND | _MS_RDONLY | flags)
    except OSError as err:  # a mount point hidden under another mount is out of reach anyway
        if err.errno not in (2, 13, 22):  # ENOENT, EACCES, EINVAL
            raise


def _mounts(libc, scratch: str) -> str:
    """The mounts; returns what /proc is: "proc" (this namespace's) or "hidden"."""
    scratch = os.path.realpath(scratch)
    mountpoints = _mountpoints()  # read before /proc may be hidden
    _mount(libc, None, "/", None, _MS_REC | _MS_PRIVATE)
    hidden = _hide_tempdir(libc, scratch)  # while /proc/self/fd is there
    proc = "proc"
    try:
        _mount(libc, "proc", "/proc", "proc", _MS_NOSUID | _MS_NODEV | _MS_NOEXEC)
    except OSError:  # a masked /proc (a container runtime's default): hide the stage's instead
        _mount(
            libc,
            "tmpfs",
            "/proc",
            "tmpfs",
            _MS_NOSUID | _MS_NODEV | _MS_NOEXEC | _MS_RDONLY,
            "size=4k",
        )
        proc = "hidden"
    if os.path.isdir("/dev/shm"):
        _mount(
            libc, "tmpfs", "/dev/shm", "tmpfs", _MS_NOSUID | _MS_NODEV, f"size={SHM_MB}m,mode=1777"
        )
    hide = [*os.environ.get(HIDE_ENV, "").split(os.pathsep), *POD_TOKEN_DIRS]
    for d in dict.fromkeys(os.path.realpath(d) for d in hide if d):
        # the stage's credential files: hidden, not merely read-only (the child's uid may read them),
        # unless hiding would take the child's own scratch or its import path with it
        if d and os.path.isdir(d) and not (scratch + os.sep).startswith(d.rstrip(os.sep) + os.sep):
            _mount(
                libc,
                "tmpfs",
                d,
                "tmpfs",
                _MS_NOSUID | _MS_NODEV | _MS_NOEXEC | _MS_RDONLY,
                "size=4k,mode=0555",
            )
    if not hidden:
        _mount(libc, scratch, scratch, None, _MS_BIND)
    for mp in [*mountpoints, *hidden]:
        if mp not in (scratch, "/dev/shm", "/proc"):  # the template writes its calls' maps
            _readonly(libc, mp)
    probe = os.path.join(os.path.dirname(scratch), f".moerl-ro-{os.getpid()}")
    try:
        with open(probe, "w"):
            pass
    except OSError:
        return proc
    os.unlink(probe)
    raise OSError(f"{probe} is still writable after the read-only remount")


_CAP_SETGID, _CAP_SETUID, _CAP_SETFCAP = 6, 7, 31


def _drop_caps(libc, keep: int = 0) -> None:
    """Every capability but the bits of `keep`, the bounding set and ambient ones; no_new_privs."""
    for cap in range(64):
        if libc.prctl(_PR_CAPBSET_DROP, cap, 0, 0, 0) != 0:
            break  # past the last capability this kernel knows
    libc.prctl(_PR_CAP_AMBIENT, _PR_CAP_AMBIENT_CLEAR_ALL, 0, 0, 0)
    _check(libc.prctl(_PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), "prctl(PR_SET_NO_NEW_PRIVS)")
    header = (ctypes.c_uint32 * 2)(0x20080522, 0)  # _LINUX_CAPABILITY_VERSION_3, this process
    data = (ctypes.c_uint32 * 6)(keep, keep, 0, 0, 0, 0)  # effective, permitted, inheritable x 2
    _check(libc.capset(header, data), "capset")


def enter(scratch: str, ctl, lim: dict) -> str:
    """Run first in a child started under `command("namespaces")` (pid 1 of its namespace):
    the mounts, then a fork. Returns in the forked process, the template (every capability
    dropped but CAP_SETUID/SETGID/SETFCAP, which write its calls' uid maps), with a line saying
    what holds each call; pid 1 waits for it and exits with its status."""
    libc = _libc()
    make_nondumpable()
    why = seccomp.available()
    try:
        if why:
            raise OSError(why)
        os.environ["SANDBOX_PROC"] = _mounts(libc, scratch)  # what /proc is, for the curious
        if os.environ["SANDBOX_PROC"] != "proc":
            raise OSError(
                "the runtime masks /proc, so no proc of the sandbox's own can be mounted and its "
                "calls' user namespaces cannot be mapped (give the pod procMount: Unmasked)"
            )
    except OSError as err:
        ctl.send(
            json.dumps(
                {"refused": f"{FIELDS}: namespaces: the sandbox could not be set up: {err}"}
            ).encode()
        )
        os._exit(2)
    os.chdir(scratch)  # the bind mount, not the read-only directory under it
    pid = os.fork()
    if pid == 0:
        _drop_caps(libc, keep=(1 << _CAP_SETUID) | (1 << _CAP_SETGID) | (1 << _CAP_SETFCAP))
        return (
            f"per call: user, pid, mount and ipc namespaces; at most {lim['pids']} processes "
            f"(RLIMIT_NPROC, uid {'nobody' if two_uids() else 'the stage'}s); {lim['memory_mb']} MiB "
            f"resident over its processes (watched); a {lim['scratch_mb']} MiB tmpfs scratch; "
            f"nested namespaces refused (seccomp, max_user_namespaces 0)"
        )
    null = os.open(os.devnull, os.O_RDWR)
    for fd in (0, 1):  # the pool reads end of file when the template goes, not when pid 1 does
        os.dup2(null, fd)
    _wait_for(pid)


def _wait_for(pid: int) -> NoReturn:
    """pid 1: reap every orphan of the namespace; exit with `pid`'s status (a signal N as 128 + N)."""
    while True:
        try:
            got, status = os.waitpid(-1, 0)
        except ChildProcessError:
            os._exit(1)
        if got == pid:
            os._exit(
                128 + os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)
            )


def two_uids() -> bool:
    with open("/proc/self/uid_map") as f:
        return len(f.read().split("\n")) > 2
