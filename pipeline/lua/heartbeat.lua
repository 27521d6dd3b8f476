-- Record a worker's heartbeat (server time) and its self-description.
-- KEYS: workers, worker_info, control
-- ARGV: worker, info JSON
-- Returns {was_registered (0: new or reaped meanwhile), paused, weight_version}.
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local added = redis.call('ZADD', KEYS[1], now, ARGV[1])
redis.call('HSET', KEYS[2], ARGV[1], ARGV[2])
local ctl = redis.call('HMGET', KEYS[3], 'paused', 'weight_version')
return {1 - added, ctl[1] == '1' and 1 or 0, tonumber(ctl[2]) or 0}
