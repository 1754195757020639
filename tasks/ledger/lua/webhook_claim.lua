-- webhook_claim: a batch of webhook turns claimed, each at once or not at all.
-- Per turn: 0 when its de-dup key is there (a retried update; 1 when the key names this very
-- job: the batch sent again after a lost connection); else the de-dup key, job record and due
-- time are written: 1 (its message is published after).
-- KEYS[1] due: the turn due set
-- KEYS[2...] turn_keys: per turn, its update's de-dup key, then its job record
-- ARGV[1] seen_ttl_s: the de-dup keys' TTL
-- ARGV[2] job_ttl_s: the job records' TTL
-- ARGV[3...] turns: per turn, its job id, its due time, its job record's fields (a JSON object of strings)
-- Returns one 0|1 per turn, in order.
local due = KEYS[1]
local turn_keys = {unpack(KEYS, 2)}
local seen_ttl_s = ARGV[1]
local job_ttl_s = ARGV[2]
local turns = {unpack(ARGV, 3)}

local out = {}
for t = 1, #turn_keys / 2 do
  local seen = turn_keys[2 * t - 1]
  local job = turn_keys[2 * t]
  local job_id, due_at, record = turns[3 * t - 2], turns[3 * t - 1], turns[3 * t]
  local was = redis.call('get', seen)
  if was then
    out[#out + 1] = (was == job_id) and 1 or 0
  else
    redis.call('set', seen, job_id, 'EX', seen_ttl_s)
    local fields = {}
    for k, v in pairs(cjson.decode(record)) do
      fields[#fields + 1] = k
      fields[#fields + 1] = v
    end
    redis.call('hset', job, unpack(fields))
    redis.call('expire', job, job_ttl_s)
    redis.call('zadd', due, due_at, job_id)
    out[#out + 1] = 1
  end
end
return out
