-- webhook_unclaim: a webhook turn's claim taken back (its publish failed), only while the
-- de-dup key still names this job.
-- KEYS[1] seen: the update's de-dup key
-- KEYS[2] job: the turn's job record
-- KEYS[3] due: the turn due set
-- ARGV[1] job_id: the turn's job id
-- Returns 1 when taken back, 0 when the de-dup key names another job (or is gone).
local seen = KEYS[1]
local job = KEYS[2]
local due = KEYS[3]
local job_id = ARGV[1]

if redis.call('get', seen) ~= job_id then return 0 end
redis.call('del', seen, job)
redis.call('zrem', due, job_id)
return 1
