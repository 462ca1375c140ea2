"""One run's shared state in Valkey: the work queue, the experience streams, the policy-version
registry and the counters.

Design, details and limitations: docs/async.md#valkey-and-why-every-hand-off-is-a-script.
"""

from __future__ import annotations

import json
import logging
import time
import uuid
from collections.abc import Collection
from dataclasses import dataclass
from typing import Any

import msgspec

from moerl.bus.client import BusError, FencedError
from moerl.bus.scripts import (
    _ACK_AND_COUNT,
    _DEAD_LETTER,
    _INCR,
    _ISSUE,
    _ONCE,
    _PUBLISH_GROUP,
    _PUBLISH_SCORED,
    _REFUSE_GROUP,
    _REQUEUE,
    _SET_SERVABLE,
    _SETTLE,
    _TOUCH,
    CONSUMED_BUCKET_S,
    CONSUMED_TTL_S,
    DEAD_PAYLOAD_BYTES,
    MAX_ENTRY_BYTES,
    MAX_READ_ENTRIES,
    OP_TTL_S,
    READ_BUDGET_BYTES,
)

log = logging.getLogger(__name__)
_JSON = msgspec.json.Encoder()
TRAINER_BEACON = "trainer-beacon"  # alive:<this> while the trainer process runs
TRAINER_BEACON_TTL_S = 30.0

UNITS, GENERATED, SCORED, DEAD = "units", "generated", "scored", "dead"
GROUPS = {UNITS: "rollout", GENERATED: "reward", SCORED: "trainer"}

# Counter names (samples unless said otherwise). The identity the fault tests check:
#   trained + filtered + stale_dropped + failed + samples_dead == generated - duplicates
# `filtered`: samples of groups whose rewards were all equal (no GRPO signal; the sync
# buffer drops them too). `failed`: samples of groups in which any sample's scoring failed.
COUNTERS = (
    "generated",
    "duplicates",
    "stale_dropped",
    "failed",
    "filtered",
    "trained",
    "scored",
    "score_failed",
    "units_issued",
    "prompts_issued",
    "units_done",
    "units_requeued",
    "units_reclaimed",
    "units_dead",
    "prompts_dead",
    "groups_generated",
    "tokens_generated",
    "groups_used",
    "groups_stale",
    "groups_failed",
    "swaps",
    "engine_loads",
    "drains",
    "leases_lost",
    "entries_dead",
    "groups_dead",
    "samples_dead",
    "prompts_too_long",  # longer than the engine can take: their groups dead-lettered, unsent
    "score_timeouts",
    "commits_not_durable",
    "sample_timeouts",
    "sample_memory",
    # multi-turn: environment calls (reset, step, close), those cut off or failed, and their wall ms
    "env_calls",
    "env_timeouts",
    "env_errors",
    "env_ms",
    # weights: where each engine fetch read a version from (moerl.store.tiers), and the
    # fan-out's chunks by source and its refused (corrupt) chunks
    "weights_from_node",
    "weights_from_peers",
    "weights_from_cache",
    "weights_from_durable",
    "fanout_chunks_peer",
    "fanout_chunks_cache",
    "fanout_chunks_durable",
    "fanout_chunks_refused",
    "weights_fetch_failed",
    "cache_tier_failed",
    # rollout: units leased while another was still generating on the same engine
    "units_overlapped",
    # commits a failover took back, made again from their manifests by the trainer
    "commits_replayed",
    # commands Valkey refused for want of memory (maxmemory), retried until it had room
    "valkey_oom_refusals",
)


@dataclass(frozen=True)
class Lease:
    entry_id: str
    unit: dict[str, Any]
    deliveries: int


@dataclass(frozen=True)
class BusWrite:
    """One hand-off script ready to send (`RunBus.group_write`, `RunBus.ack_write`): its keys,
    operation key last (so it runs once however often it is sent), and arguments. `size`: the
    bytes of its arguments."""

    script: Any  # valkey.commands.core.Script
    keys: tuple[str, ...]
    args: tuple[Any, ...]
    size: int


@dataclass(frozen=True)
class Registered:
    version: int
    uri: str
    manifest_sha256: str
    epoch: int = 0  # the trainer epoch that set a servable pointer (0: the registry)


class RunBus:
    """One run's keys on one Valkey client."""

    def __init__(
        self, client, run_id: str, visibility_timeout_s: float = 120.0, max_attempts: int = 3
    ):
        # glob characters would make one run's SCAN match another run's keys
        if not run_id or any(c in run_id for c in " :{}*?[]\\"):
            raise BusError(
                f"run id {run_id!r} cannot prefix Valkey keys (no spaces, ':', braces or glob characters)"
            )
        self.r, self.run_id = client, run_id
        self.prefix = f"moerl:{run_id}:"
        self.visibility_ms = int(visibility_timeout_s * 1000)
        self.max_attempts = max_attempts
        # how often `lease_unit` looks for idle units to reclaim, and when each consumer last did
        self.claim_every_s = min(1.0, visibility_timeout_s / 4)
        self._claimed_at: dict[str, float] = {}
        # the client's outage count last seen by `lease_unit`, and when claims may resume after one
        self._outages_seen, self._claims_after = getattr(client, "outages", 0), 0.0
        from valkey.commands.core import Script

        def reg(text: str):  # run through the retrying client, once per call (see _ONCE)
            script = Script(client, _ONCE % (text, OP_TTL_S))
            return lambda keys, args: script(
                keys=[*keys, self.key(f"op:{uuid.uuid4().hex}")], args=args
            )

        self._issue = reg(_ISSUE)
        # hand-offs sent as writes, alone or batched (`write_many`), once per write the same way
        self._publish_group_script = Script(client, _ONCE % (_PUBLISH_GROUP, OP_TTL_S))
        self._ack_script = Script(client, _ONCE % (_ACK_AND_COUNT, OP_TTL_S))
        self._refuse_group_script = Script(client, _ONCE % (_REFUSE_GROUP, OP_TTL_S))
        self._publish_scored, self._dead_letter, self._settle = (
            reg(_PUBLISH_SCORED),
            reg(_DEAD_LETTER),
            reg(_SETTLE),
        )
        self._incr, self._requeue = reg(_INCR), reg(_REQUEUE)
        if getattr(client, "on_oom_end", False) is None:  # counted once the server has room
            client.on_oom_end = lambda n: self.incr(valkey_oom_refusals=n)
        if getattr(client, "on_nogroup", False) is None:
            client.on_nogroup = self._streams_lost
        self._touch = Script(client, _TOUCH)  # idempotent by itself
        self._set_servable = Script(client, _SET_SERVABLE)  # idempotent by itself

    # -- keys and setup ---------------------------------------------------------------
    def key(self, name: str) -> str:
        return self.prefix + name

    def ensure_groups(self) -> None:
        """Create the streams' consumer groups (idempotent)."""
        import valkey

        for stream, group in GROUPS.items():
            try:
                self.r.xgroup_create(self.key(stream), group, id="0", mkstream=True)
            except valkey.exceptions.ResponseError as err:
                if "BUSYGROUP" not in str(err):
                    raise

    def _streams_lost(self) -> None:
        """A command met a missing stream or group: Valkey lost the run's keys (a flush, a
        restart without its append-only file). Made again, empty, so every stage goes on; the
        trainer stops at its next epoch check and its restart rebuilds the rest from the store."""
        log.error(
            "Valkey lost run %s's streams (NOGROUP: flushed, or restarted without its append-only "
            "file); their entries are gone, the streams made again empty",
            self.run_id,
        )
        self.ensure_groups()

    # -- counters, registry, done, liveness -------------------------------------------
    def counters(self) -> dict[str, int]:
        raw = self.r.hgetall(self.key("counters"))
        return {k: int(raw.get(k, 0)) for k in COUNTERS} | {
            k: int(v) for k, v in raw.items() if k not in COUNTERS
        }

    def incr(self, **deltas: int) -> None:
        args: list[Any] = []
        for k, v in deltas.items():
            args += [k, int(v)]
        self._incr(keys=[self.key("counters")], args=args)

    def registry(self) -> Registered | None:
        raw = self.r.hgetall(self.key("registry"))
        if not raw:
            return None
        return Registered(int(raw["version"]), raw["uri"], raw["manifest_sha256"])

    def register(self, version: int, uri: str, manifest_sha256: str) -> None:
        """Point the registry at a published, verified version."""
        self.r.hset(
            self.key("registry"),
            mapping={
                "version": version,
                "uri": uri,
                "manifest_sha256": manifest_sha256,
                "published_at": time.time(),
            },
        )

    def set_servable(self, epoch: int, version: int, uri: str, manifest_sha256: str) -> None:
        """Point the rollout engines at `version`, verified in the cache tier (servable) and
        perhaps not yet durable; `FencedError` if `epoch` is not the current trainer's. A new
        trainer sets it back to its durable `latest` when a version above was lost."""
        done = int(
            self._set_servable(
                keys=[self.key("servable"), self.key("trainer_epoch")],
                args=[version, uri, manifest_sha256, time.time(), str(epoch)],
            )
        )
        if done < 0:
            self.check_epoch(epoch)
            raise FencedError(f"trainer: epoch {epoch} was refused by Valkey")

    def servable(self) -> Registered | None:
        """The version engines should serve: the servable pointer, else the registry."""
        raw = self.r.hgetall(self.key("servable"))
        if not raw:
            return self.registry()
        return Registered(
            int(raw["version"]), raw["uri"], raw["manifest_sha256"], int(raw["epoch"])
        )

    def set_done(self) -> None:
        self.r.set(self.key("done"), "1")

    def expire_run(self, ttl_s: float) -> int:
        """Let every key of this run expire `ttl_s` from now (a finished run: its stages have
        `ttl_s` to see `done` and drain), so a shared Valkey does not keep every run it served.
        Returns how many keys were set to expire."""
        keys = self.r.scan(self.key("*"))
        for k in keys:
            self.r.expire(k, max(1, int(ttl_s)))
        return len(keys)

    def set_failed(self, reason: str) -> None:
        """Abandon the run: every stage stops, and a restarted trainer refuses to go on."""
        self.r.set(self.key("failed"), reason[:2000], nx=True)

    def failed(self) -> str | None:
        return self.r.get(self.key("failed"))

    def trainer_beacon(self, ttl_s: float = TRAINER_BEACON_TTL_S) -> None:
        """The trainer process is alive (its issuer thread calls this every few seconds, even
        while the trainer waits for samples or trains a long step)."""
        self.r.set(self.key(f"alive:{TRAINER_BEACON}"), "1", px=int(ttl_s * 1000))

    def trainer_alive(self) -> bool:
        return self.r.exists(self.key(f"alive:{TRAINER_BEACON}")) == 1

    def done(self) -> bool:
        return self.r.exists(self.key("done")) == 1

    def heartbeat(self, name: str, ttl_s: float = 15.0, **stats: float) -> None:
        """Say `name` is alive (for `ttl_s`) and record its stats (busy seconds, ...)."""
        self.r.set(self.key(f"alive:{name}"), "1", px=int(ttl_s * 1000))
        if stats:
            self.r.hset(self.key(f"stats:{name}"), mapping={k: float(v) for k, v in stats.items()})

    def forget_stats(self, name: str, *fields: str) -> None:
        """Drop `fields` of `name`'s stats (a restarted process's predecessor's)."""
        self.r.hdel(self.key(f"stats:{name}"), *fields)

    def alive(self) -> list[str]:
        n = len(self.key("alive:"))
        return sorted(k[n:] for k in self.r.scan(self.key("alive:*")))

    def stats(self) -> dict[str, dict[str, float]]:
        n = len(self.key("stats:"))
        return {
            k[n:]: {f: float(v) for f, v in self.r.hgetall(k).items()}
            for k in self.r.scan(self.key("stats:*"))
        }

    # -- the work queue -----------------------------------------------------------------
    def issue_unit(self, prompts: list[dict[str, Any]]) -> str:
        """Add a unit of `prompts` (Prompt records as dicts) to the queue; returns its unit id."""
        seq = self.r.incr(self.key("unit_seq"))
        unit_id = f"u{seq:07d}"
        unit = {
            "unit_id": unit_id,
            "prompts": [{"k": k, "prompt": p} for k, p in enumerate(prompts)],
        }
        self._issue(
            keys=[self.key("unit_seq"), self.key(UNITS), self.key("counters")],
            args=[unit_id, json.dumps(unit), len(prompts)],
        )
        return unit_id

    def _claim(
        self, stream: str, consumer: str, count: int, held: Collection[str] = ()
    ) -> list[tuple[str, dict[str, str], int]]:
        """Up to `count` entries of `stream` idle past the visibility timeout, now leased to
        `consumer`, each with its delivery count (this one included). The server finds them
        (`XPENDING ... IDLE`: one round trip however long the pending list is, an idle entry
        behind any number of busy ones included) and `XCLAIM` takes only those still idle, so
        two consumers never both take one; entries deleted meanwhile are dropped.

        Not claimed: entries the caller itself still works on (`held`: an idle entry of its own
        is touched, a claim would start a second attempt beside the first), and entries whose
        holder's liveness key is fresh (a live holder whose refresh an outage delayed). An
        entry the caller's name holds but the caller does not (a restarted process) is claimed."""
        if self._after_outage(consumer, held, stream) or time.monotonic() < self._claims_after:
            return []
        rows = self.r.xpending_range(
            self.key(stream),
            GROUPS[stream],
            min="-",
            max="+",
            count=_read_count(stream, count + len(held)),
            idle=self.visibility_ms,
        )
        if not rows:
            return []
        for r in rows:
            if r["consumer"] == consumer and r["message_id"] in held:
                self.touch(stream, consumer, r["message_id"])
        others = sorted({r["consumer"] for r in rows if r["consumer"] != consumer})
        alive = (
            dict(zip(others, self.r.mget([self.key(f"alive:{c}") for c in others])))
            if others
            else {}
        )
        rows = [
            r
            for r in rows
            if not (r["consumer"] == consumer and r["message_id"] in held)
            and not alive.get(r["consumer"])
        ][:count]
        if not rows or self._after_outage(consumer, held, stream):
            return []  # none, or the server was away while we looked: every lease looks idle
        times = {r["message_id"]: int(r["times_delivered"]) + 1 for r in rows}
        got = self.r.xclaim(
            self.key(stream), GROUPS[stream], consumer, self.visibility_ms, list(times)
        )
        return [(eid, fields, times[eid]) for eid, fields in got if fields and eid in times]

    def _read(
        self, stream: str, consumer: str, count: int, block_ms: int
    ) -> list[tuple[str, dict[str, str], int]]:
        """New entries (`>`: never delivered to the group, so this is their first delivery)."""
        reply = self.r.xreadgroup(
            GROUPS[stream],
            consumer,
            {self.key(stream): ">"},
            count=_read_count(stream, count),
            block=block_ms or None,
        )
        return [
            (eid, fields, 1) for _, entries in (reply or []) for eid, fields in entries if fields
        ]

    def lease_unit(
        self, consumer: str, block_ms: int = 500, held: Collection[str] = ()
    ) -> Lease | None:
        """A unit for `consumer`: a reclaimed one whose holder went silent, else a new one.
        A unit past `max_attempts` deliveries, or one that is not a unit (malformed, oversized),
        goes to the dead-letter stream instead, counted. Idle units are looked for at most every
        `claim_every_s` per consumer (a quarter of the visibility timeout, at most 1 s), so a
        lease is usually one round trip: a unit waits at most that much past its timeout.

        `held`: the entries the caller works on. After an outage of the server (the client met
        it unreachable) these are touched first, and nothing is claimed for one visibility
        timeout: every lease looked idle meanwhile, and each live holder needs that long to
        refresh its own before anyone may take them."""
        while True:
            self._after_outage(consumer, held)
            now = time.monotonic()
            claimed = []
            if (
                now - self._claimed_at.get(consumer, -1e9) >= self.claim_every_s
                and now >= self._claims_after
            ):
                self._claimed_at[consumer] = now
                claimed = self._claim(UNITS, consumer, 1, held)
            got = claimed or self._read(UNITS, consumer, 1, block_ms)
            self._after_outage(consumer, held)  # one met during this call: the hold starts now
            if not got:
                return None
            eid, fields, deliveries = got[0]
            if claimed:
                self.incr(units_reclaimed=1)
                log.warning("%s reclaimed unit entry %s (delivery %d)", consumer, eid, deliveries)
            unit = self._admit(UNITS, consumer, eid, fields, deliveries, _parse_unit)
            if unit is not None:
                return Lease(eid, unit, deliveries)

    def _after_outage(self, consumer: str, held: Collection[str], stream: str = UNITS) -> bool:
        """If the client met the server unreachable since the last look: touch `held`, and
        claim nothing for one visibility timeout from now. Whether it had."""
        outages = getattr(self.r, "outages", 0)
        if outages == self._outages_seen:
            return False
        self._outages_seen = outages
        self._claims_after = time.monotonic() + self.visibility_ms / 1000
        for eid in held:
            self.touch(stream, consumer, eid)
        log.warning(
            "%s: Valkey was unreachable; held leases refreshed, no claims for %.1f s",
            consumer,
            self.visibility_ms / 1000,
        )
        return True

    def _admit(
        self,
        stream: str,
        consumer: str,
        eid: str,
        fields: dict[str, str],
        deliveries: int,
        parse,
        max_deliveries: int | None = None,
    ):
        """The entry's payload parsed by `parse`, or None once it is dead-lettered: delivered
        more than `max_deliveries` (default `max_attempts`) times (a poison entry that kills or
        hangs whoever takes it), over MAX_ENTRY_BYTES, or not what the stream carries (parse
        raises). Checked in that order, so an entry that crashes its parser never reaches it
        more than once."""
        field = "unit" if stream == UNITS else "group"
        raw = fields.get(field)
        obj, reason = None, None
        cap = self.max_attempts if max_deliveries is None else max_deliveries
        if raw is None:
            reason = f"no {field!r} field"
        elif len(raw) > MAX_ENTRY_BYTES:
            reason = f"{len(raw)} bytes > {MAX_ENTRY_BYTES}"
        elif deliveries > cap:
            reason = f"delivered {deliveries} times > {cap} ({'units.max_attempts' if max_deliveries is None else 'the trainer restarts on it'})"
            obj = _countable(raw, field)
        else:
            try:
                return parse(raw)
            except Exception as err:  # noqa: BLE001 - any parse failure makes it a malformed entry
                reason = f"malformed: {type(err).__name__}: {err}"[:500]
                obj = _countable(raw, field)
        counts = _dead_counts(stream, obj)
        # prompts whose group some attempt already published are not dead
        if stream == UNITS and obj:
            done = self.published(
                [
                    group_id(obj["unit_id"], p["k"], p["prompt"].get("id", ""))
                    for p in obj["prompts"]
                    if isinstance(p, dict) and isinstance(p.get("prompt"), dict)
                ]
            )
            counts["prompts_dead"] -= len(done)
        args: list[Any] = [
            GROUPS[stream],
            eid,
            (raw or "")[:DEAD_PAYLOAD_BYTES],
            deliveries,
            consumer,
            stream,
            reason,
        ]
        for k, v in counts.items():
            args += [k, v]
        if self._dead_letter(
            keys=[self.key(stream), self.key(DEAD), self.key("counters")], args=args
        ):
            log.error("%s entry %s dead-lettered by %s: %s", stream, eid, consumer, reason)
        return None

    def touch(self, stream: str, consumer: str, entry_id: str) -> bool:
        """Refresh a lease: reset its idle time without counting a delivery (XCLAIM JUSTID), if
        `consumer` still holds it. False: the lease was lost (another consumer reclaimed it, or
        it was acknowledged); the caller stops working on it."""
        return bool(self._touch(keys=[self.key(stream)], args=[GROUPS[stream], consumer, entry_id]))

    def ack_unit(self, lease: Lease, **counts: int) -> None:
        """Acknowledge a leased unit whose groups are all published (`ack_write`)."""
        self.write_many([self.ack_write(lease, **counts)])

    def requeue_unit(self, lease: Lease, remaining_k: list[int]) -> None:
        """Put the unfinished prompts (`k` values) of a leased unit back on the queue, in one
        script: XACK of the old entry (nothing else happens if it was already acknowledged), XADD
        of the smaller unit (same unit id, same `k`s)."""
        unit = {
            "unit_id": lease.unit["unit_id"],
            "prompts": [p for p in lease.unit["prompts"] if p["k"] in set(remaining_k)],
        }
        self._requeue(
            keys=[self.key(UNITS), self.key("counters")],
            args=[GROUPS[UNITS], lease.entry_id, json.dumps(unit) if unit["prompts"] else ""],
        )

    def published(self, group_ids: list[str]) -> set[str]:
        """Which of `group_ids` some worker already published (a re-executed unit skips them)."""
        if not group_ids:
            return set()
        flags = self.r.smismember(self.key("published"), group_ids)
        return {g for g, f in zip(group_ids, flags) if f}

    def publish_group(self, group_id: str, samples: list[dict[str, Any]]) -> bool:
        """One finished GRPO group onto `generated`, marked published and counted, atomically.
        A group some other attempt already published is counted as generated and duplicate,
        and not added again; returns whether it was added."""
        return bool(self.write_many([self.group_write(group_id, samples)])[0])

    # -- batched writes ------------------------------------------------------------------
    def _write(self, script, keys: list[str], args: list[Any]) -> BusWrite:
        args_t = tuple(args)
        return BusWrite(
            script,
            (*keys, self.key(f"op:{uuid.uuid4().hex}")),
            args_t,
            sum(len(a) if isinstance(a, (str, bytes)) else 8 for a in args_t),
        )

    def group_write(self, group_id: str, samples: list[dict[str, Any]]) -> BusWrite:
        """`publish_group` as a write to send later, batched with others (`write_many`)."""
        # msgspec: the same JSON (compact), 11x faster than json.dumps on a tiny model's group, on
        # the generation loop's thread (0.055 -> 0.005 ms; docs/benchmarks.md)
        payload = _JSON.encode(
            {"group_id": group_id, "t_generated": time.time(), "samples": samples}
        )
        # refused here, not by every consumer after reading it whole
        if len(payload) > MAX_ENTRY_BYTES:
            log.error(
                "group %s: %d bytes > %d; dead-lettered by its producer",
                group_id,
                len(payload),
                MAX_ENTRY_BYTES,
            )
            return self._write(
                self._refuse_group_script,
                [self.key("published"), self.key(GENERATED), self.key("counters"), self.key(DEAD)],
                [
                    group_id,
                    payload[:DEAD_PAYLOAD_BYTES].decode(errors="replace"),
                    len(samples),
                    f"{len(payload)} bytes > {MAX_ENTRY_BYTES} (refused by its producer)",
                ],
            )
        return self._write(
            self._publish_group_script,
            [self.key("published"), self.key(GENERATED), self.key("counters")],
            [
                group_id,
                payload,
                len(samples),
                sum(len(x.get("response_token_ids", ())) for x in samples),
            ],
        )

    def refuse_write(self, group_id: str, reason: str, payload: str = "") -> BusWrite:
        """A group its producer could not generate (a prompt the engine cannot take): dead-lettered
        with `reason`, no samples, marked published so its unit can be acknowledged, as
        `group_write` refuses an oversized one."""
        return self._write(
            self._refuse_group_script,
            [self.key("published"), self.key(GENERATED), self.key("counters"), self.key(DEAD)],
            [group_id, payload[:DEAD_PAYLOAD_BYTES], 0, reason],
        )

    def ack_write(self, lease: Lease, **counts: int) -> BusWrite:
        """`ack_unit` as a write to send later, batched behind its unit's groups if need be: the
        server refuses it (an error reply; nothing changes) unless every group of the unit is
        published, so it never lands without them. `counts` go to the counters with it."""
        unknown = set(counts) - set(COUNTERS)
        if unknown:
            raise ValueError(f"unknown counters {sorted(unknown)}")
        gids = [
            group_id(lease.unit["unit_id"], p["k"], p["prompt"]["id"])
            for p in lease.unit["prompts"]
        ]
        pairs = [x for k, v in {"units_done": 1, **counts}.items() if v for x in (k, int(v))]
        return self._write(
            self._ack_script,
            [self.key(UNITS), self.key("counters"), self.key("published")],
            [GROUPS[UNITS], lease.entry_id, len(gids), *gids, *pairs],
        )

    def write_many(self, writes: list[BusWrite]) -> list[Any]:
        """Send `writes` in one round trip (a pipeline, in order) and return each one's result.

        Not a transaction: each write is one atomic script, and the server runs them in order,
        so a write whose predecessors failed with an error reply still runs (an acknowledgement
        checks its groups on the server for that reason: `ack_write`). A lost connection resends the whole batch (retried like every command,
        for `valkey.reconnect_s`): every write carries its own operation key, so one the server
        already ran returns its first result and changes nothing. The first error reply is
        raised after the batch ran."""
        import valkey

        if not writes:
            return []

        def send() -> list[Any]:
            pipe = self.r.raw.pipeline(transaction=False)
            for w in writes:
                pipe.evalsha(w.script.sha, len(w.keys), *w.keys, *w.args)
            return pipe.execute()

        def send_loaded() -> list[Any]:
            try:
                return send()
            # a restarted server forgot them: load, send again
            except valkey.exceptions.NoScriptError:
                for script in {id(w.script): w.script for w in writes}.values():
                    script.sha = self.r.raw.script_load(script.script)
                return send()

        return self.r.call(send_loaded)

    # -- scoring ------------------------------------------------------------------------
    def _take(
        self,
        stream: str,
        consumer: str,
        got: list[tuple[str, dict[str, str], int]],
        validate,
        max_deliveries: int | None = None,
    ) -> list[tuple[str, dict[str, Any]]]:
        out = []
        for eid, fields, deliveries in got:
            group = self._admit(
                stream,
                consumer,
                eid,
                fields,
                deliveries,
                lambda raw: _parse_group(raw, validate),
                max_deliveries,
            )
            if group is not None:
                out.append((eid, group))
        return out

    def take_generated(
        self, consumer: str, count: int, block_ms: int = 500, validate=None
    ) -> list[tuple[str, dict[str, Any]]]:
        """Generated groups for a scorer: reclaimed ones first (idle past the visibility
        timeout), else new ones. `validate(group)` raises on a group the caller cannot use;
        such a group, and one delivered more than `max_attempts` times, is dead-lettered."""
        claimed = self._claim(GENERATED, consumer, count)
        got = claimed or self._read(GENERATED, consumer, count, block_ms)
        return self._take(GENERATED, consumer, got, validate)

    def publish_scored(
        self, entry_id: str, group: dict[str, Any], n_failed: int, **counts: int
    ) -> bool:
        """A scored group onto `scored`, and its `generated` entry acknowledged, atomically
        (nothing happens if that entry was already acknowledged), with `counts` added to the
        counters in the same step."""
        unknown = set(counts) - set(COUNTERS)
        if unknown:
            raise ValueError(f"unknown counters {sorted(unknown)}")
        pairs = [x for k, v in counts.items() if v for x in (k, int(v))]
        return bool(
            self._publish_scored(
                keys=[self.key(GENERATED), self.key(SCORED), self.key("counters")],
                args=[
                    GROUPS[GENERATED],
                    entry_id,
                    json.dumps(group),
                    len(group["samples"]),
                    n_failed,
                    *pairs,
                ],
            )
        )

    # -- training -----------------------------------------------------------------------
    def take_scored(
        self, consumer: str, count: int, block_ms: int = 500, validate=None
    ) -> list[tuple[str, dict[str, Any]]]:
        """New scored groups for the trainer; a malformed one is dead-lettered, as in
        `take_generated`."""
        return self._take(SCORED, consumer, self._read(SCORED, consumer, count, block_ms), validate)

    def take_pending(
        self,
        stream: str,
        consumer: str,
        after: str,
        validate=None,
        count: int = MAX_READ_ENTRIES,
        skip: frozenset[str] | set[str] = frozenset(),
        max_deliveries: int | None = None,
    ) -> tuple[list[tuple[str, dict[str, Any]]], str | None]:
        """At most `count` of the entries already leased to `consumer` with ids after `after`
        (what a restarted trainer's predecessor held, or what a lost reply delivered unseen), and
        the id to continue after (None: no more). Read in pages, so a long pending list never
        comes back in one reply; entries in `skip` (the caller holds them already) are passed
        over without being parsed. Each read counts a delivery (the server's own count), so an
        entry that crashes its consumer after it parsed is read back at every restart:
        `max_deliveries` (None: no cap) dead-letters it once read more often than that."""
        reply = self.r.xreadgroup(
            GROUPS[stream], consumer, {self.key(stream): after}, count=_read_count(stream, count)
        )
        raw = [(eid, fields) for _, entries in (reply or []) for eid, fields in entries]
        if not raw:
            return [], None
        times: dict[str, int] = {}
        if max_deliveries is not None:  # one XPENDING range for the page
            rows = self.r.xpending_range(
                self.key(stream), GROUPS[stream], raw[0][0], raw[-1][0], len(raw), consumer
            )
            times = {r["message_id"]: int(r["times_delivered"]) for r in rows}
        fresh = [(e, f, times.get(e, 1)) for e, f in raw if f and e not in skip]
        return self._take(stream, consumer, fresh, validate, max_deliveries), raw[-1][0]

    def pending_count(self, stream: str, consumer: str) -> int:
        """How many entries of `stream` are delivered to `consumer` and not acknowledged (one
        XPENDING summary: O(consumers) on the server, whatever the list's length)."""
        info = self.r.xpending(self.key(stream), GROUPS[stream])
        return sum(int(c["pending"]) for c in info.get("consumers") or [] if c["name"] == consumer)

    def _consumed_key(self, t: float) -> str:
        return self.key(f"consumed:{int(t // CONSUMED_BUCKET_S)}")

    def consumed(self, group_ids: list[str]) -> set[str]:
        """Which of `group_ids` were settled (trained, filtered or dropped) within the last
        CONSUMED_TTL_S: one pipelined read over the hourly buckets still alive."""
        if not group_ids:
            return set()
        now = time.time()
        keys = [
            self._consumed_key(now - h * CONSUMED_BUCKET_S)
            for h in range(CONSUMED_TTL_S // CONSUMED_BUCKET_S + 1)
        ]

        def read() -> list[list[int]]:
            pipe = self.r.raw.pipeline(transaction=False)
            for k in keys:
                pipe.smismember(k, group_ids)
            return pipe.execute()

        rows = self.r.call(read)
        return {g for j, g in enumerate(group_ids) if any(row[j] for row in rows)}

    def claim_trainer(self, holder: str, floor: int = 0) -> int:
        """Make the caller the run's one trainer: a new epoch (fencing token), returned. Every
        settle and commit carries it, and the server refuses those of an older epoch, so a
        trainer that a newer one replaced (a KFP retry while the first TrainJob still runs, a
        launcher killed before its cleanup) can no longer move the registry or the counters.
        `floor`: the newest epoch the run's store recorded; the epoch claimed is above it even
        when Valkey lost its counter (a flush, a restart without its append-only file), else the
        store would refuse every version this trainer publishes."""
        epoch = int(
            self.r.eval(
                "local e = redis.call('INCR', KEYS[1]) "
                "if e <= tonumber(ARGV[1]) then e = tonumber(ARGV[1]) + 1 "
                "redis.call('SET', KEYS[1], e) end return e",
                1,
                self.key("trainer_epoch"),
                int(floor),
            )
        )
        self.r.hset(
            self.key("trainer"), mapping={"epoch": epoch, "holder": holder, "since": time.time()}
        )
        log.info("trainer epoch %d claimed by %s", epoch, holder)
        return epoch

    def check_epoch(self, epoch: int) -> None:
        """Raise `FencedError` if a newer trainer claimed the run since `epoch`."""
        cur = self.r.get(self.key("trainer_epoch"))
        if cur is None:
            raise FencedError(
                f"trainer: Valkey lost this run's state (its trainer epoch {epoch}, and with it the "
                "queue, the counters and the registry: a flush, or a restart without its append-only "
                "file); stopping, so that a restarted trainer continues from the store's latest version"
            )
        if int(cur) != epoch:
            holder = self.r.hget(self.key("trainer"), "holder") or "?"
            raise FencedError(
                f"trainer: epoch {epoch} was superseded by epoch {cur} ({holder}); another trainer "
                "runs this run, so this one stops without publishing or committing"
            )

    def _settle_call(
        self,
        epoch: int,
        version: int,
        uri: str,
        sha: str,
        entry_ids: list[str],
        group_ids: list[str],
        counts: dict[str, int],
    ) -> bool:
        args: list[Any] = [
            GROUPS[SCORED],
            version,
            uri,
            sha,
            len(entry_ids),
            *entry_ids,
            len(group_ids),
            *group_ids,
        ]
        for k, v in counts.items():
            if v:
                args += [k, int(v)]
        args += [str(epoch), time.time()]
        done = int(
            self._settle(
                keys=[
                    self.key(SCORED),
                    self._consumed_key(time.time()),
                    self.key("counters"),
                    self.key("registry"),
                    self.key("trainer_epoch"),
                ],
                args=args,
            )
        )
        if done < 0:
            self.check_epoch(epoch)  # raises, naming the newer epoch
            raise FencedError(f"trainer: epoch {epoch} was refused by Valkey")
        return bool(done)

    def settle(self, epoch: int, entry_ids: list[str], group_ids: list[str], **counts: int) -> bool:
        """Dispose of scored entries for good: remember their group ids (so copies are
        duplicates), acknowledge and delete them, and count, atomically; nothing happens if
        the entries were already acknowledged. `FencedError` if `epoch` is not current."""
        return self._settle_call(epoch, -1, "", "", entry_ids, group_ids, counts)

    def commit_version(
        self,
        epoch: int,
        version: int,
        uri: str,
        manifest_sha256: str,
        entry_ids: list[str],
        group_ids: list[str],
        **counts: int,
    ) -> bool:
        """After version `version` is published: its training groups are consumed, their
        entries acknowledged, the counters moved and the registry bumped, atomically. Returns
        False (nothing happens) if the registry already holds `version` or later;
        `FencedError` if `epoch` is not the current trainer epoch."""
        return self._settle_call(epoch, version, uri, manifest_sha256, entry_ids, group_ids, counts)

    def backlog(self) -> int:
        """Scored groups waiting for the trainer, not yet taken into a batch. Entries the
        trainer holds (pending) are excluded: counting them could pause issuance for good
        while the trainer waits for the rest of its batch."""
        pending = int(self.r.xpending(self.key(SCORED), GROUPS[SCORED])["pending"])
        return max(0, int(self.r.xlen(self.key(SCORED))) - pending)

    def stream_bytes(self) -> int:
        """What the run's streams hold in the server's memory (MEMORY USAGE of each, sampled:
        a few round trips, whatever their length)."""
        return sum(
            int(self.r.memory_usage(self.key(s)) or 0) for s in (UNITS, GENERATED, SCORED, DEAD)
        )

    def units_waiting(self) -> int:
        """Units issued and not yet leased by any worker: the units stream's entries less those
        delivered and unacknowledged (acknowledged entries are deleted). What KEDA's
        redis-streams trigger reads as the rollout group's lag."""
        pending = int(self.r.xpending(self.key(UNITS), GROUPS[UNITS])["pending"])
        return max(0, int(self.r.xlen(self.key(UNITS))) - pending)

    def workers_holding_units(self) -> int:
        """Rollout workers with at least one unit leased and not yet acknowledged (one XPENDING
        summary of the units group)."""
        info = self.r.xpending(self.key(UNITS), GROUPS[UNITS])
        return sum(
            1
            for c in info.get("consumers") or []
            if c["name"].startswith("rollout") and int(c["pending"]) > 0
        )

    def set_fleet(self, values: dict[str, float]) -> None:
        """The fleet controller's measurements and wish (components/rollout/fleet.py)."""
        self.r.hset(self.key("fleet"), mapping={k: float(v) for k, v in values.items()})

    def fleet(self) -> dict[str, float]:
        return {k: float(v) for k, v in self.r.hgetall(self.key("fleet")).items()}

    def depth(self) -> dict[str, int]:
        """Entries in each stream (live work: acknowledged entries are deleted)."""
        return {s: int(self.r.xlen(self.key(s))) for s in (UNITS, GENERATED, SCORED, DEAD)}

    def last_added_ms(self, stream: str) -> int | None:
        """When the newest entry ever added to `stream` was added, in the server's clock (Unix
        ms, from its entry id; deleted entries count), or None before the first."""
        last = self.r.xinfo_stream(self.key(stream)).get("last-generated-id", "0-0")
        ms = int(str(last).split("-")[0])
        return ms or None

    def wait_durable(self, replicas: int = 0, timeout_s: float = 10.0) -> tuple[int, int]:
        """WAITAOF 1 `replicas`: block until this connection's writes are fsynced to the server's
        append-only file (and to `replicas` replicas'), at most `timeout_s`. Returns (local,
        replicas) as acknowledged. `BusError` when the server keeps no append-only file."""
        import valkey

        try:
            local, reps = self.r.execute_command(
                "WAITAOF", 1, replicas, max(1, int(timeout_s * 1000))
            )
        except valkey.exceptions.ResponseError as err:
            raise BusError(f"Valkey cannot make a write durable: {err}") from err
        return int(local), int(reps)

    def replicas(self) -> int:
        """How many replicas the server has (`WAIT 0`: returns at once with the replicas that
        acknowledged this connection's writes, which for a connection that wrote nothing is
        every connected one; no admin command, so a stage's ACL user may ask)."""
        return int(self.r.execute_command("WAIT", 0, 1))

    def positions(self) -> dict[str, int]:
        """Where the run is in the dataset order (`cursor`) and in unit ids (`unit_seq`): the
        trainer records both in every version's manifest, so a run resumed on a new Valkey
        neither starts the data again from index 0 nor reuses a unit id (`restore_positions`)."""
        cur, seq = self.r.mget([self.key("cursor"), self.key("unit_seq")])
        return {"cursor": int(cur or 0), "unit_seq": int(seq or 0)}

    def restore_positions(self, cursor: int, unit_seq: int) -> None:
        """Move `cursor` and `unit_seq` forward to at least these values (never back)."""
        for name, value in (("cursor", cursor), ("unit_seq", unit_seq)):
            self.r.eval(
                "local c = tonumber(redis.call('GET', KEYS[1]) or '0') "
                "if tonumber(ARGV[1]) > c then redis.call('SET', KEYS[1], ARGV[1]) end return 1",
                1,
                self.key(name),
                int(value),
            )

    def reopen(self) -> None:
        """A run resumed on purpose (`moerl run --resume`): clear `done` and `failed`, so its
        stages run again instead of exiting at once."""
        self.r.delete(self.key("done"), self.key("failed"))

    def cursor(self, n: int) -> int:
        """Reserve the next `n` prompts of the dataset order; returns the first index."""
        return int(self.r.incrby(self.key("cursor"), n)) - n


def _read_count(stream: str, wanted: int) -> int:
    """Entries one read may bring back: at most MAX_READ_ENTRIES units, and as many groups as
    fit READ_BUDGET_BYTES at MAX_ENTRY_BYTES each (a consumer's memory bounded by design)."""
    cap = MAX_READ_ENTRIES if stream == UNITS else max(1, READ_BUDGET_BYTES // MAX_ENTRY_BYTES)
    return max(1, min(wanted, cap))


def group_id(unit_id: str, k: int, prompt_id: str) -> str:
    """A GRPO group's id: the `k`-th prompt of unit `unit_id` (see the module docstring)."""
    return f"{unit_id}/{k}:{prompt_id}"


def _parse_unit(raw: str) -> dict[str, Any]:
    unit = json.loads(raw)
    if not (
        isinstance(unit, dict)
        and isinstance(unit.get("unit_id"), str)
        and isinstance(unit.get("prompts"), list)
        and unit["prompts"]
        and all(
            isinstance(p, dict)
            and isinstance(p.get("k"), int)
            and isinstance(p.get("prompt"), dict)
            for p in unit["prompts"]
        )
    ):
        raise ValueError("not a unit {unit_id: str, prompts: [{k: int, prompt: {...}}, ...]}")
    return unit


def _parse_group(raw: str, validate) -> dict[str, Any]:
    group = json.loads(raw)
    if not (
        isinstance(group, dict)
        and isinstance(group.get("group_id"), str)
        and isinstance(group.get("samples"), list)
        and group["samples"]
    ):
        raise ValueError("not a group {group_id: str, samples: [...]}")
    if validate is not None:
        validate(group)
    return group


def _countable(raw: str, field: str) -> dict[str, Any] | None:
    """A dead entry's payload, if it decodes far enough to be counted (its prompts or samples)."""
    try:
        obj = json.loads(raw)
    except ValueError:
        return None
    key = "prompts" if field == "unit" else "samples"
    return obj if isinstance(obj, dict) and isinstance(obj.get(key), list) else None


def _dead_counts(stream: str, obj: dict[str, Any] | None) -> dict[str, int]:
    """What a dead-lettered entry takes out of the run, for the counters: a unit its prompts
    (when it could be read), a group one prompt and its samples. The trainer's issuance counts
    dead prompts as settled, and the balance counts dead samples."""
    if stream == UNITS:
        n = len(obj["prompts"]) if obj else 0
        return {"entries_dead": 1, "units_dead": 1, "prompts_dead": n}
    # a group entry is one prompt by construction; its samples are known when it decodes (an
    # oversized one is never parsed: its samples are missing from the balance, its entry is in `dead`)
    n = len(obj["samples"]) if obj else 0
    return {"entries_dead": 1, "groups_dead": 1, "prompts_dead": 1, "samples_dead": n}
