-- A trainer's bookkeeping in a hash (the slime adapter's `slime_rollouts`: which rollout read
-- each entry, which run saved each checkpoint; the consumer's rewind marks, `abandoned`:
-- pipeline/rewind.py), written under the trainer session's fence
-- like every trainer write (pipeline/writer.py): a fenced trainer records no read or
-- checkpoint, and deletes none, for entries its successor holds now.
-- KEYS: trainer, slime_rollouts|abandoned
-- ARGV: session id ('' unfenced), consumer, n, then n field/value pairs to set, then fields
--       to delete
-- Returns the number of fields deleted, or an error starting with FENCED.
local refused = fence_error(KEYS[1], ARGV[1], ARGV[2])
if refused then return refused end
local n = tonumber(ARGV[3])
if n > 0 then redis.call('HSET', KEYS[2], unpack(ARGV, 4, 3 + 2 * n)) end
if #ARGV > 3 + 2 * n then return redis.call('HDEL', KEYS[2], unpack(ARGV, 4 + 2 * n)) end
return 0
