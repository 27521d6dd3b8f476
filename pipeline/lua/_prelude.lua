-- Prepended to every script (pipeline/scripts.py): server time, and a group's history.

local function now_ms()
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end

-- A group's history is one HASH field: a line "ms event who detail" per event, the
-- oldest lines cut once it passes HISTORY_BYTES. `rollout inspect` shows it; the claim
-- script reads it to say who held a group it dead-letters.
local HISTORY_BYTES = 2048

local function record(history, gid, now, event, who, detail)
  local line = now .. ' ' .. event .. ' ' .. (who ~= '' and who or '-')
  if detail and detail ~= '' then line = line .. ' ' .. detail end
  local text = redis.call('HGET', history, gid)
  text = text and (text .. '\n' .. line) or line
  if #text > HISTORY_BYTES then
    local cut = string.find(text, '\n', #text - HISTORY_BYTES, true)
    if cut then text = string.sub(text, cut + 1) end
  end
  redis.call('HSET', history, gid, text)
end

-- The formula of pipeline/control.py:staleness_limit (AReaL pacing); a test checks they agree.
local function staleness_limit(max_staleness, version, batch_size)
  return (max_staleness + version + 1) * batch_size
end

-- The server time for the scripts that set or judge lease deadlines (register, heartbeat,
-- reap), after acting on what the server's own evidence says happened since the last of
-- them. The beats hash keeps `seen_ms` (the latest server time such a script saw) and
-- `server` (the run id of the server process that saw it); a hash of its own, so a
-- worker's ACL user writes it and never the control hash.
--   * Another server answers now (a restart: a new run id; a failover: the promoted
--     replica's): nobody could renew through that outage, so every deadline moves
--     to at least a lease from now (a grace); live workers renew before anyone reaps, the
--     dead are reaped one lease later. With nothing recorded yet, a server up for less than
--     a lease counts as restarted.
--   * The clock went back (an NTP step, a failover to a replica whose clock is behind):
--     every deadline moves back by as much, so nobody is reaped later than the lease says.
-- A silence alone (the only worker died, nobody renewed for a while) is no evidence: the
-- dead are reaped on time. Returns the server time and whether a grace was given.
local function lease_clock(workers, beats, lease)
  local now = now_ms()
  local info = redis.call('INFO', 'server')
  local server = string.match(info, 'run_id:(%x+)')
  local last = redis.call('HMGET', beats, 'seen_ms', 'server')
  local seen, known = tonumber(last[1]), last[2]
  if seen and now < seen then
    local back = seen - now
    local rows = redis.call('ZRANGE', workers, 0, -1, 'WITHSCORES')
    for i = 1, #rows, 2 do
      redis.call('ZADD', workers, 'XX', tonumber(rows[i + 1]) - back, rows[i])
    end
    redis.call('HINCRBY', beats, 'clock_back_ms', back)
  end
  local graced = false
  if known ~= server then
    if known or tonumber(string.match(info, 'uptime_in_seconds:(%d+)')) * 1000 <= lease then
      for _, w in ipairs(redis.call('ZRANGEBYSCORE', workers, '-inf', '(' .. (now + lease))) do
        redis.call('ZADD', workers, 'XX', now + lease, w)
      end
      graced = true
    end
    redis.call('HSET', beats, 'server', server)
  end
  redis.call('HSET', beats, 'seen_ms', now)
  return now, graced
end
