-- Lease a batch of one kind's jobs: first the due delayed jobs are promoted to the ready sets,
-- then jobs are taken one by one, each from the rank whose head comes first (priority with
-- aging) and within it from the tenant whose turn it is (fair.lua), while their summed cost
-- fits the budget (the first job is always taken, however costly, so no job is too big to
-- ever run).
-- KEYS[1] the kind's key base
-- ARGV[1] max jobs   ARGV[2] cost budget   ARGV[3] lease (ms)   ARGV[4] aging step (ms)
-- Returns a flat array: id, fencing token, cost, per leased job. Empty while the kind is paused.
if redis.call('EXISTS', key('paused')) == 1 then
  return {}
end
local max_jobs, budget = tonumber(ARGV[1]), tonumber(ARGV[2])
local lease_ms, step = tonumber(ARGV[3]), tonumber(ARGV[4])
local now = now_ms()

local due = redis.call('ZRANGEBYSCORE', key('delayed'), '-inf', now, 'LIMIT', 0, 1000)
for _, id in ipairs(due) do
  redis.call('ZREM', key('delayed'), id)
  local meta = redis.call('HGET', key('meta'), id)
  if meta and not redis.call('ZSCORE', key('leases'), id) and not is_ready(id) then
    local rank = meta_rank(meta)
    ready_add(id, rank, meta_tenant(meta), ready_score(now, rank, step, next_seq(key('seq'))))
  end
end

-- Weights and caps, read once per tenant per pull.
local weights, caps = {}, {}
local function weight(tenant)
  if weights[tenant] == nil then
    local w = tonumber(redis.call('HGET', key('weights'), tenant) or '1') or 1
    weights[tenant] = w > 0 and w or 1
  end
  return weights[tenant]
end
local function at_cap(tenant)
  if caps[tenant] == nil then
    caps[tenant] = tonumber(redis.call('HGET', key('caps'), tenant) or '') or false
  end
  return caps[tenant] and tonumber(redis.call('HGET', key('running'), tenant) or '0') >= caps[tenant]
end

-- The tenant whose turn it is in `rank`: the least virtual time among those under their cap.
local function next_tenant(rank)
  local i = 0
  while true do
    local t = redis.call('ZRANGE', turns_key(rank), i, i, 'WITHSCORES')
    if #t == 0 then
      return nil
    end
    if not at_cap(t[1]) then
      return t[1], tonumber(t[2])
    end
    i = i + 1
  end
end

local out = {}
local spent, taken = 0, 0
local capped = {} -- ranks whose every tenant with jobs ready is at its cap
while taken < max_jobs do
  local rank, best
  for r = 0, LOWEST_RANK do
    if not capped[r] then
      local head = redis.call('ZRANGE', rank_key(r), 0, 0, 'WITHSCORES')
      if #head > 0 and (best == nil or tonumber(head[2]) < best) then
        rank, best = r, tonumber(head[2])
      end
    end
  end
  if rank == nil then
    break
  end
  local tenant, v = next_tenant(rank)
  if tenant == nil then
    capped[rank] = true
  else
    local id = redis.call('ZRANGE', tenant_key(rank, tenant), 0, 0)[1]
    if id == nil then
      -- Not reached: a tenant leaves the turns with its last ready job. Mended if it were.
      leave_turns(rank, tenant, v)
    else
      local meta = redis.call('HGET', key('meta'), id)
      local cost = 1
      if meta then
        cost = meta_cost(meta)
      end
      if taken > 0 and spent + cost > budget then
        break
      end
      spent, taken = spent + cost, taken + 1
      if v > rank_clock(rank) then
        redis.call('HSET', key('vclock'), rank, v)
      end
      redis.call('ZADD', turns_key(rank), v + cost / weight(tenant), tenant)
      ready_remove(id, rank, tenant)
      local token = next_seq(key('seq'))
      lease_add(id, token, now + lease_ms, tenant)
      out[#out + 1] = id
      out[#out + 1] = token
      out[#out + 1] = cost
    end
  end
end
return out
