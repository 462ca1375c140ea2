"""Verifiers a user might ship by mistake, called by import path (`tests.support.hostile_verifiers:NAME`)
inside the sandboxed pool (moerl/tasks/sandbox.py). Never imported by the test process itself
for scoring: the point is that they run in a child process."""

from __future__ import annotations

import os
import time


def sleeps(response: str, answer: str) -> float:  # stuck on I/O forever
    time.sleep(10_000)
    return 1.0


def spins(response: str, answer: str) -> float:  # a busy loop that never ends
    while True:
        pass


def allocates(response: str, answer: str) -> float:
    """Memory without bound. bytes(n) comes from calloc, whose large blocks are fresh mmap
    pages nobody has to zero, so the address-space limit is reached in milliseconds however
    loaded the machine is (zero-filling 512 MiB could outlast the 1 s time limit)."""
    hoard = []
    while True:
        hoard.append(bytes(64 << 20))


def dies(
    response: str, answer: str
) -> float:  # a crash in native code, as far as the pool can tell
    os.kill(os.getpid(), 9)
    return 0.0


def raises(response: str, answer: str) -> float:
    raise ValueError("cannot parse")


def not_a_number(response: str, answer: str):
    return "high"


def prints(response: str, answer: str) -> float:  # chatter on stdout must not corrupt the protocol
    print("a verifier's debug line", flush=True)
    return 0.25


def environment(response: str, answer: str) -> dict:
    """What the verifier can see of its process."""
    return {"env": dict(os.environ), "cwd": os.getcwd()}


def slow(response: str, answer: str) -> float:  # under the per-sample limit, over a group's
    time.sleep(0.6)
    return 1.0


def by_response(response: str, answer: str) -> float:
    """Misbehaves on cue: a response that starts with 1 sleeps forever, 2 spins, 3 allocates
    without bound; any other is scored like the shipped positional verifier."""
    head = response.strip()[:1]
    if head == "1":
        return sleeps(response, answer)
    if head == "2":
        return spins(response, answer)
    if head == "3":
        return allocates(response, answer)
    from moerl.tasks.verifiers import positional

    return positional(response, answer)


def takes_one(response: str) -> float:
    return 0.0


HOSTILE_ANSWERS = {"1111": sleeps, "2222": spins, "3333": allocates, "4444": raises}


def by_answer(response: str, answer: str) -> float:
    """Misbehaves on the rows a test planted: answer 1111 sleeps forever, 2222 spins, 3333
    allocates without bound, 4444 raises; any other row is scored like the shipped positional
    verifier."""
    if answer in HOSTILE_ANSWERS:
        return HOSTILE_ANSWERS[answer](response, answer)
    from moerl.tasks.verifiers import positional

    return positional(response, answer)


def only_gold(response: str, answer: str) -> float:
    """Scores the reference answer (so it passes preflight, which calls it on a row's own
    answer) and raises on any other response: a verifier that breaks on real model output."""
    if response.strip() == answer:
        return 1.0
    raise ValueError(f"cannot parse {response!r}")


# What model-written code (or a malicious verifier) tries against the stage that runs it: each
# raises when the attempt fails, and returns what it got when it succeeds.


def attack(kind: str, arg: str) -> str:
    """`environ PID NEEDLE`: read PID's /proc environ, find NEEDLE (PID `ppid`: the parent);
    `mem PID`: read 16 bytes of PID's memory at its first mapping; `connect HOST:PORT`: open a
    TCP connection, send PING, return the reply (`unix PATH`: a unix socket's); `write DIR`:
    create a file in DIR."""
    import socket

    if kind in ("environ", "mem"):
        pid, _, needle = arg.partition(" ")
        pid = str(os.getppid()) if pid == "ppid" else pid
        if kind == "environ":
            with open(f"/proc/{pid}/environ", "rb") as f:
                data = f.read()
            if needle.encode() not in data:
                raise LookupError(
                    f"{needle} is not in the {len(data)} bytes of /proc/{pid}/environ"
                )
            return "read"
        with open(f"/proc/{pid}/maps") as f:
            start = int(f.readline().split("-")[0], 16)
        with open(f"/proc/{pid}/mem", "rb") as f:
            f.seek(start)
            return f.read(16).hex()
    if kind == "connect":
        host, _, port = arg.rpartition(":")
        with socket.create_connection((host, int(port)), timeout=3) as s:
            s.sendall(b"PING\r\n")
            return s.recv(64).decode(errors="replace")
    # a pathname unix socket (vLLM's ipc sockets are such, in the stage's temp dir)
    if kind == "unix":
        with socket.socket(socket.AF_UNIX) as s:
            s.settimeout(3)
            s.connect(arg)
            s.sendall(b"PING\r\n")
            return s.recv(64).decode(errors="replace")
    if kind == "import":  # not an attack: code on the stage's import path still imports
        import importlib

        return importlib.import_module(arg).__name__
    if kind == "proc":  # not an attack: what the sandbox says /proc is ("proc", "hidden")
        if os.environ.get("SANDBOX_PROC") != arg or (arg == "hidden") == os.path.exists(
            "/proc/self"
        ):
            raise LookupError(
                f"/proc is {os.environ.get('SANDBOX_PROC')}: {os.listdir('/proc')[:5]}"
            )
        return arg
    if kind == "write":
        with open(os.path.join(arg, "forged-by-sandbox"), "w") as f:
            f.write("forged")
        return "written"
    raise ValueError(f"unknown attack {kind!r}")


def attacks(response: str, answer: str) -> float:
    """A verifier that runs the attack its response names (`KIND ARG`): 1.0 when it succeeds;
    any other response is scored like the shipped positional verifier."""
    kind, _, arg = response.partition(" ")
    if kind in ("environ", "mem", "connect", "unix", "write", "import", "proc"):
        attack(kind, arg)
        return 1.0
    from moerl.tasks.verifiers import positional

    return positional(response, answer)


def capabilities(response: str, answer: str) -> dict:
    """What the process holds: its capability sets, no_new_privs, its pid and parent pid."""
    with open("/proc/self/status") as f:
        status = dict(line.rstrip("\n").split(":\t", 1) for line in f if ":\t" in line)
    got = {k: int(status[k], 16) for k in ("CapEff", "CapPrm", "CapBnd", "CapInh", "CapAmb")}
    return {
        **got,
        "NoNewPrivs": int(status["NoNewPrivs"]),
        "pid": os.getpid(),
        "ppid": os.getppid(),
        "proc": os.environ.get("SANDBOX_PROC"),
    }


def hangs_on_import() -> None:  # what a module that never finishes importing calls
    time.sleep(10_000)
