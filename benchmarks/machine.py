"""What machine a benchmark ran on, in every report (`envelope`): CPU model, cores, whether the
cores this process may use are SMT siblings (hyperthreads of one physical core), memory and load.

Read from /proc and /sys (Linux); elsewhere the fields it cannot read are None. A ratio measured on
two SMT siblings (one physical core) is not comparable with one on two physical cores: the
record lets a reader tell a machine effect from a regression.
"""

from __future__ import annotations

import os
import platform
from pathlib import Path
from typing import Any

SYS_CPU = Path("/sys/devices/system/cpu")


def _read(path: Path) -> str | None:
    try:
        return path.read_text().strip()
    except OSError:
        return None


def cpu_list(text: str) -> list[int]:
    """A kernel CPU list ('0-3,8,10-11') as its CPU numbers."""
    out: list[int] = []
    for part in (p.strip() for p in text.split(",")):
        if "-" in part:
            lo, hi = part.split("-")
            out += range(int(lo), int(hi) + 1)
        elif part:
            out.append(int(part))
    return out


def cpu_model(cpuinfo: str | None = None) -> str | None:
    """The first `model name` of /proc/cpuinfo (else the platform's processor string)."""
    if cpuinfo is None:
        cpuinfo = _read(Path("/proc/cpuinfo")) or ""
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        if key.strip() in ("model name", "Model", "cpu model"):
            return value.strip()
    return platform.processor() or None


def usable_cpus() -> list[int]:
    if hasattr(os, "sched_getaffinity"):
        return sorted(os.sched_getaffinity(0))
    return list(range(os.cpu_count() or 1))


def smt_groups(cpus: list[int], root: Path = SYS_CPU) -> list[list[int]] | None:
    """The usable CPUs grouped by physical core (each group the CPUs of one core that are
    usable here), from each CPU's topology/thread_siblings_list; None where it is not readable."""
    groups: dict[tuple[int, ...], list[int]] = {}
    for cpu in cpus:
        text = _read(root / f"cpu{cpu}" / "topology" / "thread_siblings_list")
        if text is None:
            return None
        key = tuple(cpu_list(text))
        groups.setdefault(key, []).append(cpu)
    return sorted(groups.values())


def _mem_gib() -> float | None:
    for line in (_read(Path("/proc/meminfo")) or "").splitlines():
        if line.startswith("MemTotal:"):
            return round(int(line.split()[1]) / 2**20, 1)
    return None


def machine_record() -> dict[str, Any]:
    """The machine this process runs on, as a report's `machine` field."""
    cpus = usable_cpus()
    groups = smt_groups(cpus)
    load = os.getloadavg() if hasattr(os, "getloadavg") else None
    return {
        "cpu_model": cpu_model(),
        "logical_cpus": os.cpu_count(),
        "usable_cpus": len(cpus),
        "physical_cores_usable": len(groups) if groups is not None else None,
        # True: some usable CPUs are hyperthreads of one core (they share its execution units)
        "smt_siblings": any(len(g) > 1 for g in groups) if groups is not None else None,
        "core_groups": [",".join(map(str, g)) for g in groups] if groups is not None else None,
        "memory_gib": _mem_gib(),
        "load_avg_1m_at_start": round(load[0], 2) if load else None,
        "platform": platform.platform(),
    }


def machine_line(record: dict[str, Any]) -> str:
    """One line for a summary: model, cores, SMT, memory, load."""
    smt = record.get("smt_siblings")
    siblings = {True: "some are SMT siblings", False: "no SMT siblings", None: "SMT unknown"}[smt]
    return (
        f"machine: {record.get('cpu_model') or 'unknown CPU'}; {record.get('usable_cpus')} usable "
        f"CPUs on {record.get('physical_cores_usable') or '?'} physical cores ({siblings}: "
        f"{' | '.join(record.get('core_groups') or [])}); {record.get('memory_gib')} GiB; "
        f"load {record.get('load_avg_1m_at_start')} at start"
    )
