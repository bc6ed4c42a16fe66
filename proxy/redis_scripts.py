"""The shared ledger's Lua scripts: one per operation, one round trip, atomic.

Per backend, three keys share the hash tag `{backend}` (so the scripts run on one
Redis Cluster slot); `key_prefix` keeps deployments apart on one server:

    <prefix>:{<backend>}:resident   integer, tokens reserved now: the sum of the leases
    <prefix>:{<backend>}:leases     hash lease_id -> tokens, plus the epoch fields
                                    `=epoch` (a random id) and `=until` (Redis ms)
    <prefix>:{<backend>}:expiry     zset lease_id -> expiry (Redis server ms)
    <prefix>:{<backend>}:refs       hash block key -> its pins (below), and one field
                                    that keeps it a hash table (`REFS_WIDE_FIELD`)
    <prefix>:{<backend>}:ready      set of block keys free to share (`proxy.ledger`)

A lease's value in the hash is what it holds outside the shared blocks it references
(its "own" tokens); the keys it references are the field `#<lease_id>`: the block
size, '|', then the keys, each 16 hex digits, end to end. The block size is also the
field `=bt`. So resident = sum of own + `=bt` x the block keys in refs, and a block is
charged once however many leases reference it.

Pins, not reference counts. A lease's keys are a hash chain (`proxy.prefix_blocks`:
a key stands for its block and every block before it), and a lease references a
leading run of them: the run held ready by others (joined), then, unless the key past
that run is held but not ready, the rest (new here). So the keys held on a backend
form a tree of chains, and a key's value in refs is its pins: the live leases whose
referenced run ends at it plus its held children (the next keys of chains through
it). Held and ready are both closed towards the root (a key is referenced, and made
ready, only with every key before it), so the run a lease can join is found by a
binary search, and a lease that joins a held prefix pins its last key only: reserve
and release of a lease whose 4,096-token prefix (256 keys) is held cost a few calls
each, not a read and a write of every key. Release unpins the last key and drops it,
and each key before it whose one pin was the key after it. The keys of a lease must be
such a chain (every lease's are: `proxy.prefix_blocks`); keys that are not would be
charged as if they were.

A 100k-token prompt in 16-token blocks is 6,250 keys: 100 kB in its lease field plus
~6,250 `refs` fields (about 0.6 MB of Redis memory while it runs); its first holder's
reserve writes them once (a few ms), a joiner's reserve reads 2 x 13 of them.

Expiry uses the Redis server's clock (TIME), never a replica's, so clock skew between
replicas cannot reclaim live leases early. No key carries a Redis TTL.

Losing the data. The lease hash is the truth; the resident counter is a sum cached
from it and the expiry zset an index over it. Redis may lose keys: a restart without
persistence (as compose runs it), a FLUSHALL, an eviction (Redis evicts whole keys).
The epoch fields live in the lease hash itself, so whatever loses the leases loses
the epoch with them, and every reserve and resize script checks the epoch first:

* no epoch: the data is gone. An empty ledger would read as free capacity while
  every replica still runs its requests, so the reserve is refused
  (`LedgerUnavailable`, 503 `ledger_unavailable`) and the replica re-registers its
  own live leases (it knows each one: id, backend, tokens), atomically, in the
  renewal script. The first replica to do so writes a new epoch and `=until` = now +
  `recovery_window_s`.
* until then, every reserve and every growing resize is refused, on every replica.
  The window lets the other replicas re-register theirs: each replica's refresh
  pass sees the epoch change (or vanish) and re-registers its leases at once, and
  re-registers them on every pass while the window lasts. The default window,
  max(1 s, 3 refresh passes) but at most lease_ttl_s/3 + refresh_interval_s (every
  live replica renews, and so re-registers, that often anyway), is 1.5 s with the
  default settings.
* a replica whose known epoch is not the current one (it missed the whole window)
  is refused until it has re-registered its own leases under the new epoch.

After the window, admission works on the rebuilt totals: never on an empty ledger.
A replica that stays silent through the whole window (stalled or cut off from Redis
longer than that) re-adds its leases when it next renews, as after any outage.

Drift. A counter or index that disagrees with the leases is repaired in Lua: every
script recomputes a missing resident counter from the leases before using it (so a
lost counter never reads as zero), and every refresh pass sets the counter to the
sum of the live leases and gives a lease that lost its expiry one TTL to be renewed
(so it is reclaimed if nobody does).

Eviction. `start()` reads `CONFIG GET maxmemory-policy` and refuses (raises
`UnsafeRedisConfig`) an `allkeys-*` policy with a `maxmemory` set: it may evict the
ledger's keys, and each eviction of a lease hash costs a rebuild window. `noeviction`
and `volatile-*` are safe: the ledger's keys carry no TTL, and volatile policies evict
only keys that do. Where CONFIG is refused (managed Redis, ACLs) it logs a warning
saying what to set. The policy is read again every lease_ttl_s/3 and an unsafe one is
logged as an error; the detection above still holds.
"""

from __future__ import annotations

__all__ = ["ATTACH_LUA", "LOST", "READY_LUA", "REBUILDING", "RECLAIM_LUA", "REFS_WIDE_FIELD",
           "RELEASE_LUA", "RENEW_LUA", "RESERVE_LUA", "RESIZE_LUA", "STALE"]

# Scripts' KEYS: [1] resident counter, [2] leases hash (with the epoch fields), [3] expiry
# zset, [4] block refs hash, [5] ready blocks set. Field names starting with '=' (byte 61)
# are the epoch's (and the block size), with '#' (byte 35) a lease's block keys; lease
# ids start with neither.

# The refs hash's one field that is not a block key. Redis keeps a hash of small fields
# as a listpack, which every HMGET and HSET scans field by field: while a backend held
# fewer than `hash-max-listpack-entries` (512) distinct blocks, each of a lease's keys
# cost a scan of all of them. A field name past `hash-max-listpack-value` (64 bytes)
# makes Redis convert the hash to a hash table, and it never converts one back.
# bench_ledger, 256-block leases, 16 in flight, x the cost of a pair without blocks:
# joining a ready prefix 9.1-10.0x -> 3.1-3.6x, registering a new one 4.2-7.2x -> 3.4-3.8x.
REFS_WIDE_FIELD = "=" + "w" * 64

_NOW = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
"""

# The truth is the lease hash: the counter is recomputed from it wherever it is missing,
# so a counter lost on its own (an eviction) never reads as zero.
_SUM = """
-- keys per HMGET/HSET/SADD call: unpack() puts them on Lua's C stack (8,000 slots)
local CHUNK = 2000
-- the refs hash's one field that is not a block (`REFS_WIDE_FIELD`)
local WIDE = '""" + REFS_WIDE_FIELD + """'
local function wide(refs_key)
  redis.call('HSETNX', refs_key, WIDE, '0')
end
local function blocks_held()
  return redis.call('HLEN', KEYS[4]) - redis.call('HEXISTS', KEYS[4], WIDE)
end
local function lease_sum()
  local all = redis.call('HGETALL', KEYS[2])
  local sum, n = 0, 0
  for i = 1, #all, 2 do
    local b = string.byte(all[i], 1)
    if b ~= 61 and b ~= 35 then
      sum = sum + tonumber(all[i + 1])
      n = n + 1
    end
  end
  local bt = tonumber(redis.call('HGET', KEYS[2], '=bt') or '0')
  return sum + bt * blocks_held(), n
end
local function resident()
  local r = redis.call('GET', KEYS[1])
  if r then return tonumber(r) end
  local sum = lease_sum()
  redis.call('SET', KEYS[1], string.format('%d', sum))
  return sum
end
-- the `i`-th key (from 1) of a list of keys, each 16 hex digits, from offset `at`
local function key_at(list, at, i)
  local s = at + 16 * i - 15
  return string.sub(list, s, s + 15)
end
-- keys `first`..`last` of `ks` registered new: one pin each (its child, the last its
-- lease's)
local function pin_new(ks, first, last)
  for c = first, last, CHUNK do
    local pairs_ = {}
    for j = c, math.min(c + CHUNK - 1, last) do
      pairs_[#pairs_ + 1] = key_at(ks, 0, j)
      pairs_[#pairs_ + 1] = 1
    end
    redis.call('HSET', KEYS[4], unpack(pairs_))
  end
end
-- drop a lease: its own tokens and the blocks only it held; -> tokens freed, or false
-- for an unknown lease. Its last key loses its pin; where that was its last, the key
-- goes, and so does each key before it whose one pin was the key after it (its only
-- held child). The first key kept loses the pin of the child that went.
local function drop(id)
  local tok = redis.call('HGET', KEYS[2], id)
  if not tok then return false end
  local freed = tonumber(tok)
  local list = redis.call('HGET', KEYS[2], '#' .. id)
  if list then
    local bar = string.find(list, '|', 1, true)
    local bt = tonumber(string.sub(list, 1, bar - 1))
    local m = (#list - bar) / 16
    if m > 0 and redis.call('HINCRBY', KEYS[4], key_at(list, bar, m), -1) <= 0 then
      local first, stop = m, nil  -- keys first..m go; `stop`: the pins of the one before
      local i = m - 1
      while i >= 1 and stop == nil do
        local lo = math.max(1, i - CHUNK + 1)
        local part = {}
        for j = lo, i do part[#part + 1] = key_at(list, bar, j) end
        local pins = redis.call('HMGET', KEYS[4], unpack(part))
        for j = i, lo, -1 do
          local n = tonumber(pins[j - lo + 1] or '0')
          if n ~= 1 then
            stop = n
            break
          end
          first = j
        end
        i = lo - 1
      end
      for c = first, m, CHUNK do
        local part = {}
        for j = c, math.min(c + CHUNK - 1, m) do part[#part + 1] = key_at(list, bar, j) end
        freed = freed + bt * redis.call('HDEL', KEYS[4], unpack(part))
        redis.call('SREM', KEYS[5], unpack(part))
      end
      -- (0: the key is missing, a drift the refresh pass repairs; nothing to unpin)
      if stop ~= nil and stop > 1 then
        redis.call('HINCRBY', KEYS[4], key_at(list, bar, first - 1), -1)
      end
    end
    redis.call('HDEL', KEYS[2], '#' .. id)
  end
  redis.call('HDEL', KEYS[2], id)
  return freed
end
"""

# Reclaim expired leases of this backend, by Redis server time; -> leases reclaimed.
_RECLAIM = """
local function reclaim()
  resident()
  local expired = redis.call('ZRANGEBYSCORE', KEYS[3], '-inf', now)
  local n = 0
  for _, id in ipairs(expired) do
    local freed = drop(id)
    if freed then
      redis.call('DECRBY', KEYS[1], freed)
      n = n + 1
    end
    redis.call('ZREM', KEYS[3], id)
  end
  return n
end
"""

# The counter := the sum of the leases; a lease without an expiry gets one TTL (so it is
# reclaimed if its owner does not renew it), an expiry without a lease goes.
# -> (tokens the counter was off by, leases given an expiry)
_RECONCILE = """
local function reconcile(ttl)
  local sum, n = lease_sum()
  local raw = redis.call('GET', KEYS[1])
  local drift = 0
  if not raw or tonumber(raw) ~= sum then
    drift = sum - tonumber(raw or '0')
    redis.call('SET', KEYS[1], string.format('%d', sum))
  end
  local indexed = 0
  if redis.call('ZCARD', KEYS[3]) ~= n then
    for _, id in ipairs(redis.call('HKEYS', KEYS[2])) do
      local b = string.byte(id, 1)
      if b ~= 61 and b ~= 35 and not redis.call('ZSCORE', KEYS[3], id) then
        redis.call('ZADD', KEYS[3], now + ttl, id)
        indexed = indexed + 1
      end
    end
    for _, id in ipairs(redis.call('ZRANGE', KEYS[3], 0, -1)) do
      if redis.call('HEXISTS', KEYS[2], id) == 0 then redis.call('ZREM', KEYS[3], id) end
    end
  end
  return drift, indexed
end
"""


def _epoch_check(known: int) -> str:
    """Refuse unless the epoch is there, is the caller's (ARGV[known]) and is not
    rebuilding: {-2} no epoch (the data is gone), {-3} another epoch (rebuilt since the
    caller re-registered its leases), {-4, ms left} rebuilding."""
    return f"""
local meta = redis.call('HMGET', KEYS[2], '=epoch', '=until')
if not meta[1] then return {{-2, 0}} end
if meta[1] ~= ARGV[{known}] then return {{-3, 0}} end
local left = tonumber(meta[2] or '0') - now
if left > 0 then return {{-4, left}} end
"""


# the epoch refusals' status codes, as the scripts return them
LOST, STALE, REBUILDING = -2, -3, -4

# ARGV[1] lease id, ARGV[2] tokens (all it spans), ARGV[3] capacity, ARGV[4] ttl ms,
# ARGV[5] channel, ARGV[6] backend, ARGV[7] the epoch this replica registered under,
# ARGV[8] block size, ARGV[9] its shared-prefix block keys, 16 hex digits each, a chain
# (distinct, in order)
# returns {1 reserved | 0 no room | -1 lease id already recorded, resident after,
#          tokens ready blocks of others covered (1) | tokens the recorded lease spans
#          (-1), how many keys it references (1: the first that many it brought) |
#          how many its record references (-1), '' (1) | those keys (-1)} or an epoch
#          refusal (-2, -3, -4).
# A -1 is a retry whose first reply was lost: the keys are what the first run
# registered (a key registered by another lease but not ready then is paid in full and
# not referenced, with all after it), so the replica records what Redis holds. What
# ready blocks covered at that first run is not recorded, so a -1 cannot say it.
RESERVE_LUA = _NOW + _SUM + _RECLAIM + _epoch_check(7) + """
if reclaim() > 0 then redis.call('PUBLISH', ARGV[5], ARGV[6]) end
local res = tonumber(redis.call('GET', KEYS[1]))
local recorded = redis.call('HGET', KEYS[2], ARGV[1])
if recorded then
  local list = redis.call('HGET', KEYS[2], '#' .. ARGV[1])
  local span, nrefs, which = tonumber(recorded), 0, ''
  if list then
    local bar = string.find(list, '|', 1, true)
    nrefs = (#list - bar) / 16
    span = span + tonumber(string.sub(list, 1, bar - 1)) * nrefs
    which = string.sub(list, bar + 1)
  end
  return {-1, res, span, nrefs, which}
end
local tokens = tonumber(ARGV[2])
local bt, ks = tonumber(ARGV[8]), ARGV[9]
local m = #ks / 16
-- joined: the leading keys held and ready. Both sets are closed towards the root of
-- the chain, so that is true of the first `joined` keys and of none after: a binary
-- search, two calls per step.
local lo, hi = 0, m
while lo < hi do
  local mid = math.floor((lo + hi + 1) / 2)
  local k = key_at(ks, 0, mid)
  if redis.call('SISMEMBER', KEYS[5], k) == 1 and redis.call('HEXISTS', KEYS[4], k) == 1 then
    lo = mid
  else
    hi = mid - 1
  end
end
local joined, nrefs = lo, lo
-- past the joined run: a key nobody holds starts keys new here (all the rest, as a
-- chain); a key held but not ready is paid in full, and so is all after it
if joined < m and redis.call('HEXISTS', KEYS[4], key_at(ks, 0, joined + 1)) == 0 then
  nrefs = m
end
local adds = tokens - bt * joined
if res + adds > tonumber(ARGV[3]) then return {0, res, 0, 0} end
redis.call('INCRBY', KEYS[1], adds)
redis.call('HSET', KEYS[2], ARGV[1], tokens - bt * nrefs)
if nrefs > 0 then
  redis.call('HSET', KEYS[2], '#' .. ARGV[1], ARGV[8] .. '|' .. string.sub(ks, 1, 16 * nrefs),
             '=bt', bt)
  wide(KEYS[4])
  if nrefs > joined then
    -- the new keys, pinned; the joined run's last key gains a child
    pin_new(ks, joined + 1, nrefs)
    if joined > 0 then redis.call('HINCRBY', KEYS[4], key_at(ks, 0, joined), 1) end
  else
    redis.call('HINCRBY', KEYS[4], key_at(ks, 0, nrefs), 1)  -- its run ends there
  end
end
redis.call('ZADD', KEYS[3], now + tonumber(ARGV[4]), ARGV[1])
return {1, res + adds, bt * joined, nrefs, ''}
"""

# ARGV[1] lease id, ARGV[2] block size, ARGV[3] its shared-prefix block keys (a chain, 16
# hex digits each), ARGV[4] the epoch this replica registered under
# returns {keys it references now} or an epoch refusal (-2, -3, -4: nothing changed).
# A lease reserved without keys (admitted on a bound of its prompt) registers them once
# counted (`Ledger.attach`): only where its first key is not held here (then none of the
# chain is), as new keys, one pin each, as its reserve would have pinned them; its own
# tokens go down by as much as the blocks add, so resident does not change. Where the
# first is held, or the lease is unknown or references keys already: {0}, nothing done.
ATTACH_LUA = _NOW + _SUM + _epoch_check(4) + """
local own = redis.call('HGET', KEYS[2], ARGV[1])
if not own or redis.call('HEXISTS', KEYS[2], '#' .. ARGV[1]) == 1 then return {0} end
local bt, ks = tonumber(ARGV[2]), ARGV[3]
local m = #ks / 16
if m == 0 or bt * m > tonumber(own) then return {0} end
if redis.call('HEXISTS', KEYS[4], key_at(ks, 0, 1)) == 1 then return {0} end
wide(KEYS[4])
pin_new(ks, 1, m)
redis.call('HSET', KEYS[2], '#' .. ARGV[1], ARGV[2] .. '|' .. ks, '=bt', bt)
redis.call('HINCRBY', KEYS[2], ARGV[1], -bt * m)
return {m}
"""

# ARGV[1] channel, ARGV[2] backend, ARGV[3] ttl ms
# returns {resident after, leases reclaimed, epoch id (nil: the data is gone), ms until the
# rebuild ends (<= 0: done), tokens the counter was off by, leases given an expiry}: the
# refresh pass, so expired leases go on the refresh schedule even when no replica
# reserves or renews on this backend, and drift is repaired on it.
RECLAIM_LUA = _NOW + _SUM + _RECLAIM + _RECONCILE + """
local meta = redis.call('HMGET', KEYS[2], '=epoch', '=until')
if not meta[1] then
  return {tonumber(redis.call('GET', KEYS[1]) or '0'), 0, false, 0, 0, 0}
end
local reclaimed = reclaim()
local drift, indexed = reconcile(tonumber(ARGV[3]))
if reclaimed > 0 or drift < 0 then redis.call('PUBLISH', ARGV[1], ARGV[2]) end
return {tonumber(redis.call('GET', KEYS[1])), reclaimed, meta[1],
        tonumber(meta[2] or '0') - now, drift, indexed}
"""

# ARGV[1] lease id, ARGV[2] channel, ARGV[3] backend
# returns {1 released | 0 unknown (already released or reclaimed), resident after}
RELEASE_LUA = _SUM + """
redis.call('ZREM', KEYS[3], ARGV[1])
if redis.call('HEXISTS', KEYS[2], ARGV[1]) == 0 then
  return {0, tonumber(redis.call('GET', KEYS[1]) or '0')}
end
resident()
local res = redis.call('DECRBY', KEYS[1], drop(ARGV[1]))
redis.call('PUBLISH', ARGV[2], ARGV[3])
return {1, res}
"""

# ARGV[1] lease id: the blocks it references become free to share (its engine answered).
# Those not ready yet are a tail of its keys (the joined run was ready): found by a
# binary search, so a lease that joined a ready prefix adds nothing key by key.
READY_LUA = """
local list = redis.call('HGET', KEYS[2], '#' .. ARGV[1])
if not list then return 0 end
local bar = string.find(list, '|', 1, true)
local m = (#list - bar) / 16
local function key(i)
  local s = bar + 16 * i - 15
  return string.sub(list, s, s + 15)
end
local lo, hi = 0, m
while lo < hi do
  local mid = math.floor((lo + hi + 1) / 2)
  if redis.call('SISMEMBER', KEYS[5], key(mid)) == 1 then lo = mid else hi = mid - 1 end
end
local n = 0
for c = lo + 1, m, 2000 do
  local part = {}
  for j = c, math.min(c + 1999, m) do part[#part + 1] = key(j) end
  n = n + redis.call('SADD', KEYS[5], unpack(part))
end
return n
"""

# ARGV[1] lease id, ARGV[2] wanted tokens, ARGV[3] capacity, ARGV[4] channel, ARGV[5] backend,
# ARGV[6] the epoch this replica registered under
# returns {tokens the lease holds now (-1: unknown lease), resident after} or an epoch
# refusal (-2, -3, -4: nothing changed). Shrinking always succeeds (and wakes waiters);
# growing takes only free room. Tokens here are the lease's own (outside shared blocks).
RESIZE_LUA = _NOW + _SUM + _epoch_check(6) + """
local res = resident()
local held = redis.call('HGET', KEYS[2], ARGV[1])
if not held then return {-1, res} end
held = tonumber(held)
local wanted = tonumber(ARGV[2])
local granted = wanted
if wanted > held then
  granted = math.min(wanted, held + math.max(0, tonumber(ARGV[3]) - res))
end
if granted ~= held then
  res = redis.call('INCRBY', KEYS[1], granted - held)
  redis.call('HSET', KEYS[2], ARGV[1], granted)
  if granted < held then redis.call('PUBLISH', ARGV[4], ARGV[5]) end
end
return {granted, res}
"""

# Renewal, which is also how a replica re-registers its leases after a loss.
# ARGV[1] ttl ms, ARGV[2] channel, ARGV[3] backend, ARGV[4] an epoch id to start with
# and ARGV[5] the rebuild window in ms (both used only if there is no epoch), then
# fours: lease id, own tokens, its block list field ('' for none), 1 if ready
# returns {resident after, leases reclaimed, live leases re-added, epoch id, ms until
#          the rebuild ends (<= 0: done), 1 if this call started the epoch, tokens the
#          counter was off by, leases given an expiry}
RENEW_LUA = _NOW + _SUM + _RECLAIM + _RECONCILE + """
local meta = redis.call('HMGET', KEYS[2], '=epoch', '=until')
local created = 0
if not meta[1] then
  -- whatever lost the leases may have left their block refs: they are rebuilt below
  redis.call('DEL', KEYS[4], KEYS[5])
  meta = {ARGV[4], string.format('%d', now + tonumber(ARGV[5]))}
  redis.call('HSET', KEYS[2], '=epoch', meta[1], '=until', meta[2])
  created = 1
end
local reclaimed = reclaim()
local ttl = tonumber(ARGV[1])
local readded = 0
for i = 6, #ARGV, 4 do
  local id, list = ARGV[i], ARGV[i + 2]
  if redis.call('HEXISTS', KEYS[2], id) == 0 then
    resident()
    local adds = tonumber(ARGV[i + 1])
    redis.call('HSET', KEYS[2], id, ARGV[i + 1])
    if list ~= '' then
      local bar = string.find(list, '|', 1, true)
      local bt = tonumber(string.sub(list, 1, bar - 1))
      redis.call('HSET', KEYS[2], '#' .. id, list, '=bt', bt)
      wide(KEYS[4])
      -- pinned as its reserve pinned them: its last key, then back while each key is
      -- new (a key held already holds every key before it)
      local m = (#list - bar) / 16
      for j = m, 1, -1 do
        if redis.call('HINCRBY', KEYS[4], key_at(list, bar, j), 1) > 1 then break end
        adds = adds + bt
      end
      if ARGV[i + 3] == '1' then
        for j = 1, m do redis.call('SADD', KEYS[5], key_at(list, bar, j)) end
      end
    end
    redis.call('INCRBY', KEYS[1], adds)
    readded = readded + 1
  end
  redis.call('ZADD', KEYS[3], now + ttl, id)
end
local drift, indexed = reconcile(ttl)
if reclaimed > 0 or drift < 0 then redis.call('PUBLISH', ARGV[2], ARGV[3]) end
return {tonumber(redis.call('GET', KEYS[1])), reclaimed, readded, meta[1],
        tonumber(meta[2] or '0') - now, created, drift, indexed}
"""
