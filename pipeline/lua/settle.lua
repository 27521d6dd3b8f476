-- Settle entries of one stream (results, requeue or dead): each entry leaves the stream
-- and goes to exactly one place. One script for every way out, so every path keeps the
-- audit's books the same way. On the results stream only the current trainer session may
-- settle, and only entries delivered to it; a trainer's settles elsewhere (the requeue
-- stream at resume) are fenced too.
-- KEYS: settled, prompts, payloads, dead, dropped, committed, stats, admitted, claims, history,
--       trainer, result...
-- (`settled` is the source stream; for the results stream one result payload key per entry follows)
-- ARGV: consumer group ('' for streams without one: no owner check), consumer, session id (''
--       for a writer without a session: no fence), max committed ids to remember, then six
--       items per entry: action, entry id, group id, text, encoded group, dead letter's reason
--       category ('' for none).
--   commit    the trainer trained on it (text: the batch, for the group's history)
--   drop      filtered or too stale; logged with text as the reason
--   duplicate a second copy of an already committed or held group
--   prompt    back to the head of the prompt list as the encoded group
--   regenerate  the same, and its admission ends: its next claim admits it anew (paced by the
--             staleness budget and stamped with the version then), as a group that must be
--             generated again from its prompt (too stale, from a timeline the trainer left,
--             refused by the trainer) is a new generation, not the old one continued
--   dead      to the dead-letter stream with text as the error (and its reason: `dead_<reason>` counted)
--   discard   an operator threw a dead letter away
-- Entries already gone (settled before) are skipped; a commit of an entry already
-- committed (a retried commit whose reply was lost) counts as done.
-- Returns {settled, already committed} or an error starting with FENCED.
local actions = {commit = true, drop = true, duplicate = true, prompt = true, regenerate = true, dead = true,
                 discard = true}
for i = 5, #ARGV, 6 do
  if not actions[ARGV[i]] then return redis.error_reply('settle: unknown action ' .. ARGV[i]) end
end
local group, consumer, session_id = ARGV[1], ARGV[2], ARGV[3]
local refused = fence_error(KEYS[11], session_id, consumer)
if refused then return refused end
local now = now_ms()
local settled, already, committed = 0, 0, 0
for i = 5, #ARGV, 6 do
  local action, id, gid, text, payload, reason = ARGV[i], ARGV[i + 1], ARGV[i + 2], ARGV[i + 3], ARGV[i + 4],
                                                  ARGV[i + 5]
  local owned = true
  if group ~= '' then
    local p = redis.call('XPENDING', KEYS[1], group, id, id, 1)
    owned = p[1] ~= nil and p[1][2] == consumer
    if owned then redis.call('XACK', KEYS[1], group, id) end
  end
  if owned and redis.call('XDEL', KEYS[1], id) == 1 then
    settled = settled + 1
    if #KEYS > 11 then redis.call('DEL', KEYS[12 + (i - 5) / 6]) end
    if action == 'commit' then
      redis.call('ZADD', KEYS[6], now, gid)
      redis.call('HDEL', KEYS[8], gid)
      record(KEYS[10], gid, now, 'committed', consumer, text)
      committed = committed + 1
    elseif action == 'drop' then
      redis.call('XADD', KEYS[5], 'MAXLEN', '~', 100000, '*', 'gid', gid, 'reason', text)
      redis.call('HDEL', KEYS[8], gid)
      redis.call('HDEL', KEYS[10], gid)
      redis.call('HINCRBY', KEYS[7], 'dropped', 1)
    elseif action == 'duplicate' then
      -- Another copy of this group id lives on: its books stay as they are.
      redis.call('HINCRBY', KEYS[7], 'duplicates', 1)
    elseif action == 'prompt' or action == 'regenerate' then
      redis.call('HSET', KEYS[3], gid, payload)
      redis.call('LPUSH', KEYS[2], gid)
      if action == 'regenerate' then redis.call('HDEL', KEYS[8], gid) end
      redis.call('HINCRBY', KEYS[7], 'released', 1)
      record(KEYS[10], gid, now, 'released', consumer, text)
    elseif action == 'dead' then
      if reason ~= '' then
        redis.call('XADD', KEYS[4], '*', 'gid', gid, 'data', payload, 'error', text, 'reason', reason)
        redis.call('HINCRBY', KEYS[7], 'dead_' .. reason, 1)
      else
        redis.call('XADD', KEYS[4], '*', 'gid', gid, 'data', payload, 'error', text)
      end
      redis.call('HDEL', KEYS[8], gid)
      redis.call('HDEL', KEYS[9], gid)
      redis.call('HINCRBY', KEYS[7], 'dead', 1)
      record(KEYS[10], gid, now, 'dead', consumer, '')
    else -- discard
      redis.call('HDEL', KEYS[8], gid)
      redis.call('HDEL', KEYS[9], gid)
      redis.call('HDEL', KEYS[10], gid)
      redis.call('HINCRBY', KEYS[7], 'discarded', 1)
    end
  elseif action == 'commit' and redis.call('ZSCORE', KEYS[6], gid) then
    already = already + 1
  end
end
if committed > 0 then
  redis.call('HINCRBY', KEYS[7], 'committed', committed)
  -- Remember the most recent ids (for deduplication); their histories go with them.
  local over = redis.call('ZCARD', KEYS[6]) - tonumber(ARGV[4])
  if over > 0 then
    for _, old in ipairs(redis.call('ZRANGE', KEYS[6], 0, over - 1)) do redis.call('HDEL', KEYS[10], old) end
    redis.call('ZREMRANGEBYRANK', KEYS[6], 0, over - 1)
  end
end
return {settled, already}
