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

-- A group's in-flight checkpoint (lua/checkpoint.lua, pipeline/checkpoints.py): a header in the
-- checkpoints hash, "<schema> <writer's token> <records> <bytes> <tokens> <write id> <ms,ms,...>",
-- and its records `gid\n1`..`gid\n<records>` in the checkpoint_records hash. It lives beside the
-- group's payload and never without it: a reap or a hand-back leaves both for the next claim,
-- and every script that deletes a payload does it with drop_payload, which deletes both.
local function checkpoint_count(header)
  return tonumber(string.match(header, '^%S+ %S+ (%d+) ')) or 0
end

local function drop_payload(payloads, checkpoints, records, gid)
  redis.call('HDEL', payloads, gid)
  local header = redis.call('HGET', checkpoints, gid)
  if not header then return end
  local fields = {}
  for k = 1, checkpoint_count(header) do fields[k] = gid .. '\n' .. k end
  if #fields > 0 then redis.call('HDEL', records, unpack(fields)) end
  redis.call('HDEL', checkpoints, gid)
end

-- A group's checkpoint as a claim hands it out: {header, record 1, ...}, or false for none.
local function checkpoint_of(checkpoints, records, gid)
  local header = redis.call('HGET', checkpoints, gid)
  if not header then return false end
  local fields = {}
  for k = 1, checkpoint_count(header) do fields[k] = gid .. '\n' .. k end
  local out = {header}
  if #fields > 0 then
    for _, record in ipairs(redis.call('HMGET', records, unpack(fields))) do out[#out + 1] = record or '' end
  end
  return out
end

-- The fence of every trainer write (pipeline/writer.py): a session id other than the
-- current trainer session's is refused, before the script writes anything. '' is a writer
-- without a session (an operator, a trainer before its first batch): not fenced.
-- Returns the error reply to return, or nil.
local function fence_error(trainer, session_id, consumer)
  if session_id == '' then return nil end
  local current = redis.call('HMGET', trainer, 'session_id', 'session')
  if current[1] == session_id then return nil end
  return redis.error_reply('FENCED trainer session ' .. consumer .. ' was replaced by session ' ..
                           tostring(current[2]))
end

-- A key of the namespace holding another type than the script writes (a key made by hand or
-- by another tool) is refused before the first write, naming it: a WRONGTYPE halfway through
-- would leave half a move. Returns the error reply to return, or nil.
local function type_error(key, kind)
  local found = redis.call('TYPE', key)['ok']
  if found == 'none' or found == kind then return nil end
  return redis.error_reply('WRONGTYPE ' .. key .. ' holds a ' .. found .. ', not a ' .. kind ..
                           ': it is not this pipeline\'s (delete or rename it)')
end

-- A command the caller's ACL user may not send on a key is refused before the first write
-- too, for scripts whose writes depend on their input (Redis 7 has redis.acl_check_cmd; 6.2
-- checks each call only as it comes). Returns the error reply to return, or nil.
local function permission_error(command, key)
  if not redis.acl_check_cmd or redis.acl_check_cmd(command, key) then return nil end
  return redis.error_reply('NOPERM this user may not run ' .. command .. ' on ' .. key)
end
