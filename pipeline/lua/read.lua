-- Deliver up to ARGV[4] new results entries to the current trainer session (0: none, only
-- the fence check); a fenced session gets an error instead, so it can never take entries
-- it would strand.
-- KEYS: results, trainer
-- ARGV: consumer group, consumer, session id, count
-- Returns {newest entry id ('0-0' when empty), entries pending for this consumer, then
-- the entries as XREADGROUP gives them}; the caller blocks (XREAD) outside when none came.
local refused = fence_error(KEYS[2], ARGV[3], ARGV[2])
if refused then return refused end
-- COUNT 0 would mean no limit: a count of 0 only confirms the session.
local reply = nil
if tonumber(ARGV[4]) > 0 then
  reply = redis.call('XREADGROUP', 'GROUP', ARGV[1], ARGV[2], 'COUNT', ARGV[4], 'STREAMS', KEYS[1], '>')
end
local pending = 0
local summary = redis.call('XPENDING', KEYS[1], ARGV[1])
for _, row in ipairs(summary[4] or {}) do
  if row[1] == ARGV[2] then pending = tonumber(row[2]) end
end
local newest = redis.call('XREVRANGE', KEYS[1], '+', '-', 'COUNT', 1)
local out = {newest[1] and newest[1][1] or '0-0', pending}
if reply then
  for _, entry in ipairs(reply[1][2]) do out[#out + 1] = entry end
end
return out
