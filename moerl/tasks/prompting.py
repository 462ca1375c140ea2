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


def max_new_tokens_for(cfg: RolloutConfig, prompt_len: int) -> int:
    """The response budget of one sample: `max_new_tokens`, cut so that prompt + response fits
    `max_total_tokens`; a prompt that leaves no room is a DataError."""
    if cfg.max_total_tokens is None:
        return cfg.max_new_tokens
    room = cfg.max_total_tokens - prompt_len
    if room < 1:
        raise DataError(
            f"a prompt of {prompt_len} tokens leaves no room under rollout.max_total_tokens "
            f"{cfg.max_total_tokens}; raise it or shorten the dataset's prompts"
        )
    return min(cfg.max_new_tokens, room)
