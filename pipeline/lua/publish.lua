-- Publish a group a worker finished, only if the worker still holds it under this claim's
-- token: a worker that was reaped, or whose claim was given back, cannot publish it.
-- The group's in-flight checkpoint goes with its payload (prelude: drop_payload).
-- KEYS: inflight, payloads, results|requeue|dead, stats, admitted, claims, history, checkpoints,
--       checkpoint_records, staged, result
-- (KEYS[3] is the target stream; the staged and the result payload keys come for results only)
-- ARGV: group id, token, encoded group ('' when staged), place, error text ('' for none), worker,
--       a dead letter's reason category ('' for none: counted under `dead` only, else also `dead_<reason>`)
-- Results entries carry the group id and token; the payload, staged with a plain SET in
-- the same MULTI (Queue.publish_many), is renamed into its result key: Redis would copy a
-- large argument into Lua (about 1.6 us per KB, more than all the rest of a publish), a
-- RENAME moves a pointer.
-- Returns {'ok', entry id}, {'already'} (a retry of a publish that went through) or {'refused'}.
local gid, token, place, worker, reason = ARGV[1], ARGV[2], ARGV[4], ARGV[6], ARGV[7] or ''
local staged = #KEYS == 11
local done = 'published ' .. worker .. ' ' .. place .. ' ' .. token
if redis.call('HGET', KEYS[1], gid) ~= token then
  if staged then redis.call('DEL', KEYS[10]) end
  local history = redis.call('HGET', KEYS[7], gid)
  -- Whole lines only: token w:1 must not find the publish of w:10.
  if history and string.find(history .. '\n', done .. '\n', 1, true) then return {'already'} end
  return {'refused'}
end
if staged and redis.call('EXISTS', KEYS[10]) == 0 then
  return redis.error_reply('publish: staged payload ' .. KEYS[10] .. ' is missing')
end
redis.call('HDEL', KEYS[1], gid)
drop_payload(KEYS[2], KEYS[8], KEYS[9], gid)
if place == 'dead' then
  -- A dead letter stops counting against the staleness budget; a retry admits it anew.
  redis.call('HDEL', KEYS[5], gid)
  redis.call('HDEL', KEYS[6], gid)
elseif place == 'requeue' then
  -- Interrupted by a pause, or handed on by a worker whose engines are down: not the group's doing.
  if redis.call('HINCRBY', KEYS[6], gid, -1) <= 0 then redis.call('HDEL', KEYS[6], gid) end
else
  redis.call('HDEL', KEYS[6], gid)  -- finished: a later restart (too stale) starts a new count
end
local id
if staged then
  redis.call('RENAME', KEYS[10], KEYS[11])
  redis.call('PERSIST', KEYS[11])
  id = redis.call('XADD', KEYS[3], '*', 'gid', gid, 'tok', token)
elseif place == 'dead' and reason ~= '' then
  id = redis.call('XADD', KEYS[3], '*', 'gid', gid, 'data', ARGV[3], 'error', ARGV[5], 'reason', reason)
  redis.call('HINCRBY', KEYS[4], 'dead_' .. reason, 1)
elseif ARGV[5] ~= '' then
  id = redis.call('XADD', KEYS[3], '*', 'gid', gid, 'data', ARGV[3], 'error', ARGV[5])
else
  id = redis.call('XADD', KEYS[3], '*', 'gid', gid, 'data', ARGV[3])
end
redis.call('HINCRBY', KEYS[4], place, 1)
record(KEYS[7], gid, now_ms(), 'published', worker, place .. ' ' .. token)
return {'ok', id}
