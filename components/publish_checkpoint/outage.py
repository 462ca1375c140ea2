"""Riding out a checkpoint store that is away for minutes (an S3 brownout): a call retried with
backoff while the store is unavailable (`StoreUnavailable`), within `checkpoint.outage_s`, each
wait said in one line naming what waits and on what; and the tidying a publish needs before it
is tried again (what its failed attempt left under its own claim).

Any other failure (a fenced writer, a version that exists, a non-finite tensor) is raised at once;
a mesh node's uploader marks its own store errors so (`NodeParts`), and the publication retries.
Limitations: the budget counts from the first failure of one copy, not across a run's outages.
"""

from __future__ import annotations

import logging
import random
import time
from collections.abc import Callable
from typing import TypeVar

from moerl.errors import StoreUnavailable
from moerl.store.base import CheckpointStore
from moerl.store.manifest import version_dir

log = logging.getLogger(__name__)
_T = TypeVar("_T")
FIRST_WAIT_S, MAX_WAIT_S = 1.0, 30.0  # the backoff: doubling from the first, capped


def backoff_s(attempt: int, rng: random.Random | None = None) -> float:
    """The wait before retry `attempt` (0 first): doubling from FIRST_WAIT_S up to MAX_WAIT_S,
    with up to a quarter of jitter (writers that met one outage do not return in step)."""
    base = min(MAX_WAIT_S, FIRST_WAIT_S * 2**attempt)
    return base * (1.0 - 0.25 * (rng or random).random())


def retrying(
    what: str,
    call: Callable[[], _T],
    budget_s: float,
    before_retry: Callable[[], None] | None = None,
    sleep: Callable[[float], None] = time.sleep,
    clock: Callable[[], float] = time.monotonic,
) -> _T:
    """`call()`, tried again with backoff while it raises StoreUnavailable, until `budget_s`
    seconds have passed since the first failure; then a StoreUnavailable naming `what`, the
    budget and the last error. `before_retry`: run before each retry (its own StoreUnavailable
    counts as one more failed attempt)."""
    first: float | None = None
    attempt = 0
    while True:
        try:
            if attempt and before_retry is not None:
                before_retry()
            out = call()
        except StoreUnavailable as e:
            now = clock()
            first = now if first is None else first
            if now - first >= budget_s:
                raise StoreUnavailable(
                    f"{what}: the checkpoint store stayed unavailable for {now - first:.0f} s, "
                    f"past checkpoint.outage_s ({budget_s:.0f} s); last error: {e}"
                ) from e
            wait = min(backoff_s(attempt), max(0.0, budget_s - (now - first)))
            print(
                f"[moerl] {what}: waiting on the checkpoint store ({e}); retry {attempt + 1} "
                f"in {wait:.1f} s ({now - first:.0f} s of checkpoint.outage_s {budget_s:.0f} s)",
                flush=True,
            )
            sleep(wait)
            attempt += 1
            continue
        if first is not None:
            log.warning(
                "%s: the checkpoint store answered again after %.0f s", what, clock() - first
            )
        return out


def tidy_own(stores: list[CheckpointStore | None], version: int, owner: str) -> None:
    """Before a publish of `version` is tried again: in each store, what its failed attempt
    left under `owner`'s claim (files, perhaps its manifest) is deleted as publish's own cleanup
    deletes it, manifest first, claim last (that cleanup may have met the outage too). A version
    `latest` already names, or one under another writer's claim, is left alone."""
    for store in stores:
        if store is None or not getattr(store, "_claims", False):
            continue
        claim = store.read_claim(version)
        if claim is None or claim.owner != owner or store.latest() == version:
            continue
        log.warning("version %d in %s: removing what a failed attempt left", version, store.uri)
        store._abort(version_dir(version))
