"""RedisStore: the Store on Redis (redis-py, bytes in and out).

Layout, every key under a configurable prefix P (default "pkv:"):

    P nodes            set   registered node ids
    P node:<id>        hash  address, spec (JSON), num_blocks, load (JSON), policy, epoch
    P alive:<id>       str   liveness; PX TTL renewed by heartbeats (tooz style)
    P nkeys:<id>       set   block keys the node holds   (reverse index: purges)
    P hkeys:<id>       set   of those, the ones on its host tier
    P idx:<key16>      set   node ids holding the key    (the global prefix index)
    P nseqs:<id>       set   seq ids with an extent on the node
    P seq:<seq_id>     hash  tenant, extents (JSON), num_tokens, state, lost_reason
    P salt:<tenant>    str   16 random bytes, SET NX (first writer wins)
    P usage:<tenant>   int   blocks reserved
    P lead:<role>      str   the holder of a role's lease (the reaper), PX TTL

Every multi-key update is one Lua script (atomic; one round trip). Scripts build
key names from P inside Redis, so this targets a single Redis (or a primary with
replicas), not Redis Cluster. A purge of a node with many keys runs in one script
and blocks Redis for its duration (~1 ms per 10k keys).

Errors: connection failures and timeouts become Unavailable. The client retries
(one Retry value, set below) on ConnectionError only: that covers a pooled
connection that died while Redis restarted; a timeout is not retried, because
the command may have run and not every call (reserve_blocks) is idempotent.
EVALSHA's NOSCRIPT after a Redis restart is handled by redis-py's Script (it
reloads and retries), so a store survives an outage without being recreated.
The per-request scripts (open_sequence, match_prefix, delete_sequence) go through
KeptScripts (kept_script.py): the same EVALSHA, retry and NOSCRIPT handling on a
connection kept for them, without redis-py's per-call machinery.
"""

from __future__ import annotations

import json
import math
import os
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import redis
from redis.backoff import ExponentialBackoff
from redis.retry import Retry

from pagedkv.protos.errors import (
    FailedPrecondition,
    IntegrityError,
    InvalidArgument,
    PermissionDenied,
    QuotaExceeded,
    SequenceNotFound,
    Unavailable,
)

from .kept_script import KeptScripts
from .placement import Placement, no_room
from .records import (
    Extent,
    NewSequence,
    NodeInfo,
    NodeNotLive,
    PurgeResult,
    SequenceExists,
    SequenceRecord,
    check_count,
    check_events,
    check_key,
    check_keys,
    check_load,
    check_name,
    check_policy,
    check_sequence_fields,
    check_ttl,
)
from .store import Store

SALT_BYTES = 16


@dataclass(frozen=True)
class RedisStoreConfig:
    """Connection settings. Timeouts bound how long a call can hang when Redis is gone."""

    prefix: str = "pkv:"
    socket_timeout_s: float = 1.0
    socket_connect_timeout_s: float = 0.5
    retries: int = 2
    max_connections: int = 64

    def __post_init__(self) -> None:
        if not isinstance(self.prefix, str) or not self.prefix:
            raise InvalidArgument(f"prefix must be a non-empty str, got {self.prefix!r}")
        for name in ("socket_timeout_s", "socket_connect_timeout_s"):
            if not isinstance(getattr(self, name), int | float) or getattr(self, name) <= 0:
                raise InvalidArgument(f"{name} must be > 0, got {getattr(self, name)!r}")
        check_count("retries", self.retries)
        if self.max_connections < 1:
            raise InvalidArgument(f"max_connections must be >= 1, got {self.max_connections!r}")


# Shared by register_node and remove_node: drop the node's keys from the index and
# mark its sequences lost. Returns {number of keys purged, {lost seq ids}}.
_PURGE = """
local function purge(P, id, reason)
  local nk = P .. 'nkeys:' .. id
  local keys = redis.call('SMEMBERS', nk)
  for _, k in ipairs(keys) do redis.call('SREM', P .. 'idx:' .. k, id) end
  redis.call('DEL', nk, P .. 'hkeys:' .. id)
  local ns = P .. 'nseqs:' .. id
  local lost = {}
  for _, s in ipairs(redis.call('SMEMBERS', ns)) do
    local sk = P .. 'seq:' .. s
    local state = redis.call('HGET', sk, 'state')
    if state then
      if state ~= 'lost' then redis.call('HSET', sk, 'state', 'lost', 'lost_reason', reason) end
      lost[#lost + 1] = s
    end
  end
  redis.call('DEL', ns)
  return {#keys, lost}
end
"""

# ARGV: P, id, address, spec_json, num_blocks, ttl_ms, reason, epoch, policy
_REGISTER = (
    _PURGE
    + """
local P, id = ARGV[1], ARGV[2]
local was = redis.call('SISMEMBER', P .. 'nodes', id)
local r = purge(P, id, ARGV[7])
local nk = P .. 'node:' .. id
redis.call('DEL', nk)
redis.call('HSET', nk, 'address', ARGV[3], 'spec', ARGV[4], 'num_blocks', ARGV[5], 'load', '{}',
           'epoch', ARGV[8], 'policy', ARGV[9])
redis.call('SADD', P .. 'nodes', id)
redis.call('SET', P .. 'alive:' .. id, '1', 'PX', ARGV[6])
return {was, r[1], r[2]}
"""
)

# ARGV: P, id, require_expired ('1'/'0'), reason.  Returns {-1} if live and required expired.
_REMOVE = (
    _PURGE
    + """
local P, id = ARGV[1], ARGV[2]
if redis.call('SISMEMBER', P .. 'nodes', id) == 0 then return {0, 0, {}} end
if ARGV[3] == '1' and redis.call('EXISTS', P .. 'alive:' .. id) == 1 then return {-1, 0, {}} end
local r = purge(P, id, ARGV[4])
redis.call('DEL', P .. 'node:' .. id, P .. 'alive:' .. id)
redis.call('SREM', P .. 'nodes', id)
return {1, r[1], r[2]}
"""
)

# ARGV: P, id, load_json, ttl_ms
_HEARTBEAT = """
local P, id = ARGV[1], ARGV[2]
if redis.call('SISMEMBER', P .. 'nodes', id) == 0 then return 0 end
redis.call('SET', P .. 'alive:' .. id, '1', 'PX', ARGV[4])
redis.call('HSET', P .. 'node:' .. id, 'load', ARGV[3])
return 1
"""

# KEYS: node:<id>, alive:<id>. Returns {address, spec, num_blocks, load, policy, epoch} | {}
_LIVE_NODE = """
if redis.call('EXISTS', KEYS[2]) == 0 then return {} end
local h = redis.call('HMGET', KEYS[1], 'address', 'spec', 'num_blocks', 'load', 'policy', 'epoch')
if not h[1] then return {} end
return {h[1], h[2], h[3], h[4], h[5] or '', h[6] or '0'}
"""

# KEYS: lead:<role>. ARGV: holder, ttl_ms. Returns 1 if the holder has the lease now, else 0.
_TRY_LEAD = """
local v = redis.call('GET', KEYS[1])
if v and v ~= ARGV[1] then return 0 end
redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
return 1
"""

# ARGV: P, want_live ('1'/'0').
# Live: {{id, address, spec, num_blocks, load, policy, epoch}, ...}; else {id, ...}
_LIST_NODES = """
local P = ARGV[1]
local out = {}
for _, id in ipairs(redis.call('SMEMBERS', P .. 'nodes')) do
  local live = redis.call('EXISTS', P .. 'alive:' .. id) == 1
  if ARGV[2] == '1' and live then
    local h = redis.call('HMGET', P .. 'node:' .. id, 'address', 'spec', 'num_blocks', 'load',
                         'policy', 'epoch')
    out[#out + 1] = {id, h[1], h[2], h[3], h[4], h[5] or '', h[6] or '0'}
  elseif ARGV[2] == '0' and not live then
    out[#out + 1] = id
  end
end
return out
"""

# ARGV: P, id, num_stored, num_offloaded, stored..., offloaded..., removed...
_APPLY_EVENTS = """
local P, id = ARGV[1], ARGV[2]
if redis.call('EXISTS', P .. 'alive:' .. id) == 0 then return 0 end
local n, m = tonumber(ARGV[3]), tonumber(ARGV[4])
local nk, hk = P .. 'nkeys:' .. id, P .. 'hkeys:' .. id
local has_host = redis.call('EXISTS', hk) == 1
local done = {}  -- in-flight markers (placement.py) of keys now stored: their wait is over
for i = 5, 4 + n do
  redis.call('SADD', P .. 'idx:' .. ARGV[i], id)
  redis.call('SADD', nk, ARGV[i])
  if has_host then redis.call('SREM', hk, ARGV[i]) end
  done[#done + 1] = P .. 'pend:' .. ARGV[i]
  if #done == 4000 then redis.call('DEL', unpack(done)); done = {} end
end
if #done > 0 then redis.call('DEL', unpack(done)) end
for i = 5 + n, 4 + n + m do  -- still held, on the host tier
  redis.call('SADD', P .. 'idx:' .. ARGV[i], id)
  redis.call('SADD', nk, ARGV[i])
  redis.call('SADD', hk, ARGV[i])
end
has_host = has_host or m > 0
for i = 5 + n + m, #ARGV do
  if has_host then redis.call('SREM', hk, ARGV[i]) end
  if redis.call('SREM', nk, ARGV[i]) == 1 then redis.call('SREM', P .. 'idx:' .. ARGV[i], id) end
end
return 1
"""

# Shared by match_prefix and open_sequence. Keys arrive as ONE argument, the 16-byte
# keys joined (redis-py encodes one bytes argument instead of 71 for a W2 open), split
# here with string.sub. The nodes with a run are those the index idx:<key> lists for the
# first key; each of them is asked its run through its reverse index nkeys:<id> (kept with
# idx:<key> by apply_events and the purges), one SMISMEMBER with every key, not once per
# key (2.5x less server time for a W2 open, bench/control.py). So a match costs
# O(H x K), H the live nodes holding the first key, K the keys: nodes that hold none of
# the prompt cost nothing (bench/scale.py). Ids and keys go in slices of 4,000, below
# Lua's unpack() limit.
_MATCH = """
local function split_keys(blob)
  local keys = {}
  for i = 1, #blob, 16 do keys[#keys + 1] = string.sub(blob, i, i + 15) end
  return keys
end
local function leading(P, id, keys)
  local n, first = 0, 1
  while first <= #keys do
    local last = math.min(first + 3999, #keys)
    local held = redis.call('SMISMEMBER', P .. 'nkeys:' .. id, unpack(keys, first, last))
    local i = 1
    while i <= #held and held[i] == 1 do i = i + 1 end
    n = n + i - 1
    if i <= #held then break end
    first = last + 1
  end
  return n
end
-- ids (a list) -> {id = true} for those whose alive:<id> exists: one MGET per 4,000 ids.
local function live_set(P, ids)
  local live = {}
  for first = 1, #ids, 4000 do
    local names = {}
    for i = first, math.min(first + 3999, #ids) do names[#names + 1] = P .. 'alive:' .. ids[i] end
    local flags = redis.call('MGET', unpack(names))
    for i, flag in ipairs(flags) do if flag then live[ids[first + i - 1]] = true end end
  end
  return live
end
-- {id = leading run} for the nodes of `wanted` (a set) that hold keys[1]; others hold 0.
local function held_runs(P, keys, wanted)
  local held = {}
  if #keys == 0 then return held end
  for _, id in ipairs(redis.call('SMEMBERS', P .. 'idx:' .. keys[1])) do
    if wanted[id] then held[id] = leading(P, id, keys) end
  end
  return held
end
"""

# ARGV: P, keys_blob.  Returns a flat {node, count, node, count, ...} over live nodes.
_MATCH_PREFIX = (
    _MATCH
    + """
local P = ARGV[1]
local keys = split_keys(ARGV[2])
local ids = redis.call('SMEMBERS', P .. 'nodes')
local live = live_set(P, ids)
local held = held_runs(P, keys, live)
local out = {}
for _, id in ipairs(ids) do
  if live[id] then out[#out + 1] = id; out[#out + 1] = held[id] or 0 end
end
return out
"""
)

# The whole open in one round trip: match, placement.place ported to Lua, quota, page table,
# and the in-flight marker (placement.py) on the first uncached key.
# ARGV: P, seq_id, tenant, num_tokens, num_blocks, overlap_weight, load_weight, quota ('' = none),
#       keys_blob, balance_slack ('-1' = no bound), pending_ttl_ms, affinity_share, balance_margin,
#       host_weight, scan_classes, candidates: one string, a line per candidate by node_id,
#       "node_id TAB free_blocks TAB total_blocks TAB evictable_blocks TAB recent_opens TAB
#       active_blocks ('-1' = not counted) LF" (one argument, not six per node: redis-py
#       encoded 6,000 arguments an open at 1,000 nodes).
# Returns {1, node, cached, {node, score, ...}, {rejected...}, pending, cached elsewhere, host, scan,
#          the node holding that}
#       | {0} (no live candidate)
#       | {-1, fewest uncached, most room} (no room) | {-2, used} (quota) | {-3} (id taken).
# Scores travel as %.17g strings (Redis truncates Lua numbers to integers), which parse back
# to the same doubles (the arithmetic is place()'s, in its order); ties go to the smallest
# sha1hex(first key .. node id), as place()'s tie_rank; scans first by sha1hex(SCAN_KEY .. id).
_OPEN_SEQ = (
    _MATCH
    + """
-- The held run as the node serves it: its device run, then the host run that continues it.
local function tiers(P, id, keys, held)
  local hk = P .. 'hkeys:' .. id
  if held == 0 or redis.call('EXISTS', hk) == 0 then return held, 0 end
  local on_host = {}
  for first = 1, held, 4000 do  -- slices below Lua's unpack() limit, as leading()
    local part = redis.call('SMISMEMBER', hk, unpack(keys, first, math.min(first + 3999, held)))
    for _, v in ipairs(part) do on_host[#on_host + 1] = v end
  end
  local device = held
  for i = 1, held do if on_host[i] == 1 then device = i - 1; break end end
  local stop = held
  for i = device + 1, held do if on_host[i] == 0 then stop = i - 1; break end end
  return stop, stop - device
end
local P, s, tenant = ARGV[1], ARGV[2], ARGV[3]
local need = tonumber(ARGV[5])
local ow, lw = tonumber(ARGV[6]), tonumber(ARGV[7])
local keys = split_keys(ARGV[9])
local slack, ttl, aff, margin = tonumber(ARGV[10]), tonumber(ARGV[11]), tonumber(ARGV[12]), tonumber(ARGV[13])
local hw, scan_mask = tonumber(ARGV[14]), tonumber(ARGV[15])
local tie = keys[1] or ''
local nodes = {}
local sum_opens, sum_total, most_cached = 0, 0, 0
local ids, rows = {}, {}
local col = '([^\\t]+)\\t'
for id, f, t, e, o, a in string.gmatch(ARGV[16], string.rep(col, 5) .. '([^\\n]+)\\n') do
  ids[#ids + 1] = id
  rows[#rows + 1] = {id, f, t, e, o, a}
end
local live = live_set(P, ids)
local runs = held_runs(P, keys, live)
local markers = {}  -- keys[i] -> its in-flight marker or false: read once, not once per node
for _, row in ipairs(rows) do
  local id = row[1]
  if live[id] then
    local free, total, evictable = tonumber(row[2]), tonumber(row[3]), tonumber(row[4])
    local opens, active = tonumber(row[5]), tonumber(row[6])
    local held, host = tiers(P, id, keys, runs[id] or 0)
    local pending = 0
    if held < #keys then
      local marker = markers[held + 1]
      if marker == nil then
        marker = redis.call('GET', P .. 'pend:' .. keys[held + 1])
        markers[held + 1] = marker
      end
      if marker then
        local count, owner = string.match(marker, '^(%d+):(.*)$')
        if owner == id then pending = math.max(0, math.min(tonumber(count), #keys) - held) end
      end
    end
    local cached = math.min(held, need)
    host = math.max(0, host - (held - cached))
    if active < 0 then active = total - free - evictable end
    nodes[#nodes + 1] = {id, free + evictable, total, cached, pending, opens, host, active}
    if cached > most_cached then most_cached = cached end
    sum_opens = sum_opens + opens
    sum_total = sum_total + total
  end
end
if #nodes == 0 then return {0} end
local class, v = 0, need - most_cached
while v > 0 do class = class + 1; v = math.floor(v / 2) end
local scan = math.floor(scan_mask / 2 ^ class) % 2 == 1
local best, best_over, best_order, best_cost, best_rank, best_cached, best_pending, best_host
local scores, rejected = {}, {}
local fewest_new, most_room = nil, 0
for _, n in ipairs(nodes) do
  local id, room, total, cached, host = n[1], n[2], n[3], n[4], n[7]
  local new = need - cached
  if fewest_new == nil or new + host < fewest_new then fewest_new = new + host end
  if room > most_room then most_room = room end
  if new + host > room then
    rejected[#rejected + 1] = id
  else
    local pending = math.min(n[5], new)
    local after = n[8] + new + host
    local cost = ow * (new - pending) + hw * host + lw * after
    scores[#scores + 1] = id; scores[#scores + 1] = string.format('%.17g', -cost)
    local fair = 0.0
    if sum_total > 0 then fair = (sum_opens + 1) * total / sum_total end
    local opens = n[6] + 1
    local over = slack >= 0 and opens > (1.0 + slack) * fair + margin
    over = over and (cached < aff * need or opens > (1.0 + 2 * slack) * fair + 2 * margin)
    local order = ''
    if scan then order = redis.sha1hex('pagedkv:scan' .. id) end
    local rank = nil  -- the tie's hash, taken only on a tie (one sha1 per node made opens O(N))
    local better = best == nil
    if not better then
      if over ~= best_over then better = not over
      elseif order ~= best_order then better = order < best_order
      elseif cost ~= best_cost then better = cost < best_cost
      else
        rank = redis.sha1hex(tie .. id)
        if best_rank == nil then best_rank = redis.sha1hex(tie .. best) end
        better = rank < best_rank
      end
    end
    if better then
      best, best_over, best_order, best_cost, best_rank = id, over, order, cost, rank
      best_cached, best_pending, best_host = cached, pending, host
    end
  end
end
if best == nil then return {-1, fewest_new, most_room} end
local elsewhere, elsewhere_id = 0, ''
for _, n in ipairs(nodes) do
  if n[1] ~= best and n[4] > elsewhere then elsewhere, elsewhere_id = n[4], n[1] end
end
local uk = P .. 'usage:' .. tenant
if ARGV[8] ~= '' then
  local used = tonumber(redis.call('GET', uk) or '0')
  if used + need > tonumber(ARGV[8]) then return {-2, used} end
end
local sk = P .. 'seq:' .. s
if redis.call('EXISTS', sk) == 1 then return {-3} end
redis.call('HSET', sk, 'tenant', tenant, 'extents', cjson.encode({{best, 0, need}}),
           'num_tokens', ARGV[4], 'state', 'active', 'lost_reason', '')
redis.call('SADD', P .. 'nseqs:' .. best, s)
if ARGV[8] ~= '' and need > 0 then redis.call('INCRBY', uk, need) end
if ttl > 0 and best_cached < #keys then
  redis.call('SET', P .. 'pend:' .. keys[best_cached + 1], #keys .. ':' .. best, 'PX', ttl)
end
return {1, best, best_cached, scores, rejected, best_pending, elsewhere, best_host, scan and 1 or 0,
        elsewhere_id}
"""
)

# ARGV: P, seq_id, tenant, extents_json, num_tokens, state, lost_reason, node ids...
# Returns {1} | {0} (exists) | {-1, node} (node not live)
_CREATE_SEQ = """
local P, s = ARGV[1], ARGV[2]
local sk = P .. 'seq:' .. s
if redis.call('EXISTS', sk) == 1 then return {0} end
for i = 8, #ARGV do
  if redis.call('EXISTS', P .. 'alive:' .. ARGV[i]) == 0 then return {-1, ARGV[i]} end
end
redis.call('HSET', sk, 'tenant', ARGV[3], 'extents', ARGV[4], 'num_tokens', ARGV[5],
           'state', ARGV[6], 'lost_reason', ARGV[7])
for i = 8, #ARGV do redis.call('SADD', P .. 'nseqs:' .. ARGV[i], s) end
return {1}
"""

# ARGV: P, seq_id, num_field_args (2 per field), field, value, ..., new node ids (when extents set)
# Returns {1, hgetall} | {0} (missing) | {-1, node} (node not live)
_UPDATE_SEQ = """
local P, s = ARGV[1], ARGV[2]
local sk = P .. 'seq:' .. s
if redis.call('EXISTS', sk) == 0 then return {0} end
local m = tonumber(ARGV[3])
local moves = false
for i = 4, 3 + m, 2 do if ARGV[i] == 'extents' then moves = true end end
if moves then
  for i = 4 + m, #ARGV do
    if redis.call('EXISTS', P .. 'alive:' .. ARGV[i]) == 0 then return {-1, ARGV[i]} end
  end
  for _, e in ipairs(cjson.decode(redis.call('HGET', sk, 'extents'))) do
    redis.call('SREM', P .. 'nseqs:' .. e[1], s)
  end
  for i = 4 + m, #ARGV do redis.call('SADD', P .. 'nseqs:' .. ARGV[i], s) end
end
for i = 4, 3 + m, 2 do redis.call('HSET', sk, ARGV[i], ARGV[i + 1]) end
return {1, redis.call('HGETALL', sk)}
"""

# ARGV: P, seq_id. Returns the deleted hash (flat), or {} if missing.
_DELETE_SEQ = """
local P, s = ARGV[1], ARGV[2]
local sk = P .. 'seq:' .. s
local h = redis.call('HGETALL', sk)
if #h == 0 then return h end
if ARGV[3] ~= '' and redis.call('HGET', sk, 'tenant') ~= ARGV[3] then return {'!tenant'} end
for _, e in ipairs(cjson.decode(redis.call('HGET', sk, 'extents'))) do
  redis.call('SREM', P .. 'nseqs:' .. e[1], s)
end
redis.call('DEL', sk)
return h
"""

# ARGV: P, node_id. Returns {seq_id, hgetall, seq_id, hgetall, ...}
_SEQS_OF_NODE = """
local P = ARGV[1]
local out = {}
for _, s in ipairs(redis.call('SMEMBERS', P .. 'nseqs:' .. ARGV[2])) do
  local h = redis.call('HGETALL', P .. 'seq:' .. s)
  if #h > 0 then out[#out + 1] = s; out[#out + 1] = h end
end
return out
"""

# KEYS: usage key. ARGV: n, quota. Returns {1, new_used} | {0, used}
_RESERVE = """
local used = tonumber(redis.call('GET', KEYS[1]) or '0')
local n, quota = tonumber(ARGV[1]), tonumber(ARGV[2])
if used + n > quota then return {0, used} end
return {1, redis.call('INCRBY', KEYS[1], n)}
"""

# KEYS: usage key. ARGV: n. Returns {1, new_used} | {0, used}
_RELEASE = """
local used = tonumber(redis.call('GET', KEYS[1]) or '0')
local n = tonumber(ARGV[1])
if n > used then return {0, used} end
local left = redis.call('DECRBY', KEYS[1], n)
if left == 0 then redis.call('DEL', KEYS[1]) end
return {1, left}
"""


def _s(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value


def _record(seq_id: str, flat: Sequence[bytes]) -> SequenceRecord:
    h = {_s(flat[i]): flat[i + 1] for i in range(0, len(flat), 2)}
    return SequenceRecord(
        seq_id=seq_id,
        tenant=_s(h["tenant"]),
        extents=tuple(Extent(n, f, b) for n, f, b in json.loads(h["extents"])),
        num_tokens=int(h["num_tokens"]),
        state=_s(h["state"]),
        lost_reason=_s(h.get("lost_reason", b"")),
    )


def _node_info(
    node_id: str, addr: bytes, spec: bytes, nb: bytes, load: bytes, policy: bytes, epoch: bytes
) -> NodeInfo:
    return NodeInfo(node_id, _s(addr), json.loads(spec), int(nb), json.loads(load), _s(policy), int(epoch))


def _purge_result(node_id: str, reply: Sequence[Any]) -> PurgeResult:
    return PurgeResult(node_id, bool(reply[0]), int(reply[1]), tuple(sorted(_s(s) for s in reply[2])))


def _encode_field(name: str, value: Any) -> str | int:
    if name == "extents":
        return json.dumps([list(e) for e in value])
    return value  # type: ignore[no-any-return]


class RedisStore(Store):
    def __init__(self, url: str, config: RedisStoreConfig | None = None, **options: Any) -> None:
        """url: redis://host:port/db. options: RedisStoreConfig fields (prefix=..., ...)."""
        self.config = config or RedisStoreConfig(**options)
        self._url = url
        self._prefix = self.config.prefix
        # The one place transient failures are retried (see the module docstring).
        retry = Retry(
            ExponentialBackoff(cap=0.2, base=0.02),
            self.config.retries,
            supported_errors=(redis.ConnectionError,),
        )
        try:
            self._redis = redis.Redis.from_url(
                url,
                decode_responses=False,
                socket_timeout=self.config.socket_timeout_s,
                socket_connect_timeout=self.config.socket_connect_timeout_s,
                retry=retry,
                retry_on_error=[redis.ConnectionError],
                max_connections=self.config.max_connections,
            )
        except ValueError as e:
            raise InvalidArgument(f"bad redis URL {url!r}: {e}") from e
        reg = self._redis.register_script
        self._register = reg(_REGISTER)
        self._remove = reg(_REMOVE)
        self._heartbeat = reg(_HEARTBEAT)
        self._list_nodes = reg(_LIST_NODES)
        self._live_node = reg(_LIVE_NODE)
        self._try_lead = reg(_TRY_LEAD)
        self._apply_events = reg(_APPLY_EVENTS)
        self._match_prefix = reg(_MATCH_PREFIX)
        self._open_seq = reg(_OPEN_SEQ)
        self._create_seq = reg(_CREATE_SEQ)
        self._update_seq = reg(_UPDATE_SEQ)
        self._delete_seq = reg(_DELETE_SEQ)
        self._seqs_of_node = reg(_SEQS_OF_NODE)
        self._reserve = reg(_RESERVE)
        self._release = reg(_RELEASE)
        self._kept = KeptScripts(self._redis)

    def __repr__(self) -> str:
        return f"RedisStore({self._redis.connection_pool!r}, prefix={self._prefix!r})"

    # Called after every Redis call with (op, seconds, ok) when set (the coordinator's metrics).
    observer: Callable[[str, float, bool], None] | None = None

    def _call(self, what: str, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """Run one Redis call, translating redis-py's errors into the pagedkv hierarchy.

        Returns Any: redis-py's reply types are too loose to be useful here."""
        if self.observer is None:
            return self._call_redis(what, fn, *args, **kwargs)
        start, ok = time.perf_counter(), False
        try:
            result = self._call_redis(what, fn, *args, **kwargs)
            ok = True
            return result
        finally:
            self.observer(what, time.perf_counter() - start, ok)

    def _call_redis(self, what: str, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except (redis.ConnectionError, redis.TimeoutError) as e:
            raise Unavailable(f"redis unreachable during {what}: {e}") from e
        except (redis.ReadOnlyError, redis.exceptions.OutOfMemoryError) as e:
            raise Unavailable(f"redis refused {what}: {e}") from e
        except redis.ResponseError as e:
            if str(e).startswith(("BUSY", "LOADING", "MASTERDOWN", "TRYAGAIN")):
                raise Unavailable(f"redis busy during {what}: {e}") from e
            raise IntegrityError(f"redis rejected {what} (a pagedkv bug): {e}") from e
        except redis.RedisError as e:
            raise Unavailable(f"redis error during {what}: {e}") from e

    def _key(self, *parts: str | bytes) -> bytes:
        return self._prefix.encode() + b"".join(p.encode() if isinstance(p, str) else p for p in parts)

    # ---- membership ---------------------------------------------------------------------------

    def register_node(
        self,
        node_id: str,
        address: str,
        spec: Mapping[str, Any],
        num_blocks: int,
        ttl_s: float,
        epoch: int = 0,
        *,
        policy: str = "",
    ) -> PurgeResult:
        check_name("node_id", node_id)
        check_name("address", address)
        check_count("num_blocks", num_blocks)
        check_policy(policy)
        ttl_ms = max(1, round(check_ttl(ttl_s) * 1000))
        try:
            spec_json = json.dumps(dict(spec), sort_keys=True)
        except (TypeError, ValueError) as e:
            raise InvalidArgument(f"spec must be a JSON-able mapping: {e}") from e
        reason = f"node {node_id} re-registered (restarted; its blocks are gone)"
        args = [
            self._prefix,
            node_id,
            address,
            spec_json,
            num_blocks,
            ttl_ms,
            reason,
            check_count("epoch", epoch),
            policy,
        ]
        reply = self._call("register_node", self._register, args=args)
        return _purge_result(node_id, reply)

    def heartbeat(self, node_id: str, load: Mapping[str, int], ttl_s: float) -> bool:
        check_name("node_id", node_id)
        load_json = json.dumps(check_load(load), sort_keys=True)
        ttl_ms = max(1, round(check_ttl(ttl_s) * 1000))
        args = [self._prefix, node_id, load_json, ttl_ms]
        return bool(self._call("heartbeat", self._kept.run, self._heartbeat, args))

    def live_nodes(self) -> list[NodeInfo]:
        rows = self._call("live_nodes", self._list_nodes, args=[self._prefix, "1"])
        nodes = [_node_info(_s(row[0]), *row[1:]) for row in rows]
        return sorted(nodes, key=lambda n: n.node_id)

    def live_node(self, node_id: str) -> NodeInfo | None:
        check_name("node_id", node_id)
        keys = [self._key("node:", node_id), self._key("alive:", node_id)]
        row = self._call("live_node", self._live_node, keys=keys)
        if not row:
            return None
        return _node_info(node_id, *row)

    def try_lead(self, role: str, holder: str, ttl_s: float) -> bool:
        check_name("role", role)
        check_name("holder", holder)
        ttl_ms = max(1, round(check_ttl(ttl_s) * 1000))
        return bool(
            self._call("try_lead", self._try_lead, keys=[self._key("lead:", role)], args=[holder, ttl_ms])
        )

    def expired_nodes(self) -> list[str]:
        rows = self._call("expired_nodes", self._list_nodes, args=[self._prefix, "0"])
        return sorted(_s(i) for i in rows)

    def remove_node(self, node_id: str, *, require_expired: bool = False) -> PurgeResult:
        check_name("node_id", node_id)
        args = [self._prefix, node_id, "1" if require_expired else "0", f"node {node_id} died"]
        reply = self._call("remove_node", self._remove, args=args)
        if reply[0] == -1:
            raise FailedPrecondition(f"node {node_id!r} is live (heartbeat renewed); not removed")
        return _purge_result(node_id, reply)

    # ---- prefix index -------------------------------------------------------------------------

    def apply_events(
        self,
        node_id: str,
        stored: Sequence[bytes],
        removed: Sequence[bytes],
        offloaded: Sequence[bytes] = (),
    ) -> None:
        check_name("node_id", node_id)
        stored, removed, offloaded = check_events(stored, removed, offloaded)
        args = [self._prefix, node_id, len(stored), len(offloaded), *stored, *offloaded, *removed]
        if not self._call("apply_events", self._apply_events, args=args):
            raise NodeNotLive(node_id, "events ignored; register again")

    def match_prefix(self, keys: Sequence[bytes]) -> dict[str, int]:
        keys = check_keys(keys)
        flat = self._call("match_prefix", self._kept.run, self._match_prefix, [self._prefix, b"".join(keys)])
        return {_s(flat[i]): int(flat[i + 1]) for i in range(0, len(flat), 2)}

    def nodes_holding(self, key: bytes) -> set[str]:
        members = self._call("nodes_holding", self._redis.smembers, self._key("idx:", check_key(key)))
        return {_s(m) for m in members}

    def keys_of(self, node_id: str) -> set[bytes]:
        check_name("node_id", node_id)
        return set(self._call("keys_of", self._redis.smembers, self._key("nkeys:", node_id)))

    # ---- page tables --------------------------------------------------------------------------

    def create_sequence(self, record: SequenceRecord) -> None:
        if not isinstance(record, SequenceRecord):
            raise InvalidArgument(f"expected a SequenceRecord, got {type(record).__name__}")
        args = [
            self._prefix,
            record.seq_id,
            record.tenant,
            _encode_field("extents", record.extents),
            record.num_tokens,
            record.state,
            record.lost_reason,
            *record.node_ids,
        ]
        reply = self._call("create_sequence", self._create_seq, args=args)
        if reply[0] == 0:
            raise SequenceExists(record.seq_id)
        if reply[0] == -1:
            raise NodeNotLive(_s(reply[1]), f"cannot place sequence {record.seq_id!r} there")

    def open_sequence(self, new: NewSequence) -> Placement:
        if not isinstance(new, NewSequence):
            raise InvalidArgument(f"expected a NewSequence, got {type(new).__name__}")
        w = new.weights
        args: list[str | int | bytes] = [
            self._prefix,
            new.seq_id,
            new.tenant,
            new.num_tokens,
            new.num_blocks,
            repr(float(w.overlap_weight)),
            repr(float(w.load_weight)),
            "" if new.quota is None else new.quota,
            new.keys,
            repr(float(w.balance_slack)) if math.isfinite(w.balance_slack) else "-1",
            new.pending_ttl_ms,
            repr(float(w.affinity_share)),
            repr(float(w.balance_margin)),
            repr(float(w.host_weight)),
            new.scan_classes,
        ]
        rows = "".join(
            f"{c[0]}\t{c[1]}\t{c[2]}\t{c[3]}\t{c[4]!r}\t{-1 if c[5] is None else c[5]}\n"
            for c in new.candidates
        )
        # A tab or line feed in a node id would shift the columns: the counts catch it in C.
        if rows.count("\n") != len(new.candidates) or rows.count("\t") != 5 * len(new.candidates):
            raise InvalidArgument("candidate node ids must not contain tabs or line feeds")
        args.append(rows)
        reply = self._call("open_sequence", self._kept.run, self._open_seq, args)
        code = reply[0]
        if code == 1:
            flat = reply[3]
            cached = int(reply[2])
            return Placement(
                node_id=_s(reply[1]),
                cached_blocks=cached,
                cached_tokens=cached * new.block_size,
                new_blocks=new.num_blocks - cached,
                scores={_s(flat[i]): float(flat[i + 1]) for i in range(0, len(flat), 2)},
                rejected=tuple(sorted(_s(n) for n in reply[4])),
                pending_blocks=int(reply[5]),
                cached_elsewhere_blocks=int(reply[6]),
                host_blocks=int(reply[7]),
                is_scan=bool(reply[8]),
                cached_elsewhere_node_id=_s(reply[9]),
            )
        if code == 0:
            raise Unavailable("no live cache node to place a sequence on")
        if code == -1:
            raise no_room(new.num_blocks, int(reply[1]), int(reply[2]))
        if code == -2:
            quota = new.quota or 0  # -2 only comes with a quota
            raise QuotaExceeded(new.tenant, requested=new.num_blocks, quota=quota, used=int(reply[1]))
        raise SequenceExists(new.seq_id)

    def get_sequence(self, seq_id: str) -> SequenceRecord:
        check_name("seq_id", seq_id)
        h = self._call("get_sequence", self._redis.hgetall, self._key("seq:", seq_id))
        if not h:
            raise SequenceNotFound(seq_id)
        return _record(seq_id, [x for kv in h.items() for x in kv])

    def update_sequence(self, seq_id: str, **fields: Any) -> SequenceRecord:
        check_name("seq_id", seq_id)
        fields = check_sequence_fields(fields)
        flat = [x for name, value in fields.items() for x in (name, _encode_field(name, value))]
        nodes = list(dict.fromkeys(e.node_id for e in fields.get("extents", ())))
        reply = self._call(
            "update_sequence", self._update_seq, args=[self._prefix, seq_id, len(flat), *flat, *nodes]
        )
        if reply[0] == 0:
            raise SequenceNotFound(seq_id)
        if reply[0] == -1:
            raise NodeNotLive(_s(reply[1]), f"cannot move sequence {seq_id!r} there")
        return _record(seq_id, reply[1])

    def delete_sequence(self, seq_id: str, *, tenant: str | None = None) -> SequenceRecord:
        check_name("seq_id", seq_id)
        if tenant is not None:
            check_name("tenant", tenant)
        args = [self._prefix, seq_id, tenant or ""]
        flat = self._call("delete_sequence", self._kept.run, self._delete_seq, args)
        if not flat:
            raise SequenceNotFound(seq_id)
        if len(flat) == 1:
            raise PermissionDenied(f"sequence {seq_id!r} belongs to another tenant")
        return _record(seq_id, flat)

    def sequences_of_node(self, node_id: str) -> list[SequenceRecord]:
        check_name("node_id", node_id)
        flat = self._call("sequences_of_node", self._seqs_of_node, args=[self._prefix, node_id])
        records = [_record(_s(flat[i]), flat[i + 1]) for i in range(0, len(flat), 2)]
        return sorted(records, key=lambda r: r.seq_id)

    # ---- tenants ------------------------------------------------------------------------------

    def tenant_salt(self, tenant: str) -> bytes:
        check_name("tenant", tenant)
        fresh = os.urandom(SALT_BYTES)
        # SET NX GET (Redis >= 7.0): one round trip; returns the old salt, or None if ours won.
        old = self._call("tenant_salt", self._redis.set, self._key("salt:", tenant), fresh, nx=True, get=True)
        return fresh if old is None else bytes(old)

    def reserve_blocks(self, tenant: str, n: int, quota: int) -> int:
        check_name("tenant", tenant)
        check_count("n", n)
        check_count("quota", quota)
        ok, used = self._call(
            "reserve_blocks", self._reserve, keys=[self._key("usage:", tenant)], args=[n, quota]
        )
        if not ok:
            raise QuotaExceeded(tenant, requested=n, quota=quota, used=int(used))
        return int(used)

    def release_blocks(self, tenant: str, n: int) -> int:
        check_name("tenant", tenant)
        check_count("n", n)
        ok, used = self._call("release_blocks", self._release, keys=[self._key("usage:", tenant)], args=[n])
        if not ok:
            raise InvalidArgument(f"tenant {tenant!r}: cannot release {n} blocks, only {used} reserved")
        return int(used)

    def tenant_usage(self, tenant: str) -> int:
        check_name("tenant", tenant)
        value = self._call("tenant_usage", self._redis.get, self._key("usage:", tenant))
        return int(value) if value is not None else 0

    # ---- operations ---------------------------------------------------------------------------

    def ping(self) -> None:
        self._call("ping", self._redis.ping)

    def close(self) -> None:
        self._kept.close()
        self._redis.close()
