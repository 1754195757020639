-- lane_pop_done: the step last looked at is popped from its chat's lane when it is still the
-- lane's head and all its receipts are terminal (or gone: expired, nothing to send). Run by the
-- lane's lease holder (the only one that pops a lane), before its next look.
-- Keys of one chat: KEYS[1]; of the step's deliveries: KEYS[2...].
-- KEYS[1] lane: the chat's lane (list of steps)
-- KEYS[2...] receipts: the step's receipts (one, or an album's)
-- ARGV[1] step: the step's id (its first delivery's)
-- ARGV[2...] terminal: the states a delivery never leaves (states.py DELIVERY_OVER)
-- Returns 1 when popped, else 0.
local lane = KEYS[1]
local receipts = {unpack(KEYS, 2)}
local step = ARGV[1]
local terminal_states = {unpack(ARGV, 2)}

local terminal = {}
for _, st in ipairs(terminal_states) do terminal[st] = true end
if redis.call('lindex', lane, 0) ~= step then return 0 end
for _, receipt in ipairs(receipts) do
  local st = redis.call('hget', receipt, 'state')
  if st and not terminal[st] then return 0 end
end
redis.call('lpop', lane)
return 1
