"""An example of a user's task package for moerl: verifiers by import path.

Put the folder that holds `my_tasks/` on PYTHONPATH (or `pip install` your own package), then:

    moerl run configs/tiny-moe-grpo.yaml --set task.dataset=examples/my_tasks/digits_any.jsonl \\
        --set 'reward.verifiers={"any_of": "my_tasks:any_of", "copy": "my_tasks:copy_async"}'

Each verifier runs in moerl's sandboxed pool (a child process with no credentials, a time and
a memory limit), is imported and called on one row of its task before any work starts, and
gets `(response, answer, meta)`, where `meta` is the dataset row's optional `meta` mapping.
"""

from __future__ import annotations

import asyncio


def any_of(response: str, answer: str, meta: dict | None) -> float:
    """1 for any of the row's accepted answers (`meta["accepted"]`), else the share of the
    reference answer's characters in place: a task with several right answers."""
    accepted = set((meta or {}).get("accepted", [answer]))
    r = response.strip()
    if r in accepted:
        return 1.0
    hits = sum(a == b for a, b in zip(r, answer))
    return hits / max(len(r), len(answer), 1)


async def copy_async(response: str, answer: str) -> float:
    """An `async def` verifier (one that awaits a service, say) without meta: exact match."""
    await asyncio.sleep(0)
    return float(response.strip() == answer)
