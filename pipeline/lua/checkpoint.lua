-- Save the partial samples of groups one worker holds, each only under the token of the claim
-- that holds it: a worker whose claim was reaped, handed back or published cannot write the
-- checkpoint its group's next holder resumes from. Per group a write replaces the checkpoint
-- (full) or adds a record to it (append, to the records the writer saw: a checkpoint that
-- changed meanwhile asks for a full write). A retried write (its write id is the last one
-- stored) is recognised. A checkpoint is bounded: ARGV[2] records and ARGV[3] bytes at most.
-- KEYS: inflight, checkpoints, checkpoint_records, stats
-- ARGV: worker, max records, max bytes, then seven per group: group id, token, mode (full or
--       append), records before (append: the count the writer saw), response tokens held after
--       this write, write id, record
-- Returns one status per group: ok, already (this write went through before: a retry),
-- refused (not held under that token), resync (write it full), too_large (over a bound).
local max_records, max_bytes = tonumber(ARGV[2]), tonumber(ARGV[3])
if not max_records or not max_bytes or (#ARGV - 3) % 7 ~= 0 then
  return redis.error_reply('checkpoint: expected worker, max records, max bytes and 7 arguments per group')
end
for i = 4, #ARGV, 7 do
  local mode = ARGV[i + 2]
  if (mode ~= 'full' and mode ~= 'append') or not tonumber(ARGV[i + 3]) or not tonumber(ARGV[i + 4])
      or not string.match(ARGV[i + 1], '^%S+$') or not string.match(ARGV[i + 5], '^%S+$') then
    return redis.error_reply('checkpoint: bad arguments for group ' .. ARGV[i])
  end
end
local now = now_ms()
local out, written, refused = {}, 0, 0
for i = 4, #ARGV, 7 do
  local gid, token, mode, before, tokens, wid, record =
    ARGV[i], ARGV[i + 1], ARGV[i + 2], tonumber(ARGV[i + 3]), ARGV[i + 4], ARGV[i + 5], ARGV[i + 6]
  local status
  local header = redis.call('HGET', KEYS[2], gid)
  local count, size, last, times = 0, 0, '', ''
  if header then
    local c, b, w, ts = string.match(header, '^%S+ %S+ (%d+) (%d+) %d+ (%S+) ?(%S*)$')
    count, size, last, times = tonumber(c) or 0, tonumber(b) or 0, w or '', ts or ''
  end
  if redis.call('HGET', KEYS[1], gid) ~= token then
    status = 'refused'
  elseif last == wid then
    status = 'already'
  elseif mode == 'append' and (not header or count ~= before or count + 1 > max_records) then
    status = 'resync'
  elseif #record + (mode == 'append' and size or 0) > max_bytes then
    status = 'too_large'
  else
    if mode == 'full' then
      local fields = {}
      for k = 1, count do fields[k] = gid .. '\n' .. k end
      if #fields > 0 then redis.call('HDEL', KEYS[3], unpack(fields)) end
      count, size, times = 0, 0, ''
    end
    count, size = count + 1, size + #record
    times = times == '' and tostring(now) or (times .. ',' .. now)
    redis.call('HSET', KEYS[3], gid .. '\n' .. count, record)
    redis.call('HSET', KEYS[2], gid, table.concat({'c1', token, count, size, tokens, wid, times}, ' '))
    status = 'ok'
  end
  if status == 'ok' then written = written + 1 elseif status == 'refused' then refused = refused + 1 end
  out[#out + 1] = status
end
if written > 0 then redis.call('HINCRBY', KEYS[4], 'checkpoints', written) end
if refused > 0 then redis.call('HINCRBY', KEYS[4], 'checkpoints_refused', refused) end
return out
