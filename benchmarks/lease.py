"""`moerl bench lease`: what leasing a unit costs a rollout worker as the run's pending list
grows, the bus's way against the way it used before, side by side on one embedded Valkey
(append-only file fsynced on every write, as deployed).

Design, details and limitations: docs/bench-reports/lease.md#how-it-works-benchmarksleasepy.
"""

from __future__ import annotations

import statistics
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from benchmarks import envelope, format_table, write_report

VISIBILITY_S = 120.0  # the default `units.visibility_timeout_s`: nothing pending goes idle here


def _prompt(i: int) -> dict[str, Any]:
    return {"id": f"p{i}", "task": "copy", "prompt": f"copy {i}", "answer": str(i)}


def _commands(admin) -> int:
    """The server's count of commands processed (this INFO call included)."""
    return int(admin.info("stats")["total_commands_processed"])


def _lease_by_xautoclaim(bus, consumer: str) -> Any:
    """The previous `lease_unit`: XAUTOCLAIM pages from the start of the pending list, then a new
    entry, then its delivery count from XPENDING."""
    from moerl.bus import UNITS
    from moerl.bus.run import GROUPS

    key, group, start = bus.key(UNITS), GROUPS[UNITS], "0-0"
    for _ in range(100_000):
        reply = bus.r.xautoclaim(key, group, consumer, bus.visibility_ms, start_id=start, count=1)
        if any(fields for _, fields in reply[1]):
            return reply[1][0][0]
        start = reply[0]
        if start == "0-0":
            break
    got = bus.r.xreadgroup(group, consumer, {key: ">"}, count=1, block=None)
    eid = got[0][1][0][0] if got else None
    if eid is not None:
        bus.r.xpending_range(key, group, min=eid, max=eid, count=1)
    return eid


def _arm(admin, bus, leases: int, way: str) -> dict[str, Any]:
    for i in range(leases):
        bus.issue_unit([_prompt(i)])
    walls, leased = [], 0
    c0 = _commands(admin)
    for _ in range(leases):
        t0 = time.perf_counter()
        got = (
            _lease_by_xautoclaim(bus, "w-new")
            if way == "xautoclaim"
            else bus.lease_unit("w-new", block_ms=0)
        )
        walls.append(time.perf_counter() - t0)
        leased += got is not None
    commands = _commands(admin) - c0 - 1  # less the second INFO
    walls.sort()
    return {
        "way": way,
        "leases": leased,
        "commands_per_lease": commands / leases,
        "median_ms": statistics.median(walls) * 1000,
        "p90_ms": walls[min(len(walls) - 1, int(0.9 * len(walls)))] * 1000,
    }


def run_bench_lease(
    pending: str | Sequence[int] = (0, 256, 1024, 4096),
    leases: int = 50,
    out: Path = Path("bench/lease.json"),
    echo=print,
) -> dict[str, Any]:
    """Both ways at each pending-list length; the report (also written to `out`).

    Args:
        pending: pending-list lengths (units other workers hold), comma-separated
        leases: leases timed at each length, each way
        out: the report (JSON)
    """
    import valkey

    from moerl.bus import EmbeddedValkey, RunBus, connect
    from moerl.errors import ConfigError

    if isinstance(pending, str):
        try:
            pending = [int(x) for x in pending.split(",") if x.strip()]
        except ValueError:
            raise ConfigError(
                f"--pending must be comma-separated integers, got {pending!r}"
            ) from None
    if leases < 1:
        raise ConfigError(f"--leases: {leases}; allowed: an integer >= 1")
    if not pending or any(n < 0 for n in pending):
        raise ConfigError(f"--pending: {list(pending)}; allowed: one or more lengths >= 0")
    rows = []
    with tempfile.TemporaryDirectory(prefix="moerl-bench-lease-") as tmp:
        server = EmbeddedValkey(Path(tmp) / "valkey").start()
        try:
            # the loopback admin reads the server's counts
            admin = valkey.Valkey.from_url(server.url)
            for n in pending:
                row: dict[str, Any] = {"pending": n}
                for way in ("xautoclaim", "bus"):
                    bus = RunBus(
                        connect(server.url, 30.0),
                        f"bench-lease-{way}-{n}",
                        visibility_timeout_s=VISIBILITY_S,
                    )
                    bus.ensure_groups()
                    # leased by other workers, busy: never idle within the window
                    for i in range(n):
                        bus.issue_unit([_prompt(i)])
                    for i in range(n):
                        bus.lease_unit(f"w-{i % 64}", block_ms=0)
                    row[way] = _arm(admin, bus, leases, way)
                    if row[way]["leases"] != leases:
                        raise RuntimeError(
                            f"bench lease: the {way} way leased {row[way]['leases']} of {leases} units"
                        )
                row["median_ratio"] = row["xautoclaim"]["median_ms"] / row["bus"]["median_ms"]
                rows.append(row)
                echo(
                    f"[bench lease] pending {n}: {row['xautoclaim']['commands_per_lease']:.1f} -> "
                    f"{row['bus']['commands_per_lease']:.1f} commands per lease"
                )
        finally:
            server.stop()
    report = envelope("lease", True, leases=leases, visibility_timeout_s=VISIBILITY_S, rows=rows)
    write_report(out, report)
    echo(
        format_table(
            [
                "pending",
                "xautoclaim: cmds/lease",
                "median ms",
                "p90 ms",
                "bus: cmds/lease",
                "median ms",
                "p90 ms",
                "x faster",
            ],
            [
                [
                    r["pending"],
                    r["xautoclaim"]["commands_per_lease"],
                    r["xautoclaim"]["median_ms"],
                    r["xautoclaim"]["p90_ms"],
                    r["bus"]["commands_per_lease"],
                    r["bus"]["median_ms"],
                    r["bus"]["p90_ms"],
                    r["median_ratio"],
                ]
                for r in rows
            ],
        )
    )
    echo(f"report: {out}")
    return report
