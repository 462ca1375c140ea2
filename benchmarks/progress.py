"""Progress bars with an ETA for long benchmarks (tqdm, on stderr).

A benchmark declares its steps up front (repeats x versions, sizes x repeats, ...) and calls
`advance` after each; tqdm shows the bar, the rate and the time left. Where stderr is not a
terminal (CI logs, `moerl bench ... 2> file`) tqdm still writes, at most every
`mininterval` seconds, so a log shows progress without a line per step.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from contextlib import contextmanager


class Progress:
    """A bar of `total` steps named `desc`; `advance(n, note)` moves it and shows `note`."""

    def __init__(self, total: int, desc: str, unit: str = "step", enabled: bool = True):
        from tqdm import tqdm

        self.total = total
        self.done = 0
        self._bar = tqdm(
            total=total,
            desc=desc,
            unit=unit,
            file=sys.stderr,
            disable=not enabled,
            mininterval=0.0 if sys.stderr.isatty() else 10.0,
            dynamic_ncols=True,
            bar_format="{desc}: {percentage:3.0f}%|{bar}| {n_fmt}/{total_fmt} "
            "[{elapsed}<{remaining}, {rate_fmt}] {postfix}",
        )

    def advance(self, n: int = 1, note: str | None = None) -> None:
        self.done += n
        if note is not None:
            self._bar.set_postfix_str(note, refresh=False)
        self._bar.update(n)

    def close(self) -> None:
        self._bar.close()


@contextmanager
def progress(total: int, desc: str, unit: str = "step", enabled: bool = True) -> Iterator[Progress]:
    bar = Progress(total, desc, unit, enabled)
    try:
        yield bar
    finally:
        bar.close()
