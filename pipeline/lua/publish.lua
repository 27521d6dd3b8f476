-- Publish a group a worker finished, only if that worker still holds it: a worker
-- that was reaped (presumed dead) cannot publish afterwards.
-- KEYS: inflight, payloads, target stream (results, requeue or dead), stats, admitted
-- ARGV: group id, encoded group, counter to increment, error text ('' for none)
-- Returns the new stream entry id, or false when the worker no longer holds it.
if redis.call('SREM', KEYS[1], ARGV[1]) == 0 then return false end
redis.call('HDEL', KEYS[2], ARGV[1])
-- A dead letter stops counting against the staleness budget; a retry admits it anew.
if ARGV[3] == 'dead' then redis.call('HDEL', KEYS[5], ARGV[1]) end
local id
if ARGV[4] ~= '' then
  id = redis.call('XADD', KEYS[3], '*', 'gid', ARGV[1], 'data', ARGV[2], 'error', ARGV[4])
else
  id = redis.call('XADD', KEYS[3], '*', 'gid', ARGV[1], 'data', ARGV[2])
end
redis.call('HINCRBY', KEYS[4], ARGV[3], 1)
return id
