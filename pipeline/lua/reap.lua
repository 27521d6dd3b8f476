-- Return a worker's in-flight groups to the head of the prompt list if its last
-- heartbeat is older than the lease (ARGV[2] = 0 reaps unconditionally: a worker
-- leaving cleanly), and forget the worker.
-- KEYS: workers, inflight, prompts, worker_info, stats
-- ARGV: worker, lease_ms
-- Returns the number of groups returned, or -1 when the worker is alive after all.
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local seen = redis.call('ZSCORE', KEYS[1], ARGV[1])
local lease = tonumber(ARGV[2])
if seen and lease > 0 and now - tonumber(seen) < lease then return -1 end
local gids = redis.call('SMEMBERS', KEYS[2])
for i = 1, #gids do redis.call('LPUSH', KEYS[3], gids[i]) end
redis.call('DEL', KEYS[2])
redis.call('ZREM', KEYS[1], ARGV[1])
redis.call('HDEL', KEYS[4], ARGV[1])
if #gids > 0 then redis.call('HINCRBY', KEYS[5], 'reaped', #gids) end
return #gids
