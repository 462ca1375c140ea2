"""Reading what a user hands to moerl (the run config, a dataset, a checkpoint's config.json)
without trusting it.

A user's file may be missing, a directory, a FIFO, unreadable, huge, binary, not UTF-8, or
nested deeper than a parser can recurse. Each helper here turns such a file into a one-line
reason (`FileProblem`, which names no file: the caller adds the field and the path and raises
its own `MoerlError`), so every such mistake ends as one `moerl: error:` line, never a
traceback.

Limitations: reasons locate bytes by line and column (columns count bytes, not characters).
"""

from __future__ import annotations

import reprlib
from pathlib import Path

MIB = 1 << 20


class FileProblem(ValueError):
    """Why a user's file (or one line of it) cannot be used: one line, without the path."""


def kind_problem(p: Path) -> str | None:
    """None when `p` is a regular file; else what it is instead."""
    if p.is_file():
        return None
    if p.is_dir():
        return "is a directory, not a file"
    if p.exists():
        return "is not a regular file"
    return "does not exist"


def read_bytes_capped(p: Path, max_bytes: int) -> bytes:
    """The file's bytes; a file over `max_bytes` is refused after reading max_bytes + 1, so a
    huge file (or /dev/zero behind a symlink) never fills memory."""
    try:
        with p.open("rb") as f:
            raw = f.read(max_bytes + 1)
    except OSError as err:
        raise FileProblem(f"cannot be read ({err.strerror or err})") from None
    if len(raw) > max_bytes:
        raise FileProblem(f"is larger than {human_bytes(max_bytes)}")
    return raw


def decode_text(raw: bytes, single_line: bool = False) -> str:
    """UTF-8 text with no NUL bytes (a leading BOM is dropped), or a FileProblem locating the
    first bad byte (by column only when `raw` is one line of a file the caller numbers)."""
    text, bad = "", -1
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as err:
        bad = err.start
    nul = raw.find(b"\x00")
    if nul != -1 and (bad == -1 or nul < bad):  # NUL is valid UTF-8: report whichever comes first
        raise FileProblem(f"has a NUL byte at {location(raw, nul, single_line)}; expected text")
    if bad != -1:
        raise FileProblem(
            f"is not UTF-8 text: byte 0x{raw[bad]:02x} at {location(raw, bad, single_line)}"
        )
    return text.removeprefix("\ufeff")


def location(raw: bytes, offset: int, column_only: bool = False) -> str:
    line = raw.count(b"\n", 0, offset) + 1
    column = offset - (raw.rfind(b"\n", 0, offset) + 1) + 1
    return f"column {column}" if column_only else f"line {line}, column {column}"


def human_bytes(n: int) -> str:
    return f"{n // MIB} MiB" if n % MIB == 0 else f"{n} bytes"


_ESCAPES = str.maketrans({"\n": "\\n", "\r": "\\r", "\t": "\\t", "\x00": "\\0"})


def one_line(text: str) -> str:
    """`text` with line breaks (and other control characters) escaped: an error message that
    quotes user input must still be one line."""
    text = text.translate(_ESCAPES)
    if text.isprintable():
        return text
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)


_REPR = reprlib.Repr()
_REPR.maxstring = _REPR.maxother = 60
_REPR.maxlist = _REPR.maxtuple = _REPR.maxdict = _REPR.maxset = 4
_REPR.maxlevel = 2


def short_repr(value: object) -> str:
    """repr bounded in length and depth: a YAML alias bomb or a megabyte string quoted in an
    error message stays short (and is never expanded in full)."""
    return one_line(_REPR.repr(value))


def yaml_problem(err: Exception) -> str:
    """A PyYAML error as one line: what is wrong and where (line and column are 1-based)."""
    problem = getattr(err, "problem", None)
    mark = getattr(err, "problem_mark", None)
    if problem and mark is not None:
        context = getattr(err, "context", None)
        where = f"line {mark.line + 1}, column {mark.column + 1}"
        return one_line(f"{context + ': ' if context else ''}{problem} at {where}")
    return one_line(" ".join(str(err).split()))
