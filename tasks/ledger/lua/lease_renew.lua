-- lease_renew: extend a lease (or a lock) its holder still holds.
-- KEYS[1] lease: the lease or lock key (a string whose value is its holder's token)
-- ARGV[1] token: the holder's token
-- ARGV[2] ttl_s: the TTL it gets again, in seconds
-- Returns 1 when renewed, 0 when it lapsed or another holds it.
local lease = KEYS[1]
local token = ARGV[1]
local ttl_s = ARGV[2]

if redis.call('get', lease) == token then
  return redis.call('expire', lease, ttl_s)
end
return 0
