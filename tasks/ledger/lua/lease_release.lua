-- lease_release: release a lease (or a lock) only when the caller holds it (compare-and-delete).
-- KEYS[1] lease: the lease or lock key (a string whose value is its holder's token)
-- ARGV[1] token: the caller's token
-- Returns 1 when released, 0 when it was not the caller's.
local lease = KEYS[1]
local token = ARGV[1]

if redis.call('get', lease) == token then
  return redis.call('del', lease)
end
return 0
