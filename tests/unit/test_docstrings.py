"""Module docstrings stay short: what the module is for, and a link to the doc with the design.

The design lives in docs/, each fact in one place; a module docstring that grows past
MAX_LINES is repeating it.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("moerl", "components", "pipelines", "kernels", "benchmarks")
MAX_LINES = 15

# Not temporary: these benchmarks print part of their own docstring (methodology, formulas) in
# their reports, so the docstring is data the code reads (`__doc__`), not a summary.
DOCSTRING_IS_DATA = frozenset(
    {
        "benchmarks/dispatch.py",
        "benchmarks/ep_memory.py",
        "benchmarks/memfit.py",
        "benchmarks/project.py",
        "benchmarks/redistribution.py",
    }
)

# Temporary: long docstrings not yet moved into docs/. Remove each entry as it is shrunk; the
# last test fails on an entry that no longer needs it.
NOT_YET_SHRUNK = frozenset[str]()

ALLOWED = NOT_YET_SHRUNK | DOCSTRING_IS_DATA


def docstring_lines(path: Path) -> int:
    """Lines in the module docstring of `path` (0 when it has none)."""
    doc = ast.get_docstring(ast.parse(path.read_text(encoding="utf-8")))
    return len(doc.strip().splitlines()) if doc else 0


def module_docstring_lengths() -> dict[str, int]:
    lengths = {}
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            rel = path.relative_to(ROOT).as_posix()
            lengths[rel] = docstring_lines(path)
    return lengths


def test_docstring_lines_counts_the_docstring_only(tmp_path: Path) -> None:
    module = tmp_path / "m.py"
    module.write_text('"""One.\n\nTwo.\nThree.\n"""\n\nx = """not\na\ndocstring"""\n')
    assert docstring_lines(module) == 4
    module.write_text("x = 1\n")
    assert docstring_lines(module) == 0


def test_module_docstrings_are_short() -> None:
    lengths = module_docstring_lengths()
    assert len(lengths) > 50, "the packages were not found"
    too_long = {p: n for p, n in lengths.items() if n > MAX_LINES and p not in ALLOWED}
    assert not too_long, (
        f"module docstrings over {MAX_LINES} lines (say what the module is for and link the doc "
        f"that holds the design): {too_long}"
    )


def test_docstring_data_is_still_read() -> None:
    for rel in DOCSTRING_IS_DATA:
        assert "__doc__" in (ROOT / rel).read_text(encoding="utf-8"), f"{rel} no longer reads it"


def test_not_yet_shrunk_holds_only_long_docstrings() -> None:
    lengths = module_docstring_lengths()
    stale = sorted(p for p in NOT_YET_SHRUNK if lengths.get(p, 0) <= MAX_LINES)
    assert not stale, f"remove these from the allow-list in {Path(__file__).name}: {stale}"
