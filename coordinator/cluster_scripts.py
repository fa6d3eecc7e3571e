"""The Lua scripts of ClusterStore (cluster_store.py): each declares every key it touches in
KEYS[] and those keys share one hash tag, so each runs in one slot of a Redis Cluster.

What spans slots (a node's keys and the prefix index, a sequence and its node links) is
split into these one-slot steps in the order cluster_store.py states, with its consistency
rule. The single-key scripts (LIVE_NODE, TRY_LEAD, RESERVE, RELEASE, EXPIRE_LOST) are
redis_scripts.py's own.
"""

from . import redis_scripts as lua

# KEYS: the node's record, alive, nkeys, hkeys, nseqs (tag {n:<id>}).
# ARGV: address, spec_json, num_blocks, ttl_ms, epoch, policy.
# Returns {was registered (0/1), {keys it held}, {ids of its sequences}}: what to purge.
REGISTER = """
local was = redis.call('EXISTS', KEYS[1])
local keys = redis.call('SMEMBERS', KEYS[3])
local seqs = redis.call('SMEMBERS', KEYS[5])
redis.call('DEL', KEYS[1], KEYS[3], KEYS[4], KEYS[5])
redis.call('HSET', KEYS[1], 'address', ARGV[1], 'spec', ARGV[2], 'num_blocks', ARGV[3], 'load', '{}',
           'epoch', ARGV[5], 'policy', ARGV[6], 'applied', '0')
redis.call('SET', KEYS[2], '1', 'PX', ARGV[4])
return {was, keys, seqs}
"""

# KEYS: as REGISTER. ARGV: require_expired ('1'/'0').
# Returns {1, {keys}, {seq ids}} | {0, {}, {}} (unknown) | {-1, {}, {}} (live, expiry required).
REMOVE = """
if redis.call('EXISTS', KEYS[1]) == 0 then return {0, {}, {}} end
if ARGV[1] == '1' and redis.call('EXISTS', KEYS[2]) == 1 then return {-1, {}, {}} end
local keys = redis.call('SMEMBERS', KEYS[3])
local seqs = redis.call('SMEMBERS', KEYS[5])
redis.call('DEL', KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5])
return {1, keys, seqs}
"""

# KEYS: the node's record, alive. ARGV: load_json, ttl_ms. Returns 1, or 0 if not registered.
HEARTBEAT = """
if redis.call('EXISTS', KEYS[1]) == 0 then return 0 end
redis.call('SET', KEYS[2], '1', 'PX', ARGV[2])
redis.call('HSET', KEYS[1], 'load', ARGV[1])
return 1
"""

# Shared by apply_events and apply_event_runs (event_run_scripts.py): n stored keys, m
# offloaded, then removed ones, from ARGV[at] to the end, into the node's nkeys and hkeys.
# Returns the keys it no longer holds (their index entries go next).
APPLY_NODE = """
local function apply_node(nk, hk, n, m, at)
  local has_host = redis.call('EXISTS', hk) == 1
  for i = at, at + n - 1 do
    redis.call('SADD', nk, ARGV[i])
    if has_host then redis.call('SREM', hk, ARGV[i]) end
  end
  for i = at + n, at + n + m - 1 do
    redis.call('SADD', nk, ARGV[i])
    redis.call('SADD', hk, ARGV[i])
  end
  has_host = has_host or m > 0
  local gone = {}
  for i = at + n + m, #ARGV do
    if has_host then redis.call('SREM', hk, ARGV[i]) end
    if redis.call('SREM', nk, ARGV[i]) == 1 then gone[#gone + 1] = ARGV[i] end
  end
  return gone
end
"""

# KEYS: the node's alive, nkeys, hkeys. ARGV: num_stored, num_offloaded, stored..., offloaded...,
# removed... Returns {1, {keys it no longer holds}} (their index entries go next) | {0} (not live).
EVENTS = (
    APPLY_NODE
    + """
if redis.call('EXISTS', KEYS[1]) == 0 then return {0} end
return {1, apply_node(KEYS[2], KEYS[3], tonumber(ARGV[1]), tonumber(ARGV[2]), 3)}
"""
)

# KEYS: a sequence's record. ARGV: field, value, ... Returns 1 (written) | 0 (the id is taken).
CREATE_SEQ = """
if redis.call('EXISTS', KEYS[1]) == 1 then return 0 end
redis.call('HSET', KEYS[1], unpack(ARGV))
return 1
"""

# KEYS: a sequence's record. ARGV: field, value, ... (the pseudo field '?tail': redis_scripts.py's
# EXPECT_TAIL). Returns {1, extents before (JSON), the record after (flat)} | {0} (missing) |
# {-2, '', the record (flat)} (its tail is not '?tail''s: nothing changed).
UPDATE_SEQ = (
    lua.TAIL_IS
    + """
if redis.call('EXISTS', KEYS[1]) == 0 then return {0} end
local before = redis.call('HGET', KEYS[1], 'extents')
local set = {}
for i = 1, #ARGV, 2 do
  if ARGV[i] == '?tail' then
    if not tail_is(KEYS[1], ARGV[i + 1]) then return {-2, '', redis.call('HGETALL', KEYS[1])} end
  else
    table.insert(set, ARGV[i])
    table.insert(set, ARGV[i + 1])
  end
end
redis.call('HSET', KEYS[1], unpack(set))
return {1, before, redis.call('HGETALL', KEYS[1])}
"""
)

# KEYS: a sequence's record. ARGV: tenant ('' = any). Returns the deleted record (flat), {}
# if missing, or {'!tenant'} if it is another tenant's (then it stays).
DELETE_SEQ = """
local h = redis.call('HGETALL', KEYS[1])
if #h == 0 then return h end
if ARGV[1] ~= '' and redis.call('HGET', KEYS[1], 'tenant') ~= ARGV[1] then return {'!tenant'} end
redis.call('DEL', KEYS[1])
return h
"""

# KEYS: a sequence's record. ARGV: reason, ttl_ms. Store.mark_lost (reconciliation): the hash as
# it was (flat), or {} (changing nothing) when it is missing or lost already.
LOSE_SEQ = """
local h = redis.call('HGETALL', KEYS[1])
if #h == 0 or redis.call('HGET', KEYS[1], 'state') == 'lost' then return {} end
redis.call('HSET', KEYS[1], 'state', 'lost', 'lost_reason', ARGV[1])
redis.call('PEXPIRE', KEYS[1], ARGV[2])
return h
"""

# KEYS: a sequence's record. ARGV: reason. Returns 1 if it exists (now lost), else 0.
MARK_LOST = """
local state = redis.call('HGET', KEYS[1], 'state')
if not state then return 0 end
if state ~= 'lost' then redis.call('HSET', KEYS[1], 'state', 'lost', 'lost_reason', ARGV[1]) end
return 1
"""
