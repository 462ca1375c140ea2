"""Verifiers as a user writes them, called by import path (`tests.support.user_verifiers:NAME`) in the
sandboxed pool: with the row's `meta`, asynchronous, or with a signature that fits neither form."""

from __future__ import annotations

import asyncio


def by_meta(response: str, answer: str, meta: dict | None) -> float:
    """1 when the response is the row's `meta["expected"]` (a value the answer does not hold)."""
    return float(response.strip() == (meta or {}).get("expected"))


async def exact_async(response: str, answer: str) -> float:
    await asyncio.sleep(0)
    return float(response.strip() == answer)


def three_required(response: str, answer: str, meta: dict, extra: int) -> float:
    return 0.0


def fails_on_gold(response: str, answer: str, meta: dict | None) -> float:
    raise RuntimeError("no parser for this answer format")
