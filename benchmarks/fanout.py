"""`moerl bench fanout`: what the fan-out's bookkeeping costs Valkey for one version, the way it
is kept now against the way it was kept before, side by side on one embedded Valkey
(append-only file fsynced on every write, as deployed).

Design, details and limitations: docs/bench-reports/fanout.md#how-it-works-benchmarksfanoutpy.
"""

from __future__ import annotations

import random
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks import envelope, format_table, write_report

VERSION, SHA = 1, "0" * 64
OLD_HAVE_TTL_S = 24 * 3600


class _Before:
    """The bookkeeping `moerl.store.fanout` used before (its baseline; not used by any worker)."""

    def __init__(self, bus, names: list[str], clock) -> None:  # noqa: ANN001
        self.bus, self.names, self.clock = bus, names, clock
        # each node: its holders map (chunk -> peers holding it) and when it was read
        self.state: dict[str, dict[str, Any]] = {
            n: {"holders": {}, "at": float("-inf")} for n in names
        }
        self.unsent: dict[str, list[int]] = {n: [] for n in names}
        self.refreshes = 0

    def _key(self, peer: str) -> str:
        return self.bus.key(f"fanout:have:{VERSION}:{SHA}:{peer}")

    def _holders(self, me: str) -> dict[int, list[str]]:
        out: dict[int, list[str]] = {}
        for peer in self.names:
            if peer != me:
                for i in self.bus.r.smembers(self._key(peer)):
                    out.setdefault(int(i), []).append(peer)
        return out

    def chunk(self, me: str, i: int) -> None:
        st = self.state[me]
        age = self.clock() - st["at"]
        if age > 0.5 or (i not in st["holders"] and age > 0.02):
            st["holders"], st["at"] = self._holders(me), self.clock()
            self.refreshes += 1
        source = "peer" if st["holders"].get(i) else "cache"
        self.bus.incr(**{f"fanout_chunks_{source}": 1})
        self.bus.r.sadd(self._key(me), i)
        self.bus.r.expire(self._key(me), OLD_HAVE_TTL_S)

    def skip(self, me: str, i: int) -> None:
        self.unsent[me].append(i)

    def sync(self, rng: random.Random) -> None:
        for me, idx in self.unsent.items():
            if idx:
                self.bus.r.sadd(self._key(me), *idx)
            self.unsent[me] = []
        for me in self.names:
            self.state[me] = {
                "holders": self._holders(me),
                "at": self.clock() - rng.uniform(0, 0.5),
            }

    def finish(self, me: str) -> None:
        pass

    def reads(self) -> int:
        return self.refreshes * (len(self.names) - 1)


class _After:
    """The bookkeeping the workers run (`moerl.store.fanout_book`)."""

    def __init__(self, bus, names: list[str], clock) -> None:  # noqa: ANN001
        from moerl.store.fanout_book import Book, Holders

        self.names = names
        self.books = {n: Book(bus, n, clock=clock) for n in names}
        self.views = {
            n: Holders(self.books[n], VERSION, SHA, [p for p in names if p != n]) for n in names
        }
        self.clock = clock
        self.refreshes = 0  # in the measured windows

    def chunk(self, me: str, i: int) -> None:
        view, book = self.views[me], self.books[me]
        before = view.refreshes
        source = "peer" if view.of(i) else "cache"
        self.refreshes += view.refreshes - before
        book.count(source)
        book.announce(VERSION, SHA, [i])
        book.flush_if_due()

    def skip(self, me: str, i: int) -> None:
        self.books[me].announce(VERSION, SHA, [i])

    def sync(self, rng: random.Random) -> None:
        from moerl.store.fanout_book import REFRESH_S

        for book in self.books.values():
            book.flush()
        for view in self.views.values():
            view._bits = view.book.read(VERSION, SHA, view.peers)
            view._at = self.clock() - rng.uniform(0, REFRESH_S)

    def finish(self, me: str) -> None:
        self.books[me].flush()  # before the copy is declared assembled

    def reads(self) -> int:
        return self.refreshes * (len(self.names) - 1)


def _snapshot(admin) -> dict[str, Any]:  # noqa: ANN001
    stats, cpu = admin.info("commandstats"), admin.info("cpu")
    return {
        "calls": {k.removeprefix("cmdstat_"): int(v["calls"]) for k, v in stats.items()},
        "cpu_s": float(cpu["used_cpu_sys"]) + float(cpu["used_cpu_user"]),
        "out_bytes": int(admin.info("stats")["total_net_output_bytes"]),
    }


def _delta(a: dict[str, Any], b: dict[str, Any]) -> dict[str, Any]:
    calls = {k: n - a["calls"].get(k, 0) for k, n in b["calls"].items() if k != "info"}
    return {
        "calls": {k: n for k, n in calls.items() if n},
        "cpu_s": b["cpu_s"] - a["cpu_s"],
        "out_bytes": b["out_bytes"] - a["out_bytes"],
    }


def _schedule(
    peers: int, chunks: int, version_s: float, rng: random.Random
) -> list[tuple[float, int, int]]:
    """(time, peer, chunk) of every chunk, in time order: the rotated order at each peer's pace."""
    dt = version_s / chunks
    events = []
    for k in range(peers):
        pace, start = dt * rng.uniform(0.9, 1.1), rng.uniform(0.0, 0.2)
        first = k * chunks // peers
        events += [(start + (j + 1) * pace, k, (first + j) % chunks) for j in range(chunks)]
    events.sort()
    return events


def _arm(
    way: str,
    admin,
    bus,
    peers: int,
    events,
    windows: list[tuple[float, float]],  # noqa: ANN001
    seed: int,
) -> dict[str, Any]:
    names = [f"rollout-{k:02d}" for k in range(peers)]
    now = [0.0]
    arm = (_Before if way == "before" else _After)(bus, names, lambda: now[0])
    rng = random.Random(seed)
    total: dict[str, Any] = {"calls": {}, "cpu_s": 0.0, "out_bytes": 0}
    wall, e = 0.0, 0
    for lo, hi in windows:
        while e < len(events) and events[e][0] < lo:  # before the window: state only, unmeasured
            now[0] = events[e][0]
            arm.skip(names[events[e][1]], events[e][2])
            e += 1
        now[0] = lo
        arm.sync(rng)
        a, t0 = _snapshot(admin), time.perf_counter()
        while e < len(events) and events[e][0] < hi:
            t, k, i = events[e]
            now[0] = t
            arm.chunk(names[k], i)
            e += 1
        if hi == float("inf"):
            for name in names:
                arm.finish(name)
        wall += time.perf_counter() - t0
        d = _delta(a, _snapshot(admin))
        for c, n in d["calls"].items():
            total["calls"][c] = total["calls"].get(c, 0) + n
        total["cpu_s"] += d["cpu_s"]
        total["out_bytes"] += d["out_bytes"]
    total["commands"] = sum(total["calls"].values())
    total["refreshes"] = arm.refreshes
    total["reads"] = arm.reads()
    total["wall_s"] = wall
    return total


def run_bench_fanout(
    out: Path = Path("bench/fanout.json"),
    peers: int = 32,
    chunks: int = 7000,
    version_s: float = 75.0,
    windows: int = 4,
    window_s: float = 1.0,
    seed: int = 0,
    echo=print,
) -> dict[str, Any]:
    """Both ways on one embedded Valkey; the report (also written to `out`).

    Args:
        out: the report (JSON)
        peers: rollout workers fetching the version
        chunks: chunks per version (Qwen3-235B at 64 MiB: ~7,000)
        version_s: virtual seconds one version's fetch takes
        windows: measured windows spread over the version (0: all of it)
        window_s: virtual seconds per measured window
        seed: the simulated peers' random seed
    """
    import valkey

    from moerl.bus import EmbeddedValkey, RunBus, connect
    from moerl.errors import ConfigError

    if peers < 2:
        raise ConfigError(f"--peers: {peers}; allowed: an integer >= 2")
    if chunks < 1:
        raise ConfigError(f"--chunks: {chunks}; allowed: an integer >= 1")
    if not version_s > 0 or not window_s > 0:
        raise ConfigError(f"--version-s {version_s}, --window-s {window_s}: allowed: seconds > 0")
    if windows < 0 or windows * window_s > version_s:
        raise ConfigError(
            f"--windows {windows} x --window-s {window_s} s: allowed: 0 (the whole version) or "
            f"windows that fit in --version-s {version_s} s"
        )
    rng = random.Random(seed)
    events = _schedule(peers, chunks, version_s, rng)
    span = events[-1][0]
    if windows == 0:
        spans = [(float("-inf"), float("inf"))]
        measured_s = span
    else:
        spans = [
            ((w + 0.5) * span / windows - window_s / 2, (w + 0.5) * span / windows + window_s / 2)
            for w in range(windows)
        ]
        measured_s = windows * window_s
    scale = span / measured_s
    arms: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="moerl-bench-fanout-") as tmp:
        server = EmbeddedValkey(Path(tmp) / "valkey").start()
        try:
            # the loopback admin reads the server's counts
            admin = valkey.Valkey.from_url(server.url)
            for way in ("before", "after"):
                bus = RunBus(connect(server.url, 30.0), f"bench-fanout-{way}")
                m = _arm(way, admin, bus, peers, events, spans, seed)
                arms[way] = {
                    "measured": m,
                    "per_version": {
                        "commands": m["commands"] * scale,
                        "valkey_cpu_s": m["cpu_s"] * scale,
                        "bytes_sent": m["out_bytes"] * scale,
                        "reads": m["reads"] * scale,
                        "refreshes_per_peer": m["refreshes"] * scale / peers,
                        "commands_per_s": m["commands"] / measured_s,
                        "valkey_cpu_share": m["cpu_s"] / measured_s,
                    },
                }
                echo(
                    f"[bench fanout] {way}: {m['commands']:,} commands, {m['cpu_s']:.3f} s Valkey CPU in "
                    f"{measured_s:.1f} virtual s (bench wall {m['wall_s']:.1f} s)"
                )
        finally:
            server.stop()
    b, a = arms["before"]["per_version"], arms["after"]["per_version"]
    ratios = {
        k: (b[k] / a[k] if a[k] else None) for k in ("commands", "valkey_cpu_s", "bytes_sent")
    }
    am = arms["after"]["measured"]
    # GETs of the bitmaps: every counter script (moerl/bus/scripts.py, _ONCE) runs one GET of its
    # operation key, so those are taken out
    bitmap_gets = am["calls"].get("get", 0) - am["calls"].get("evalsha", 0)
    per_refresh = bitmap_gets / am["refreshes"] if am["refreshes"] else None
    report = envelope(
        "fanout",
        True,
        peers=peers,
        chunks=chunks,
        version_s=span,
        windows=windows,
        window_s=window_s,
        measured_s=measured_s,
        scale=scale,
        seed=seed,
        before=arms["before"],
        after=arms["after"],
        ratios=ratios,
        after_bitmap_gets=bitmap_gets,
        after_gets_per_refresh=per_refresh,
    )
    write_report(out, report)
    rows = [
        ["Valkey commands", round(b["commands"]), round(a["commands"]), ratios["commands"]],
        ["  of which reads (SMEMBERS / GET)", round(b["reads"]), round(a["reads"]), None],
        ["Valkey CPU s", b["valkey_cpu_s"], a["valkey_cpu_s"], ratios["valkey_cpu_s"]],
        ["MB sent by Valkey", b["bytes_sent"] / 1e6, a["bytes_sent"] / 1e6, ratios["bytes_sent"]],
        ["looks at the peers, per peer", b["refreshes_per_peer"], a["refreshes_per_peer"], None],
        [
            "commands / s (while fetching)",
            round(b["commands_per_s"]),
            round(a["commands_per_s"]),
            None,
        ],
        ["Valkey CPU share (while fetching)", b["valkey_cpu_share"], a["valkey_cpu_share"], None],
    ]
    echo(
        f"one version: {peers} peers x {chunks} chunks over {span:.0f} s "
        f"({'measured whole' if windows == 0 else f'{windows} windows of {window_s} s, x{scale:.1f}'})"
    )
    echo(format_table(["per version", "before", "after", "before / after"], rows))
    echo(f"report: {out}")
    return report
