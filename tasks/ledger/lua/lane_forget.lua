-- lane_forget: a lane found empty is forgotten (its due time) and its lease released, in the
-- same step as the check that it is still empty: a step appended meanwhile (its wake-up found
-- the lease held) is never left without a drive or a due time. With `pop`, the next lane of
-- the ready set is popped too (the drive goes on with it).
-- Keys of one chat (`target`'s): KEYS[1], KEYS[3]; KEYS[2] and KEYS[4] are courier-wide.
-- KEYS[1] lane: the chat's lane (list of steps)
-- KEYS[2] due: the lane due set
-- KEYS[3] lease: the lane's lease
-- KEYS[4] ready: the ready set (lanes woken while enough drives were waiting)
-- ARGV[1] target: the chat (the lane's member in `due`)
-- ARGV[2] token: the caller's lease token
-- ARGV[3] pop: '1' to pop the next lane of the ready set
-- Returns {'again'} when the lane is not empty (look again: the lease is kept); else {'empty'},
-- or with `pop` {'empty', the next lane ('' when the set is empty)}.
local lane = KEYS[1]
local due = KEYS[2]
local lease = KEYS[3]
local ready = KEYS[4]
local target = ARGV[1]
local token = ARGV[2]
local pop = ARGV[3]

if redis.call('llen', lane) > 0 then return {'again'} end
redis.call('zrem', due, target)
if redis.call('get', lease) == token then redis.call('del', lease) end
if pop ~= '1' then return {'empty'} end
local nxt = redis.call('zpopmin', ready)[1]
return {'empty', nxt or ''}
