"""The bus's hand-offs as Lua scripts, and the limits they enforce (see moerl/bus/run.py).

Each script runs atomically on the server. Wrapped in `_ONCE` with a fresh operation key per
call, it runs once per call whatever the network does (module `run`, `RunBus.__init__`).
"""

# Hand-offs as Lua scripts: atomic like MULTI, and idempotent. A client whose connection
# drops after the server ran a command retries it (valkey-py's Retry), so every script is
# guarded: by the XACK of its input entry (1 only the first time) or a set/flag, and a second
# execution changes nothing. KEYS/ARGV are documented at each call site.
_ISSUE = """
redis.call('XADD', KEYS[2], '*', 'unit', ARGV[2])
redis.call('HINCRBY', KEYS[3], 'units_issued', 1)
redis.call('HINCRBY', KEYS[3], 'prompts_issued', tonumber(ARGV[3]))
return 1
"""
_PUBLISH_GROUP = """
redis.call('HINCRBY', KEYS[3], 'generated', tonumber(ARGV[3]))
if redis.call('SADD', KEYS[1], ARGV[1]) == 0 then
  redis.call('HINCRBY', KEYS[3], 'duplicates', tonumber(ARGV[3]))
  return 0
end
redis.call('XADD', KEYS[2], '*', 'group', ARGV[2])
redis.call('HINCRBY', KEYS[3], 'groups_generated', 1)
redis.call('HINCRBY', KEYS[3], 'tokens_generated', tonumber(ARGV[4]))
return 1
"""
# A group too large for the bus, refused by its producer (KEYS as _PUBLISH_GROUP, then the
# dead stream. ARGV: group id, the payload's head, n samples, its size, the cap). It counts as
# generated and, at once, dead (its samples and its prompt), and is marked published so its
# unit can be acknowledged: the balance holds and admission sees its prompt settled, and no
# consumer ever reads an entry it would have to refuse after holding it in memory.
_REFUSE_GROUP = """
redis.call('HINCRBY', KEYS[3], 'generated', tonumber(ARGV[3]))
if redis.call('SADD', KEYS[1], ARGV[1]) == 0 then
  redis.call('HINCRBY', KEYS[3], 'duplicates', tonumber(ARGV[3]))
  return 0
end
redis.call('XADD', KEYS[4], 'MAXLEN', '~', DEAD_MAXLEN, '*', 'stream', 'generated', 'entry', ARGV[1], 'payload', ARGV[2], 'deliveries', 0,
           'by', 'producer', 'reason', ARGV[4])
for _, k in ipairs({'entries_dead', 'groups_dead', 'prompts_dead'}) do redis.call('HINCRBY', KEYS[3], k, 1) end
redis.call('HINCRBY', KEYS[3], 'samples_dead', tonumber(ARGV[3]))
return 1
"""
# A unit's acknowledgement. KEYS: units stream, counters, published set. ARGV: group, entry id,
# n, the unit's n group ids, then name/delta pairs. Refused with an error reply, changing
# nothing, unless every one of the unit's groups is published: an acknowledgement never lands
# without its groups, however it was sent (batched behind them in one pipeline, in particular,
# where a group refused with an error reply does not stop the writes after it).
_ACK_AND_COUNT = """
local n = tonumber(ARGV[3])
-- already acknowledged (by this call's first run, or by whoever reclaimed the unit): nothing to
-- do, and its groups may have left `published` with that acknowledgement
if #redis.call('XPENDING', KEYS[1], ARGV[1], ARGV[2], ARGV[2], 1) == 0 then return 0 end
for i = 4, 3 + n do
  if redis.call('SISMEMBER', KEYS[3], ARGV[i]) == 0 then
    error({err = 'MOERL_UNPUBLISHED unit entry ' .. ARGV[2] .. ' not acknowledged: its group ' .. ARGV[i] ..
                 ' is not published'})
  end
end
if redis.call('XACK', KEYS[1], ARGV[1], ARGV[2]) == 0 then return 0 end
redis.call('XDEL', KEYS[1], ARGV[2])
-- bounded state: an acknowledged unit is never executed again, so its groups need no longer be
-- remembered as published (a late copy from a holder that lost the lease is a duplicate the
-- trainer drops by its consumed set)
for i = 4, 3 + n do redis.call('SREM', KEYS[3], ARGV[i]) end
for i = 4 + n, #ARGV, 2 do redis.call('HINCRBY', KEYS[2], ARGV[i], tonumber(ARGV[i + 1])) end
return 1
"""
_PUBLISH_SCORED = """
if redis.call('XACK', KEYS[1], ARGV[1], ARGV[2]) == 0 then return 0 end
redis.call('XDEL', KEYS[1], ARGV[2])
redis.call('XADD', KEYS[2], '*', 'group', ARGV[3])
redis.call('HINCRBY', KEYS[3], 'scored', tonumber(ARGV[4]))
redis.call('HINCRBY', KEYS[3], 'score_failed', tonumber(ARGV[5]))
for i = 6, #ARGV, 2 do redis.call('HINCRBY', KEYS[3], ARGV[i], tonumber(ARGV[i + 1])) end
return 1
"""
# KEYS: the entry's stream, dead stream, counters. ARGV: group, entry id, payload (cut to
# DEAD_PAYLOAD_BYTES), deliveries, consumer, stream name, reason, then name/delta pairs.
_DEAD_LETTER = """
if redis.call('XACK', KEYS[1], ARGV[1], ARGV[2]) == 0 then return 0 end
redis.call('XDEL', KEYS[1], ARGV[2])
redis.call('XADD', KEYS[2], 'MAXLEN', '~', DEAD_MAXLEN, '*', 'stream', ARGV[6], 'entry', ARGV[2], 'payload', ARGV[3], 'deliveries', ARGV[4],
           'by', ARGV[5], 'reason', ARGV[7])
for i = 8, #ARGV, 2 do redis.call('HINCRBY', KEYS[3], ARGV[i], tonumber(ARGV[i + 1])) end
return 1
"""
# An entry larger than this is refused (dead-lettered) before it is parsed: a GRPO group of 16
# samples with 32 k response tokens each (ids and logprobs as JSON) is about 15 MB.
MAX_ENTRY_BYTES = 64 << 20
DEAD_PAYLOAD_BYTES = 4096  # what the dead-letter stream keeps of a refused payload
# KEYS: scored stream, consumed set, counters, registry, trainer epoch. ARGV: group, version
# (or -1: no registry bump), uri, sha, n_entries, entries..., n_groups, groups..., then
# name/delta pairs, then the caller's epoch, then the time. Fenced first: a trainer whose epoch
# is not the current one changes nothing (-1). Then guarded by the registry version for a
# commit, by each entry's XACK for a settle.
_SETTLE = """
if redis.call('GET', KEYS[5]) ~= ARGV[#ARGV - 1] then return -1 end
local version = tonumber(ARGV[2])
if version >= 0 then
  local cur = redis.call('HGET', KEYS[4], 'version')
  if cur and tonumber(cur) >= version then return 0 end
end
local i = 6
local ne = tonumber(ARGV[5])
local acked = 0
for j = 1, ne do
  acked = acked + redis.call('XACK', KEYS[1], ARGV[1], ARGV[i])
  redis.call('XDEL', KEYS[1], ARGV[i])
  i = i + 1
end
if version < 0 and ne > 0 and acked == 0 then return 0 end
local ng = tonumber(ARGV[i])
i = i + 1
for j = 1, ng do redis.call('SADD', KEYS[2], ARGV[i]); i = i + 1 end
if ng > 0 then redis.call('EXPIRE', KEYS[2], CONSUMED_TTL_S) end
while i < #ARGV - 1 do redis.call('HINCRBY', KEYS[3], ARGV[i], tonumber(ARGV[i + 1])); i = i + 2 end
if version >= 0 then
  redis.call('HSET', KEYS[4], 'version', version, 'uri', ARGV[3], 'manifest_sha256', ARGV[4], 'published_at', ARGV[#ARGV])
end
return 1
"""


# KEYS: stream. ARGV: group, consumer, entry id, min idle 0. A lease refresh that only its
# holder can make: XCLAIM with min-idle 0 would take the entry from whoever holds it now (a
# worker that reclaimed it while this one was busy), so the owner is checked first, atomically.
_TOUCH = """
local p = redis.call('XPENDING', KEYS[1], ARGV[1], ARGV[3], ARGV[3], 1)
if #p == 0 or p[1][2] ~= ARGV[2] then return 0 end
redis.call('XCLAIM', KEYS[1], ARGV[1], ARGV[2], 0, ARGV[3], 'JUSTID')
return 1
"""


# KEYS: servable hash, trainer epoch. ARGV: version, uri, manifest sha256, unix time, epoch.
# Set only by the current trainer epoch (-1 otherwise): a fenced-off trainer's publisher can
# never point the engines at its versions.
_SET_SERVABLE = """
if redis.call('GET', KEYS[2]) ~= ARGV[5] then return -1 end
redis.call('HSET', KEYS[1], 'version', ARGV[1], 'uri', ARGV[2], 'manifest_sha256', ARGV[3], 'at', ARGV[4],
           'epoch', ARGV[5])
return 1
"""


_INCR = """
for i = 1, #ARGV, 2 do redis.call('HINCRBY', KEYS[1], ARGV[i], tonumber(ARGV[i + 1])) end
return 1
"""
# KEYS: units stream, counters. ARGV: group, old entry id, the smaller unit's JSON or ''.
_REQUEUE = """
if redis.call('XACK', KEYS[1], ARGV[1], ARGV[2]) == 0 then return 0 end
redis.call('XDEL', KEYS[1], ARGV[2])
if ARGV[3] ~= '' then redis.call('XADD', KEYS[1], '*', 'unit', ARGV[3]) end
redis.call('HINCRBY', KEYS[2], 'units_requeued', 1)
return 1
"""
# Every hand-off runs once per call whatever the network does: a client whose connection
# dropped after the server ran a script (the reply was lost) sends it again with the same
# operation key (the last KEYS entry, a fresh id per call), and the second run returns the
# first one's result without touching anything. The key expires after OP_TTL_S, far past any
# retry (`valkey.reconnect_s` is at most that). So a resend never adds a second unit, never
# counts a group twice and never drifts a counter.
OP_TTL_S = 3600
_ONCE = """
local prev = redis.call('GET', KEYS[#KEYS])
if prev then return tonumber(prev) end
local function handoff()
%s
end
local r = handoff()
redis.call('SET', KEYS[#KEYS], r, 'EX', %d)
return r
"""
# Bounded state. The dead-letter stream keeps its newest DEAD_MAXLEN entries (the counters keep
# every one). The consumed set is kept in hourly buckets, each forgotten CONSUMED_TTL_S after its
# last write: it only has to catch a copy of a group settled in the last hours (a late publish by
# a holder that lost its lease; a re-delivery after a failover is replayed from the registry).
DEAD_MAXLEN = 10_000
CONSUMED_BUCKET_S = 3600
CONSUMED_TTL_S = 7 * CONSUMED_BUCKET_S
for _name in ("_SETTLE", "_DEAD_LETTER", "_REFUSE_GROUP"):
    globals()[_name] = (
        globals()[_name]
        .replace("CONSUMED_TTL_S", str(CONSUMED_TTL_S))
        .replace("DEAD_MAXLEN", str(DEAD_MAXLEN))
    )
MAX_READ_ENTRIES = 32  # entries per stream read of small entries (units)
# What one read of a stream of groups may bring back at most: its count is bounded so that
# count * MAX_ENTRY_BYTES stays under this (8 entries of 64 MiB), so a consumer's memory is
# bounded whatever sizes the producers wrote. The server caps any one argument near the entry
# cap (`proto-max-bulk-len`, moerl/bus/client.py and manifests/base/valkey.yaml), so even a
# writer that skips the producer's check cannot store a larger entry.
READ_BUDGET_BYTES = 512 << 20
PROTO_MAX_BULK_LEN = MAX_ENTRY_BYTES + (4 << 20)  # an entry and its envelope
