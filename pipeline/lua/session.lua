-- Start a trainer session. Its generation fences every earlier session (their reads and
-- commits are refused from now on), so it takes over at once every entry delivered to
-- them and not committed, oldest first; consumers left holding nothing are forgotten.
-- KEYS: trainer, results
-- ARGV: consumer group, consumer base name, info JSON
-- Returns {generation, consumer name, entries taken over}.
local group = ARGV[1]
redis.pcall('XGROUP', 'CREATE', KEYS[2], group, '0', 'MKSTREAM')  -- an error: it exists already
local generation = redis.call('HINCRBY', KEYS[1], 'generation', 1)
local name = ARGV[2] .. '.' .. generation
redis.call('HSET', KEYS[1], 'session', name, 'info', ARGV[3], 'started_ms', now_ms())
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
