-- confirm_status: a platform's status for a message courier sent, on its receipt. A status for
-- a receipt that is not delivered (retried, cancelled, gone) changes nothing; the failed status
-- makes it failed; a higher rank raises `confirmed`.
-- KEYS[1] receipt: the delivery's receipt (hash)
-- ARGV[1] status: the platform's status
-- ARGV[2] rank: the status's rank (tasks/delivery/confirm.py RANK)
-- ARGV[3] now: the time, in seconds (as written)
-- ARGV[4] reason: the failure's reason (for the failed status)
-- ARGV[5] delivered: the delivered state (states.py)
-- ARGV[6] failed: the failed state (states.py), also the status that means it
-- ARGV[7...] ranks: status, rank pairs (tasks/delivery/confirm.py RANK; a status not there ranks 0)
-- Returns what it did: the failed state | confirmed | stale | not_delivered.
local receipt = KEYS[1]
local status = ARGV[1]
local rank = tonumber(ARGV[2])
local now = ARGV[3]
local reason = ARGV[4]
local delivered = ARGV[5]
local failed = ARGV[6]
local rank_pairs = {unpack(ARGV, 7)}

if redis.call('hget', receipt, 'state') ~= delivered then return 'not_delivered' end
if status == failed then
  redis.call('hset', receipt, 'state', failed, 'confirmed', failed, 'confirmed_s', now,
             'reason', reason, 'failed_after_acceptance', '1')
  return failed
end
local ranks = {}
for i = 1, #rank_pairs, 2 do ranks[rank_pairs[i]] = tonumber(rank_pairs[i + 1]) end
local confirmed = redis.call('hget', receipt, 'confirmed')
local was = 0
if confirmed then was = ranks[confirmed] or 0 end
if rank <= was then return 'stale' end
redis.call('hset', receipt, 'confirmed', status, 'confirmed_s', now)
return 'confirmed'
