"""Verifiers a user might ship by mistake, called by import path (`tests.hostile_verifiers:NAME`)
inside the sandboxed pool (moerl/tasks/sandbox.py). Never imported by the test process itself
for scoring: the point is that they run in a child process."""

from __future__ import annotations

import os
import time


def sleeps(response: str, answer: str) -> float:  # stuck on I/O forever
    time.sleep(10_000)
    return 1.0


def spins(response: str, answer: str) -> float:  # a busy loop that never ends
    while True:
        pass


def allocates(response: str, answer: str) -> float:  # memory without bound
    hoard = []
    while True:
        hoard.append(bytearray(64 << 20))


def dies(response: str, answer: str) -> float:  # a crash in native code, as far as the pool can tell
    os.kill(os.getpid(), 9)
    return 0.0


def raises(response: str, answer: str) -> float:
    raise ValueError("cannot parse")


def not_a_number(response: str, answer: str):
    return "high"


def prints(response: str, answer: str) -> float:  # chatter on stdout must not corrupt the protocol
    print("a verifier's debug line", flush=True)
    return 0.25


def environment(response: str, answer: str) -> dict:
    """What the verifier can see of its process."""
    return {"env": dict(os.environ), "cwd": os.getcwd()}


def slow(response: str, answer: str) -> float:  # under the per-sample limit, over a group's
    time.sleep(0.6)
    return 1.0


def by_response(response: str, answer: str) -> float:
    """Misbehaves on cue: a response that starts with 1 sleeps forever, 2 spins, 3 allocates
    without bound; any other is scored like the shipped positional verifier."""
    head = response.strip()[:1]
    if head == "1":
        return sleeps(response, answer)
    if head == "2":
        return spins(response, answer)
    if head == "3":
        return allocates(response, answer)
    from moerl.tasks.verifiers import positional

    return positional(response, answer)


def takes_one(response: str) -> float:
    return 0.0


HOSTILE_ANSWERS = {"1111": sleeps, "2222": spins, "3333": allocates, "4444": raises}


def by_answer(response: str, answer: str) -> float:
    """Misbehaves on the rows a test planted: answer 1111 sleeps forever, 2222 spins, 3333
    allocates without bound, 4444 raises; any other row is scored like the shipped positional
    verifier."""
    if answer in HOSTILE_ANSWERS:
        return HOSTILE_ANSWERS[answer](response, answer)
    from moerl.tasks.verifiers import positional

    return positional(response, answer)


def only_gold(response: str, answer: str) -> float:
    """Scores the reference answer (so it passes preflight, which calls it on a row's own
    answer) and raises on any other response: a verifier that breaks on real model output."""
    if response.strip() == answer:
        return 1.0
    raise ValueError(f"cannot parse {response!r}")
