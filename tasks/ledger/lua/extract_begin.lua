-- extract_begin: the start of an extraction (tasks/turn/extract.py `run`). Reads the three receipt
-- fields it looks at (not the whole receipt: the spec is all the stage reads).
-- KEYS[1] receipt: the delivery's receipt (hash)
-- KEYS[2] lease: the extraction stage's lease
-- KEYS[3] due: the extraction due set
-- ARGV[1] did: the delivery id
-- ARGV[2] token: the lease token
-- ARGV[3] ttl_s: the lease TTL
-- ARGV[4] due_at: the due time while it runs
-- ARGV[5] extraction_ok: the receipt's `extraction` once extracted
-- ARGV[6] extraction_failed: the receipt's `extraction` once failed for good
-- ARGV[7...] terminal: the states after which an extraction has nothing to do (states.py)
-- Returns {what, spec}: `gone` (no receipt or no spec), `done` (extracted, failed or final
-- already; both clear the due time), `busy` (a live worker holds the lease), or `run`: the
-- lease taken and the due time set.
local receipt = KEYS[1]
local lease = KEYS[2]
local due = KEYS[3]
local did = ARGV[1]
local token = ARGV[2]
local ttl_s = ARGV[3]
local due_at = ARGV[4]
local extraction_ok = ARGV[5]
local extraction_failed = ARGV[6]
local terminal = {unpack(ARGV, 7)}

local f = redis.call('hmget', receipt, 'spec', 'extraction', 'state')
local spec, extraction, state = f[1], f[2], f[3]
local done = not spec or extraction == extraction_ok or extraction == extraction_failed
for _, st in ipairs(terminal) do if state == st then done = true end end
if done then
  redis.call('zrem', due, did)
  return {spec and 'done' or 'gone', spec}
end
if not redis.call('set', lease, token, 'NX', 'EX', ttl_s) then return {'busy', spec} end
redis.call('zadd', due, due_at, did)
return {'run', spec}
