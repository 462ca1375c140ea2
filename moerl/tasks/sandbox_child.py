"""The child side of the sandboxed pool (moerl/tasks/sandbox.py): `python -m
moerl.tasks.sandbox_child LIMITS_JSON` is the pool's template. With isolation `namespaces` it
first enters the sandbox's namespaces (`isolation.enter`). It imports what calls name, forks
processes ahead (each in namespaces of its own: `isolation_calls.call_namespaces`), and hands
one the socket of each call (or episode), which it serves limited (`_limit`). The template
never sees a call's arguments or reply; it watches the memory of each call's processes
together, kills a call when the pool asks, and reports each call's end.

Limitations: see sandbox.py and isolation.py (what a call can still read and reach).
"""

from __future__ import annotations

import gc
import json
import os
import select
import shutil
import signal
import socket
import sys
import tempfile
import time
from typing import Any

from moerl.tasks import isolation as iso
from moerl.tasks import isolation_calls as calls
from moerl.tasks.sandbox import resolve

_NOFILE = 256
_FSIZE = 64 << 20
WATCH_S = 0.05  # how often the template sums each call's memory


def _limit(lim: dict) -> None:
    import resource

    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    resource.setrlimit(resource.RLIMIT_NOFILE, (_NOFILE, _NOFILE))
    resource.setrlimit(resource.RLIMIT_FSIZE, (_FSIZE, _FSIZE))
    cap = lim["memory_mb"] << 20
    resource.setrlimit(resource.RLIMIT_AS, (cap, cap))
    resource.setrlimit(resource.RLIMIT_NPROC, (lim["pids"], lim["pids"]))


def _serve(sock: socket.socket, keep: bool, lim: dict) -> None:
    """Run in the call's own process: read calls (one, or an episode's, until the pool closes
    the socket), reply to each with its id."""
    proto_in, proto_out = sock.makefile("rb"), sock.makefile("wb")
    devnull = os.open(os.devnull, os.O_RDWR)
    os.dup2(devnull, 0)
    os.dup2(2, 1)  # a verifier's print goes to stderr, never into the protocol
    sys.stdin, sys.stdout = open(os.devnull), sys.stderr

    def reply(msg: dict) -> None:
        proto_out.write(json.dumps(msg, allow_nan=False).encode() + b"\n")
        proto_out.flush()

    for line in proto_in:
        req = json.loads(line)
        try:
            value = resolve(req["target"])(*req["args"])
            json.dumps(value, allow_nan=False)  # a reply the pool can read, or an error here
            reply({"id": req["id"], "ok": value})
        except MemoryError:
            mb = lim["memory_mb"]
            reply(
                {
                    "id": req["id"],
                    "err": f"MemoryError: over the sandbox's {mb} MiB",
                    "memory": True,
                }
            )
            os._exit(3)
        except BaseException as err:  # noqa: BLE001 - reported for this call
            reply({"id": req["id"], "err": f"{type(err).__name__}: {err}"})
        if not keep:
            break
    proto_out.flush()
    os._exit(0)


def _close_fds(keep: set[int]) -> None:
    for fd in map(int, os.listdir("/proc/self/fd") if os.path.isdir("/proc/self/fd") else []):
        if fd > 2 and fd not in keep:
            try:
                os.close(fd)
            except OSError:
                pass


class Template:
    """The loop: fork calls, watch their memory, kill on request, report ends."""

    def __init__(self, ctl: socket.socket, lim: dict):
        import asyncio  # noqa: F401 - what moerl's call functions import when called: once, here
        import inspect  # noqa: F401

        self.ctl, self.lim = ctl, lim
        self.isolated = lim["isolation"] != "none"
        if not self.isolated:  # a call's orphans come to the template, which ends them
            import ctypes

            ctypes.CDLL(None).prctl(36, 1, 0, 0, 0)  # PR_SET_CHILD_SUBREAPER
        self.calls: dict[int, dict[str, Any]] = {}  # pid -> {h, memory, scratch}
        self.imported: set[str] = set()
        self.mapping: dict[int, tuple[int, int]] = {}  # sync fd -> (call pid, its go-on fd)
        self.watch_s, self.watched = WATCH_S, 0.0
        # processes forked ahead, set up and waiting for a call: (pid, handoff socket, scratch)
        self.spares: list[tuple[int, socket.socket, str]] = []

    def send(self, msg: dict) -> None:
        try:
            self.ctl.send(json.dumps(msg).encode())
        except OSError:  # the pool is gone: so are its calls
            self.stop()

    def run(self) -> None:
        self.send({"ready": os.getpid(), "enforced": self.lim.get("enforced", "")})
        self.poll = select.poll()
        self.poll.register(self.ctl.fileno(), select.POLLIN)
        while True:
            for fd, ev in self.poll.poll(self.watch_s * 1000 if self.calls else 1000):
                if fd in self.mapping:  # a call has its user namespace: its maps, then go on
                    self.map(fd)
                elif ev & select.POLLIN:
                    msg, fds, _, _ = socket.recv_fds(self.ctl, 65536, 1)
                    if not msg:
                        return self.stop()
                    self.handle(json.loads(msg), fds)
                elif ev & (select.POLLHUP | select.POLLERR):
                    return self.stop()
            self.reap()
            if time.monotonic() - self.watched >= self.watch_s:
                self.watch()
            while len(self.spares) < self.lim.get("spares", 0):
                self.spares.append(self.spawn())

    def map(self, fd: int) -> None:
        pid, back = self.mapping.pop(fd)
        self.poll.unregister(fd)
        try:
            calls.map_call(pid, fd, back)
        except OSError:
            pass  # it died meanwhile: reaped and reported as any end
        finally:
            os.close(fd)
            os.close(back)

    def handle(self, msg: dict, fds: list[int]) -> None:
        if "kill" in msg:
            for pid, c in self.calls.items():
                if c["h"] == msg["kill"]:
                    self._kill(pid)
            return
        new = [n for n in msg.get("imports", []) if n not in self.imported]
        for name in new:  # warm the template: each call forks with it
            self.imported.add(name)
            try:
                resolve(name)
            except Exception:  # noqa: BLE001 - the call itself raises it, for its sample
                pass
        if new:  # forked before these imports: they would import them per call
            for pid, hand, _ in self.spares:
                self._kill(pid)
                hand.close()
            self.spares = []
        pid, hand, scratch = self.spares.pop(0) if self.spares else self.spawn()
        try:
            socket.send_fds(hand, [json.dumps({"keep": bool(msg.get("keep"))}).encode()], fds)
        except OSError:
            pass  # it died while waiting: reaped and reported as any end
        hand.close()
        os.close(fds[0])
        self.calls[pid] = {"h": msg["fork"], "memory": False, "scratch": scratch}
        self.send({"forked": msg["fork"]})

    def spawn(self) -> tuple[int, socket.socket, str]:
        """A process set up for a call (namespaces, mounts, limits), waiting on a handoff socket
        for the call's own socket."""
        gc.freeze()  # what the template holds: never scanned (so never copied) by a call's GC
        mine, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        pid, scratch = self.fork(theirs.fileno())
        theirs.close()
        return pid, mine, scratch

    def fork(self, hand: int) -> tuple[int, str]:
        scratch = "" if self.isolated else tempfile.mkdtemp(dir=os.getcwd())
        sync = os.pipe() if self.isolated else None
        back = os.pipe() if self.isolated else None
        pid = os.fork()
        if pid == 0:
            try:
                self.ctl.close()
                null = os.open(os.devnull, os.O_RDWR)
                for std in (0, 1):  # the control socket's copies; a received fd lands above
                    os.dup2(null, std)
                _close_fds({hand, *(sync or ()), *(back or ())})
                if self.isolated:
                    assert sync is not None and back is not None
                    calls.call_namespaces(sync[1], back[0], self.lim, hand)
                else:
                    os.setsid()
                    os.chdir(scratch)
                    os.environ["HOME"] = os.environ["TMPDIR"] = scratch
                msg, fds, _, _ = socket.recv_fds(socket.socket(fileno=hand), 4096, 1)
                if not msg or not fds:  # retired unused
                    os._exit(0)
                _limit(self.lim)
                _serve(socket.socket(fileno=fds[0]), json.loads(msg)["keep"], self.lim)
            except BaseException:  # noqa: BLE001 - said on stderr; the pool reads exit code 70
                import traceback

                traceback.print_exc()
            finally:
                os._exit(70)
        if sync is not None and back is not None:
            os.close(sync[1])
            os.close(back[0])
            self.mapping[sync[0]] = (pid, back[1])  # mapped once it has unshared (`map`)
            self.poll.register(sync[0], select.POLLIN)
        return pid, scratch

    def _kill(self, pid: int) -> None:
        """The call's processes: its pid 1 takes them along; without namespaces, its process
        group (it made one) and what descends from it."""
        if not self.isolated:
            try:
                os.killpg(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        for p in [pid] if self.isolated else _tree(pid, _parents()):
            _sigkill(p)

    def reap(self) -> None:
        while True:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            c = self.calls.pop(pid, None)
            if c is None:
                self._spare_gone(pid)
                continue
            if not self.isolated:  # what the call left behind: its group, the orphans
                try:
                    os.killpg(pid, signal.SIGKILL)
                except (ProcessLookupError, PermissionError):
                    pass
                kids = _parents()
                ours = {*self.calls, *(sp[0] for sp in self.spares)}
                for orphan in kids.get(os.getpid(), []):
                    if orphan not in ours:
                        for p in _tree(orphan, kids):
                            _sigkill(p)
                shutil.rmtree(c["scratch"], ignore_errors=True)
            sig = os.WTERMSIG(status) if os.WIFSIGNALED(status) else 0
            code = os.WEXITSTATUS(status) if os.WIFEXITED(status) else 0
            if self.isolated and 128 < code < 128 + signal.NSIG:  # pid 1 passes on a signal
                sig, code = code - 128, 0
            self.send({"exit": c["h"], "signal": sig, "code": code, "memory": c["memory"]})

    def _spare_gone(self, pid: int) -> None:
        for spare in [sp for sp in self.spares if sp[0] == pid]:
            self.spares.remove(spare)
            spare[1].close()
            if spare[2]:
                shutil.rmtree(spare[2], ignore_errors=True)

    def watch(self) -> None:
        """Kill each call whose processes together hold more than memory_mb resident."""
        if not self.calls:
            return
        t0 = self.watched = time.monotonic()
        parents = _parents()
        page = os.sysconf("SC_PAGE_SIZE")
        for pid, c in list(self.calls.items()):
            if c["memory"]:
                continue
            total = sum(_anon_pages(p) for p in _tree(pid, parents)) * page
            if total > self.lim["memory_mb"] << 20:
                c["memory"] = True
                self._kill(pid)
        # at most a quarter of a core on looking, however many processes there are
        self.watch_s = max(WATCH_S, 4 * (time.monotonic() - t0))

    def stop(self) -> None:
        for pid in [*self.calls, *(sp[0] for sp in self.spares)]:
            self._kill(pid)
        for c in self.calls.values():
            if c["scratch"]:
                shutil.rmtree(c["scratch"], ignore_errors=True)
        os._exit(0)


def _sigkill(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def _parents() -> dict[int, list[int]]:
    kids: dict[int, list[int]] = {}
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                with open(f"/proc/{d}/stat", "rb") as f:
                    ppid = int(f.read().rsplit(b")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            kids.setdefault(ppid, []).append(int(d))
    return kids


def _tree(pid: int, kids: dict[int, list[int]]) -> list[int]:
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        todo.extend(kids.get(p, ()))
    return out


def _anon_pages(pid: int) -> int:
    """Resident pages not backed by a file (statm's resident minus shared)."""
    try:
        with open(f"/proc/{pid}/statm") as f:
            fields = f.read().split()
        return max(0, int(fields[1]) - int(fields[2]))
    except (OSError, IndexError, ValueError):
        return 0


def _has_caps() -> bool:
    with open("/proc/self/status") as f:
        return any(line.startswith("CapEff:") and int(line.split()[1], 16) != 0 for line in f)


def main(lim: dict) -> None:
    ctl = socket.socket(fileno=0)
    if lim["isolation"] == "namespaces":
        if not lim.get("mapped"):
            msg = ctl.recv(65536)  # the pool writes our uid/gid maps, then says go
            if json.loads(msg or b"{}").get("go") is None:
                os._exit(2)
            if not _has_caps():  # exec'd before the maps: exec again, as the namespace's root
                lim["mapped"] = True
                os.execv(sys.executable, [sys.executable, "-m", __spec__.name, json.dumps(lim)])
        lim["enforced"] = iso.enter(os.getcwd(), ctl, lim)  # returns in the template
    else:
        os.makedirs(os.getcwd(), exist_ok=True)
        lim["enforced"] = "none"
    Template(ctl, lim).run()


if __name__ == "__main__":
    main(json.loads(sys.argv[1]))
    time.sleep(0)
