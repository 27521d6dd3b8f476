-- Push a chunk of dataset rows, advancing the dataset cursor in the same step so a
-- (dataset, epoch, row) is never pushed twice, even by two producers at once.
-- KEYS: prompts, payloads, stats, dataset, dead
-- ARGV: cursor field, expected cursor, then triples (destination, group id, payload)
--       with destination 'prompt' or an error text for a row that goes to dead letters.
-- Returns {'ok', new cursor} or {'moved', actual cursor} when another producer got there first.
local cursor = tonumber(redis.call('HGET', KEYS[4], ARGV[1]) or '0')
if cursor ~= tonumber(ARGV[2]) then return {'moved', cursor} end
local pushed, dead = 0, 0
for i = 3, #ARGV, 3 do
  local dest, gid, payload = ARGV[i], ARGV[i + 1], ARGV[i + 2]
  if dest == 'prompt' then
    redis.call('HSET', KEYS[2], gid, payload)
    redis.call('RPUSH', KEYS[1], gid)
  else
    redis.call('XADD', KEYS[5], '*', 'gid', gid, 'data', payload, 'error', dest)
    dead = dead + 1
  end
  pushed = pushed + 1
end
cursor = cursor + pushed
redis.call('HSET', KEYS[4], ARGV[1], cursor)
redis.call('HINCRBY', KEYS[3], 'pushed', pushed)
if dead > 0 then redis.call('HINCRBY', KEYS[3], 'dead', dead) end
return {'ok', cursor}
