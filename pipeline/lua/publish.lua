-- Publish a group a worker finished, only if that worker still holds it: a worker
-- that was reaped (presumed dead) cannot publish afterwards.
-- KEYS: inflight, payloads, target stream (results, requeue or dead), stats, admitted
--       and, for results only: the staged payload key, the result payload key
-- ARGV: group id, encoded group ('' when staged), counter to increment, error text ('' for none)
-- Results entries carry only the group id; the payload, staged with a plain SET, is
-- renamed into its result key. Redis would copy a large argument into Lua (about
-- 1.6 us per KB, more than all the rest of a publish), a RENAME moves a pointer.
-- Returns the new stream entry id, or false when the worker no longer holds it.
local staged = #KEYS == 7
if staged and redis.call('EXISTS', KEYS[6]) == 0 then
  return redis.error_reply('publish: staged payload ' .. KEYS[6] .. ' is missing')
end
if redis.call('SREM', KEYS[1], ARGV[1]) == 0 then
  if staged then redis.call('DEL', KEYS[6]) end
  return false
end
redis.call('HDEL', KEYS[2], ARGV[1])
-- A dead letter stops counting against the staleness budget; a retry admits it anew.
if ARGV[3] == 'dead' then redis.call('HDEL', KEYS[5], ARGV[1]) end
local id
if staged then
  redis.call('RENAME', KEYS[6], KEYS[7])
  redis.call('PERSIST', KEYS[7])
  id = redis.call('XADD', KEYS[3], '*', 'gid', ARGV[1])
elseif ARGV[4] ~= '' then
  id = redis.call('XADD', KEYS[3], '*', 'gid', ARGV[1], 'data', ARGV[2], 'error', ARGV[4])
else
  id = redis.call('XADD', KEYS[3], '*', 'gid', ARGV[1], 'data', ARGV[2])
end
redis.call('HINCRBY', KEYS[4], ARGV[3], 1)
return id
