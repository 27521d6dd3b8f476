-- Claim up to ARGV[3] groups from the head of the prompt list for one registered worker,
-- unless admission is paused, the results backlog is full, or the staleness budget is
-- spent. Each group is held under the claim id, its fencing token: publish and hand-back
-- check it. A retried claim (same claim id, its reply was lost) returns what the first
-- run took.
-- Claims are counted per group before the work starts. A group whose holder died twice
-- (a suspect) runs alone: only a worker holding nothing claims it, and claims nothing
-- else until it is done, so a group that kills its workers takes no neighbour with it.
-- Claimed more than max_claims times without finishing, it goes to dead letters.
-- A group is handed out with its in-flight checkpoint, if a holder before saved one (prelude).
-- KEYS: prompts, payloads, inflight, workers, control, results, admitted, stats, claims, history,
--       dead, last_claim, isolated, holders, checkpoints, checkpoint_records
-- ARGV: worker, claim id, max groups, default max_ready, default max_claims
-- Returns {status, weight_version, gid, payload, admitted_version, checkpoint, gid, ...} with status
-- one of ok, empty, paused, backlog, budget, isolating (a suspect runs alone), unregistered (reaped
-- or never registered), expired; a checkpoint is {header, record...} or false.
local worker, token = ARGV[1], ARGV[2]
local now = now_ms()
local ctl = redis.call('HMGET', KEYS[5], 'paused', 'max_ready', 'max_staleness', 'batch_size',
                       'weight_version', 'max_claims', 'budget_base')
local version = tonumber(ctl[5]) or 0
local deadline = redis.call('ZSCORE', KEYS[4], worker)
if not deadline then return {'unregistered', version} end

local function held(out, gid)
  out[#out + 1] = gid
  out[#out + 1] = redis.call('HGET', KEYS[2], gid) or ''
  out[#out + 1] = redis.call('HGET', KEYS[7], gid)
  out[#out + 1] = checkpoint_of(KEYS[15], KEYS[16], gid)
  return out[#out]
end

local last = redis.call('HGET', KEYS[12], worker)
if last and string.sub(last, 1, #token + 1) == token .. '\n' then
  local out = {'ok', version}
  for gid in string.gmatch(string.sub(last, #token + 2), '[^\n]+') do
    if redis.call('HGET', KEYS[3], gid) == token then held(out, gid) end
  end
  return out
end
-- After the retry path: a claim that went through is returned even if the lease ran out
-- before its retry (the groups are held; the worker renews or is reaped with them).
if tonumber(deadline) < now then return {'expired', version} end

if ctl[1] == '1' then return {'paused', version} end
local alone = redis.call('HGET', KEYS[13], worker)
if alone then
  if redis.call('HEXISTS', KEYS[3], alone) == 1 then return {'isolating', version} end
  redis.call('HDEL', KEYS[13], worker)
end
local room = (tonumber(ctl[2]) or tonumber(ARGV[4])) - redis.call('XLEN', KEYS[6])
if room <= 0 then return {'backlog', version} end
local want = math.min(tonumber(ARGV[3]), room)

local limit = nil
if tonumber(ctl[3]) and tonumber(ctl[4]) then
  limit = staleness_limit(tonumber(ctl[3]), version, tonumber(ctl[4]))
end
-- Against the budget: groups committed since the clock's version 0 (budget_base: the
-- committed count there, set when a trainer starts or goes back in versions) plus groups
-- admitted and not yet settled. A dropped or dead group gives its slot back, so dynamic
-- sampling cannot stall admission.
local admitted = tonumber(redis.call('HGET', KEYS[8], 'committed') or '0') - (tonumber(ctl[7]) or 0)
                 + redis.call('HLEN', KEYS[7])
local max_claims = tonumber(ctl[6]) or tonumber(ARGV[5])

-- "w1 (reaped), w2 (handed back)": the workers that held a group, from its history.
local function holders(gid)
  local list, state = {}, {}
  for line in string.gmatch(redis.call('HGET', KEYS[10], gid) or '', '[^\n]+') do
    local _, event, who = string.match(line, '^(%S+) (%S+) (%S+)')
    if event == 'claimed' then
      list[#list + 1] = who
      state[#list] = 'held'
    elseif (event == 'reaped' or event == 'handed_back' or event == 'reconciled') and #list > 0 then
      state[#list] = event == 'handed_back' and 'handed back' or event
    end
  end
  local parts = {}
  for i, who in ipairs(list) do parts[#parts + 1] = who .. ' (' .. state[i] .. ')' end
  return #parts > 0 and table.concat(parts, ', ') or 'unknown workers'
end

local out, taken = {'ok', version}, {token}
local status = 'ok'
while #taken - 1 < want do
  local gid = redis.call('LPOP', KEYS[1])
  if not gid then status = 'empty' break end
  local first = redis.call('HSETNX', KEYS[7], gid, version) == 1
  if first and limit and admitted >= limit then
    -- Over budget: undo, and leave it at the head for when the trainer catches up.
    redis.call('HDEL', KEYS[7], gid)
    redis.call('LPUSH', KEYS[1], gid)
    status = 'budget'
    break
  end
  local suspect = tonumber(redis.call('HGET', KEYS[9], gid) or '0') >= 2
  if suspect and (#taken > 1 or redis.call('HLEN', KEYS[3]) > 0) then
    -- Not with anything else: back to the head, for a worker that holds nothing.
    if first then redis.call('HDEL', KEYS[7], gid) end
    redis.call('LPUSH', KEYS[1], gid)
    status = 'isolating'
    break
  end
  if first then admitted = admitted + 1 end
  local claims = redis.call('HINCRBY', KEYS[9], gid, 1)
  if claims > max_claims then
    local reason = 'claimed ' .. (claims - 1) .. ' times without finishing; held by ' .. holders(gid)
    redis.call('XADD', KEYS[11], '*', 'gid', gid, 'data', redis.call('HGET', KEYS[2], gid) or '',
               'error', reason, 'reason', 'max_claims')
    drop_payload(KEYS[2], KEYS[15], KEYS[16], gid)
    redis.call('HDEL', KEYS[9], gid)
    admitted = admitted - redis.call('HDEL', KEYS[7], gid)
    redis.call('HINCRBY', KEYS[8], 'dead', 1)
    redis.call('HINCRBY', KEYS[8], 'dead_max_claims', 1)
    record(KEYS[10], gid, now, 'dead', worker, 'max_claims')
  else
    redis.call('HSET', KEYS[3], gid, token)
    record(KEYS[10], gid, now, 'claimed', worker, token)
    taken[#taken + 1] = gid
    local checkpoint = held(out, gid)
    if checkpoint then
      redis.call('HINCRBY', KEYS[8], 'checkpoints_claimed', 1)
      redis.call('HINCRBY', KEYS[8], 'checkpoint_tokens_claimed', tonumber(string.match(checkpoint[1],
                 '^%S+ %S+ %d+ %d+ (%d+) ')) or 0)
    end
    if suspect then
      redis.call('HSET', KEYS[13], worker, gid)
      break
    end
  end
end
if #taken > 1 then
  redis.call('HSET', KEYS[12], worker, table.concat(taken, '\n'))
  redis.call('SADD', KEYS[14], worker)
  redis.call('HINCRBY', KEYS[8], 'claims', #taken - 1)
  return out
end
out[1] = status
return out
