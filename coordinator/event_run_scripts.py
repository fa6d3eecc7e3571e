"""The Lua scripts of Store.apply_event_runs and Store.applied_seq, for RedisStore and ClusterStore.

A node's record (the hash P node:<id>, or P{n:<id>}node on a cluster) holds, beside `epoch`,
`applied`: the last event seq of this registration the store has applied ('0' at register),
and `run`: the token of a run applied in parts (event_runs.py) whose last part has not come.

Seqs travel and are kept as decimal strings and compared as such (seq_lt): Lua numbers are
doubles, exact only below 2**53, and seqs go up to 2**63. The caller sends first_seq - 1
(`before`), so no arithmetic happens here.

Each script is one part of a run (a run of more than event_runs.MAX_KEYS_PER_SCRIPT keys is
several), with ARGV from `at`: epoch, before, last_seq, token ('' for a whole run), starts
('1': the run's first part), ends ('1': its last part: it records last_seq), num_stored,
num_offloaded, then the keys (stored, offloaded, removed) as apply_events takes them.
"""

from . import cluster_scripts as cl
from . import redis_scripts as lua

# Why a run whose first_seq <= applied + 1 < last_seq is applied whole: the store reflects events
# 1..applied, and the run's net gives each key it names its last event in first..last, which is
# its last event in 1..last; the keys it does not name had none in applied+1..last. So after it
# the store reflects 1..last, as if only applied+1..last had been sent. A replay (last <= applied)
# or a gap (first > applied + 1) changes nothing; the reply (applied) says where to resume.
#
# Parts: each applies under the same checks, and only the last records last_seq, so a crash
# between parts leaves `applied` as it was and the run is resent whole (re-applying a part is
# idempotent: set semantics). Parts of one run are fenced by its token: the first part writes
# it into `run`, every whole run or other first part replaces or clears it, and a later part
# applies only while `run` still holds its token. Without the fence another replica's run could
# overwrite a key between two parts with an older event, and the last part would then record
# last_seq over a key that does not reflect it.
GUARD = """
local function seq_lt(a, b) return #a < #b or (#a == #b and a < b) end
-- The node's applied seq (a string) when it is live under `epoch`, else nil.
local function applied_under(node, alive, epoch)
  if redis.call('EXISTS', alive) == 0 then return nil end
  local h = redis.call('HMGET', node, 'epoch', 'applied')
  if h[1] ~= epoch then return nil end
  return h[2] or '0'  -- registered before runs were numbered: none applied
end
-- nil and the applied seq when this part may apply now, else the script's answer (NOT_LIVE,
-- or the applied seq it leaves alone).
local function refuse(node, alive, at)
  local applied = applied_under(node, alive, ARGV[at])
  if not applied then return -1 end
  if not seq_lt(applied, ARGV[at + 2]) or seq_lt(applied, ARGV[at + 1]) then return applied end
  if ARGV[at + 4] ~= '1' and redis.call('HGET', node, 'run') ~= ARGV[at + 3] then return applied end
  return nil, applied
end
-- After the part applied: the last part records last_seq; a first part leaves its token.
local function record(node, at, applied)
  if ARGV[at + 5] == '1' then
    redis.call('HSET', node, 'applied', ARGV[at + 2])
    redis.call('HDEL', node, 'run')
    return ARGV[at + 2]
  end
  if ARGV[at + 4] == '1' then redis.call('HSET', node, 'run', ARGV[at + 3]) end
  return applied
end
"""

# RedisStore: several parts in one script (event_runs.batch_parts). ARGV: P, then each part as
# its node's id, the number of its arguments, and the part (the module docstring). Returns,
# for each part in order, the node's applied seq after it (a decimal string) | -1 (not live
# under that epoch).
APPLY_EVENT_RUNS = (
    GUARD
    + lua.APPLY
    + """
local P, out, at = ARGV[1], {}, 2
while at < #ARGV do
  local id, part = ARGV[at], at + 2
  local after = part + tonumber(ARGV[at + 1])
  local node = P .. 'node:' .. id
  local refused, applied = refuse(node, P .. 'alive:' .. id, part)
  if refused then
    out[#out + 1] = refused
  else
    apply(P, id, tonumber(ARGV[part + 6]), tonumber(ARGV[part + 7]), part + 8, after - 1)
    out[#out + 1] = record(node, part, applied)
  end
  at = after
end
return out
"""
)

# ClusterStore, the node's slot. KEYS: the node's record, alive, nkeys, hkeys. ARGV: the part.
# Returns {applied after it | -1, 1 if it applied (its index entries go next) else 0,
# {keys it no longer holds}}.
CLUSTER_APPLY_EVENT_RUN = (
    GUARD
    + cl.APPLY_NODE
    + """
local refused, applied = refuse(KEYS[1], KEYS[2], 1)
if refused then return {refused, 0, {}} end
local gone = apply_node(KEYS[3], KEYS[4], tonumber(ARGV[7]), tonumber(ARGV[8]), 9)
return {record(KEYS[1], 1, applied), 1, gone}
"""
)

# KEYS: the node's record, alive. ARGV: epoch. Returns its applied seq (a decimal string) | -1.
APPLIED_SEQ = (
    GUARD
    + """
return applied_under(KEYS[1], KEYS[2], ARGV[1]) or -1
"""
)
