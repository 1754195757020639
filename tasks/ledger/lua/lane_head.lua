-- lane_head: what the lane's lease holder does with the step at its lane's head, decided in one
-- step (tasks/delivery/lanes.py `_look`):
-- - a head that is one file still being extracted (its receipt names its extraction queue and
--   has no result yet): the lane's due time set and the lease released together (an extraction
--   that ends after it finds the lease free and drives the lane itself): {'extracting'};
-- - a lease just taken (the caller passes the chat's gate then) clears that gate when it still
--   says a send is on its way (left by a holder that died mid-send: a live one would still hold
--   the lease);
-- - one delivery ready to send (not an album, not terminal) with an `owner`: its send lock taken
--   and, when taken, its attempt counted and its state sending (as tasks/delivery/sendlock.py `begin_send`).
-- Keys of one chat (`target`'s): KEYS[1], KEYS[3], KEYS[6]; of the head delivery: KEYS[4], KEYS[5];
-- courier-wide: KEYS[2].
-- KEYS[1] lane: the chat's lane (list of steps)
-- KEYS[2] due: the lane due set
-- KEYS[3] lease: the lane's lease
-- KEYS[4] receipt: the head step's first receipt
-- KEYS[5] lock: the head step's send lock
-- KEYS[6?] gate: the chat's send gate, passed when the caller has just taken the lease (absent:
--   the lease was held already, or the platform paces no chat)
-- ARGV[1] target: the chat (the lane's member in `due`)
-- ARGV[2] token: the caller's lease token
-- ARGV[3] head: the head step's id as the caller read it
-- ARGV[4] extract_due_at: the lane's due time while its head is extracted
-- ARGV[5] owner: the send lock's owner ('': take no lock)
-- ARGV[6] lock_ttl_s: the send lock's TTL
-- ARGV[7] dead_send: how a gate left by a sender that died mid-send starts
-- ARGV[8] sending: the sending state (states.py)
-- ARGV[9] extraction_ok: the receipt's `extraction` once extracted
-- ARGV[10] extraction_failed: the receipt's `extraction` once failed for good
-- ARGV[11...] terminal: the states a delivery never leaves (states.py DELIVERY_OVER)
-- Returns {'moved'} (the head is no longer `head`: look again), {'extracting'}, or {'head',
-- receipt (HGETALL, as it was)} and, with an owner and one delivery to send, its lock taken
-- (1|0) and its attempt number (0: not taken).
local lane = KEYS[1]
local due = KEYS[2]
local lease = KEYS[3]
local receipt = KEYS[4]
local lock = KEYS[5]
local gate = KEYS[6]
local target = ARGV[1]
local token = ARGV[2]
local head = ARGV[3]
local extract_due_at = ARGV[4]
local owner = ARGV[5]
local lock_ttl_s = ARGV[6]
local dead_send = ARGV[7]
local sending = ARGV[8]
local extraction_ok = ARGV[9]
local extraction_failed = ARGV[10]
local terminal_states = {unpack(ARGV, 11)}

if redis.call('lindex', lane, 0) ~= head then return {'moved'} end
local terminal = {}
for _, st in ipairs(terminal_states) do terminal[st] = true end
local rec = redis.call('hgetall', receipt)
local f = {}
for i = 1, #rec, 2 do f[rec[i]] = rec[i + 1] end
local final = f['state'] ~= nil and terminal[f['state']] == true
if f['queue'] and not f['album'] and not final and f['extraction'] ~= extraction_ok
    and f['extraction'] ~= extraction_failed then
  redis.call('zadd', due, extract_due_at, target)
  if redis.call('get', lease) == token then redis.call('del', lease) end
  return {'extracting'}
end
if gate then
  local g = redis.call('get', gate)
  if g and string.sub(g, 1, #dead_send) == dead_send then redis.call('del', gate) end
end
if owner ~= '' and #rec > 0 and not f['album'] and not final then
  if not redis.call('set', lock, owner, 'NX', 'EX', lock_ttl_s) then return {'head', rec, 0, 0} end
  local n = redis.call('hincrby', receipt, 'attempts', 1)
  redis.call('hset', receipt, 'state', sending)
  return {'head', rec, 1, n}
end
return {'head', rec}
