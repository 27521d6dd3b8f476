-- The audit's second look, at result payload keys: an entry still in the results stream
-- whose payload key is gone, or a payload key that exists with no entry naming it.
-- Both are read in this one step, so a publish or a commit in between cannot fake either.
-- KEYS: results, result...
-- (one payload key per entry id in ARGV, then candidate payload keys found by SCAN)
-- ARGV: number of entry ids N, the N entry ids, the payload key prefix ("{ns}:result:")
-- Returns {entries without payload, payload keys without entry}.
local n = tonumber(ARGV[1])
local prefix = ARGV[n + 2]
local missing, orphans = 0, 0
for i = 1, n do
  if #redis.call('XRANGE', KEYS[1], ARGV[1 + i], ARGV[1 + i]) > 0 and redis.call('EXISTS', KEYS[1 + i]) == 0 then
    missing = missing + 1
  end
end
if #KEYS > n + 1 then
  local named = {}  -- the payload key name each entry implies (names compared, never opened)
  for _, entry in ipairs(redis.call('XRANGE', KEYS[1], '-', '+')) do
    local gid, tok = '', ''
    for j = 1, #entry[2], 2 do
      if entry[2][j] == 'gid' then gid = entry[2][j + 1] elseif entry[2][j] == 'tok' then tok = entry[2][j + 1] end
    end
    named[prefix .. gid .. ':' .. tok] = true
  end
  for i = n + 2, #KEYS do
    if redis.call('EXISTS', KEYS[i]) == 1 and not named[KEYS[i]] then orphans = orphans + 1 end
  end
end
return {missing, orphans}
