-- delivery_cancel: cancel a delivery (`courier cancel`) unless it is final or its send is in flight.
-- KEYS[1] receipt: the delivery's receipt (hash)
-- KEYS[2] lock: the delivery's send lock
-- KEYS[3] step_lock: the send lock of the step it belongs to (an album's first delivery; else KEYS[2] again)
-- ARGV[1] reason: the receipt's reason
-- ARGV[2] now: the time, in seconds (as written)
-- ARGV[3] cancelled: the cancelled state (states.py)
-- ARGV[4...] over: the states a delivery never leaves (states.py DELIVERY_OVER)
-- Returns {what, the state it was in}: `gone`, `final`, `in_flight`, or the cancelled state.
local receipt = KEYS[1]
local lock = KEYS[2]
local step_lock = KEYS[3]
local reason = ARGV[1]
local now = ARGV[2]
local cancelled = ARGV[3]
local over = {unpack(ARGV, 4)}

local st = redis.call('hget', receipt, 'state')
if not st then return {'gone', ''} end
for _, s in ipairs(over) do if st == s then return {'final', st} end end
if redis.call('exists', lock) == 1 or redis.call('exists', step_lock) == 1 then return {'in_flight', st} end
redis.call('hset', receipt, 'state', cancelled, 'final', '1', 'reason', reason, 'cancelled_s', now)
return {cancelled, st}
