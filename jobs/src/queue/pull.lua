-- Lease a batch of one kind's jobs: first the due delayed jobs are promoted to the ready set,
-- then jobs are taken in score order while their summed cost fits the budget (the first job is
-- always taken, however costly, so no job is too big to ever run).
-- KEYS[1] ready zset   KEYS[2] delayed zset   KEYS[3] leases zset   KEYS[4] meta hash
-- KEYS[5] seq counter  KEYS[6] lease tokens hash   KEYS[7] paused flag
-- ARGV[1] max jobs   ARGV[2] cost budget   ARGV[3] lease (ms)   ARGV[4] aging step (ms)
-- Returns a flat array: id, fencing token, cost, per leased job. Empty while the kind is paused.
if redis.call('EXISTS', KEYS[7]) == 1 then
  return {}
end
local max_jobs, budget = tonumber(ARGV[1]), tonumber(ARGV[2])
local lease_ms, step = tonumber(ARGV[3]), tonumber(ARGV[4])
local now = now_ms()

local due = redis.call('ZRANGEBYSCORE', KEYS[2], '-inf', now, 'LIMIT', 0, 1000)
for _, id in ipairs(due) do
  redis.call('ZREM', KEYS[2], id)
  local meta = redis.call('HGET', KEYS[4], id)
  if meta and not redis.call('ZSCORE', KEYS[3], id) then
    redis.call('ZADD', KEYS[1], 'NX', ready_score(now, meta_rank(meta), step, next_seq(KEYS[5])), id)
  end
end

local out = {}
local spent, taken = 0, 0
for _, id in ipairs(redis.call('ZRANGE', KEYS[1], 0, max_jobs - 1)) do
  local meta = redis.call('HGET', KEYS[4], id)
  local cost = 1
  if meta then cost = meta_cost(meta) end
  if taken > 0 and spent + cost > budget then break end
  spent, taken = spent + cost, taken + 1
  redis.call('ZREM', KEYS[1], id)
  local token = next_seq(KEYS[5])
  redis.call('HSET', KEYS[6], id, token)
  redis.call('ZADD', KEYS[3], now + lease_ms, id)
  out[#out + 1] = id
  out[#out + 1] = token
  out[#out + 1] = cost
end
return out
