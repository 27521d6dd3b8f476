-- Push a chunk of dataset rows, advancing the dataset cursor in the same step so a
-- (dataset, epoch, row) is never pushed twice, even by two producers at once.
-- KEYS: prompts, payloads, stats, dataset, dead
-- ARGV: cursor field ('' for none: no cursor), expected cursor, then triples
--       (destination, group id, payload) with destination 'prompt' or an error text for a
--       row that goes to dead letters.
-- A group id already queued or in flight is not pushed again (one copy per group id).
-- Returns {'ok', new cursor, duplicates} or {'moved', actual cursor} when another producer
-- got there first. Every refusal Redis could make partway (a key of the namespace holding
-- another type, a command the user may not send) is checked before the first write, so a
-- refused push leaves nothing behind; out of memory refuses only a script's first write.
local refused = type_error(KEYS[1], 'list')
  or type_error(KEYS[2], 'hash')
  or type_error(KEYS[3], 'hash')
  or type_error(KEYS[4], 'hash')
  or type_error(KEYS[5], 'stream')
if refused then return refused end
local prompts, dead = false, false
for i = 3, #ARGV, 3 do
  if ARGV[i] == 'prompt' then prompts = true else dead = true end
end
refused = (prompts and (permission_error('HSETNX', KEYS[2]) or permission_error('RPUSH', KEYS[1])))
  or (dead and permission_error('XADD', KEYS[5]))
  or permission_error('HINCRBY', KEYS[3])
  or (ARGV[1] ~= '' and permission_error('HSET', KEYS[4]))
if refused then return refused end
local cursor = 0
if ARGV[1] ~= '' then
  cursor = tonumber(redis.call('HGET', KEYS[4], ARGV[1]) or '0')
  if cursor ~= tonumber(ARGV[2]) then return {'moved', cursor} end
end
local rows, pushed, dead, duplicates = 0, 0, 0, 0
for i = 3, #ARGV, 3 do
  local dest, gid, payload = ARGV[i], ARGV[i + 1], ARGV[i + 2]
  if dest == 'prompt' then
    if redis.call('HSETNX', KEYS[2], gid, payload) == 1 then
      redis.call('RPUSH', KEYS[1], gid)
      pushed = pushed + 1
    else
      duplicates = duplicates + 1
    end
  else
    redis.call('XADD', KEYS[5], '*', 'gid', gid, 'data', payload, 'error', dest, 'reason', 'bad_row')
    dead = dead + 1
  end
  rows = rows + 1
end
if ARGV[1] ~= '' then
  cursor = cursor + rows
  redis.call('HSET', KEYS[4], ARGV[1], cursor)
end
if pushed + dead > 0 then redis.call('HINCRBY', KEYS[3], 'pushed', pushed + dead) end
if dead > 0 then
  redis.call('HINCRBY', KEYS[3], 'dead', dead)
  redis.call('HINCRBY', KEYS[3], 'dead_bad_row', dead)
end
return {'ok', cursor, duplicates}
