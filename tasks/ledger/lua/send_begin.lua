-- send_begin: a delivery's send lock taken and its receipt read in one step; when the lock was
-- taken and the delivery is not done yet (and asked), an attempt counted and the receipt sending.
-- KEYS[1] lock: the delivery's send lock
-- KEYS[2] receipt: the delivery's receipt (hash)
-- ARGV[1] owner: the lock's owner
-- ARGV[2] ttl_s: the lock's TTL
-- ARGV[3] count: '1' to count an attempt
-- ARGV[4] sending: the sending state (states.py)
-- ARGV[5] delivered: the delivered state
-- ARGV[6] cancelled: the cancelled state
-- ARGV[7] failed: the failed state (done only when `final` is '1')
-- Returns {1|0 locked, {state, final, message_id, reason} as it was, attempt number or 0}.
local lock = KEYS[1]
local receipt = KEYS[2]
local owner = ARGV[1]
local ttl_s = ARGV[2]
local count = ARGV[3]
local sending = ARGV[4]
local delivered = ARGV[5]
local cancelled = ARGV[6]
local failed = ARGV[7]

local locked = redis.call('set', lock, owner, 'NX', 'EX', ttl_s)
local rec = redis.call('hmget', receipt, 'state', 'final', 'message_id', 'reason')
local attempts = 0
if locked and count == '1' then
  local st, final = rec[1], rec[2]
  if st ~= delivered and st ~= cancelled and not (st == failed and final == '1') then
    attempts = redis.call('hincrby', receipt, 'attempts', 1)
    redis.call('hset', receipt, 'state', sending)
  end
end
return {locked and 1 or 0, rec, attempts}
