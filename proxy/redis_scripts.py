"""The shared ledger's Lua scripts: one per operation, one round trip, atomic.

Per backend, three keys share the hash tag `{backend}` (so the scripts run on one
Redis Cluster slot); `key_prefix` keeps deployments apart on one server:

    <prefix>:{<backend>}:resident   integer, tokens reserved now: the sum of the leases
    <prefix>:{<backend>}:leases     hash lease_id -> tokens, plus the epoch fields
                                    `=epoch` (a random id) and `=until` (Redis ms)
    <prefix>:{<backend>}:expiry     zset lease_id -> expiry (Redis server ms)

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

__all__ = ["LOST", "REBUILDING", "RECLAIM_LUA", "RELEASE_LUA", "RENEW_LUA", "RESERVE_LUA",
           "RESIZE_LUA", "STALE"]

# Scripts' KEYS: [1] resident counter, [2] leases hash (with the epoch fields), [3] expiry
# zset. Field names starting with '=' (byte 61) are the epoch's; lease ids never do.

_NOW = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
"""

# The truth is the lease hash: the counter is recomputed from it wherever it is missing,
# so a counter lost on its own (an eviction) never reads as zero.
_SUM = """
local function lease_sum()
  local all = redis.call('HGETALL', KEYS[2])
  local sum, n = 0, 0
  for i = 1, #all, 2 do
    if string.byte(all[i], 1) ~= 61 then
      sum = sum + tonumber(all[i + 1])
      n = n + 1
    end
  end
  return sum, n
end
local function resident()
  local r = redis.call('GET', KEYS[1])
  if r then return tonumber(r) end
  local sum = lease_sum()
  redis.call('SET', KEYS[1], string.format('%d', sum))
  return sum
end
"""

# Reclaim expired leases of this backend, by Redis server time; -> leases reclaimed.
_RECLAIM = """
local function reclaim()
  resident()
  local expired = redis.call('ZRANGEBYSCORE', KEYS[3], '-inf', now)
  local n = 0
  for _, id in ipairs(expired) do
    local tok = redis.call('HGET', KEYS[2], id)
    if tok then
      redis.call('DECRBY', KEYS[1], tok)
      redis.call('HDEL', KEYS[2], id)
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
      if string.byte(id, 1) ~= 61 and not redis.call('ZSCORE', KEYS[3], id) then
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

# ARGV[1] lease id, ARGV[2] tokens, ARGV[3] capacity, ARGV[4] ttl ms,
# ARGV[5] channel, ARGV[6] backend, ARGV[7] the epoch this replica registered under
# returns {1 reserved | 0 no room | -1 lease id already recorded, resident after,
#          tokens recorded under that lease id (for -1)} or an epoch refusal (-2, -3, -4)
RESERVE_LUA = _NOW + _SUM + _RECLAIM + _epoch_check(7) + """
if reclaim() > 0 then redis.call('PUBLISH', ARGV[5], ARGV[6]) end
local res = tonumber(redis.call('GET', KEYS[1]))
local recorded = redis.call('HGET', KEYS[2], ARGV[1])
if recorded then return {-1, res, tonumber(recorded)} end
local tokens = tonumber(ARGV[2])
if res + tokens > tonumber(ARGV[3]) then return {0, res} end
redis.call('INCRBY', KEYS[1], tokens)
redis.call('HSET', KEYS[2], ARGV[1], tokens)
redis.call('ZADD', KEYS[3], now + tonumber(ARGV[4]), ARGV[1])
return {1, res + tokens}
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
local tok = redis.call('HGET', KEYS[2], ARGV[1])
redis.call('ZREM', KEYS[3], ARGV[1])
if not tok then
  return {0, tonumber(redis.call('GET', KEYS[1]) or '0')}
end
resident()
redis.call('HDEL', KEYS[2], ARGV[1])
local res = redis.call('DECRBY', KEYS[1], tok)
redis.call('PUBLISH', ARGV[2], ARGV[3])
return {1, res}
"""

# ARGV[1] lease id, ARGV[2] wanted tokens, ARGV[3] capacity, ARGV[4] channel, ARGV[5] backend,
# ARGV[6] the epoch this replica registered under
# returns {tokens the lease holds now (-1: unknown lease), resident after} or an epoch
# refusal (-2, -3, -4: nothing changed). Shrinking always succeeds (and wakes waiters);
# growing takes only free room.
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
# pairs: lease id, tokens
# returns {resident after, leases reclaimed, live leases re-added, epoch id, ms until
#          the rebuild ends (<= 0: done), 1 if this call started the epoch, tokens the
#          counter was off by, leases given an expiry}
RENEW_LUA = _NOW + _SUM + _RECLAIM + _RECONCILE + """
local meta = redis.call('HMGET', KEYS[2], '=epoch', '=until')
local created = 0
if not meta[1] then
  meta = {ARGV[4], string.format('%d', now + tonumber(ARGV[5]))}
  redis.call('HSET', KEYS[2], '=epoch', meta[1], '=until', meta[2])
  created = 1
end
local reclaimed = reclaim()
local ttl = tonumber(ARGV[1])
local readded = 0
for i = 6, #ARGV, 2 do
  local id = ARGV[i]
  if redis.call('HEXISTS', KEYS[2], id) == 0 then
    redis.call('HSET', KEYS[2], id, ARGV[i + 1])
    redis.call('INCRBY', KEYS[1], ARGV[i + 1])
    readded = readded + 1
  end
  redis.call('ZADD', KEYS[3], now + ttl, id)
end
local drift, indexed = reconcile(ttl)
if reclaimed > 0 or drift < 0 then redis.call('PUBLISH', ARGV[2], ARGV[3]) end
return {tonumber(redis.call('GET', KEYS[1])), reclaimed, readded, meta[1],
        tonumber(meta[2] or '0') - now, created, drift, indexed}
"""
