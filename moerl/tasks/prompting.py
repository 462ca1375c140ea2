"""How a dataset row becomes the token ids the engine continues.

Design, details and limitations: docs/tasks.md#moerltaskspromptingpy.
"""

from __future__ import annotations

from typing import Any

from moerl.config import RolloutConfig
from moerl.errors import ConfigError, DataError


def _messages(row: Any) -> list[dict[str, str]] | None:
    msgs = row.get("messages") if isinstance(row, dict) else getattr(row, "messages", None)
    if msgs is None:
        return None
    return [m if isinstance(m, dict) else m.model_dump() for m in msgs]


def _text(row: Any) -> str:
    return row.get("prompt", "") if isinstance(row, dict) else row.prompt


def uses_template(has: bool, cfg: RolloutConfig, row: Any) -> bool:
    """Whether `row` goes through the tokenizer's chat template, given whether the tokenizer
    `has` one (see the module docstring)."""
    msgs = _messages(row)
    if cfg.chat_template is False:
        if msgs:
            raise ConfigError(
                "rollout.chat_template false, but dataset rows give chat messages; allowed: auto or "
                "true (the tokenizer's template), or rows with a text prompt"
            )
        return False
    if msgs and not has:
        raise ConfigError(
            "dataset rows give chat messages, but the policy's tokenizer has no chat template; allowed: "
            "a tokenizer with one (tokenizer_config.json chat_template), or rows with a text prompt"
        )
    if cfg.chat_template is True and not has:
        raise ConfigError(
            "rollout.chat_template true, but the policy's tokenizer has no chat template; allowed: "
            "auto or false"
        )
    return bool(msgs) or cfg.chat_template is True


def encode_prompt(tokenizer, cfg: RolloutConfig, row: Any) -> list[int]:
    """The token ids of `row`'s prompt (a `Prompt`, or its dict form in an async unit)."""
    if not uses_template(bool(getattr(tokenizer, "chat_template", None)), cfg, row):
        return list(tokenizer.encode(_text(row)))
    msgs = _messages(row) or [{"role": "user", "content": _text(row)}]
    ids = tokenizer.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True)
    # a BatchEncoding, in some transformers versions
    if isinstance(ids, dict) or hasattr(ids, "keys"):
        ids = ids["input_ids"]
    return list(ids)


def max_new_tokens_at(cfg: RolloutConfig, version: int | None) -> int:
    """`rollout.max_new_tokens` for a unit generated with policy `version`: the last step of
    `max_new_tokens_schedule` whose from_version <= version, else max_new_tokens. A schedule needs
    the version: None (an engine no version was given, as the sync stage's) is a ConfigError."""
    if not cfg.max_new_tokens_schedule:
        return cfg.max_new_tokens
    if version is None:
        raise ConfigError(
            "rollout.max_new_tokens_schedule applies a length by the policy version a unit is "
            "generated with, which only the async mode's rollout workers give their engine; "
            "allowed: pipeline.mode async, or an empty schedule (rollout.max_new_tokens alone)"
        )
    steps = [s for s in cfg.max_new_tokens_schedule if s.from_version <= version]
    return steps[-1].max_new_tokens if steps else cfg.max_new_tokens


def max_new_tokens_ceiling(cfg: RolloutConfig) -> int:
    """The largest response length any version may get (max_new_tokens or a scheduled one)."""
    return max([cfg.max_new_tokens, *(s.max_new_tokens for s in cfg.max_new_tokens_schedule)])


def max_new_tokens_for(cfg: RolloutConfig, prompt_len: int, version: int | None = None) -> int:
    """The response budget of one sample generated with policy `version`: `max_new_tokens_at`,
    cut so that prompt + response fits `max_total_tokens`; a prompt that leaves no room is a
    DataError."""
    length = max_new_tokens_at(cfg, version)
    if cfg.max_total_tokens is None:
        return length
    room = cfg.max_total_tokens - prompt_len
    if room < 1:
        raise DataError(
            f"a prompt of {prompt_len} tokens leaves no room under rollout.max_total_tokens "
            f"{cfg.max_total_tokens}; raise it or shorten the dataset's prompts"
        )
    return min(length, room)
