-- Where one group is, read in one atomic step (`rollout inspect`): a group that moves
-- while we look is seen where it is, never in no place or two. Blocks Redis for time
-- linear in the lengths of the requeue, results and dead streams (an operator's tool,
-- as the audit). The drop log is searched afterwards: a drop is final.
-- KEYS: prompts, payloads, workers, requeue, results, dead, committed, claims, history, admitted, trainer,
--       checkpoints, checkpoint_records, inflight...
-- (one in-flight key per worker in ARGV)
-- ARGV: group id, consumer group, then the worker ids whose in-flight keys follow
-- Returns 'retry' when a worker registered that is not among those given; else {JSON of
-- where the group is, its encoded group or false, its in-flight checkpoint or false}: the
-- stored payload while queued or in flight, else the data of its newest requeue or dead entry.
local gid, group = ARGV[1], ARGV[2]
local given = {}
for i = 3, #ARGV do given[ARGV[i]] = true end
for _, w in ipairs(redis.call('ZRANGE', KEYS[3], 0, -1)) do
  if not given[w] then return 'retry' end
end

local where = {}
local payload = redis.call('HGET', KEYS[2], gid)
local position = redis.call('LPOS', KEYS[1], gid)
if position then where[#where + 1] = {place = 'prompts', position = position} end
for i = 3, #ARGV do
  local token = redis.call('HGET', KEYS[11 + i], gid)
  if token then where[#where + 1] = {place = 'inflight', worker = ARGV[i], token = token} end
end

local function search(key, place)
  for _, entry in ipairs(redis.call('XRANGE', key, '-', '+')) do
    local f = {}
    for j = 1, #entry[2], 2 do f[entry[2][j]] = entry[2][j + 1] end
    if f.gid == gid then
      local hit = {place = place, entry_id = entry[1], token = f.tok, error = f.error, reason = f.reason}
      if place == 'results' then
        local p = redis.pcall('XPENDING', key, group, entry[1], entry[1], 1)  -- an error: no consumer group
        if type(p) == 'table' and p[1] then hit.session, hit.deliveries = p[1][2], p[1][4] end
      elseif not payload and f.data then
        payload = f.data
      end
      where[#where + 1] = hit
    end
  end
end
search(KEYS[4], 'requeue')
search(KEYS[5], 'results')
search(KEYS[6], 'dead')
local committed = redis.call('ZSCORE', KEYS[7], gid)
if committed then where[#where + 1] = {place = 'committed', at_ms = tonumber(committed)} end

local session = redis.call('HGET', KEYS[11], 'session')
return {cjson.encode({
  where = where, now_ms = now_ms(), claims = tonumber(redis.call('HGET', KEYS[8], gid) or '0'),
  history = redis.call('HGET', KEYS[9], gid) or '', admitted = redis.call('HGET', KEYS[10], gid) or false,
  session = session or false,
}), payload or false, checkpoint_of(KEYS[12], KEYS[13], gid)}
