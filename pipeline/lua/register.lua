-- Register a worker incarnation with a lease deadline. Nothing else registers a worker:
-- a worker that was reaped learns it on its next contact and registers anew under a new id.
-- A retry (the first reply was lost) finds its own registration stored and succeeds: the
-- same info, or info with the same `registration` nonce (a heartbeat may have rewritten
-- the info in between); any other registration of an id that exists is refused.
-- The deadline is set on the lease clock (prelude), so a clock step is rebased before it.
-- KEYS: workers, worker_info, control, beats
-- ARGV: worker, info JSON, default lease ms
-- Returns {'ok' or 'exists', lease ms}.
local lease = tonumber(redis.call('HGET', KEYS[3], 'lease_ms')) or tonumber(ARGV[3])
local now = lease_clock(KEYS[1], KEYS[4], lease)
local function registration(info)
  local ok, decoded = pcall(cjson.decode, info or '')
  return ok and type(decoded) == 'table' and type(decoded.registration) == 'string' and decoded.registration or nil
end
if redis.call('ZADD', KEYS[1], 'NX', now + lease, ARGV[1]) == 0 then
  local stored = redis.call('HGET', KEYS[2], ARGV[1])
  if stored == ARGV[2] then return {'ok', lease} end
  local mine = registration(ARGV[2])
  if mine and registration(stored) == mine then return {'ok', lease} end
  return {'exists', lease}
end
redis.call('HSET', KEYS[2], ARGV[1], ARGV[2])
return {'ok', lease}
