-- breaker_trip: a sandbox's read timed out: open its breaker (again, for twice as long, when it
-- ran out) or keep it as it is when open; the postponed extractions are due at its end.
-- KEYS[1] breakers: the open or half-open breakers (sorted set of sandboxes, by the breaker's end)
-- KEYS[2] breaker: the sandbox's breaker (hash with TTL: opens, since_s, until_s, reason)
-- KEYS[3] scout: the sandbox's scout key (string with TTL: a delivery id)
-- KEYS[4] waiting: the extractions the sandbox's breaker postponed (set of delivery ids, with TTL)
-- KEYS[5] answered: the sandboxes by when one last answered (sorted set)
-- KEYS[6] due: the extraction due set
-- ARGV[1] ident: the sandbox (`<kind>:<host>:<target>`)
-- ARGV[2] did: the extraction's delivery id
-- ARGV[3] now: the time, in seconds
-- ARGV[4] base_s: how long a breaker first stays open
-- ARGV[5] max_s: the longest a breaker stays open
-- ARGV[6] reason: the timeout's reason
-- ARGV[7] state_ttl_s: the breaker's and the waiting set's TTL
-- ARGV[8] stale_before: a breaker that ended before this time starts again from one
-- Returns {end, opens (0: kept as it was)}.
local breakers = KEYS[1]
local breaker = KEYS[2]
local scout = KEYS[3]
local waiting = KEYS[4]
local answered = KEYS[5]
local due = KEYS[6]
local ident = ARGV[1]
local did = ARGV[2]
local now_s = ARGV[3]
local now = tonumber(now_s)
local base_s = tonumber(ARGV[4])
local max_s = tonumber(ARGV[5])
local reason = ARGV[6]
local state_ttl_s = ARGV[7]
local stale_before = ARGV[8]

redis.call('zrem', answered, ident)
redis.call('sadd', waiting, did)
redis.call('expire', waiting, state_ttl_s)
if redis.call('get', scout) == did then redis.call('del', scout) end
local untl = tonumber(redis.call('zscore', breakers, ident))
if untl and untl > now then return {string.format('%.6f', untl), '0'} end
if untl and untl < tonumber(stale_before) then untl = nil end
local n = 1
if untl then n = (tonumber(redis.call('hget', breaker, 'opens')) or 0) + 1 end
untl = now + math.min(max_s, base_s * 2 ^ (n - 1))
redis.call('zremrangebyscore', breakers, '-inf', stale_before)
redis.call('zadd', breakers, untl, ident)
if n == 1 then redis.call('hset', breaker, 'since_s', now_s) end
redis.call('hset', breaker, 'opens', n, 'until_s', string.format('%.6f', untl), 'reason', reason)
redis.call('expire', breaker, state_ttl_s)
for _, id in ipairs(redis.call('smembers', waiting)) do
  redis.call('zadd', due, 'XX', untl, id)
end
return {string.format('%.6f', untl), tostring(n)}
