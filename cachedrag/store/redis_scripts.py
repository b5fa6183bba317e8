"""The Redis tier's atomic Lua scripts: shared byte accounting, LRU-ish eviction and repair.

Owns: the scripts ``RedisTier`` registers (``PUT``, ``GET``, ``REMOVE``, ``REPAIR``), the
malformed-accounting check every one of them runs before writing (``CHECK``) and its answer
(``MALFORMED``). Does not own: the key layout's names (passed in ``KEYS``), calling the scripts,
timeouts and the circuit breaker (``redis_tier``).

The accounting spans every namespace under ``prefix``: ``budget_bytes`` caps everything
cachedrag keeps in that server. A value is charged ``MEMORY USAGE`` of its key (the real
allocation, measured inside the write script) plus ``overhead_bytes`` for its hash and
sorted-set fields. A write that would exceed the budget evicts the least recently used
values (any process's) inside the same script, or is refused if the value alone is larger
than the budget. Values that expire by TTL are uncharged lazily (on the next miss or as
eviction victims). A standalone server is assumed (the scripts touch keys they were not
passed, which Redis Cluster forbids).

Malformed accounting (a key of the wrong type, a non-numeric ``__used`` or ``__clock``,
non-numeric sizes) is checked by every script *before* it writes anything; the script then
answers "malformed" and ``RedisTier`` runs a repair script (one atomic pass: wrong-typed keys
reset, sizes and the LRU set reconciled, uncharged values under the prefix charged, usage
recomputed and brought back under the budget) with a ``RuntimeWarning``, and retries once.
"""

MALFORMED = -2

# KEYS[2..5]: sizes, lru, used, clock. Returns nil, or why the accounting is malformed.
CHECK = """
local function count_ok(k)
  local t = redis.call('TYPE', k)['ok']
  if t == 'none' then return true end
  if t ~= 'string' then return false end
  local v = redis.call('GET', k)
  return #v <= 18 and string.find(v, '^%d+$') ~= nil
end
local function malformed()
  local t = redis.call('TYPE', KEYS[2])['ok']
  if t ~= 'hash' and t ~= 'none' then return 'sizes is a ' .. t end
  t = redis.call('TYPE', KEYS[3])['ok']
  if t ~= 'zset' and t ~= 'none' then return 'lru is a ' .. t end
  if not count_ok(KEYS[4]) then return 'used is not a byte count' end
  if not count_ok(KEYS[5]) then return 'clock is not a counter' end
  local s = redis.call('HGET', KEYS[2], KEYS[1])
  if s and (#s > 18 or not string.find(s, '^%d+$')) then return 'size of ' .. KEYS[1] .. ' is not a byte count' end
  return nil
end
local function drop(k)
  local s = tonumber(redis.call('HGET', KEYS[2], k) or '0') or 0
  redis.call('DEL', k)
  redis.call('HDEL', KEYS[2], k)
  redis.call('ZREM', KEYS[3], k)
  return s
end
"""

# KEYS: value, sizes, lru, used, clock. ARGV: blob, budget, ttl_ms, overhead, may_evict
PUT = CHECK + """
local bad = malformed()
if bad then return {-2, 0, 0, bad} end
local budget = tonumber(ARGV[2])
local ttl = tonumber(ARGV[3])
local used = tonumber(redis.call('GET', KEYS[4]) or '0') - drop(KEYS[1])
if used < 0 then used = 0 end
if ttl > 0 then
  redis.call('SET', KEYS[1], ARGV[1], 'PX', ttl)
else
  redis.call('SET', KEYS[1], ARGV[1])
end
local size = tonumber(redis.call('MEMORY', 'USAGE', KEYS[1]) or 0) + tonumber(ARGV[4])
if size > budget then
  redis.call('DEL', KEYS[1])
  redis.call('SET', KEYS[4], used)
  return {0, 0, size}
end
local evicted = 0
while used + size > budget do
  local victim = redis.call('ZRANGE', KEYS[3], 0, 0)[1]
  if ARGV[5] ~= '1' or not victim then
    redis.call('DEL', KEYS[1])
    redis.call('SET', KEYS[4], used)
    return {-1, evicted, size}
  end
  used = used - drop(victim)
  evicted = evicted + 1
end
if used < 0 then used = 0 end
redis.call('HSET', KEYS[2], KEYS[1], size)
redis.call('ZADD', KEYS[3], redis.call('INCR', KEYS[5]), KEYS[1])
redis.call('SET', KEYS[4], used + size)
return {1, evicted, size}
"""

# KEYS: value, sizes, lru, used, clock. Returns {1, value} (touching it), {0} (a miss, uncharging
# a lapsed value) or {-2, value-or-false, why} (malformed accounting: nothing touched).
GET = CHECK + """
local t = redis.call('TYPE', KEYS[1])['ok']
local v = false
if t == 'string' then v = redis.call('GET', KEYS[1]) end
local bad = malformed()
if bad then return {-2, v, bad} end
if v then
  redis.call('ZADD', KEYS[3], 'XX', redis.call('INCR', KEYS[5]), KEYS[1])
  return {1, v}
end
if t == 'none' and redis.call('HEXISTS', KEYS[2], KEYS[1]) == 1 then
  local used = tonumber(redis.call('GET', KEYS[4]) or '0') - drop(KEYS[1])
  if used < 0 then used = 0 end
  redis.call('SET', KEYS[4], used)
end
return {0}
"""

# KEYS: value, sizes, lru, used, clock. Returns {existed} or {-2, why}.
REMOVE = CHECK + """
local bad = malformed()
if bad then return {-2, bad} end
local existed = redis.call('EXISTS', KEYS[1])
local used = tonumber(redis.call('GET', KEYS[4]) or '0') - drop(KEYS[1])
if used < 0 then used = 0 end
redis.call('SET', KEYS[4], used)
return {existed}
"""

# KEYS: sizes, lru, used, clock. ARGV: SCAN pattern of the prefix's keys, budget, overhead,
# the accounting keys' common prefix. Resets what is malformed and reconciles the rest;
# returns a list of what it fixed.
REPAIR = """
local fixed = {}
for i, want in ipairs({'hash', 'zset', 'string', 'string'}) do
  local t = redis.call('TYPE', KEYS[i])['ok']
  if t ~= want and t ~= 'none' then
    redis.call('DEL', KEYS[i])
    table.insert(fixed, KEYS[i] .. ' was a ' .. t)
  end
end
local used = 0
local sizes = redis.call('HGETALL', KEYS[1])
for i = 1, #sizes, 2 do
  local k, s = sizes[i], tonumber(sizes[i + 1])
  if s == nil or s < 0 or s ~= math.floor(s) then
    redis.call('HDEL', KEYS[1], k)
    redis.call('ZREM', KEYS[2], k)
    redis.call('DEL', k)
    table.insert(fixed, 'size of ' .. k)
  elseif redis.call('EXISTS', k) == 0 then
    redis.call('HDEL', KEYS[1], k)
    redis.call('ZREM', KEYS[2], k)
  else
    used = used + s
    if not redis.call('ZSCORE', KEYS[2], k) then redis.call('ZADD', KEYS[2], 0, k) end
  end
end
for _, k in ipairs(redis.call('ZRANGE', KEYS[2], 0, -1)) do
  if redis.call('HEXISTS', KEYS[1], k) == 0 then redis.call('ZREM', KEYS[2], k) end
end
local cursor = '0'
repeat
  local r = redis.call('SCAN', cursor, 'MATCH', ARGV[1], 'COUNT', 1000)
  cursor = r[1]
  for _, k in ipairs(r[2]) do
    if string.sub(k, 1, #ARGV[4]) ~= ARGV[4] and redis.call('HEXISTS', KEYS[1], k) == 0 then
      local s = tonumber(redis.call('MEMORY', 'USAGE', k) or 0) + tonumber(ARGV[3])
      redis.call('HSET', KEYS[1], k, s)
      redis.call('ZADD', KEYS[2], 0, k)
      used = used + s
      table.insert(fixed, 'uncharged ' .. k)
    end
  end
until cursor == '0'
local budget = tonumber(ARGV[2])
while used > budget do
  local victim = redis.call('ZRANGE', KEYS[2], 0, 0)[1]
  if not victim then break end
  used = used - (tonumber(redis.call('HGET', KEYS[1], victim)) or 0)
  redis.call('DEL', victim)
  redis.call('HDEL', KEYS[1], victim)
  redis.call('ZREM', KEYS[2], victim)
end
if used < 0 then used = 0 end
local old = redis.call('GET', KEYS[3])
if old ~= tostring(used) then table.insert(fixed, 'used ' .. tostring(old) .. ' -> ' .. used) end
redis.call('SET', KEYS[3], used)
local clock = redis.call('GET', KEYS[4])
if clock and (#clock > 18 or not string.find(clock, '^%d+$')) then
  local top = redis.call('ZRANGE', KEYS[2], -1, -1, 'WITHSCORES')
  redis.call('SET', KEYS[4], math.floor(tonumber(top[2] or '0') or 0))
  table.insert(fixed, 'clock')
end
return fixed
"""
