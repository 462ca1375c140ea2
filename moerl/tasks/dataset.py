"""Prompt datasets: loading and validating a user's file or a shipped one.

Design, details and limitations: docs/tasks.md#moerltasksdatasetpy.
"""

from __future__ import annotations

import json
import random
from collections.abc import Iterator
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import BinaryIO

from pydantic import ValidationError

from moerl.errors import DataError
from moerl.records import Prompt, R
from moerl.userfiles import FileProblem, decode_text, kind_problem, one_line


@dataclass(frozen=True)
class Dataset:
    rows: list[Prompt]
    source: str
    bad_rows: int

    def batch(self, iteration: int, size: int, seed: int) -> list[Prompt]:
        """The prompts of `iteration`: a seeded permutation read with a cursor, so a run (and a
        resumed run) sees every prompt once per epoch in the same order."""
        return self.window(iteration * size, size, seed)

    def window(self, start: int, size: int, seed: int) -> list[Prompt]:
        """`size` prompts from position `start` of the seeded order (the async mode's cursor)."""
        order = list(range(len(self.rows)))
        random.Random(seed).shuffle(order)
        return [self.rows[order[(start + j) % len(order)]] for j in range(size)]


def resolve_path(
    spec: str, field: str = "task.dataset", rows: str = "{id, task, prompt, answer}"
) -> Path:
    """`builtin:<name>` (a file shipped in moerl/data) or a path to a user's regular file; a
    DataError naming `field` otherwise."""
    if spec.startswith("builtin:"):
        name = spec.removeprefix("builtin:")
        known = sorted(
            x.name.removesuffix(".jsonl")
            for x in resources.files("moerl.tasks.data").iterdir()
            if x.name.endswith(".jsonl")
        )
        # Only the names listed: "builtin:../x" must not reach outside the package.
        if name not in known:
            raise DataError(
                f"{field}: no builtin dataset {one_line(repr(name))}; builtin: {', '.join(known)}"
            )
        return Path(str(resources.files("moerl.tasks.data").joinpath(f"{name}.jsonl")))
    p = Path(spec).expanduser()
    what = kind_problem(p)
    if what == "does not exist":
        raise DataError(f"{field}: file not found: {p}")
    if what:
        raise DataError(f"{field}: {p} {what}; expected a JSONL file of {rows} rows")
    return p


MAX_LINE_BYTES = 1 << 20  # 1 MiB: a prompt row is a few hundred bytes; longer is a wrong file


def _lines(f: BinaryIO) -> Iterator[tuple[int, bytes | None]]:
    """(line number, raw line) for each line; None for a line over MAX_LINE_BYTES, whose rest
    is skipped in bounded reads, so a file with no newline never fills memory."""
    lineno = 0
    while chunk := f.readline(MAX_LINE_BYTES + 1):
        lineno += 1
        if len(chunk) <= MAX_LINE_BYTES or chunk.endswith(b"\n"):
            yield lineno, chunk
            continue
        while chunk and not chunk.endswith(b"\n"):
            chunk = f.readline(MAX_LINE_BYTES)
        yield lineno, None


def json_line(raw: bytes | None) -> object:
    """One line of a JSONL file (from `_lines`) decoded, or FileProblem saying why not."""
    if raw is None:
        raise FileProblem(f"longer than {MAX_LINE_BYTES // (1 << 20)} MiB")
    text = decode_text(raw, single_line=True)
    try:
        return json.loads(text)
    except json.JSONDecodeError as err:
        raise FileProblem(f"not JSON ({err.msg} at column {err.colno})") from None
    except RecursionError:
        raise FileProblem("JSON nested too deeply") from None


def validate_row(cls: type[R], obj: object, rows: str) -> R:
    """`obj` as a `cls` record, or FileProblem naming the first bad field and the schema."""
    try:
        return cls.model_validate(obj)
    except ValidationError as err:
        e = err.errors(include_url=False)[0]
        where = ".".join(str(x) for x in e["loc"]) or "row"
        raise FileProblem(one_line(f"{where}: {e['msg']}; a row is {rows}")) from None


def _parse_row(raw: bytes | None) -> Prompt:
    """One dataset row, or FileProblem saying why the line is malformed."""
    row = validate_row(Prompt, json_line(raw), "{id, task, prompt, answer}")
    if any(
        "\x00" in v
        for v in (
            row.id,
            row.task,
            row.prompt,
            row.answer,
            *(m.content for m in row.messages or []),
        )
    ):
        raise FileProblem("a field holds a NUL character (\\u0000)")
    return row


def load_dataset(spec: str, max_bad_fraction: float) -> Dataset:
    """Load a JSONL prompt dataset, skipping and counting malformed rows."""
    path = resolve_path(spec)
    rows: list[Prompt] = []
    bad = 0
    first_bad: str | None = None
    try:
        with path.open("rb") as f:
            for lineno, raw in _lines(f):
                if raw is not None and not raw.strip():
                    continue
                try:
                    rows.append(_parse_row(raw))
                except FileProblem as problem:
                    bad += 1
                    if first_bad is None:
                        first_bad = f"line {lineno}: {str(problem).removeprefix('is ')}"
    except OSError as err:
        raise DataError(f"task.dataset: cannot read {path} ({err.strerror or err})") from None
    total = len(rows) + bad
    if total == 0:
        raise DataError(f"task.dataset: {path} has no rows (the file is empty or blank)")
    if bad / total > max_bad_fraction:
        raise DataError(
            f"task.dataset: {bad} of {total} rows in {path} are malformed "
            f"({bad / total:.1%} > task.max_bad_fraction {max_bad_fraction:.1%}); first: {first_bad}"
        )
    return Dataset(rows=rows, source=str(path), bad_rows=bad)
