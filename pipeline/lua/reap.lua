-- Return a worker's in-flight groups to the head of the prompt list and forget the worker.
--   expired: only if its lease deadline has passed (a crash or a stall: the claims count)
--   leave:   unconditionally, the worker's own hand-back on shutdown (the claims do not count)
-- KEYS: workers, inflight, prompts, worker_info, stats, claims, history, last_claim, reaped, isolated,
--       control, holders, beats
-- ARGV: worker ('' with mode expired: a reaper that found nobody expired, only the lease
--       clock of the prelude), mode, default lease ms
-- Returns the number of groups returned, or -1 when the lease has not expired (or a restart
-- or failover has just given every worker a grace: prelude, lease_clock).
local worker, mode = ARGV[1], ARGV[2]
local now = lease_clock(KEYS[1], KEYS[13], tonumber(redis.call('HGET', KEYS[11], 'lease_ms')) or tonumber(ARGV[3]))
if mode == 'expired' and worker == '' then return 0 end
local deadline = redis.call('ZSCORE', KEYS[1], worker)
if mode == 'expired' and deadline and tonumber(deadline) >= now then return -1 end
local gids = redis.call('HKEYS', KEYS[2])
local event = mode == 'leave' and 'handed_back' or 'reaped'
for _, gid in ipairs(gids) do
  redis.call('LPUSH', KEYS[3], gid)
  if mode == 'leave' and redis.call('HINCRBY', KEYS[6], gid, -1) <= 0 then redis.call('HDEL', KEYS[6], gid) end
  record(KEYS[7], gid, now, event, worker)
end
redis.call('DEL', KEYS[2])
redis.call('SREM', KEYS[12], worker)
redis.call('ZREM', KEYS[1], worker)
redis.call('HDEL', KEYS[4], worker)
redis.call('HDEL', KEYS[8], worker)
redis.call('HDEL', KEYS[10], worker)
if #gids > 0 then redis.call('HINCRBY', KEYS[5], event, #gids) end
if deadline or #gids > 0 then
  local overdue = deadline and math.max(0, now - tonumber(deadline)) or 0
  redis.call('LPUSH', KEYS[9], cjson.encode({worker = worker, at_ms = now, groups = #gids, how = event,
                                              overdue_ms = overdue}))
  redis.call('LTRIM', KEYS[9], 0, 49)
end
return #gids
