-- One page of the prompt list for the audit, counted from the tail: claims pop the head
-- and reaps push there, so a page's place from the tail moves only when rows are pushed
-- (the 'pushed' counter says by how much at most). Each group's payload and committed
-- mark are read in the same step as the page, so neither can be faked by a move.
-- KEYS: prompts, payloads, committed, stats
-- ARGV: offset from the tail (0: the last element), page size
-- Returns {pushed so far, then per group of the page, head to tail: gid, flags} with
-- flags 1 = no payload stored, 2 = committed (3: both).
local last = -1 - tonumber(ARGV[1])
local gids = redis.call('LRANGE', KEYS[1], last - tonumber(ARGV[2]) + 1, last)
local out = {tonumber(redis.call('HGET', KEYS[4], 'pushed') or '0') or 0}
for _, gid in ipairs(gids) do
  local flags = 0
  if redis.call('HEXISTS', KEYS[2], gid) == 0 then flags = flags + 1 end
  if redis.call('ZSCORE', KEYS[3], gid) then flags = flags + 2 end
  out[#out + 1] = gid
  out[#out + 1] = flags
end
return out
