"""Cron expressions for scheduled retraining: one 6-field expression, as KFP takes it, and
the 5-field form an Argo CronWorkflow takes.

Design, details and limitations: docs/schedule.md#moerlorchestratecronpy.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from moerl.errors import ConfigError

_MONTHS = ("JAN", "FEB", "MAR", "APR", "MAY", "JUN", "JUL", "AUG", "SEP", "OCT", "NOV", "DEC")
_DAYS = ("SUN", "MON", "TUE", "WED", "THU", "FRI", "SAT")


@dataclass(frozen=True)
class _Field:
    name: str
    lo: int
    hi: int
    names: dict[str, int]
    question: bool  # `?` allowed (day of month, day of week)


_FIELDS = (
    _Field("second", 0, 59, {}, False),
    _Field("minute", 0, 59, {}, False),
    _Field("hour", 0, 23, {}, False),
    _Field("day of month", 1, 31, {}, True),
    _Field("month", 1, 12, {m: i + 1 for i, m in enumerate(_MONTHS)}, False),
    _Field("day of week", 0, 6, {d: i for i, d in enumerate(_DAYS)}, True),
)
_DESCRIPTORS = {
    "@yearly": "0 0 0 1 1 *",
    "@annually": "0 0 0 1 1 *",
    "@monthly": "0 0 0 1 * *",
    "@weekly": "0 0 0 * * 0",
    "@daily": "0 0 0 * * *",
    "@midnight": "0 0 0 * * *",
    "@hourly": "0 0 * * * *",
}
FORMAT = "second minute hour day-of-month month day-of-week"
_QUARTZ = re.compile(r"^\d*L$|^\d+W$|^LW$|#")  # Quartz-only syntax


@dataclass(frozen=True)
class Cron:
    """A validated 6-field cron expression. `kfp`: as KFP takes it; `argo()`: 5 fields."""

    fields: tuple[str, ...]
    seconds: frozenset[int]

    @property
    def kfp(self) -> str:
        return " ".join(self.fields)

    def argo(self) -> str:
        """The standard 5-field form (no seconds; `?` written as `*`, its meaning in robfig)."""
        if self.seconds != {0}:
            raise ConfigError(
                f"cron: field 1 (second) is {self.fields[0]!r}; an Argo CronWorkflow fires at most once a "
                "minute, at second 0, so --argo-out needs a seconds field of 0"
            )
        return " ".join("*" if f == "?" else f for f in self.fields[1:])


def parse_cron(expr: str) -> Cron:
    """Validate a 6-field cron expression (or a descriptor); raise a ConfigError naming the field."""
    text = " ".join(str(expr).split())
    if text.startswith("@"):
        if text.lower() not in _DESCRIPTORS:
            raise ConfigError(
                f"cron: unknown descriptor {text!r}; allowed: {', '.join(_DESCRIPTORS)}, or 6 fields "
                f"({FORMAT})"
            )
        text = _DESCRIPTORS[text.lower()]
    parts = text.split(" ") if text else []
    if len(parts) != len(_FIELDS):
        hint = f"; KFP takes a leading seconds field, e.g. '0 {text}'" if len(parts) == 5 else ""
        raise ConfigError(f"cron: expected 6 fields ({FORMAT}), got {len(parts)} in {text!r}{hint}")
    values = [_parse_field(i, f, p) for i, (f, p) in enumerate(zip(_FIELDS, parts), 1)]
    return Cron(tuple(parts), frozenset(values[0]))


def _parse_field(index: int, field: _Field, text: str) -> set[int]:
    where = f"cron: field {index} ({field.name})"
    if text == "?":
        if not field.question:
            raise ConfigError(f"{where}: '?' is allowed only in day of month and day of week")
        return set(range(field.lo, field.hi + 1))
    out: set[int] = set()
    for item in text.split(","):
        if not item:
            raise ConfigError(f"{where}: empty item in list {text!r}")
        span, slash, step_text = item.partition("/")
        step = 1
        if slash:
            if not step_text.isdigit() or int(step_text) < 1:
                raise ConfigError(
                    f"{where}: step must be a positive integer, got {step_text!r} in {item!r}"
                )
            step = int(step_text)
        if span == "*":
            lo, hi = field.lo, field.hi
        else:
            first, dash, last = span.partition("-")
            lo = _value(where, field, first)
            hi = _value(where, field, last) if dash else (field.hi if slash else lo)
            if lo > hi:
                raise ConfigError(f"{where}: range {span!r} runs backwards ({lo} > {hi})")
        out.update(range(lo, hi + 1, step))
    return out


def _value(where: str, field: _Field, token: str) -> int:
    allowed = f"{field.lo}-{field.hi}"
    if field.names:
        names = list(field.names)
        allowed += f" or {names[0]}-{names[-1]}"
    if token.upper() in field.names:
        return field.names[token.upper()]
    if not token.isdigit() or not field.lo <= int(token) <= field.hi:
        extra = " (L, W and # are not supported)" if _QUARTZ.search(token.upper()) else ""
        raise ConfigError(f"{where} must be {allowed}, got {token!r}{extra}")
    return int(token)


def check_timezone(name: str) -> str:
    """An IANA time zone name, e.g. UTC or Europe/Berlin, checked against this machine's time
    zone database (UTC needs none)."""
    from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

    if name == "UTC":
        return name
    try:
        ZoneInfo(name)
    except (ZoneInfoNotFoundError, ValueError):
        raise ConfigError(
            f"--timezone: {name!r} is not an IANA time zone name (e.g. UTC, Europe/Berlin)"
        ) from None
    return name
