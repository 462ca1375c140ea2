"""Network byte counters for benchmarks: the EFA NICs where present, the kernel's interface
counters otherwise.

Design, details and limitations: docs/bench-reports/suite.md#how-it-works-benchmarksnetiopy.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path

IB_ROOT = Path("/sys/class/infiniband")
PROC_NET_DEV = Path("/proc/net/dev")


@dataclass(frozen=True)
class Snapshot:
    source: str  # "rdma:<dev>,..." or "proc-net-dev:<ifaces>"
    tx_bytes: int
    rx_bytes: int
    t: float = field(default_factory=time.perf_counter)


def _read_int(p: Path) -> int | None:
    try:
        return int(p.read_text().strip())
    except (OSError, ValueError):
        return None


def rdma_counters(root: Path = IB_ROOT) -> tuple[list[str], int, int] | None:
    """(devices, tx bytes, rx bytes) summed over every RDMA port under `root`; None without any."""
    if not root.is_dir():
        return None
    devs, tx, rx = [], 0, 0
    for dev in sorted(root.iterdir()):
        for port in sorted((dev / "ports").glob("*")):
            hw_tx, hw_rx = (
                _read_int(port / "hw_counters" / "tx_bytes"),
                _read_int(port / "hw_counters" / "rx_bytes"),
            )
            if hw_tx is not None and hw_rx is not None:  # EFA: bytes
                tx, rx = tx + hw_tx, rx + hw_rx
                devs.append(f"{dev.name}/{port.name}")
                continue
            ib_tx = _read_int(port / "counters" / "port_xmit_data")
            ib_rx = _read_int(port / "counters" / "port_rcv_data")
            if ib_tx is not None and ib_rx is not None:  # IB: 4-byte words
                tx, rx = tx + 4 * ib_tx, rx + 4 * ib_rx
                devs.append(f"{dev.name}/{port.name}")
    return (devs, tx, rx) if devs else None


def proc_net_dev(text: str) -> dict[str, tuple[int, int]]:
    """Parse /proc/net/dev: {interface: (rx bytes, tx bytes)}."""
    out = {}
    for line in text.splitlines()[2:]:
        if ":" not in line:
            continue
        name, rest = line.split(":", 1)
        cols = rest.split()
        if len(cols) >= 9:
            out[name.strip()] = (int(cols[0]), int(cols[8]))
    return out


def snapshot(ib_root: Path = IB_ROOT, net_dev: Path = PROC_NET_DEV) -> Snapshot:
    """The RDMA NICs' counters where any exist, else every interface's in /proc/net/dev."""
    rdma = rdma_counters(ib_root)
    if rdma is not None:
        devs, tx, rx = rdma
        return Snapshot(f"rdma:{','.join(devs)}", tx, rx)
    ifaces = proc_net_dev(net_dev.read_text())
    return Snapshot(
        f"proc-net-dev:{','.join(sorted(ifaces))}",
        sum(t for _, t in ifaces.values()),
        sum(r for r, _ in ifaces.values()),
    )


def delta(before: Snapshot, after: Snapshot) -> dict[str, float | str]:
    """Bytes and rates between two snapshots of the same source."""
    if before.source != after.source:
        raise ValueError(f"counter sources differ: {before.source} vs {after.source}")
    dt = max(after.t - before.t, 1e-9)
    tx, rx = after.tx_bytes - before.tx_bytes, after.rx_bytes - before.rx_bytes
    return {
        "source": after.source,
        "tx_bytes": tx,
        "rx_bytes": rx,
        "seconds": dt,
        "tx_mb_s": tx / dt / 1e6,
        "rx_mb_s": rx / dt / 1e6,
    }
