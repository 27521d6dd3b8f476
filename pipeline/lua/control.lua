-- Write control state (pipeline/control.py: settings, pause, weight version, draining, release
-- policy) for the writer of pipeline/writer.py. A trainer session's write is fenced: refused
-- once a newer session started, like its reads and commits. A writer without a session (an
-- operator's command, a trainer before its first batch) is not fenced, and its write is
-- recorded (`unfenced_write` in the trainer hash: server ms, who, what). The weight version
-- only moves forward unless the write says it is a rollback (a trainer resumed from an
-- earlier checkpoint, `rollout resume --rollback`). With the restart flag, the staleness
-- budget restarts at the version written (budget_base = committed - version * batch size).
-- KEYS: control, trainer, stats
-- ARGV: session id ('' unfenced), who, what, version rule ('forward' or 'rollback'), restart
--       budget ('1' or '0'), n, then n field/value pairs to set, then fields to remove
-- Returns the weight version recorded after the write, or an error starting with FENCED or
-- BEHIND (BEHIND <version asked> <version recorded>).
local refused = fence_error(KEYS[2], ARGV[1], ARGV[2])
if refused then return refused end
local n = tonumber(ARGV[6])
local fields, asked = {}, nil
for i = 7, 6 + 2 * n, 2 do
  fields[#fields + 1] = ARGV[i]
  fields[#fields + 1] = ARGV[i + 1]
  if ARGV[i] == 'weight_version' then asked = tonumber(ARGV[i + 1]) end
end
local recorded = tonumber(redis.call('HGET', KEYS[1], 'weight_version')) or 0
if asked and asked < recorded and ARGV[4] ~= 'rollback' then
  return redis.error_reply('BEHIND ' .. asked .. ' ' .. recorded)
end
if asked and ARGV[5] == '1' then
  local batch = tonumber(redis.call('HGET', KEYS[1], 'batch_size')) or 0
  for i = 1, #fields, 2 do
    if fields[i] == 'batch_size' then batch = tonumber(fields[i + 1]) end
  end
  local committed = tonumber(redis.call('HGET', KEYS[3], 'committed')) or 0
  fields[#fields + 1] = 'budget_base'
  fields[#fields + 1] = committed - asked * batch
end
if #fields > 0 then redis.call('HSET', KEYS[1], unpack(fields)) end
if #ARGV > 6 + 2 * n then redis.call('HDEL', KEYS[1], unpack(ARGV, 7 + 2 * n)) end
if ARGV[1] == '' then redis.call('HSET', KEYS[2], 'unfenced_write', now_ms() .. ' ' .. ARGV[2] .. ' ' .. ARGV[3]) end
return asked or recorded
