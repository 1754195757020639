-- lane_wake: a lane's wake-up, decided before its drive is published.
-- Keys: both courier-wide (no chat's).
-- KEYS[1] waiting: the drives published and not started yet (sorted set of task ids, by publish time)
-- KEYS[2] ready: the lanes whose wake-up joined the set the waiting drives drain (sorted set of targets)
-- ARGV[1] target: the lane's target ('': a drain, always published)
-- ARGV[2] task_id: the drive's task id
-- ARGV[3] now: the time, in seconds
-- ARGV[4] backlog: how many waiting drives are enough (chains.WAKE_BACKLOG)
-- ARGV[5] stale_s: a drive waiting longer than this no longer counts (chains.WAKE_STALE_S)
-- Returns 1: publish the drive (counted waiting from now); 0: `backlog` drives are waiting
-- already, the lane joined the ready set they drain.
local waiting = KEYS[1]
local ready = KEYS[2]
local target = ARGV[1]
local task_id = ARGV[2]
local now = tonumber(ARGV[3])
local backlog = tonumber(ARGV[4])
local stale_s = tonumber(ARGV[5])

redis.call('zremrangebyscore', waiting, '-inf', now - stale_s)
if target ~= '' and redis.call('zcard', waiting) >= backlog then
  redis.call('zadd', ready, 'NX', now, target)
  return 0
end
redis.call('zadd', waiting, now, task_id)
return 1
