-- Move up to ARGV[2] group ids from the head of the prompt list into one worker's
-- in-flight set, unless admission is paused, the results backlog is full, or the
-- staleness budget (AReaL pacing: admitted <= (max_staleness + version + 1) * batch_size,
-- admitted = committed + admitted-and-unsettled) is spent. Claiming also counts as a heartbeat.
-- KEYS: prompts, payloads, inflight, workers, control, results, admitted, stats
-- ARGV: worker, max_groups, default max_ready (when the control hash sets none)
-- Returns {status, weight_version, gid, payload, admitted_version, gid, payload, ...}
-- with status one of ok, empty, paused, backlog, budget.
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
redis.call('ZADD', KEYS[4], now, ARGV[1])

local ctl = redis.call('HMGET', KEYS[5], 'paused', 'max_ready', 'max_staleness',
                       'batch_size', 'weight_version', 'admitted')
local version = tonumber(ctl[5]) or 0
if ctl[1] == '1' then return {'paused', version} end

local want = tonumber(ARGV[2])
local room = (tonumber(ctl[2]) or tonumber(ARGV[3])) - redis.call('XLEN', KEYS[6])
if room <= 0 then return {'backlog', version} end
want = math.min(want, room)

local limit = nil
if ctl[3] and ctl[4] then
  limit = (tonumber(ctl[3]) + version + 1) * tonumber(ctl[4])
end
-- What counts against the budget: groups committed so far plus groups admitted and not
-- yet settled (the admitted hash). A group dropped by the filter, the staleness check or
-- a requeue-drop (or discarded) gives its slot back, as a rejected rollout does in
-- AReaL; a plain counter of first claims would spend the budget on groups the trainer
-- never gets, and dynamic sampling would stall once drops reach the slack.
local admitted = tonumber(redis.call('HGET', KEYS[8], 'committed') or '0') + redis.call('HLEN', KEYS[7])

local out = {'ok', version}
local status = 'ok'
for _ = 1, want do
  local gid = redis.call('LPOP', KEYS[1])
  if not gid then status = 'empty' break end
  local first = redis.call('HSETNX', KEYS[7], gid, version) == 1
  if first and limit and admitted >= limit then
    -- Over budget: undo and leave it at the head for when the trainer catches up.
    redis.call('HDEL', KEYS[7], gid)
    redis.call('LPUSH', KEYS[1], gid)
    status = 'budget'
    break
  end
  if first then admitted = admitted + 1 end
  redis.call('SADD', KEYS[3], gid)
  out[#out + 1] = gid
  out[#out + 1] = redis.call('HGET', KEYS[2], gid) or ''
  out[#out + 1] = redis.call('HGET', KEYS[7], gid)
end
if #out > 2 then
  redis.call('HINCRBY', KEYS[8], 'claims', (#out - 2) / 3)
  return out
end
out[1] = status
return out
