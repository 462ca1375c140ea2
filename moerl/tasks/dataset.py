"""Prompt datasets: a shipped set, a user's file or folder of JSONL/Parquet shards, or an S3
object or prefix, indexed per shard and read a window at a time in a seeded order.

Design, details and limitations: docs/tasks.md#moerltasksdatasetpy.
"""

from __future__ import annotations

import bisect
import random
import threading
from collections import OrderedDict
from collections.abc import Iterator

from moerl.config import CheckpointConfig
from moerl.errors import DataError
from moerl.records import Prompt
from moerl.store.sources import SourceChanged
from moerl.tasks.shards import (  # noqa: F401 (the row readers: dataset's names, kept)
    MAX_LINE_BYTES,
    RowKind,
    Scan,
    Shard,
    Source,
    _lines,
    check_budget,
    index,
    json_line,
    resolve_path,
    validate_row,
)
from moerl.userfiles import FileProblem


class Dataset:
    """A prompt dataset as its shard index (moerl/tasks/shards.py): rows are read from the
    shards a window needs, at most `CACHED_SHARDS` parsed shards held at a time.

    The order (`window`): the shards (named in sorted order, index i) in a seeded order,
    `random.Random(seed).shuffle(list(range(k)))`; the good rows of shard i in the order of
    `random.Random(seed + i).shuffle(list(range(rows_i)))`; position p of the order is taken
    modulo the row count. One shard: exactly `random.Random(seed).shuffle(list(range(n)))`."""

    CACHED_SHARDS = 2

    def __init__(
        self, src: Source, shards: list[Shard], bad_rows: int, sample: list[Prompt]
    ) -> None:
        self._src, self.shards, self.bad_rows = src, shards, bad_rows
        self.source = src.spec if len(shards) > 1 or src.s3 else shards[0].uri
        self.sample = sample  # the first row, each task's first row, the first chat row
        self.n = sum(s.rows for s in shards)
        self.shards_parsed = 0  # shards read for windows (the memory bound's witness)
        self._cache: OrderedDict[int, list[Prompt]] = OrderedDict()
        self._perms: dict[tuple[int, int], list[int]] = {}
        self._lock = threading.Lock()
        self._rows: list[Prompt] | None = None

    def __len__(self) -> int:
        return self.n

    @property
    def held_rows(self) -> int:
        """Rows held now: the cached shards' (and all of them once `rows` was asked for)."""
        return sum(len(v) for v in self._cache.values()) + len(self._rows or [])

    def _shard_rows(self, i: int) -> list[Prompt]:
        if i in self._cache:
            self._cache.move_to_end(i)
            return self._cache[i]
        rows = [r for _, r in Scan(self._src, self.shards[i], PROMPTS) if isinstance(r, Prompt)]
        if len(rows) != self.shards[i].rows:
            raise SourceChanged(
                f"task.dataset: {self.shards[i].uri} gave {len(rows)} rows, indexed with "
                f"{self.shards[i].rows}; it changed under the run"
            )
        self.shards_parsed += 1
        self._cache[i] = rows
        while len(self._cache) > self.CACHED_SHARDS:
            old, _ = self._cache.popitem(last=False)
            for key in [k for k in self._perms if k[0] == old]:
                del self._perms[key]
        return rows

    def _perm(self, i: int, seed: int) -> list[int]:
        if (i, seed) not in self._perms:
            order = list(range(self.shards[i].rows))
            random.Random(seed + i).shuffle(order)
            self._perms[(i, seed)] = order
        return self._perms[(i, seed)]

    def batch(self, iteration: int, size: int, seed: int) -> list[Prompt]:
        """The prompts of `iteration`: a seeded permutation read with a cursor, so a run (and a
        resumed run) sees every prompt once per epoch in the same order."""
        return self.window(iteration * size, size, seed)

    def window(self, start: int, size: int, seed: int) -> list[Prompt]:
        """`size` prompts from position `start` of the seeded order (the async mode's cursor)."""
        shard_order = list(range(len(self.shards)))
        random.Random(seed).shuffle(shard_order)
        offsets, at = [], 0
        for i in shard_order:
            offsets.append(at)
            at += self.shards[i].rows
        if self.n == 0:
            raise DataError(f"task.dataset: {self.source} has no good rows")
        out = []
        with self._lock:
            for j in range(size):
                p = (start + j) % self.n
                t = bisect.bisect_right(offsets, p) - 1
                i = shard_order[t]
                rows = self._shard_rows(i)
                out.append(rows[self._perm(i, seed)[p - offsets[t]]])
        return out

    def iter_rows(self) -> Iterator[Prompt]:
        """Every good row in file order, shard by shard (one shard's rows in memory)."""
        for shard in self.shards:
            for _, r in Scan(self._src, shard, PROMPTS):
                if isinstance(r, Prompt):
                    yield r

    @property
    def rows(self) -> list[Prompt]:
        """All rows in file order, held: for small datasets only (benches, tests)."""
        if self._rows is None:
            self._rows = list(self.iter_rows())
        return self._rows


def _check_prompt(row: Prompt) -> Prompt:
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


SCHEMA = "{id, task, prompt, answer}"
PROMPTS = RowKind(
    cls=Prompt,
    field="task.dataset",
    schema=SCHEMA,
    columns=("id", "task", "prompt", "messages", "answer", "meta"),
    required=("id", "task", "answer"),
    json_fields=("messages", "meta"),
    check=_check_prompt,
    one_of=("prompt", "messages"),
)


def load_dataset(spec: str, max_bad_fraction: float, ck: CheckpointConfig | None = None) -> Dataset:
    """Index a prompt dataset (builtin:, a local file or folder of shards, s3://), skipping and
    counting malformed rows; `ck` gives the S3 endpoint and region (`cfg.checkpoint`)."""
    src = Source(spec, "task.dataset", SCHEMA, ck)
    sample: list[Prompt] = []
    tasks: set[str] = set()
    chat = False

    def keep(row: Prompt) -> None:
        nonlocal chat
        first = not sample
        if first or row.task not in tasks or (row.messages and not chat):
            sample.append(row)
        tasks.add(row.task)
        chat = chat or bool(row.messages)

    idx = index(src, PROMPTS, keep)
    check_budget(src, idx, "task.dataset", max_bad_fraction)
    return Dataset(src, idx.shards, idx.bad_rows, sample)
