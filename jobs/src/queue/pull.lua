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
    ready_add(id, rank, meta_tenant(meta), ready_score(next_arrival(key('arrivals'), now, 1), rank, step))
  end
end

-- Weights, caps and running counts, read once per tenant per pull and kept here meanwhile.
local weights, caps, running = {}, {}, {}
local function weight(tenant)
  if weights[tenant] == nil then
    weights[tenant] = tenant_weight(tenant)
  end
  return weights[tenant]
end
local function at_cap(tenant)
  if caps[tenant] == nil then
    caps[tenant] = tonumber(redis.call('HGET', key('caps'), tenant) or '') or false
  end
  if not caps[tenant] then
    return false
  end
  if running[tenant] == nil then
    running[tenant] = tonumber(redis.call('HGET', key('running'), tenant) or '0')
  end
  return running[tenant] >= caps[tenant]
end

-- The tenant whose turn it is in `rank`: the least virtual time among those under their cap,
-- from position `from` of the rank's turns on. Returns it, its time and its position.
local function next_tenant(rank, from)
  local i = from
  while true do
    local t = redis.call('ZRANGE', turns_key(rank), i, i, 'WITHSCORES')
    if #t == 0 then
      return nil
    end
    if not at_cap(t[1]) then
      return t[1], tonumber(t[2]), i
    end
    i = i + 1
  end
end

-- Most jobs taken from one tenant in one run (each a few commands fewer than one at a time).
local RUN_MAX = 512

-- Each rank's head score (false: empty), re-read only for the rank a job was taken from.
local heads, clocks, clocks_read = {}, {}, {}
local function read_head(rank)
  local head = redis.call('ZRANGE', rank_key(rank), 0, 0, 'WITHSCORES')
  heads[rank] = #head > 0 and tonumber(head[2])
end
for r = 0, LOWEST_RANK do
  read_head(r)
  clocks[r] = rank_clock(r)
  clocks_read[r] = clocks[r]
end

local leased = {} -- tenant -> leases taken by this pull, counted once at the end
local out = {}
local spent, taken = 0, 0
local capped = {} -- ranks whose every tenant with jobs ready is at its cap
local full = false -- the budget is spent
while taken < max_jobs do
  local rank, best
  for r = 0, LOWEST_RANK do
    if not capped[r] and heads[r] and (best == nil or heads[r] < best) then
      rank, best = r, heads[r]
    end
  end
  if rank == nil then
    break
  end
  local tenant, v, at = next_tenant(rank, 0)
  if tenant == nil then
    capped[rank] = true
  else
    -- A run: this tenant's jobs, in order, while its virtual time stays below the next
    -- tenant's and its next job comes before every other rank's head (the first job is taken
    -- whatever: the rank and the tenant were chosen for it).
    local _, v_next = next_tenant(rank, at + 1)
    local other
    for r = 0, LOWEST_RANK do
      if r ~= rank and not capped[r] and heads[r] and (other == nil or heads[r] < other) then
        other = heads[r]
      end
    end
    local room = math.min(max_jobs - taken, RUN_MAX)
    if v_next then
      -- Each job (of cost 1 at least) adds 1 / weight or more to its time: no more can fit.
      room = math.min(room, math.floor((v_next - v) * weight(tenant)) + 1)
    end
    if caps[tenant] then
      room = math.min(room, caps[tenant] - running[tenant])
    end
    local tq = tenant_key(rank, tenant)
    local found = redis.call('ZRANGE', tq, 0, room - 1, 'WITHSCORES')
    if #found == 0 then
      -- Not reached: a tenant leaves the turns with its last ready job. Mended if it were.
      leave_turns(rank, tenant, v, clocks[rank])
    else
      local ids = {}
      for j = 1, #found, 2 do
        ids[#ids + 1] = found[j]
      end
      local metas = redis.call('HMGET', key('meta'), unpack(ids))
      local w = weight(tenant)
      local run, costs = {}, {}
      for j, id in ipairs(ids) do
        if #run > 0 and ((v_next and v >= v_next) or (other and tonumber(found[2 * j]) > other)) then
          break
        end
        local cost = 1
        if metas[j] then
          cost = meta_cost(metas[j])
        end
        if taken > 0 and spent + cost > budget then
          full = true
          break
        end
        spent, taken = spent + cost, taken + 1
        clocks[rank] = math.max(clocks[rank], v)
        v = v + cost / w
        run[#run + 1] = id
        costs[#run] = cost
      end
      if #run > 0 then
        redis.call('ZADD', turns_key(rank), v, tenant)
        redis.call('ZREM', rank_key(rank), unpack(run))
        redis.call('ZREM', tq, unpack(run))
        if redis.call('EXISTS', tq) == 0 then
          leave_turns(rank, tenant, v, clocks[rank])
        end
        read_head(rank)
        local first = next_seq(key('seq'))
        if #run > 1 then
          redis.call('INCRBY', key('seq'), #run - 1)
        end
        local tokens, deadlines = {}, {}
        for j, id in ipairs(run) do
          local token = first + j - 1
          tokens[#tokens + 1] = id
          tokens[#tokens + 1] = token
          deadlines[#deadlines + 1] = now + lease_ms
          deadlines[#deadlines + 1] = id
          out[#out + 1] = id
          out[#out + 1] = token
          out[#out + 1] = costs[j]
        end
        redis.call('HSET', key('tokens'), unpack(tokens))
        local added = redis.call('ZADD', key('leases'), unpack(deadlines))
        leased[tenant] = (leased[tenant] or 0) + added
        if running[tenant] then
          running[tenant] = running[tenant] + added
        end
      end
    end
  end
  if full then
    break
  end
end
for r = 0, LOWEST_RANK do
  if clocks[r] > clocks_read[r] then
    redis.call('HSET', key('vclock'), r, clocks[r])
  end
end
for tenant, n in pairs(leased) do
  count_leases(tenant, n)
end
return out
