-- breaker_answered: a sandbox answered: stamped; its breaker closed, its scout key dropped and
-- the extractions it postponed due at once (never pushed out).
-- KEYS[1] breakers: the open or half-open breakers (sorted set of sandboxes, by the breaker's end)
-- KEYS[2] breaker: the sandbox's breaker (hash with TTL)
-- KEYS[3] scout: the sandbox's scout key (string with TTL: a delivery id)
-- KEYS[4] waiting: the extractions the sandbox's breaker postponed (set of delivery ids, with TTL)
-- KEYS[5] answered: the sandboxes by when one last answered (sorted set)
-- KEYS[6] due: the extraction due set
-- ARGV[1] ident: the sandbox (`<kind>:<host>:<target>`)
-- ARGV[2] did: the extraction's delivery id
-- ARGV[3] now: the time, in seconds
-- ARGV[4] fresh_s: answers older than this are dropped from `answered`
-- ARGV[5] due_at: when the handed-on extractions are due
-- Returns the ids of the extractions handed on.
local breakers = KEYS[1]
local breaker = KEYS[2]
local scout = KEYS[3]
local waiting = KEYS[4]
local answered = KEYS[5]
local due = KEYS[6]
local ident = ARGV[1]
local did = ARGV[2]
local now = tonumber(ARGV[3])
local fresh_s = tonumber(ARGV[4])
local due_at = ARGV[5]

redis.call('zadd', answered, now, ident)
redis.call('zremrangebyscore', answered, '-inf', now - fresh_s)
if redis.call('get', scout) == did then redis.call('del', scout) end
redis.call('zrem', breakers, ident)
redis.call('del', breaker)
local ids = redis.call('smembers', waiting)
for _, id in ipairs(ids) do
  redis.call('zadd', due, 'XX', 'LT', due_at, id)
end
redis.call('del', waiting)
return ids
