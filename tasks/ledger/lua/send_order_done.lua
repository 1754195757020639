-- send_order_done: a numbered send registered (or gave up): the next number's turn.
-- `next` moves past the number, never back.
-- Keys of one chat: KEYS[1].
-- KEYS[1] order: the chat's send order hash (`issued`, `next`)
-- ARGV[1] seq: the number that registered
-- ARGV[2] ttl_s: how long the record outlives the chat's last send
-- Returns 1.
local order = KEYS[1]
local seq = tonumber(ARGV[1])
local ttl_s = ARGV[2]

local nxt = tonumber(redis.call('hget', order, 'next') or '0')
if seq >= nxt then redis.call('hset', order, 'next', seq + 1) end
redis.call('expire', order, ttl_s)
return 1
