"""The collective weight path's control plane in Valkey (docs/weights.md, "Weights over the
wire"): the engines that can take part (`enroll`), one session per version opened by the
trainer and fenced by its epoch (`open`), what each engine reports (`report`), and catch-ups:
an engine that started after the newest session asks for its version (`request`), which the
trainer sends from what it kept of that session (kind "catchup").

A version delivered over the wire is known by `wire_sha(epoch, version)` until its manifest
exists: the store claims each version create-only under the trainer's epoch, so (epoch, version)
names one set of weights in a run. `same_weights` and `sha_agrees` let the files' sha256 and
that name stand for the same version.
"""

from __future__ import annotations

import json
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from moerl.bus.client import FencedError

WIRE_PREFIX = "wire-"
REPORT_TTL_S = 3600

# KEYS: the session hash, trainer_epoch. ARGV: version, sha, epoch, groups, members, deadline,
# nonces. Idempotent by itself (a resend writes the same fields).
_OPEN = """
if redis.call('GET', KEYS[2]) ~= ARGV[3] then return -1 end
redis.call('DEL', KEYS[1])
redis.call('HSET', KEYS[1], 'version', ARGV[1], 'sha', ARGV[2], 'epoch', ARGV[3],
           'groups', ARGV[4], 'members', ARGV[5], 'deadline', ARGV[6], 'nonces', ARGV[7])
return 1
"""


def wire_sha(epoch: int, version: int) -> str:
    """What a version delivered over the wire is called before its manifest exists."""
    return f"{WIRE_PREFIX}e{epoch}-v{version}"


def same_weights(version: int, manifest_sha256: str, epoch: int, sv: int | None, sha: str | None):
    """Whether an engine serving (sv, sha) serves the version a pointer names (version, its
    manifest sha256, set by trainer `epoch`): the same sha, or the wire name of that version."""
    return sv == version and sha in (manifest_sha256, wire_sha(epoch, version))


def sha_agrees(known: str | frozenset[str] | None, sha: str) -> bool:
    """Whether a sample's sha for a version is one the trainer knows that version by (a
    manifest sha256, or also its wire name: a frozenset); unknown versions agree."""
    if known is None:
        return True
    return sha == known if isinstance(known, str) else sha in known


@dataclass(frozen=True)
class WireSession:
    version: int
    sha: str
    epoch: int
    groups: list[dict[str, Any]]  # wire.GroupAddress.as_dict, in trainer rank order
    members: dict[str, int]  # engine (worker name) -> its first rank among the engine ranks
    deadline: float  # Unix time
    kind: str = "session"  # or "catchup": a version already delivered, for engines that joined
    # member -> the nonce it enrolled with: a restarted worker of the same name is not its
    # predecessor, whose sessions it must not join
    nonces: dict[str, str] = field(default_factory=dict)

    def first_rank(self, name: str, nonce: str | None = None) -> int | None:
        if nonce is not None and self.nonces.get(name, nonce) != nonce:
            return None
        return self.members.get(name)


@dataclass(frozen=True)
class Report:
    ok: bool
    digests: list[str]
    seconds: float
    error: str = ""


class WeightSessions:
    """One run's weight sessions on a RunBus's client."""

    def __init__(self, bus) -> None:
        from valkey.commands.core import Script

        self.bus, self.r = bus, bus.r
        self._open = Script(self.r, _OPEN)

    # -- the engines' side ----------------------------------------------------------------
    def enroll(self, name: str, ranks: int, nonce: str = "") -> None:
        """Engine `name` (a rollout worker's) can take part, with `ranks` weight-holding ranks;
        `nonce`: this process's, which the sessions naming it carry."""
        value = json.dumps({"ranks": int(ranks), "nonce": nonce})
        self.r.hset(self.bus.key("wire:engines"), name, value)

    def withdraw(self, name: str) -> None:
        self.r.hdel(self.bus.key("wire:engines"), name)

    def current(self, kind: str = "session") -> WireSession | None:
        raw = self.r.hgetall(self.bus.key(f"wire:{kind}"))
        if not raw:
            return None
        return WireSession(
            version=int(raw["version"]),
            sha=raw["sha"],
            epoch=int(raw["epoch"]),
            groups=json.loads(raw["groups"]),
            members={k: int(v) for k, v in json.loads(raw["members"]).items()},
            deadline=float(raw["deadline"]),
            kind=kind,
            nonces=json.loads(raw.get("nonces") or "{}"),
        )

    def set_delivered(self, s: WireSession) -> None:
        """`s` was delivered: the version a catch-up may ask for."""
        self.r.hset(
            self.bus.key("wire:delivered"), mapping={"version": s.version, "epoch": s.epoch}
        )

    def delivered(self) -> tuple[int, int] | None:
        """(epoch, version) of the newest session delivered."""
        raw = self.r.hgetall(self.bus.key("wire:delivered"))
        return (int(raw["epoch"]), int(raw["version"])) if raw else None

    def request(self, name: str, ranks: int, version: int, nonce: str = "") -> None:
        """Engine `name` (`ranks` weight ranks, enrolled with `nonce`), not in the newest
        session, asks for `version`."""
        value = json.dumps({"ranks": ranks, "version": version, "nonce": nonce})
        self.r.hset(self.bus.key("wire:requests"), name, value)

    def _key(self, s: WireSession) -> str:
        # the deadline tells two catch-ups of one version apart
        return self.bus.key(f"wire:reports:{s.kind}:{s.epoch}:{s.version}:{s.deadline:.3f}")

    def report(self, s: WireSession, name: str, rep: Report) -> None:
        key = self._key(s)
        self.r.hset(key, name, json.dumps(rep.__dict__))
        self.r.expire(key, REPORT_TTL_S)

    # -- the trainer's side ---------------------------------------------------------------
    def members(self) -> dict[str, int]:
        """The enrolled engines that are alive now, with their ranks, in name order."""
        return {n: ranks for n, (ranks, _) in self.enrolled().items()}

    def enrolled(self) -> dict[str, tuple[int, str]]:
        """The enrolled engines alive now: (ranks, nonce), in name order."""
        raw = self.r.hgetall(self.bus.key("wire:engines"))
        alive = set(self.bus.alive())
        out = {}
        for n, v in sorted(raw.items()):
            if n in alive:
                e = json.loads(v)
                out[n] = (int(e["ranks"]), str(e.get("nonce", "")))
        return out

    def requests(self) -> dict[str, tuple[int, int, str]]:
        """The catch-ups asked for: engine -> (its ranks, the version it wants, its nonce)."""
        out = {}
        for n, v in self.r.hgetall(self.bus.key("wire:requests")).items():
            e = json.loads(v)
            out[n] = (int(e["ranks"]), int(e["version"]), str(e.get("nonce", "")))
        return out

    def answered(self, names: list[str]) -> None:
        if names:
            self.r.hdel(self.bus.key("wire:requests"), *names)

    def open(
        self,
        epoch: int,
        version: int,
        groups: list[dict[str, Any]],
        members: Mapping[str, int],
        deadline: float,
        kind: str = "session",
        nonces: Mapping[str, str] | None = None,
    ) -> WireSession:
        """Open the session of `version` (FencedError if `epoch` is not the run's trainer's)."""
        s = WireSession(
            version,
            wire_sha(epoch, version),
            epoch,
            groups,
            dict(members),
            deadline,
            kind,
            dict(nonces or {}),
        )
        done = int(
            self._open(
                keys=[self.bus.key(f"wire:{kind}"), self.bus.key("trainer_epoch")],
                args=[
                    version,
                    s.sha,
                    str(epoch),
                    json.dumps(groups),
                    json.dumps(s.members),
                    deadline,
                    json.dumps(s.nonces),
                ],
            )
        )
        if done < 0:
            self.bus.check_epoch(epoch)
            raise FencedError(f"trainer: epoch {epoch} was refused by Valkey")
        return s

    def reports(self, s: WireSession) -> dict[str, Report]:
        raw = self.r.hgetall(self._key(s))
        return {n: Report(**json.loads(v)) for n, v in raw.items()}

    def wait_reports(
        self, s: WireSession, poll_s: float = 0.05, grace_s: float = 2.0
    ) -> dict[str, Report]:
        """Every member's report, or those in by the session's deadline and `grace_s` (for the
        failures found at the deadline itself); a missing one failed."""
        while True:
            got = self.reports(s)
            if set(s.members) <= set(got) or time.time() > s.deadline + grace_s:
                return got
            time.sleep(poll_s)


def outcome(s: WireSession, got: Mapping[str, Report]) -> tuple[bool, str]:
    """(delivered, why not): every member reported success, and the engines' per-rank digests
    agree (every engine of a run has the same layout)."""
    missing = sorted(set(s.members) - set(got))
    if missing:
        return False, f"no report by the deadline from {', '.join(missing)}"
    failed = {n: r.error for n, r in got.items() if n in s.members and not r.ok}
    if failed:
        return False, "; ".join(f"{n}: {e}" for n, e in sorted(failed.items()))
    digests = {tuple(r.digests) for n, r in got.items() if n in s.members}
    if len(digests) > 1:
        return False, f"the engines' digests disagree ({len(digests)} different sets)"
    return True, ""
