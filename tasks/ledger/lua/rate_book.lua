-- rate_book: a send's slot in a shared moving window (at most `limit` sends in any `window_s`: a
-- bot's limit), given in the order the sends asked. A send goes now while the window has room;
-- else it is booked the earliest time after every slot booked before it that keeps every window
-- within the limit, and that time is its chat's ticket: the chat's next ask is answered from the
-- ticket (go once its time has come), never booked twice. First come, first served: no herd at a
-- window's reset, no chat starved by a lottery of retries. Times are Redis' own clock.
-- KEYS[1] window: the slots given, oldest first (a list of times; the last `limit` are kept)
-- KEYS[2] ticket: the chat's booked slot (a time), if it has one
-- ARGV[1] limit: sends per window
-- ARGV[2] window_s: the window, seconds
-- ARGV[3] early_s: a ticket is good this long before its time (a timer's slack)
-- ARGV[4] keep_s: a ticket is kept this long past its time (a chat that comes later books again)
-- Returns {'go'}, or {'wait', seconds to wait (a string)}.
local window = KEYS[1]
local ticket = KEYS[2]
local limit = tonumber(ARGV[1])
local window_s = tonumber(ARGV[2])
local early_s = tonumber(ARGV[3])
local keep_s = tonumber(ARGV[4])

local t = redis.call('time')
local now = tonumber(t[1]) + tonumber(t[2]) / 1e6

local booked = tonumber(redis.call('get', ticket))
if booked then
  if now >= booked - early_s then
    redis.call('del', ticket)
    return {'go'}
  end
  return {'wait', string.format('%.3f', booked - now)}
end

local at = now
local n = redis.call('llen', window)
if n > 0 then
  at = math.max(at, tonumber(redis.call('lindex', window, -1)))
end
if n >= limit then
  at = math.max(at, tonumber(redis.call('lindex', window, -limit)) + window_s)
end
redis.call('rpush', window, string.format('%.6f', at))
redis.call('ltrim', window, -limit, -1)
redis.call('pexpire', window, math.ceil((at - now + window_s) * 1000) + 1000)
if at - now <= early_s then
  return {'go'}
end
redis.call('set', ticket, string.format('%.6f', at), 'px', math.ceil((at - now + keep_s) * 1000))
return {'wait', string.format('%.3f', at - now)}
