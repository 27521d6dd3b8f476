-- Register a worker incarnation with a lease deadline. Nothing else registers a worker:
-- a worker that was reaped learns it on its next contact and registers anew under a new id.
-- KEYS: workers, worker_info, control
-- ARGV: worker, info JSON, default lease ms
-- Returns {'ok' or 'exists', lease ms}.
local lease = tonumber(redis.call('HGET', KEYS[3], 'lease_ms')) or tonumber(ARGV[3])
if redis.call('ZADD', KEYS[1], 'NX', now_ms() + lease, ARGV[1]) == 0 then return {'exists', lease} end
redis.call('HSET', KEYS[2], ARGV[1], ARGV[2])
return {'ok', lease}
