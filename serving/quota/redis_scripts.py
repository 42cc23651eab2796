"""The Redis quota store's Lua scripts: reserve, settle, add and lease renewal (see
:mod:`.redis_store` for how they are called, :mod:`.leases` for the lease rules).

Every script gets its item keys in ``KEYS`` and, when leases are on, the two lease keys of the
reservation's hash tag after them, so on a Redis Cluster each call touches one slot.
"""

from __future__ import annotations

__all__ = ["RESERVE_LUA", "SETTLE_LUA", "ADD_LUA", "RENEW_LUA"]

_PRELUDE = r"""
local function fmt(x) return string.format('%.17g', x) end
local now
if ARGV[1] == '' then
  local t = redis.call('TIME')
  now = tonumber(t[1]) + tonumber(t[2]) / 1000000
else
  now = tonumber(ARGV[1])
end
"""

#: The lease state of one hash tag (one org, or the global level), beside its quota keys:
#:   {prefix}lease:{tag}   hash  holder id -> lease deadline (seconds on the store's clock)
#:   {prefix}held:{tag}    hash  'holder id|quota key' -> units of that hold the holder has
#: reclaim(lease, held, now) gives back the holds of every holder whose deadline is <= now
#: (DECRBY each quota key by what the holder held, dropping keys at <= 0) and forgets them;
#: returns how many holders it found expired.
_LEASES_LUA = r"""
local function hdel_all(key, fields)
  for j = 1, #fields, 1000 do
    redis.call('HDEL', key, unpack(fields, j, math.min(j + 999, #fields)))
  end
end
local function reclaim(lease, held, at)
  local L = redis.call('HGETALL', lease)
  local dead, names = {}, {}
  for j = 1, #L, 2 do
    if tonumber(L[j + 1]) <= at then
      dead[L[j]] = true
      names[#names + 1] = L[j]
    end
  end
  if #names == 0 then return 0 end
  local H = redis.call('HGETALL', held)
  local gone = {}
  for j = 1, #H, 2 do
    local f = H[j]
    local bar = string.find(f, '|', 1, true)
    if bar and dead[string.sub(f, 1, bar - 1)] then
      local key = string.sub(f, bar + 1)
      if redis.call('DECRBY', key, H[j + 1]) <= 0 then redis.call('DEL', key) end
      gone[#gone + 1] = f
    end
  end
  hdel_all(held, gone)
  hdel_all(lease, names)
  return #names
end
"""

#: KEYS: one per item, then — when ARGV[10] names a holder — the reservation's lease hash and
#: held hash (see _LEASES_LUA).
#: ARGV[1]: now ('' = Redis TIME); ARGV[2..8]: the request's amount per source (SRC_0..SRC_6);
#: ARGV[9]: the items' descriptors (PlanItem.desc, 27 bytes each, struct '<c1Bc1ddd'), in KEYS
#: order: kind ('r' rate, 'c' counter, 'd' deadline), source, settle rule, then
#:   rate      interval T s, tolerance tau s, key TTL ms (0 = none)
#:   counter   limit, TTL s from creation (0 = none), big (1 if limit >= 2^53)
#:   deadline  max age s, TTL s, 0
#: ARGV[10]: the holder id ('' = no leases); ARGV[11]: lease seconds;
#: ARGV[12...]: for each big counter in item order, its headroom (limit - amount, exact decimal).
#: Check every item (one MGET); if a hold (a 'release' counter) does not fit, give back the holds
#: of every holder whose lease has passed and check again; then apply every item. Keys without
#: TTL are written with one MSET (values computed from the MGET; exact, being below 2^53);
#: counters with a TTL or a big limit use INCRBY (SET would drop the TTL; doubles would round).
#: Each hold applied is also counted under the holder in the held hash, and the holder's lease
#: set to now + lease seconds.
#: Returns {1, now, 'new TAT of each rate item, space-separated'} when admitted,
#:         {0, index (0-based), retry_after | '', value, now} when not (nothing applied).
RESERVE_LUA = _PRELUDE + _LEASES_LUA + r"""
local function le(a, b)  -- a <= b for decimal integer strings >= 0 without leading zeros
  if #a ~= #b then return #a < #b end
  return a <= b
end
local holder = ARGV[10]
local n = #KEYS
if holder ~= '' then n = n - 2 end
local amt = {}
for s = 0, 6 do amt[s] = tonumber(ARGV[2 + s]) end
local D = ARGV[9]
if #D ~= 27 * n then return redis.error_reply('kvmeter reserve: descriptors do not match keys') end
local kind, src, rule, A, B, C, head, st = {}, {}, {}, {}, {}, {}, {}, {}
local extra = 12
local pos = 1
for i = 1, n do
  kind[i], src[i], rule[i], A[i], B[i], C[i], pos = struct.unpack('<c1Bc1ddd', D, pos)
  if kind[i] == 'c' and C[i] == 1 then
    head[i] = ARGV[extra]
    extra = extra + 1
  end
end
-- the first item that does not fit and its refusal, or nil (st: the new TATs)
local function check(cur)
  for i = 1, n do
    local k, c, x, y = kind[i], cur[i], A[i], B[i]
    if k == 'r' then
      local tat = tonumber(c) or now
      if tat < now then tat = now end
      local new = tat + amt[src[i]] * x
      if new - now > y then
        return i, {0, i - 1, fmt(new - y - now), fmt(tat), fmt(now)}
      end
      st[i] = new
    elseif k == 'c' then
      if C[i] == 1 then
        if not le(c or '0', head[i]) then return i, {0, i - 1, '', c or '0', fmt(now)} end
      elseif (tonumber(c) or 0) + amt[src[i]] > x then
        return i, {0, i - 1, '', c or '0', fmt(now)}
      end
    elseif c and now - tonumber(c) > x then
      return i, {0, i - 1, '', c, fmt(now)}
    end
  end
  return nil, nil
end
local cur = redis.call('MGET', unpack(KEYS, 1, n))
local bad, refusal = check(cur)
if bad and holder ~= '' and kind[bad] == 'c' and rule[bad] == 'r' then
  if reclaim(KEYS[n + 1], KEYS[n + 2], now) > 0 then
    cur = redis.call('MGET', unpack(KEYS, 1, n))
    bad, refusal = check(cur)
  end
end
if bad then return refusal end
local states, mset = {}, {}
local held = false
for i = 1, n do
  local k = kind[i]
  if k == 'r' then
    local v = fmt(st[i])
    states[#states + 1] = v
    if C[i] > 0 then
      redis.call('SET', KEYS[i], v, 'PX', C[i])
    else
      mset[#mset + 1] = KEYS[i]
      mset[#mset + 1] = v
    end
  elseif k == 'c' then
    local a = amt[src[i]]
    if a ~= 0 then
      if B[i] > 0 or C[i] == 1 then
        redis.call('INCRBY', KEYS[i], ARGV[2 + src[i]])
        if B[i] > 0 and not cur[i] then redis.call('EXPIRE', KEYS[i], B[i]) end
      else
        mset[#mset + 1] = KEYS[i]
        mset[#mset + 1] = string.format('%d', (tonumber(cur[i]) or 0) + a)
      end
      if holder ~= '' and rule[i] == 'r' then
        redis.call('HINCRBY', KEYS[n + 2], holder .. '|' .. KEYS[i], ARGV[2 + src[i]])
        held = true
      end
    end
  elseif not cur[i] then
    redis.call('SET', KEYS[i], fmt(now), 'EX', B[i])
  end
end
if #mset > 0 then redis.call('MSET', unpack(mset)) end
if held then redis.call('HSET', KEYS[n + 1], holder, fmt(now + tonumber(ARGV[11]))) end
return {1, fmt(now), table.concat(states, ' ')}
"""

#: KEYS: the reservation's items, then — when ARGV[17] names a holder — its lease hash and held
#: hash. ARGV[1]: now; ARGV[2..8]: per source, actual - reserved (the delta of 'adjust' items);
#: ARGV[9..15]: per source, -reserved (the delta of 'release' items); ARGV[16]: the descriptors,
#: as for RESERVE_LUA; ARGV[17]: the holder id ('' = no leases). 'keep' items and zero deltas are
#: skipped. With a holder, a hold gives back at most what the held hash still counts for the
#: holder (none if its lease passed and its holds were given back already: never twice).
SETTLE_LUA = _PRELUDE + r"""
local holder = ARGV[17]
local n = #KEYS
if holder ~= '' then n = n - 2 end
local D = ARGV[16]
if #D ~= 27 * n then return redis.error_reply('kvmeter settle: descriptors do not match keys') end
local cur = redis.call('MGET', unpack(KEYS, 1, n))
local mset, del = {}, {}
local pos = 1
for i = 1, n do
  local k, s, rule, x, y, z
  k, s, rule, x, y, z, pos = struct.unpack('<c1Bc1ddd', D, pos)
  local delta = '0'
  if rule == 'a' then delta = ARGV[2 + s] elseif rule == 'r' then delta = ARGV[9 + s] end
  if delta ~= '0' and k == 'c' and rule == 'r' and holder ~= '' then
    local f = holder .. '|' .. KEYS[i]
    local h = tonumber(redis.call('HGET', KEYS[n + 2], f) or '0')
    local give = math.min(-tonumber(delta), h)
    if give <= 0 then
      delta = '0'
    else
      if h - give <= 0 then
        redis.call('HDEL', KEYS[n + 2], f)
      else
        redis.call('HINCRBY', KEYS[n + 2], f, string.format('%d', -give))
      end
      delta = string.format('%d', -give)
    end
  end
  if delta ~= '0' and k ~= 'd' then
    if k == 'r' then
      local tat = tonumber(cur[i]) or now
      if tat < now then tat = now end
      local new = tat + tonumber(delta) * x
      if new <= now then
        del[#del + 1] = KEYS[i]
      elseif z > 0 then
        redis.call('SET', KEYS[i], fmt(new), 'PX', z)
      else
        mset[#mset + 1] = KEYS[i]
        mset[#mset + 1] = fmt(new)
      end
    elseif y > 0 or z == 1 then
      local v = redis.call('INCRBY', KEYS[i], delta)
      if v <= 0 then
        del[#del + 1] = KEYS[i]
      elseif y > 0 and not cur[i] then
        redis.call('EXPIRE', KEYS[i], y)
      end
    else
      local v = (tonumber(cur[i]) or 0) + tonumber(delta)
      if v <= 0 then
        del[#del + 1] = KEYS[i]
      else
        mset[#mset + 1] = KEYS[i]
        mset[#mset + 1] = string.format('%d', v)
      end
    end
  end
end
if #mset > 0 then redis.call('MSET', unpack(mset)) end
if #del > 0 then redis.call('DEL', unpack(del)) end
return 1
"""

#: KEYS[1]: a lease hash. ARGV[1]: now ('' = Redis TIME); ARGV[2]: holder; ARGV[3]: lease s.
RENEW_LUA = _PRELUDE + r"""
redis.call('HSET', KEYS[1], ARGV[2], fmt(now + tonumber(ARGV[3])))
return 1
"""

#: KEYS[1]: counter. ARGV: amount, ttl s ('0' none). Returns the new value.
ADD_LUA = r"""
local v = redis.call('INCRBY', KEYS[1], ARGV[1])
if ARGV[2] ~= '0' then redis.call('EXPIRE', KEYS[1], ARGV[2]) end
return v
"""
