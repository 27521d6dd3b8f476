-- Extend a registered worker's lease and record its self-description. It never registers
-- a worker: one that was reaped is told so (and must cancel its work and register anew).
-- The first after a silence longer than a lease gives every worker a grace (prelude).
-- KEYS: workers, worker_info, control, beats
-- ARGV: worker, info JSON, default lease ms
-- Returns {'ok' or 'reaped', paused (0/1), weight_version, lease ms, version clock ('' = engine)}.
local ctl = redis.call('HMGET', KEYS[3], 'paused', 'weight_version', 'lease_ms', 'version_clock')
local lease = tonumber(ctl[3]) or tonumber(ARGV[3])
local paused, version, clock = ctl[1] == '1' and 1 or 0, tonumber(ctl[2]) or 0, ctl[4] or ''
local now = now_ms()
grace_after_silence(KEYS[1], KEYS[4], now, lease)
if not redis.call('ZSCORE', KEYS[1], ARGV[1]) then return {'reaped', paused, version, lease, clock} end
redis.call('ZADD', KEYS[1], 'XX', now + lease, ARGV[1])
redis.call('HSET', KEYS[2], ARGV[1], ARGV[2])
return {'ok', paused, version, lease, clock}
