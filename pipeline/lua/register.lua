-- Register a worker incarnation with a lease deadline. Nothing else registers a worker:
-- a worker that was reaped learns it on its next contact and registers anew under a new id.
-- A retry (the first reply was lost) finds its own info stored and succeeds; any other
-- registration of an id that exists is refused.
-- KEYS: workers, worker_info, control
-- ARGV: worker, info JSON, default lease ms
-- Returns {'ok' or 'exists', lease ms}.
local lease = tonumber(redis.call('HGET', KEYS[3], 'lease_ms')) or tonumber(ARGV[3])
if redis.call('ZADD', KEYS[1], 'NX', now_ms() + lease, ARGV[1]) == 0 then
  if redis.call('HGET', KEYS[2], ARGV[1]) == ARGV[2] then return {'ok', lease} end
  return {'exists', lease}
end
redis.call('HSET', KEYS[2], ARGV[1], ARGV[2])
return {'ok', lease}
