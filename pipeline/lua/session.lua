-- Start a trainer session. Its random id (ARGV[4]) fences every earlier session (their
-- reads and commits are refused from now on), so it takes over at once every entry
-- delivered to them and not committed, oldest first; consumers left holding nothing are
-- forgotten. The fence is the id, not the generation counter: a failover to a replica
-- that missed the last session start rolls the counter back and would hand out the same
-- generation twice; the id (and the consumer name, which carries it) never repeats.
-- KEYS: trainer, results
-- ARGV: consumer group, consumer base name, info JSON, session id
-- Returns {generation, consumer name, entries taken over}.
local group = ARGV[1]
redis.pcall('XGROUP', 'CREATE', KEYS[2], group, '0', 'MKSTREAM')  -- an error: it exists already
local current = redis.call('HMGET', KEYS[1], 'session_id', 'generation', 'session')
local generation, name = tonumber(current[2]), current[3]
if current[1] ~= ARGV[4] then  -- else a retry whose reply was lost: the session is started
  generation = redis.call('HINCRBY', KEYS[1], 'generation', 1)
  name = ARGV[2] .. '.' .. generation .. '-' .. ARGV[4]
  redis.call('HSET', KEYS[1], 'session', name, 'session_id', ARGV[4], 'info', ARGV[3], 'started_ms', now_ms())
end
redis.call('XGROUP', 'CREATECONSUMER', KEYS[2], group, name)  -- visible to XINFO before its first read
local cursor, taken = '0-0', 0
repeat
  -- Not JUSTID: that would not count the delivery, and a batch that keeps killing its
  -- trainer is recognised by its delivery count.
  local reply = redis.call('XAUTOCLAIM', KEYS[2], group, name, 0, cursor, 'COUNT', 1000)
  cursor, taken = reply[1], taken + #reply[2]
until cursor == '0-0'
for _, c in ipairs(redis.call('XINFO', 'CONSUMERS', KEYS[2], group)) do
  -- each consumer is a flat list: name, <name>, pending, <n>, idle, <ms>, ...
  if c[2] ~= name and c[4] == 0 then redis.call('XGROUP', 'DELCONSUMER', KEYS[2], group, c[2]) end
end
return {generation, name, taken}
