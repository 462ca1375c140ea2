"""A multi-turn environment as a user writes one: guess the row's number with feedback.

    task.environments: {"guess": "my_tasks.guess:GuessNumber"}
    task.max_turns: 4

Each episode gets its own `GuessNumber()`. `reset(row)` reads the secret from the row's `meta`;
after each model message, `step` finds the first number in it and replies " +=" (higher),
" -=" (lower) or " ?=" (no number found), or ends the episode with reward 1 / tries when the
guess is right; a wrong guess is rewarded 0. `step` is `async def` to show that it may be
(a tool that awaits a service). It runs in moerl's sandboxed pool, like a verifier.
"""

from __future__ import annotations

import asyncio
import re

_NUMBER = re.compile(r"\d+")


class GuessNumber:
    def reset(self, row: dict) -> str | None:
        self.secret = int(row["meta"]["secret"])
        self.tries = 0
        return None  # the prompt says it all; a string here would be appended after it

    async def step(self, text: str) -> tuple[str | None, float | None, bool]:
        await asyncio.sleep(0)
        self.tries += 1
        m = _NUMBER.search(text)
        if m is None:
            return " ?=", 0.0, False
        guess = int(m.group())
        if guess == self.secret:
            return None, 1.0 / self.tries, True
        return (" +=" if guess < self.secret else " -="), 0.0, False

    def close(self) -> None:
        pass
