"""Preference pairs for reward-model training (RLHF): the schema, loading, the shipped set.

Design, details and limitations: docs/tasks.md#moerltaskspreferencespy.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from moerl.errors import DataError
from moerl.records import PreferencePair, Prompt
from moerl.tasks.dataset import _lines, json_line, load_dataset, resolve_path, validate_row
from moerl.userfiles import FileProblem, one_line

FIELDS = ("id", "prompt", "chosen", "rejected")
ROWS = "{" + ", ".join(FIELDS) + "}"
BUILTIN = "prefs-digits"
BUILTIN_SOURCE = (
    "builtin:digits-copy"  # the default GRPO task: the reward model scores its responses
)
BUILTIN_PAIRS = 2500
BUILTIN_SEED = 0
BUILTIN_MARGIN = 0.4


@dataclass(frozen=True)
class PreferenceSet:
    rows: list[PreferencePair]
    source: str
    bad_rows: int


def _check(row: PreferencePair) -> PreferencePair:
    if any("\x00" in v for v in (row.id, row.prompt, row.chosen, row.rejected)):
        raise FileProblem("a field holds a NUL character (\\u0000)")
    if row.chosen == row.rejected:
        raise FileProblem("chosen equals rejected: no preference")
    return row


def _validate(obj: object) -> PreferencePair:
    return _check(validate_row(PreferencePair, obj, ROWS))


def _jsonl_rows(path: Path) -> Iterator[tuple[str, PreferencePair | FileProblem]]:
    with path.open("rb") as f:
        for lineno, raw in _lines(f):
            if raw is not None and not raw.strip():
                continue
            try:
                yield f"line {lineno}", _validate(json_line(raw))
            except FileProblem as problem:
                yield f"line {lineno}", problem


def _parquet_rows(path: Path, field: str) -> Iterator[tuple[str, PreferencePair | FileProblem]]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        table = pq.read_table(path)
    except (pa.ArrowException, OSError) as err:
        raise DataError(
            f"{field}: {path} is not a readable Parquet file ({one_line(str(err))[:300]})"
        ) from None
    missing = [c for c in FIELDS if c not in table.column_names]
    if missing:
        raise DataError(
            f"{field}: {path} has no column(s) {', '.join(missing)}; a row is {ROWS} "
            f"(columns: {', '.join(table.column_names) or 'none'})"
        )
    for i, rec in enumerate(table.select(list(FIELDS)).to_pylist(), 1):
        bad = [k for k in FIELDS if not isinstance(rec[k], str)]
        if bad:
            yield (
                f"row {i}",
                FileProblem(f"{bad[0]}: expected a string, got {type(rec[bad[0]]).__name__}"),
            )
            continue
        try:
            yield f"row {i}", _validate(rec)
        except FileProblem as problem:
            yield f"row {i}", problem


def load_preferences(
    spec: str, max_bad_fraction: float, field: str = "reward_model.data"
) -> PreferenceSet:
    """Load a JSONL or Parquet preference dataset, skipping and counting malformed rows."""
    path = resolve_path(spec, field=field, rows=ROWS)
    rows: list[PreferencePair] = []
    bad, first_bad = 0, None
    parquet = path.suffix.lower() in (".parquet", ".pq")
    try:
        for where, item in _parquet_rows(path, field) if parquet else _jsonl_rows(path):
            if isinstance(item, FileProblem):
                bad += 1
                first_bad = first_bad or f"{where}: {str(item).removeprefix('is ')}"
            else:
                rows.append(item)
    except OSError as err:
        raise DataError(f"{field}: cannot read {path} ({err.strerror or err})") from None
    total = len(rows) + bad
    if total == 0:
        raise DataError(f"{field}: {path} has no rows (the file is empty or blank)")
    if bad / total > max_bad_fraction:
        raise DataError(
            f"{field}: {bad} of {total} rows in {path} are malformed "
            f"({bad / total:.1%} > task.max_bad_fraction {max_bad_fraction:.1%}); first: {first_bad}"
        )
    ids = [r.id for r in rows]
    if len(set(ids)) != len(ids):
        dup = next(i for i in ids if ids.count(i) > 1)
        raise DataError(
            f"{field}: id {one_line(repr(dup))} appears more than once in {path}; ids name pairs "
            f"(the held-out split is made by id)"
        )
    return PreferenceSet(rows=rows, source=str(path), bad_rows=bad)


def split(
    rows: list[PreferencePair], eval_fraction: float, seed: int
) -> tuple[list[PreferencePair], list[PreferencePair]]:
    """(train, eval): a seeded permutation, the first `eval_fraction` of it held out (at least
    one pair each side when there are two or more)."""
    order = sorted(rows, key=lambda r: r.id)
    random.Random(seed).shuffle(order)
    n_eval = min(max(1, round(len(order) * eval_fraction)), len(order) - 1) if len(order) > 1 else 0
    return order[n_eval:], order[:n_eval]


def _candidate(answer: str, rng: random.Random, max_len: int) -> str:
    u = rng.random()
    if u < 0.25:
        return answer
    if u < 0.55 and answer:
        chars = list(answer)
        for i in rng.sample(range(len(chars)), rng.randint(1, len(chars))):
            chars[i] = rng.choice("0123456789")
        return "".join(chars)
    if u < 0.7:
        run_on = answer + "".join(rng.choice("0123456789") for _ in range(3))
        return run_on[: rng.randint(1, len(answer) + 2)]
    return "".join(rng.choice("0123456789") for _ in range(rng.randint(1, max_len)))


def synthesize(
    prompts: list[Prompt], n: int, seed: int, margin: float = BUILTIN_MARGIN, max_len: int = 6
) -> list[PreferencePair]:
    """`n` pairs whose chosen response the prompt's verifier scores at least `margin` above
    the rejected one (see the module docstring)."""
    from moerl.tasks.verifiers import verifier_for

    rng = random.Random(seed)
    out: list[PreferencePair] = []
    while len(out) < n:
        p = rng.choice(prompts)
        verify = verifier_for("auto", p.task)
        a, b = _candidate(p.answer, rng, max_len), _candidate(p.answer, rng, max_len)
        sa, sb = verify(a, p.answer), verify(b, p.answer)
        if abs(sa - sb) < margin:
            continue
        chosen, rejected = (a, b) if sa > sb else (b, a)
        out.append(
            PreferencePair(
                id=f"pref-{seed}-{len(out):06d}", prompt=p.prompt, chosen=chosen, rejected=rejected
            )
        )
    return out


def builtin_pairs() -> list[PreferencePair]:
    """The shipped set, as `python -m moerl.tasks.preferences` writes it."""
    return synthesize(load_dataset(BUILTIN_SOURCE, 0.0).rows, BUILTIN_PAIRS, BUILTIN_SEED)


def main() -> int:
    from moerl.records import write_records

    out = Path(__file__).parent / "data" / f"{BUILTIN}.jsonl"
    n = write_records(out, builtin_pairs())
    print(f"wrote {n} preference pairs to {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
