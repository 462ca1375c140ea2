"""Preference pairs for reward-model training (RLHF): the schema, loading, the shipped set.

Design, details and limitations: docs/tasks.md#moerltaskspreferencespy.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, replace
from dataclasses import field as dc_field
from pathlib import Path

from moerl.config import CheckpointConfig
from moerl.errors import DataError
from moerl.records import PreferencePair, Prompt
from moerl.tasks.dataset import load_dataset
from moerl.tasks.shards import RowKind, Shard, Source, check_budget, index
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
    shards: list[Shard] = dc_field(default_factory=list)


def _check(row: PreferencePair) -> PreferencePair:
    if any("\x00" in v for v in (row.id, row.prompt, row.chosen, row.rejected)):
        raise FileProblem("a field holds a NUL character (\\u0000)")
    if row.chosen == row.rejected:
        raise FileProblem("chosen equals rejected: no preference")
    return row


PAIRS = RowKind(
    cls=PreferencePair,
    field="reward_model.data",
    schema=ROWS,
    columns=FIELDS,
    required=FIELDS,
    check=_check,
)


def load_preferences(
    spec: str,
    max_bad_fraction: float,
    field: str = "reward_model.data",
    ck: CheckpointConfig | None = None,
) -> PreferenceSet:
    """Load a preference dataset (builtin:, a local JSONL or Parquet file or folder of shards,
    s3://) through the shard reader, all pairs in memory, skipping and counting malformed
    rows; `ck` gives the S3 endpoint and region (`cfg.checkpoint`)."""
    kind = replace(PAIRS, field=field)
    src = Source(spec, field, ROWS, ck)
    rows: list[PreferencePair] = []
    idx = index(src, kind, rows.append)
    check_budget(src, idx, field, max_bad_fraction)
    seen: set[str] = set()
    for r in rows:
        if r.id in seen:
            raise DataError(
                f"{field}: id {one_line(repr(r.id))} appears more than once in {src.spec}; ids "
                "name pairs (the held-out split is made by id)"
            )
        seen.add(r.id)
    source = src.spec if len(idx.shards) > 1 or src.s3 else idx.shards[0].uri
    return PreferenceSet(rows=rows, source=source, bad_rows=idx.bad_rows, shards=idx.shards)


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
