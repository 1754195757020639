-- breaker_admit: may an extraction touch its sandbox? (tasks/turn/breaker.py `Gate.enter`)
-- KEYS[1] breakers: the open or half-open breakers (sorted set of sandboxes, by the breaker's end)
-- KEYS[2] answered: the sandboxes by when one last answered (sorted set)
-- KEYS[3] scout: the sandbox's scout key (string with TTL: the delivery id of the extraction that tries it)
-- KEYS[4] waiting: the extractions the sandbox's breaker postponed (set of delivery ids, with TTL)
-- ARGV[1] ident: the sandbox (`<kind>:<host>:<target>`)
-- ARGV[2] did: the extraction's delivery id
-- ARGV[3] now: the time, in seconds
-- ARGV[4] fresh_s: an answer this recent proves the sandbox
-- ARGV[5] scout_ttl_ms: the scout key's TTL, in milliseconds
-- ARGV[6] state_ttl_s: the waiting set's TTL
-- Returns {verdict, at}: `open` (at: the breaker's end), `run`, `scout` (this extraction tries
-- the sandbox), or `wait` (at: when the scout's key lapses); postponed ones join `waiting`.
local breakers = KEYS[1]
local answered = KEYS[2]
local scout = KEYS[3]
local waiting = KEYS[4]
local ident = ARGV[1]
local did = ARGV[2]
local now = tonumber(ARGV[3])
local fresh_s = tonumber(ARGV[4])
local scout_ttl_ms = ARGV[5]
local state_ttl_s = ARGV[6]

local untl = tonumber(redis.call('zscore', breakers, ident))
local verdict, at = 'wait', 0
if untl and untl > now then
  verdict, at = 'open', untl
else
  if not untl then
    local seen = tonumber(redis.call('zscore', answered, ident))
    if seen and seen >= now - fresh_s then return {'run', ''} end
  end
  local holder = redis.call('get', scout)
  if not holder or holder == did then
    redis.call('set', scout, did, 'PX', scout_ttl_ms)
    return {'scout', ''}
  end
  at = now + math.max(redis.call('pttl', scout), 0) / 1000
end
redis.call('sadd', waiting, did)
redis.call('expire', waiting, state_ttl_s)
return {verdict, string.format('%.6f', at)}
