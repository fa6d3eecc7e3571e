"""The Lua scripts of RedisStore (redis_store.py), one per multi-key update or read.

Every script is atomic (Redis runs one at a time) and one round trip. Key names are built
inside Lua from the prefix P (ARGV[1]) unless a script says KEYS: so these target a single
Redis (or a primary with replicas), not Redis Cluster. The layout is in redis_store.py.
"""

# Shared by register_node and remove_node: drop the node's keys from the index and
# mark its sequences lost. Returns {number of keys purged, {lost seq ids}}.
PURGE = """
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
REGISTER = (
    PURGE
    + """
local P, id = ARGV[1], ARGV[2]
local was = redis.call('SISMEMBER', P .. 'nodes', id)
local r = purge(P, id, ARGV[7])
local nk = P .. 'node:' .. id
redis.call('DEL', nk)
redis.call('HSET', nk, 'address', ARGV[3], 'spec', ARGV[4], 'num_blocks', ARGV[5], 'load', '{}',
           'epoch', ARGV[8], 'policy', ARGV[9], 'applied', '0')
redis.call('SADD', P .. 'nodes', id)
redis.call('SET', P .. 'alive:' .. id, '1', 'PX', ARGV[6])
return {was, r[1], r[2]}
"""
)

# ARGV: P, id, require_expired ('1'/'0'), reason.  Returns {-1} if live and required expired.
REMOVE = (
    PURGE
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
HEARTBEAT = """
local P, id = ARGV[1], ARGV[2]
if redis.call('SISMEMBER', P .. 'nodes', id) == 0 then return 0 end
redis.call('SET', P .. 'alive:' .. id, '1', 'PX', ARGV[4])
redis.call('HSET', P .. 'node:' .. id, 'load', ARGV[3])
return 1
"""

# KEYS: node:<id>, alive:<id>. Returns {address, spec, num_blocks, load, policy, epoch} | {}
LIVE_NODE = """
if redis.call('EXISTS', KEYS[2]) == 0 then return {} end
local h = redis.call('HMGET', KEYS[1], 'address', 'spec', 'num_blocks', 'load', 'policy', 'epoch')
if not h[1] then return {} end
return {h[1], h[2], h[3], h[4], h[5] or '', h[6] or '0'}
"""

# KEYS: lead:<role>. ARGV: holder, ttl_ms. Returns 1 if the holder has the lease now, else 0.
TRY_LEAD = """
local v = redis.call('GET', KEYS[1])
if v and v ~= ARGV[1] then return 0 end
redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
return 1
"""

# ARGV: P, want_live ('1'/'0').
# Live: {{id, address, spec, num_blocks, load, policy, epoch}, ...}; else {id, ...}
LIST_NODES = """
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

# Shared by apply_events and apply_event_runs (event_run_scripts.py): n stored keys, m
# offloaded, then removed ones, from ARGV[at] to the end: the node's keys, the index and the
# in-flight markers of the stored keys.
APPLY = """
local function apply(P, id, n, m, at, last)  -- the keys in ARGV[at..last] (last: #ARGV when nil)
  local nk, hk = P .. 'nkeys:' .. id, P .. 'hkeys:' .. id
  local has_host = redis.call('EXISTS', hk) == 1
  local done = {}  -- in-flight markers (placement.py) of keys now stored: their wait is over
  for i = at, at + n - 1 do
    redis.call('SADD', P .. 'idx:' .. ARGV[i], id)
    redis.call('SADD', nk, ARGV[i])
    if has_host then redis.call('SREM', hk, ARGV[i]) end
    done[#done + 1] = P .. 'pend:' .. ARGV[i]
    if #done == 4000 then redis.call('DEL', unpack(done)); done = {} end
  end
  if #done > 0 then redis.call('DEL', unpack(done)) end
  for i = at + n, at + n + m - 1 do  -- still held, on the host tier
    redis.call('SADD', P .. 'idx:' .. ARGV[i], id)
    redis.call('SADD', nk, ARGV[i])
    redis.call('SADD', hk, ARGV[i])
  end
  has_host = has_host or m > 0
  for i = at + n + m, last or #ARGV do
    if has_host then redis.call('SREM', hk, ARGV[i]) end
    if redis.call('SREM', nk, ARGV[i]) == 1 then redis.call('SREM', P .. 'idx:' .. ARGV[i], id) end
  end
end
"""

# ARGV: P, id, num_stored, num_offloaded, stored..., offloaded..., removed...
APPLY_EVENTS = (
    APPLY
    + """
local P, id = ARGV[1], ARGV[2]
if redis.call('EXISTS', P .. 'alive:' .. id) == 0 then return 0 end
apply(P, id, tonumber(ARGV[3]), tonumber(ARGV[4]), 5)
return 1
"""
)

# Shared by match_prefix and open_sequence. Keys arrive as ONE argument, the 16-byte
# keys joined (redis-py encodes one bytes argument instead of 71 for a W2 open), split
# here with string.sub. The nodes with a run are those the index idx:<key> lists for the
# first key; each of them is asked its run through its reverse index nkeys:<id> (kept with
# idx:<key> by apply_events and the purges), one SMISMEMBER with every key, not once per
# key (2.5x less server time for a W2 open, bench/control.py). So a match costs
# O(H x K), H the live nodes holding the first key, K the keys: nodes that hold none of
# the prompt cost nothing (bench/scale.py). Ids and keys go in slices of 4,000, below
# Lua's unpack() limit.
MATCH = """
local function split_keys(blob)  -- (a counter, not #keys: a border search per key was a third
  local keys, n, sub = {}, 0, string.sub  -- of the split, ~90 us of a 32k-token open)
  for i = 1, #blob, 16 do n = n + 1; keys[n] = sub(blob, i, i + 15) end
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
-- The nodes the index lists for keys[1] (every node with a run), {} for no keys.
local function first_holders(P, keys)
  if #keys == 0 then return {} end
  return redis.call('SMEMBERS', P .. 'idx:' .. keys[1])
end
-- {id = leading run} for the nodes of `wanted` (a set) among `holders` (first_holders, read
-- once by the caller when it has them); others hold 0.
local function held_runs(P, keys, wanted, holders)
  local held = {}
  for _, id in ipairs(holders or first_holders(P, keys)) do
    if wanted[id] then held[id] = leading(P, id, keys) end
  end
  return held
end
"""

# ARGV: P, keys_blob.  Returns a flat {node, count, node, count, ...} over live nodes.
MATCH_PREFIX = (
    MATCH
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
#       active_blocks ('-1' = not counted)" each after a LF (one argument, not six per node:
#       redis-py encoded 6,000 arguments an open at 1,000 nodes), request_id (kept in the page
#       table), opens_scale (every recent_opens is that many times the count it stands for);
#       in shortlist mode (over shortlist.WEIGH_ALL candidates) also: rooms (the
#       caller's room table: a hash id -> "stamp TAB the row's fields"), full ('1': ARGV[16] is
#       every row, stamped; else the rows changed since the caller's last open), the shortlist
#       (ids joined by TAB), the sums of recent_opens and of total_blocks over every candidate;
#       then, for an open sent in a batch (RedisStore.open_sequences; ARGV[19..23] '' when
#       every row travels), the batch's hash: what its earlier opens placed, per node (room
#       taken, active blocks, opens), weighed as the coordinator weighs an open it placed, so
#       that the opens of a batch spread as they would one after the other.
# Cost, K prompt keys, H nodes holding keys[1], S the shortlist, D the rows changed since the
# caller's last open (the room table stays in Redis, per caller and candidate set: a 1,000-row
# argument cost ~100 us an open): in shortlist mode the script weighs only the H holders, the
# in-flight marker's node and the S others (shortlist.py: the best non-holders by place()'s own
# order), read from that table by id: O(H x K + S + D), flat in N (bench/README "Control plane
# at scale"). With N <= WEIGH_ALL, H > 64, or every weighed node lapsed it weighs all N rows.
# Returns {1, node, cached, {node, score, ...}, {rejected...}, pending, cached elsewhere, host, scan,
#          the node holding that}
#       | {0} (no live candidate)
#       | {-1, fewest uncached, most room} (no room) | {-2, used} (quota) | {-3} (id taken)
#       | {-4} (the room table is gone: nothing changed; send it whole).
# Scores travel as %.17g strings (Redis truncates Lua numbers to integers), which parse back
# to the same doubles (the arithmetic is place()'s, in its order); ties go to the smallest
# sha1hex(first key .. node id), as place()'s tie_rank; scans first by sha1hex(SCAN_KEY .. id).
# ARGV: a key. Drops it (a batch's hash, once its opens ran).
DROP_KEY = "return redis.call('DEL', ARGV[1])"

OPEN_SEQ = (
    MATCH
    + """
-- The held run as the node serves it: its device run, then the host run that continues it.
local function tiers(P, id, all_keys, held)
  local hk = P .. 'hkeys:' .. id
  if held == 0 or redis.call('EXISTS', hk) == 0 then return held, 0 end
  local keys = all_keys()
  local on_host, n = {}, 0
  for first = 1, held, 4000 do  -- slices below Lua's unpack() limit, as leading()
    local part = redis.call('SMISMEMBER', hk, unpack(keys, first, math.min(first + 3999, held)))
    for _, v in ipairs(part) do n = n + 1; on_host[n] = v end
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
-- The prompt's keys, split only once a node holds the first: a miss splits none (a 32k prompt's
-- 2,048 took ~200 us of Redis), reading the few it needs by position.
local blob = ARGV[9]
local nkeys = math.ceil(#blob / 16)
local function key_at(i) return string.sub(blob, 16 * i - 15, 16 * i) end
local split = nil
local function all_keys()
  if not split then split = split_keys(blob) end
  return split
end
local slack, ttl, aff, margin = tonumber(ARGV[10]), tonumber(ARGV[11]), tonumber(ARGV[12]), tonumber(ARGV[13])
local hw, scan_mask = tonumber(ARGV[14]), tonumber(ARGV[15])
local tie = nkeys > 0 and key_at(1) or ''
local col = '([^\\t]+)\\t'
local row_pat = '\\n([^\\t]+)\\t' .. string.rep(col, 4) .. '([^\\n]+)'
local opens_scale = tonumber(ARGV[18])  -- recent_opens arrive scaled by it (records.NewSequence)
local rooms = ARGV[19]  -- the caller's room table (shortlist mode), or nil: every row in ARGV[16]
if rooms == '' then rooms = nil end
local batch = ARGV[24]  -- the batch's hash (see above), or nil
if batch == '' then batch = nil end
local taken, batch_opens = {}, 0  -- node -> {room taken, active, opens} by the batch's earlier opens
if batch then
  local flat = redis.call('HGETALL', batch)
  for i = 1, #flat, 2 do
    local id, what = string.match(flat[i], '^(.*)\t(%a)$')
    taken[id] = taken[id] or {r = 0, a = 0, o = 0}
    taken[id][what] = tonumber(flat[i + 1])
    if what == 'o' then batch_opens = batch_opens + tonumber(flat[i + 1]) end
  end
end
if rooms then
  -- Rows changed since the caller last sent them, stamped: a row older than the one stored (a
  -- slower concurrent open) is not written. A table that is gone (a Redis restart, its expiry)
  -- is refused unless this is the whole table: the caller sends it again.
  if ARGV[20] ~= '1' and redis.call('EXISTS', rooms) == 0 then return {-4} end
  local ids, vals = {}, {}
  for id, stamp, rest in string.gmatch(ARGV[16], '\\n([^\\t]+)\\t(%d+)\\t([^\\n]+)') do
    ids[#ids + 1] = id; vals[#vals + 1] = {tonumber(stamp), stamp .. '\\t' .. rest}
  end
  for first = 1, #ids, 4000 do
    local last = math.min(first + 3999, #ids)
    local old = redis.call('HMGET', rooms, unpack(ids, first, last))
    local put = {}
    for i = first, last do
      local was = old[i - first + 1]
      if not was or tonumber(string.match(was, '^(%d+)')) < vals[i][1] then
        put[#put + 1] = ids[i]; put[#put + 1] = vals[i][2]
      end
    end
    if #put > 0 then redis.call('HSET', rooms, unpack(put)) end
  end
  redis.call('PEXPIRE', rooms, 600000)
end
local function stored_row(id, value)
  local f, t, e, o, a = string.match(value, '^%d+\\t' .. string.rep(col, 4) .. '(.+)$')
  return {id, f, t, e, o, a}
end
-- Every row of the candidate table.
local function all_rows()
  local rows = {}
  if rooms then
    local flat = redis.call('HGETALL', rooms)
    for i = 1, #flat, 2 do rows[#rows + 1] = stored_row(flat[i], flat[i + 1]) end
  else
    for id, f, t, e, o, a in string.gmatch(ARGV[16], row_pat) do rows[#rows + 1] = {id, f, t, e, o, a} end
  end
  return rows
end
-- The rows that can win: the first key's holders, the node its in-flight marker names, and
-- the shortlist (ARGV[21]), read from the room table by id: O(H + S), the rest never read.
local function some_rows(holders)
  local ids, seen = {}, {}
  local function add(id)
    if id and not seen[id] then seen[id] = true; ids[#ids + 1] = id end
  end
  for _, id in ipairs(holders) do add(id) end
  if nkeys > 0 then
    local marker = redis.call('GET', P .. 'pend:' .. key_at(1))
    if marker then add(string.match(marker, '^%d+:(.*)$')) end
  end
  for id in string.gmatch(ARGV[21], '[^\\t]+') do add(id) end
  local rows = {}
  if #ids == 0 then return rows end
  for i, value in ipairs(redis.call('HMGET', rooms, unpack(ids))) do
    if value then rows[#rows + 1] = stored_row(ids[i], value) end
  end
  return rows
end
-- The live rows as placement's candidates, and the sums of the balance bound: over the live
-- rows when the whole table is read, else the caller's sums less the rows found lapsed.
local function gather(rows, holders, shortlisted)
  local ids = {}
  for i, row in ipairs(rows) do ids[i] = row[1] end
  local live = live_set(P, ids)
  local runs = held_runs(P, #holders > 0 and all_keys() or {}, live, holders)
  local nodes, markers = {}, {}  -- markers: keys[i] -> its in-flight marker or false, read once
  local sum_opens, sum_total, most_cached, dead_opens, dead_total = 0, 0, 0, 0, 0
  for _, row in ipairs(rows) do
    local id = row[1]
    local free, total, evictable = tonumber(row[2]), tonumber(row[3]), tonumber(row[4])
    local opens, active = tonumber(row[5]) / opens_scale, tonumber(row[6])
    if live[id] then
      local held, host = tiers(P, id, all_keys, runs[id] or 0)
      local pending = 0
      if held < nkeys then
        local marker = markers[held + 1]
        if marker == nil then
          marker = redis.call('GET', P .. 'pend:' .. key_at(held + 1))
          markers[held + 1] = marker
        end
        if marker then
          local count, owner = string.match(marker, '^(%d+):(.*)$')
          if owner == id then pending = math.max(0, math.min(tonumber(count), nkeys) - held) end
        end
      end
      local cached = math.min(held, need)
      host = math.max(0, host - (held - cached))
      if active < 0 then active = total - free - evictable end
      local room, t = free + evictable, taken[id]
      if t then room, active, opens = math.max(0, room - t.r), active + t.a, opens + t.o end
      nodes[#nodes + 1] = {id, room, total, cached, pending, opens, host, active}
      if cached > most_cached then most_cached = cached end
      sum_opens = sum_opens + opens
      sum_total = sum_total + total
    else
      dead_opens, dead_total = dead_opens + opens, dead_total + total
    end
  end
  if shortlisted then
    sum_opens = math.max(0, tonumber(ARGV[22]) - dead_opens) + batch_opens
    sum_total = math.max(0, tonumber(ARGV[23]) - dead_total)
  end
  return nodes, sum_opens, sum_total, most_cached
end
local holders = nkeys > 0 and redis.call('SMEMBERS', P .. 'idx:' .. key_at(1)) or {}
local shortlisted = rooms ~= nil and #holders <= 64
local rows = shortlisted and some_rows(holders) or all_rows()
local nodes, sum_opens, sum_total, most_cached = gather(rows, holders, shortlisted)
if #nodes == 0 and shortlisted then  -- every node it weighed has lapsed: weigh them all
  nodes, sum_opens, sum_total, most_cached = gather(all_rows(), holders, false)
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
           'num_tokens', ARGV[4], 'state', 'active', 'lost_reason', '', 'req', ARGV[17] or '',
           'cached', best_cached)
redis.call('SADD', P .. 'nseqs:' .. best, s)
if ARGV[8] ~= '' and need > 0 then redis.call('INCRBY', uk, need) end
if ttl > 0 and best_cached < nkeys then
  redis.call('SET', P .. 'pend:' .. key_at(best_cached + 1), nkeys .. ':' .. best, 'PX', ttl)
end
if batch then  -- (as Coordinator._end_open accounts it: _account, _count_open)
  redis.call('HINCRBY', batch, best .. '\tr', need - best_cached + best_host)
  redis.call('HINCRBY', batch, best .. '\ta', need)
  redis.call('HINCRBY', batch, best .. '\to', 1)
  redis.call('PEXPIRE', batch, 10000)
end
return {1, best, best_cached, scores, rejected, best_pending, elsewhere, best_host, scan and 1 or 0,
        elsewhere_id}
"""
)

# ARGV: P, seq_id, tenant, extents_json, num_tokens, state, lost_reason, node ids...
# Returns {1} | {0} (exists) | {-1, node} (node not live)
CREATE_SEQ = """
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

# The pseudo field of update_sequence's compare-and-set: its value is 'node@first_block', the
# tail extent the record must still have (TAIL_IS: a Lua function of the hash key and value).
EXPECT_TAIL = "?tail"
TAIL_IS = """
local function tail_is(key, want)
  local ex = cjson.decode(redis.call('HGET', key, 'extents'))
  local t = ex[#ex]
  return t[1] .. '@' .. string.format('%d', t[2]) == want
end
"""

# ARGV: P, seq_id, num_field_args (2 per field), field, value, ..., new node ids (when extents set)
# Returns {1, hgetall} | {0} (missing) | {-1, node} (node not live) | {-2, hgetall} (the tail
# is not the '?tail' field's: nothing changed)
UPDATE_SEQ = (
    TAIL_IS
    + """
local P, s = ARGV[1], ARGV[2]
local sk = P .. 'seq:' .. s
if redis.call('EXISTS', sk) == 0 then return {0} end
local m = tonumber(ARGV[3])
local moves = false
for i = 4, 3 + m, 2 do
  if ARGV[i] == 'extents' then moves = true end
  if ARGV[i] == '?tail' and not tail_is(sk, ARGV[i + 1]) then return {-2, redis.call('HGETALL', sk)} end
end
if moves then
  for i = 4 + m, #ARGV do
    if redis.call('EXISTS', P .. 'alive:' .. ARGV[i]) == 0 then return {-1, ARGV[i]} end
  end
  for _, e in ipairs(cjson.decode(redis.call('HGET', sk, 'extents'))) do
    redis.call('SREM', P .. 'nseqs:' .. e[1], s)
  end
  for i = 4 + m, #ARGV do redis.call('SADD', P .. 'nseqs:' .. ARGV[i], s) end
end
for i = 4, 3 + m, 2 do
  if ARGV[i] ~= '?tail' then redis.call('HSET', sk, ARGV[i], ARGV[i + 1]) end
end
return {1, redis.call('HGETALL', sk)}
"""
)

# ARGV: P, seq_id, tenant ('' : any), require_live ('1' / absent).
# Returns the deleted hash (flat), {} if missing, {'!tenant'}, or {'!live', node} (kept).
DELETE_SEQ = """
local P, s = ARGV[1], ARGV[2]
local sk = P .. 'seq:' .. s
local h = redis.call('HGETALL', sk)
if #h == 0 then return h end
if ARGV[3] ~= '' and redis.call('HGET', sk, 'tenant') ~= ARGV[3] then return {'!tenant'} end
local extents = cjson.decode(redis.call('HGET', sk, 'extents'))
if ARGV[4] == '1' and redis.call('HGET', sk, 'state') ~= 'lost' then
  for _, e in ipairs(extents) do
    if redis.call('EXISTS', P .. 'alive:' .. e[1]) == 0 then return {'!live', e[1]} end
  end
end
for _, e in ipairs(extents) do
  redis.call('SREM', P .. 'nseqs:' .. e[1], s)
end
redis.call('DEL', sk)
return h
"""

# ARGV: P, seq_id, reason, ttl_ms. Returns the hash as it was (flat), or {} if missing or lost.
MARK_LOST = """
local P, s = ARGV[1], ARGV[2]
local sk = P .. 'seq:' .. s
local h = redis.call('HGETALL', sk)
if #h == 0 or redis.call('HGET', sk, 'state') == 'lost' then return {} end
for _, e in ipairs(cjson.decode(redis.call('HGET', sk, 'extents'))) do
  redis.call('SREM', P .. 'nseqs:' .. e[1], s)
end
redis.call('HSET', sk, 'state', 'lost', 'lost_reason', ARGV[3])
redis.call('PEXPIRE', sk, ARGV[4])
return h
"""

# ARGV: P, node_id. Returns {seq_id, hgetall, seq_id, hgetall, ...}
SEQS_OF_NODE = """
local P = ARGV[1]
local out = {}
for _, s in ipairs(redis.call('SMEMBERS', P .. 'nseqs:' .. ARGV[2])) do
  local h = redis.call('HGETALL', P .. 'seq:' .. s)
  if #h > 0 then out[#out + 1] = s; out[#out + 1] = h end
end
return out
"""

# KEYS: usage key. ARGV: n, quota. Returns {1, new_used} | {0, used}
RESERVE = """
local used = tonumber(redis.call('GET', KEYS[1]) or '0')
local n, quota = tonumber(ARGV[1]), tonumber(ARGV[2])
if used + n > quota then return {0, used} end
return {1, redis.call('INCRBY', KEYS[1], n)}
"""

# KEYS: usage key. ARGV: n. Returns {1, new_used} | {0, used}
RELEASE = """
local used = tonumber(redis.call('GET', KEYS[1]) or '0')
local n = tonumber(ARGV[1])
if n > used then return {0, used} end
local left = redis.call('DECRBY', KEYS[1], n)
if left == 0 then redis.call('DEL', KEYS[1]) end
return {1, left}
"""

# KEYS: a sequence's record. ARGV: ttl_ms. Returns 1 if it is lost (and now expires), else 0.
EXPIRE_LOST = """
if redis.call('HGET', KEYS[1], 'state') ~= 'lost' then return 0 end
return redis.call('PEXPIRE', KEYS[1], ARGV[1])
"""
