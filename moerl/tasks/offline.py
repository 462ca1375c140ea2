"""Real tasks with no download (the `moerl[tasks]` extra): reasoning-gym's procedural
generators and math-verify's answer equivalence.

Design, details and limitations: docs/tasks.md#moerltasksofflinepy.
"""

from __future__ import annotations

import functools
import json
from typing import Any

from moerl.errors import ConfigError
from moerl.records import Prompt

RG_TASK = "reasoning_gym"
MATH_TASK = "math"


def _rg():
    try:
        import reasoning_gym
    except ImportError:
        raise ConfigError(
            "reasoning-gym is not installed: pip install 'moerl[tasks]' (reasoning-gym 0.1.25)"
        ) from None
    return reasoning_gym


def generator_names() -> list[str]:
    from reasoning_gym.factory import DATASETS

    _rg()
    return sorted(DATASETS)


@functools.lru_cache(maxsize=64)
def _dataset(name: str, seed: int, size: int, config_json: str):
    return _rg().create_dataset(name, seed=seed, size=size, **json.loads(config_json))


def make_reasoning_gym(
    names: list[str],
    seed: int,
    size: int,
    math: bool = False,
    config: dict[str, dict[str, Any]] | None = None,
) -> list[Prompt]:
    """`size` rows of each generator in `names` (deterministic in `seed`); `config[name]`:
    that generator's settings (its dataclass's fields)."""
    known = set(generator_names())
    bad = [n for n in names if n not in known]
    if bad:
        raise ConfigError(
            f"--names: no reasoning-gym generator {bad[0]!r}; allowed: {', '.join(sorted(known))}"
        )
    if size < 1:
        raise ConfigError(f"--size must be >= 1, got {size}")
    rows = []
    for name in names:
        cfg = (config or {}).get(name, {})
        try:
            ds = _dataset(name, seed, size, json.dumps(cfg, sort_keys=True))
        except (TypeError, ValueError, AssertionError) as err:
            raise ConfigError(
                f"--config: reasoning-gym's {name} refuses {json.dumps(cfg)}: {err}"
            ) from None
        for i in range(size):
            item = ds[i]
            rows.append(
                Prompt(
                    id=f"{name}-{seed}-{i:06d}",
                    task=MATH_TASK if math else RG_TASK,
                    prompt=item["question"],
                    answer="" if item["answer"] is None else str(item["answer"]),
                    meta={"generator": name, "seed": seed, "index": i, "size": size, "config": cfg},
                )
            )
    return rows


def score_reasoning_gym(response: str, answer: str, meta: dict | None) -> float:
    """The generator's own `score_answer` on the item the row's `meta` regenerates."""
    if not meta or "generator" not in meta:
        raise ValueError(
            "a reasoning_gym row needs meta {generator, seed, index, size, config} "
            "(moerl tasks make reasoning-gym writes it)"
        )
    ds = _dataset(
        meta["generator"],
        int(meta["seed"]),
        int(meta["size"]),
        json.dumps(meta.get("config") or {}, sort_keys=True),
    )
    entry = ds[int(meta["index"])]
    try:
        return float(ds.score_answer(response, entry))
    except Exception:  # noqa: BLE001 - some scorers raise on an answer they cannot parse (prime_factorization
        # on a non-number): that is a wrong answer, not a broken verifier, when the gold one scores
        if ds.score_answer(entry["answer"], entry) is None:
            raise
        return 0.0


def score_math(response: str, answer: str) -> float:
    """1 if math-verify finds the response's final answer equivalent to the reference answer
    (numbers, fractions, LaTeX expressions, sets), else 0."""
    from math_verify import parse, verify

    gold = parse(answer if "$" in answer else f"${answer}$")
    return float(bool(gold) and verify(gold, parse(response)))
