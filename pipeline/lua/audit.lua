-- The audit's atomic step: every count, and every group outside the prompt list and the
-- dead-letter stream, in one snapshot, so a busy pipeline cannot make groups look missing
-- or doubled. It reads the places a pipeline keeps small (in flight, requeue, results:
-- bounded by concurrency and max_ready) and only the lengths of the two that grow with a
-- dataset (prompts, dead), which the audit then reads page by page (audit_page.lua, XRANGE):
-- the server is never held for time linear in the groups queued.
-- In-flight checkpoints live beside payloads (prelude): one whose group has no payload, or a
-- record its header does not name, is an orphan.
-- KEYS: prompts, payloads, workers, requeue, results, dead, stats, committed, checkpoints,
--       checkpoint_records, inflight...
-- (one in-flight key per worker in ARGV)
-- ARGV: consumer group, then the worker ids whose in-flight keys follow
-- Returns 'retry' when a worker registered that is not among those given; else a JSON object.
local registered = redis.call('ZRANGE', KEYS[3], 0, -1)
local given = {}
for i = 2, #ARGV do given[ARGV[i]] = true end
for _, w in ipairs(registered) do
  if not given[w] then return 'retry' end
end

local count, order, placed = {}, {}, {}
local function seen(gid, place)
  if not count[gid] then order[#order + 1] = gid end
  count[gid] = (count[gid] or 0) + 1
  placed[#placed + 1] = gid
  placed[#placed + 1] = place
end
local inflight, unregistered, missing_payloads, inflight_payloads = {}, {}, 0, 0
local is_registered = {}
for _, w in ipairs(registered) do is_registered[w] = true end
for i = 2, #ARGV do
  local gids = redis.call('HKEYS', KEYS[9 + i])
  if #gids > 0 then
    inflight[ARGV[i]] = #gids
    if not is_registered[ARGV[i]] then unregistered[#unregistered + 1] = ARGV[i] end
  end
  for _, gid in ipairs(gids) do
    seen(gid, 'inflight')
    if redis.call('HEXISTS', KEYS[2], gid) == 1 then
      inflight_payloads = inflight_payloads + 1
    else
      missing_payloads = missing_payloads + 1
    end
  end
end
local function stream(key, place, with_token)
  local n, rows = 0, {}
  for _, entry in ipairs(redis.call('XRANGE', key, '-', '+')) do
    local f = entry[2]
    local gid, tok = nil, ''
    for j = 1, #f, 2 do
      if f[j] == 'gid' then gid = f[j + 1] elseif f[j] == 'tok' then tok = f[j + 1] end
    end
    if gid then
      seen(gid, place)
      n = n + 1
      if with_token then rows[#rows + 1] = {entry[1], gid, tok} end
    end
  end
  return n, rows
end
local requeue = stream(KEYS[4], 'requeue', false)
local results, result_rows = stream(KEYS[5], 'results', true)
local pending = 0
local summary = redis.pcall('XPENDING', KEYS[5], ARGV[1])  -- an error: no consumer group yet
if type(summary) == 'table' and not summary.err then pending = tonumber(summary[1]) end

local twice, committed_too = {}, {}
for _, gid in ipairs(order) do
  if count[gid] > 1 then twice[#twice + 1] = gid end
  if redis.call('ZSCORE', KEYS[8], gid) then committed_too[#committed_too + 1] = gid end
end
local checkpoints, checkpoint_bytes, checkpoint_tokens, orphan_checkpoints = 0, 0, 0, 0
local records_of = {}
local headers = redis.call('HGETALL', KEYS[9])
for j = 1, #headers, 2 do
  local gid = headers[j]
  local n, b, t = string.match(headers[j + 1], '^%S+ %S+ (%d+) (%d+) (%d+) ')
  checkpoints = checkpoints + 1
  checkpoint_bytes = checkpoint_bytes + (tonumber(b) or 0)
  checkpoint_tokens = checkpoint_tokens + (tonumber(t) or 0)
  if not n or redis.call('HEXISTS', KEYS[2], gid) == 0 then orphan_checkpoints = orphan_checkpoints + 1 end
  records_of[gid] = tonumber(n) or 0
end
for _, field in ipairs(redis.call('HKEYS', KEYS[10])) do
  local gid, k = string.match(field, '^(.*)\n(%d+)$')
  if not gid or not records_of[gid] or tonumber(k) > records_of[gid] or tonumber(k) < 1 then
    orphan_checkpoints = orphan_checkpoints + 1
  end
end
local stats = {}
local flat = redis.call('HGETALL', KEYS[7])
for j = 1, #flat, 2 do stats[flat[j]] = flat[j + 1] end
return cjson.encode({
  stats = stats, prompts = redis.call('LLEN', KEYS[1]), inflight = inflight, unregistered = unregistered,
  requeue = requeue, results = results, pending = pending, dead = redis.call('XLEN', KEYS[6]),
  in_two_places = twice, committed_too = committed_too, missing_payloads = missing_payloads,
  payloads = redis.call('HLEN', KEYS[2]), inflight_payloads = inflight_payloads, placed = placed,
  result_rows = result_rows, checkpoints = checkpoints, checkpoint_bytes = checkpoint_bytes,
  checkpoint_tokens = checkpoint_tokens, orphan_checkpoints = orphan_checkpoints,
})
