-- delivery_add: register a delivery (idempotent: an existing receipt is kept), appended to its
-- job's deliveries and, when asked, to its chat's lane.
-- Keys of one chat: KEYS[3]; of the delivery: KEYS[1]; of its job: KEYS[2].
-- KEYS[1] receipt: the delivery's receipt (hash)
-- KEYS[2] job_deliveries: the job's delivery ids (list)
-- KEYS[3] lane: the chat's lane (list of steps; untouched unless ARGV[2] is '1')
-- ARGV[1] ttl_s: the receipt's retention
-- ARGV[2] to_lane: '1' to append the delivery to the lane
-- ARGV[3...] fields: the receipt's field, value pairs (with its `id`)
-- Returns 1 when registered, 0 when the receipt was there.
local receipt = KEYS[1]
local job_deliveries = KEYS[2]
local lane = KEYS[3]
local ttl_s = ARGV[1]
local to_lane = ARGV[2]
local fields = {unpack(ARGV, 3)}

if redis.call('exists', receipt) == 1 then return 0 end
redis.call('hset', receipt, unpack(fields))
redis.call('expire', receipt, ttl_s)
local id = redis.call('hget', receipt, 'id')
redis.call('rpush', job_deliveries, id)
redis.call('expire', job_deliveries, ttl_s)
if to_lane == '1' then redis.call('rpush', lane, id) end
return 1
