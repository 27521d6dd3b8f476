-- Extend a registered worker's lease and record its self-description. It never registers
-- a worker: one that was reaped is told so (and must cancel its work and register anew).
-- Through the lease clock (prelude): after a restart or a failover every worker gets a
-- grace; after a clock step back every deadline is rebased.
-- KEYS: workers, worker_info, control, beats
-- ARGV: worker, info JSON, default lease ms
-- Returns {'ok' or 'reaped', paused (0/1), weight_version, lease ms, version clock ('' = engine)}.
local ctl = redis.call('HMGET', KEYS[3], 'paused', 'weight_version', 'lease_ms', 'version_clock')
local lease = tonumber(ctl[3]) or tonumber(ARGV[3])
local paused, version, clock = ctl[1] == '1' and 1 or 0, tonumber(ctl[2]) or 0, ctl[4] or ''
local now = lease_clock(KEYS[1], KEYS[4], lease)
if not redis.call('ZSCORE', KEYS[1], ARGV[1]) then return {'reaped', paused, version, lease, clock} end
redis.call('ZADD', KEYS[1], 'XX', now + lease, ARGV[1])
redis.call('HSET', KEYS[2], ARGV[1], ARGV[2])
return {'ok', paused, version, lease, clock}
