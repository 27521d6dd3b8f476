-- Give back groups a live worker holds in Redis but has no task for (reconciliation), each
-- only if it still holds it under the given token. The claims count: whatever lost the task
-- may be the group's doing, and a group that keeps doing it must reach max_claims.
-- KEYS: inflight, prompts, history, stats
-- ARGV: worker, then pairs: group id, token
-- Returns how many groups went back.
local now = now_ms()
local n = 0
for i = 2, #ARGV, 2 do
  local gid, token = ARGV[i], ARGV[i + 1]
  if redis.call('HGET', KEYS[1], gid) == token then
    redis.call('HDEL', KEYS[1], gid)
    redis.call('LPUSH', KEYS[2], gid)
    record(KEYS[3], gid, now, 'reconciled', ARGV[1], token)
    n = n + 1
  end
end
if n > 0 then redis.call('HINCRBY', KEYS[4], 'reconciled', n) end
return n
