-- delivery_retry: a failed or cancelled delivery queued again (`courier retry`): its failure
-- fields cleared, its extraction too when that is what failed, the step appended to its lane.
-- Keys of one chat: KEYS[2]; of the delivery: KEYS[1].
-- KEYS[1] receipt: the delivery's receipt (hash)
-- KEYS[2] lane: the chat's lane (list of steps)
-- ARGV[1] now: the time, in seconds (as written)
-- ARGV[2] ttl_s: the receipt's retention
-- ARGV[3] did: the delivery id
-- ARGV[4] queued: the queued state (states.py)
-- ARGV[5] extraction_failed: the receipt's `extraction` once failed for good
-- ARGV[6...] retryable: the states a delivery may be retried from
-- Returns {what, the state it was in}: `gone`, `refused`, or `lane` / `extract` (what runs it again).
local receipt = KEYS[1]
local lane = KEYS[2]
local now = ARGV[1]
local ttl_s = ARGV[2]
local did = ARGV[3]
local queued = ARGV[4]
local extraction_failed = ARGV[5]
local retryable = {unpack(ARGV, 6)}

local st = redis.call('hget', receipt, 'state')
if not st then return {'gone', ''} end
local may = false
for _, s in ipairs(retryable) do if st == s then may = true end end
if not may then return {'refused', st} end
redis.call('hdel', receipt, 'final', 'reason', 'transient_errors', 'first_error_s', 'rate_limited', 'album',
           'step', 'cancelled_s')
local again = 'lane'
if redis.call('hget', receipt, 'extraction') == extraction_failed then
  redis.call('hdel', receipt, 'extraction', 'too_large', 'notify', 'limit_bytes')
  again = 'extract'
end
redis.call('hset', receipt, 'state', queued, 'retried_s', now)
redis.call('hincrby', receipt, 'retries', 1)
redis.call('expire', receipt, ttl_s)
redis.call('rpush', lane, did)
return {again, st}
