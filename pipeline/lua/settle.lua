-- Settle entries of one stream (results, requeue or dead): each entry leaves the
-- stream and goes to exactly one place. One script for every way out, so every path
-- keeps the audit's books the same way.
-- KEYS: source stream, prompts, payloads, dead, dropped, committed, stats, admitted,
--       and for the results stream one result payload key per entry (deleted with it)
-- ARGV: consumer group ('' when the source has none), max committed ids to remember,
--       then five items per entry: action, entry id, group id, text, encoded group.
--   commit    the trainer trained on it
--   drop      filtered or too stale; logged with text as the reason
--   duplicate a second copy of an already committed group
--   prompt    back to the head of the prompt list as the encoded group
--   dead      to the dead-letter stream with text as the error
--   discard   an operator threw a dead letter away
-- Settled groups leave the admitted hash (they stop counting against the staleness budget),
-- except those sent back to the prompt list.
-- Entries already gone (settled by someone else) are skipped.
-- Returns how many entries were settled.
local actions = {commit = true, drop = true, duplicate = true, prompt = true, dead = true, discard = true}
for i = 3, #ARGV, 5 do
  if not actions[ARGV[i]] then return redis.error_reply('settle: unknown action ' .. ARGV[i]) end
end
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local group = ARGV[1]
local settled, committed = 0, 0
for i = 3, #ARGV, 5 do
  local action, id, gid, text, payload = ARGV[i], ARGV[i + 1], ARGV[i + 2], ARGV[i + 3], ARGV[i + 4]
  local owned = group == '' or redis.call('XACK', KEYS[1], group, id) == 1
  if owned and redis.call('XDEL', KEYS[1], id) == 1 then
    settled = settled + 1
    if #KEYS > 8 then redis.call('DEL', KEYS[9 + (i - 3) / 5]) end
    if action == 'commit' then
      redis.call('ZADD', KEYS[6], now, gid)
      redis.call('HDEL', KEYS[8], gid)
      committed = committed + 1
    elseif action == 'drop' then
      redis.call('XADD', KEYS[5], 'MAXLEN', '~', 100000, '*', 'gid', gid, 'reason', text)
      redis.call('HDEL', KEYS[8], gid)
      redis.call('HINCRBY', KEYS[7], 'dropped', 1)
    elseif action == 'duplicate' then
      redis.call('HINCRBY', KEYS[7], 'duplicates', 1)
    elseif action == 'prompt' then
      redis.call('HSET', KEYS[3], gid, payload)
      redis.call('LPUSH', KEYS[2], gid)
      redis.call('HINCRBY', KEYS[7], 'released', 1)
    elseif action == 'dead' then
      redis.call('XADD', KEYS[4], '*', 'gid', gid, 'data', payload, 'error', text)
      redis.call('HDEL', KEYS[8], gid)
      redis.call('HINCRBY', KEYS[7], 'dead', 1)
    else -- discard
      redis.call('HDEL', KEYS[8], gid)
      redis.call('HINCRBY', KEYS[7], 'discarded', 1)
    end
  end
end
if committed > 0 then
  redis.call('HINCRBY', KEYS[7], 'committed', committed)
  redis.call('ZREMRANGEBYRANK', KEYS[6], 0, -(tonumber(ARGV[2]) + 1))
end
return settled
