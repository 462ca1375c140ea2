"""Each sandboxed call's own namespaces (moerl/tasks/sandbox_child.py forks a call, then runs
`call_namespaces` in it while the template runs `map_call`), and the sandbox's uid/gid maps the
pool writes (`write_maps`).

Design, details and limitations: docs/tasks.md#moerltasksisolationpy.
"""

from __future__ import annotations

import os
import signal
import time

from moerl.tasks import seccomp
from moerl.tasks.isolation import (
    _MS_NODEV,
    _MS_NOEXEC,
    _MS_NOSUID,
    _PR_SET_PDEATHSIG,
    SHM_MB,
    _check,
    _drop_caps,
    _libc,
    _mount,
    _wait_for,
    two_uids,
)

_CALL_NS = 0x10000000 | 0x20000 | 0x08000000 | 0x20000000  # NEWUSER NEWNS NEWIPC NEWPID
NOBODY = (
    65534  # the host uid a root stage's calls run as (their real uid: what RLIMIT_NPROC counts)
)


def write_maps(pid: int) -> str:
    """From the stage: the uid/gid maps of the sandbox `pid` just made (its root is the stage's
    user). A root stage also maps uid/gid 1 to NOBODY, the real uid calls run as: RLIMIT_NPROC
    does not bind host uid 0. Returns "" or why the pids limit cannot hold here."""
    deadline = time.monotonic() + 30
    mine = os.readlink("/proc/self/ns/user")
    while os.readlink(f"/proc/{pid}/ns/user") == mine:  # unshare(1) has not unshared yet
        if time.monotonic() > deadline:
            return "the sandbox's user namespace did not appear within 30 s"
        time.sleep(0.001)
    uid, gid = os.geteuid(), os.getegid()

    def put(name: str, text: str) -> None:
        with open(f"/proc/{pid}/{name}", "w") as f:
            f.write(text)

    if uid == 0:
        try:
            put("uid_map", f"0 0 1\n1 {NOBODY} 1\n")
            put("gid_map", f"0 {gid} 1\n1 {NOBODY} 1\n")
            return ""
        except OSError:
            with open("/proc/self/uid_map") as f:
                if any(line.split()[:2] == ["0", "0"] for line in f):
                    return (
                        f"the stage runs as host uid 0 and cannot map uid {NOBODY} for its calls "
                        "(the pids limit, RLIMIT_NPROC, does not bind uid 0)"
                    )
    put("setgroups", "deny")
    put("uid_map", f"0 {uid} 1\n")
    put("gid_map", f"0 {gid} 1\n")
    return ""


def call_namespaces(sync_w: int, back_r: int, lim: dict, fd: int) -> None:
    """In the process the template forked for a call: new user, pid, mount and ipc namespaces
    (the template writes the maps), then pid 1 of the new pid namespace, which mounts the call's
    /proc, scratch and /dev/shm, refuses nested user namespaces and forks the process that runs
    the call. Returns in that process: no capability, real uid 1 where mapped, seccomp on.
    Only that process (and what it starts) holds the call's socket `fd`: the pool reads end of
    file when they are gone."""
    libc = _libc()
    _check(libc.unshare(_CALL_NS), "unshare")
    os.write(sync_w, b"u")
    if os.read(back_r, 1) != b"m":
        os._exit(71)
    os.close(sync_w)
    os.close(back_r)
    p1 = os.fork()
    if p1:
        os.close(fd)
        _wait_for(p1)
    libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)  # the template killed the call
    flags = _MS_NOSUID | _MS_NODEV
    if os.environ.get("SANDBOX_PROC") == "proc":
        _mount(libc, "proc", "/proc", "proc", flags | _MS_NOEXEC)
        for kind in ("user", "mnt", "net", "pid", "ipc", "uts", "cgroup", "time"):
            try:
                with open(f"/proc/sys/user/max_{kind}_namespaces", "w") as f:
                    f.write("0")
            except FileNotFoundError:  # an older kernel without that kind
                pass
    scratch = os.getcwd()
    _mount(libc, "tmpfs", scratch, "tmpfs", flags, f"size={lim['scratch_mb']}m,mode=0700")
    if os.path.isdir("/dev/shm"):
        _mount(libc, "tmpfs", "/dev/shm", "tmpfs", flags, f"size={SHM_MB}m,mode=1777")
    os.chdir(scratch)  # the new tmpfs
    w = os.fork()
    if w:
        os.close(fd)
        _drop_caps(libc)
        seccomp.install()
        _wait_for(w)
    if two_uids():
        os.setresuid(1, 0, 0)  # the real uid RLIMIT_NPROC counts, in this namespace only
    _drop_caps(libc)
    seccomp.install()


def map_call(pid: int, sync_r: int, back_w: int) -> None:
    """In the template: once the call `pid` has its user namespace, write its maps (uid 0, and 1
    where the sandbox has it, as in the sandbox) and let it go on."""
    if os.read(sync_r, 1) != b"u":  # readable: it unshared, or died
        return
    ids = "0 0 1\n1 1 1\n" if two_uids() else "0 0 1\n"
    for name in ("uid_map", "gid_map"):
        with open(f"/proc/{pid}/{name}", "w") as f:
            f.write(ids)
    os.write(back_w, b"m")
