"""Attacks on the sandbox's limits and on other samples' scores, by import path
(`tests.support.sandbox_attacks:NAME`), run in the sandboxed pool (moerl/tasks/sandbox.py).
Each returns what it achieved (or raises), so a test can tell a held limit from a broken one."""

from __future__ import annotations

import ctypes
import os
import threading
import time

MARK = os.path.join(os.environ.get("TMPDIR", "/tmp"), "left-by-an-earlier-call")


def honest(response: str, answer: str) -> float:
    return float(response)


def forges(response: str, answer: str) -> float:
    """Leaves a thread that writes replies for the calls after this one, on every socket."""

    def spam() -> None:
        for _ in range(200):
            for fd in range(3, 64):
                for i in range(1, 400):
                    try:
                        os.write(fd, b'{"id": %d, "ok": 9}\n' % i)
                    except OSError:
                        break
            time.sleep(0.005)

    threading.Thread(target=spam, daemon=True).start()
    time.sleep(0.05)
    return float(response)


def forks_memory(response: str, answer: str) -> int:
    """Four children of 300 MiB each (touched), all alive at once."""
    kids = []
    for _ in range(4):
        pid = os.fork()
        if pid == 0:
            block = bytearray(300 << 20)
            for i in range(0, len(block), 4096):
                block[i] = 1
            time.sleep(30)
            os._exit(0)
        kids.append(pid)
    time.sleep(8)
    return len(kids)


def leaves_a_process(response: str, answer: str) -> int:
    """Starts a background process that outlives the call, and a file in the scratch."""
    pid = os.fork()
    if pid == 0:
        os.setsid()
        time.sleep(600)
        os._exit(0)
    with open(MARK, "w") as f:
        f.write(str(pid))
    return pid


def finds_a_process(response: str, answer: str) -> list:
    """What an earlier call left: its file and any process but this call's own."""
    others = [p for p in os.listdir("/proc") if p.isdigit() and int(p) not in (1, os.getpid())]
    return [os.path.exists(MARK), sorted(others)]


def fills_scratch(response: str, answer: str) -> int:
    """Writes 64 MiB files into the scratch until 120 MiB are written; returns MiB written."""
    written = 0
    chunk = b"x" * (1 << 20)
    for n in range(2):
        with open(os.path.join(os.environ["TMPDIR"], f"fill{n}"), "wb") as f:
            for _ in range(60 if n == 0 else 60):
                f.write(chunk)
                f.flush()
                written += 1
    return written


def nested_namespace(response: str, answer: str) -> str:
    """A user + network namespace of its own, with a full capability set in it (made in a
    forked, single-threaded process)."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.unshare(0x10000000 | 0x40000000) != 0:
            err = ctypes.get_errno()
            with open("/proc/sys/user/max_user_namespaces") as f:
                limit = f.read().strip()
            os.write(w, f"E unshare: {os.strerror(err)}; max_user_namespaces {limit}".encode())
        else:
            with open("/proc/self/status") as f:
                os.write(w, next(x for x in f if x.startswith("CapEff")).split()[1].encode())
        os._exit(0)
    os.close(w)
    got = os.read(r, 4096).decode()
    os.waitpid(pid, 0)
    if got.startswith("E "):
        raise PermissionError(got[2:])
    return got


def fork_bomb(response: str, answer: str) -> int:
    """Forks until refused; returns how many processes it made (they wait, then exit)."""
    made = 0
    try:
        while made < 5000:
            if os.fork() == 0:
                time.sleep(5)
                os._exit(0)
            made += 1
    except OSError:
        raise BlockingIOError(f"fork refused after {made} processes") from None
    return made


def reads(response: str, answer: str) -> str:
    """A file's text (the pod's service-account token, say)."""
    with open(response) as f:
        return f.read()
