-- send_order_stamp: the next number of a chat's `courier.delivery.send` messages (the publisher's side).
-- Keys of one chat: KEYS[1].
-- KEYS[1] order: the chat's send order hash (`issued`, `next`)
-- ARGV[1] ttl_s: how long the record outlives the chat's last send
-- Returns the number stamped.
local order = KEYS[1]
local ttl_s = ARGV[1]

local n = redis.call('hincrby', order, 'issued', 1)
if n == 1 then redis.call('hset', order, 'next', 1) end
redis.call('expire', order, ttl_s)
return n
