-- delivery_update_open: set receipt fields unless the delivery is already delivered or cancelled
-- (a redelivered extraction must not touch a finished receipt).
-- KEYS[1] receipt: the delivery's receipt (hash)
-- ARGV[1] delivered: the delivered state (states.py)
-- ARGV[2] cancelled: the cancelled state (states.py)
-- ARGV[3...] fields: field, value pairs
-- Returns 1 when set, 0 when the receipt was left alone.
local receipt = KEYS[1]
local delivered = ARGV[1]
local cancelled = ARGV[2]
local fields = {unpack(ARGV, 3)}

local st = redis.call('hget', receipt, 'state')
if st == delivered or st == cancelled then return 0 end
redis.call('hset', receipt, unpack(fields))
return 1
