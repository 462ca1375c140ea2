"""Environments as a user might get them wrong, by import path
(`tests.support.hostile_environments:NAME`), run in the sandboxed pool."""

from __future__ import annotations

import os
import time

# Which process holds an environment: made once per process. Not the pid: a sandboxed child in
# its own pid namespace (isolation `namespaces`) is pid 2 in every one of them.
PROCESS = os.urandom(6).hex()


class Counter:
    """Counts its steps, in its own memory: the observation is the step number and an id of
    the process that holds it (PROCESS); done after three steps, reward 1 at the end."""

    def reset(self, row: dict) -> str:
        self.n = 0
        return f"<{row['id']}>"

    show_pid = True

    def step(self, text: str):
        self.n += 1
        obs = f"{self.n}@{PROCESS}" if self.show_pid else f"{self.n}:{text}"
        return obs, (1.0 if self.n == 3 else None), self.n == 3


class HangsOnSlow(Counter):
    """Hangs in its step number `meta["slow"]` (1: the first), when the row's meta says so."""

    def reset(self, row: dict) -> str:
        self.slow = int((row.get("meta") or {}).get("slow") or 0)
        return super().reset(row)

    def step(self, text: str):
        if self.slow == self.n + 1:
            time.sleep(3600)
        return super().step(text)


class SteadyHangsOnSlow(HangsOnSlow):
    """Deterministic in its row and the messages (no pid): an episode can be replayed."""

    show_pid = False


class RaisesOnReset:
    def reset(self, row: dict):
        raise RuntimeError("no such puzzle")

    def step(self, text: str):
        return None, 0.0, True


class NoStep:
    def reset(self, row: dict):
        return None


class BadStep:
    def reset(self, row: dict):
        return None

    def step(self, text: str):
        return "obs", 1.0  # two values, not three


class StringReward(BadStep):
    def step(self, text: str):
        return None, "1", True


class ReadsSecrets(Counter):
    """Replies with every credential-looking variable it can see."""

    def step(self, text: str):
        seen = sorted(k for k in os.environ if k.startswith(("AWS", "MLFLOW", "VALKEY", "MOERL")))
        return ",".join(seen) or "none", 0.0, True


NOT_A_FACTORY = 42


class RunsModelCode(Counter):
    """Executes the model's message as Python (a code environment): what the code leaves in
    `result` is the observation, reward 1; an exception ends the episode failed."""

    def step(self, text: str):
        scope: dict = {}
        exec(text, scope)  # noqa: S102 - the point: model-written code, in the sandbox
        return str(scope.get("result")), 1.0, True


class PatchesGrader:
    """Model-written code an environment runs, in its first episode, patches the grader class
    (`Grader`) so that any answer is right; a later episode grades with what it finds."""

    def reset(self, row: dict) -> None:
        self.id = row["id"]

    def step(self, text: str):
        if text == "patch":
            Grader.right = staticmethod(lambda answer: True)
            return None, 0.0, True
        return None, 1.0 if Grader.right(text) else 0.0, True


class Grader:
    @staticmethod
    def right(answer: str) -> bool:
        return answer == "42"


class ForgesReplies(Counter):
    """Model-written code in its step leaves a thread writing replies on every descriptor."""

    def step(self, text: str):
        from tests.support.sandbox_attacks import forges

        forges("1", "")
        return super().step(text)
