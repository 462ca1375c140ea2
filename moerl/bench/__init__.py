"""Benchmark reports: one JSON file per benchmark and a plain-text table on stdout.

Every `moerl bench ...` command prints a table to read and writes the same numbers, with the
versions it ran on, as JSON to `--out`. The helpers here keep that shape in one place.

Limitations: the benches that predate this package (`moerl bench weights`, `dispatch`,
`ep-memory`) keep their own writers; new benches should use these.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Sequence


def write_report(out: Path, report: dict[str, Any]) -> Path:
    """Write `report` as indented JSON to `out` (parents created); returns `out`."""
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2, sort_keys=False) + "\n")
    return out


def cell(value: Any, digits: int = 2) -> str:
    """A table cell: floats rounded to `digits`, None as '-', anything else as str."""
    if value is None:
        return "-"
    if isinstance(value, bool):
        return "ok" if value else "FAIL"
    if isinstance(value, float):
        return f"{value:.{digits}f}"
    return str(value)


def format_table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """Columns right-aligned to their widest cell, a rule under the header."""
    text = [[str(h) for h in headers]] + [[cell(v) for v in r] for r in rows]
    widths = [max(len(r[i]) for r in text) for i in range(len(headers))]
    lines = ["  ".join(c.rjust(w) for c, w in zip(r, widths)) for r in text]
    lines.insert(1, "-" * len(lines[0]))
    return "\n".join(lines)
