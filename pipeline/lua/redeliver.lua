-- Hand a batch back to the session it was delivered to (its training step failed): each
-- entry is claimed again by that session, which counts one more delivery. Fenced like
-- every trainer call, so a replaced session cannot take entries back.
-- KEYS: results, trainer
-- ARGV: consumer group, consumer, session id, then entry ids
-- Returns the delivery count of each entry still pending for this session (0: it is not).
local refused = fence_error(KEYS[2], ARGV[3], ARGV[2])
if refused then return refused end
local out = {}
for i = 4, #ARGV do
  local p = redis.call('XPENDING', KEYS[1], ARGV[1], ARGV[i], ARGV[i], 1)
  if p[1] and p[1][2] == ARGV[2] then
    redis.call('XCLAIM', KEYS[1], ARGV[1], ARGV[2], 0, ARGV[i])
    out[#out + 1] = p[1][4] + 1
  else
    out[#out + 1] = 0
  end
end
return out
