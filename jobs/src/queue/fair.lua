-- Shared fragment, prepended after clock.lua to every queue script: where a kind's jobs wait
-- and how tenants share the kind's workers.
--
-- KEYS[1] of a queue script is the kind's key base (`{prefix}:{kind}`, the kind in braces as a
-- hash tag); every key hangs off it, so one script touches one cluster slot.
--
-- Ready jobs wait in a sorted set per priority rank, `ready:<rank>`, scored by ready_score, and
-- again in one per rank and tenant, `tq:<rank>:<tenant>`, with the same score. The heads of the
-- rank sets say which rank is served next: priority with aging, exactly as with one set.
-- Within that rank tenants take turns by virtual time: `vt:<rank>` holds each tenant with jobs
-- ready there and the cost it has been served divided by its weight (`weights`, default 1); the
-- tenant with the least goes next. That is deficit round robin with an infinitely small
-- quantum: work done follows the weights whatever the jobs' costs (1 window or 4,000 tokens),
-- and a choice costs O(log tenants). A tenant that arrives starts at the rank's clock (`vclock`,
-- the virtual time last served), so idleness earns no credit; one that leaves while ahead of
-- the clock keeps its lead (`vsaved:<rank>`), so leaving and coming back cannot jump the line.
-- A tenant whose leased jobs (`running`) reach its cap (`caps`) is passed over until one ends.

local BASE = KEYS[1]
local LOWEST_RANK = 3 -- ranks run 0 (urgent) .. 3 (low)

local function key(name)
  return BASE .. ':' .. name
end

local function rank_key(rank)
  return BASE .. ':ready:' .. rank
end

local function tenant_key(rank, tenant)
  return BASE .. ':tq:' .. rank .. ':' .. tenant
end

local function turns_key(rank)
  return BASE .. ':vt:' .. rank
end

local function rank_clock(rank)
  return tonumber(redis.call('HGET', key('vclock'), rank) or '0')
end

-- A tenant's weight: `weights` holds those other than 1.
local function tenant_weight(tenant)
  local w = tonumber(redis.call('HGET', key('weights'), tenant) or '1') or 1
  return w > 0 and w or 1
end

local in_turns = {} -- rank:tenant -> true: known to take turns, within this script call

-- A tenant with nothing ready in `rank` any more leaves its turns, keeping a lead over the
-- clock (virtual time `v`) for when it returns. `clock`: the rank's clock if the caller holds
-- it (nil: read it).
local function leave_turns(rank, tenant, v, clock)
  in_turns[rank .. ':' .. tenant] = nil
  redis.call('ZREM', turns_key(rank), tenant)
  if v > (clock or rank_clock(rank)) then
    redis.call('HSET', BASE .. ':vsaved:' .. rank, tenant, v)
  end
end

-- A tenant with jobs ready in `rank` takes turns there, if it did not yet.
local function join_turns(rank, tenant)
  local turns = turns_key(rank)
  if not in_turns[rank .. ':' .. tenant] and not redis.call('ZSCORE', turns, tenant) then
    local saved = BASE .. ':vsaved:' .. rank
    local lead = tonumber(redis.call('HGET', saved, tenant) or '0')
    redis.call('HDEL', saved, tenant)
    redis.call('ZADD', turns, math.max(rank_clock(rank), lead), tenant)
  end
  in_turns[rank .. ':' .. tenant] = true
end

-- Puts a job in its ready sets; its tenant joins the rank's turns if it was not in them.
local function ready_add(id, rank, tenant, score)
  redis.call('ZADD', rank_key(rank), score, id)
  redis.call('ZADD', tenant_key(rank, tenant), score, id)
  join_turns(rank, tenant)
end

-- Takes a job out of its ready sets; true if it was ready.
local function ready_remove(id, rank, tenant)
  if redis.call('ZREM', rank_key(rank), id) == 0 then
    return false
  end
  local tq = tenant_key(rank, tenant)
  redis.call('ZREM', tq, id)
  if redis.call('EXISTS', tq) == 0 then
    local v = redis.call('ZSCORE', turns_key(rank), tenant)
    if v then
      leave_turns(rank, tenant, tonumber(v))
    end
  end
  return true
end

-- Whether a job is ready. Every ready job has metadata (admit writes it first, and it goes
-- only once the job is done or canceled), which names the one rank set to look in.
local function is_ready(id)
  local meta = redis.call('HGET', key('meta'), id)
  return meta ~= false and redis.call('ZSCORE', rank_key(meta_rank(meta)), id) ~= false
end

-- Leases a job under `token` until `deadline`; true if it held no lease. The caller counts
-- a new lease against its tenant's cap (count_leases).
local function lease_add(id, token, deadline)
  redis.call('HSET', key('tokens'), id, token)
  return redis.call('ZADD', key('leases'), deadline, id) == 1
end

local function count_leases(tenant, n)
  redis.call('HINCRBY', key('running'), tenant, n)
end

-- Drops the leases of jobs `ids` (tenants[n] the tenant of ids[n], false where unknown: the
-- job's metadata is gone) that have one, and counts them off their tenants: a few commands
-- for the whole list. A lease of no known tenant is counted off none (the next restore
-- counts every tenant's leases again).
local function lease_remove_many(ids, tenants)
  if #ids == 0 then
    return
  end
  local leased = redis.call('ZMSCORE', key('leases'), unpack(ids))
  local freed = {}
  for n = 1, #ids do
    local tenant = tenants[n]
    if leased[n] and tenant then
      freed[tenant] = (freed[tenant] or 0) + 1
    end
  end
  redis.call('HDEL', key('tokens'), unpack(ids))
  redis.call('ZREM', key('leases'), unpack(ids))
  for tenant, k in pairs(freed) do
    if redis.call('HINCRBY', key('running'), tenant, -k) <= 0 then
      redis.call('HDEL', key('running'), tenant)
    end
  end
end

-- Sets each tenant's running count to its number of leases (the metadata names a lease's
-- tenant; a lease without metadata counts for no tenant).
local function recount_leases()
  local ids = redis.call('ZRANGE', key('leases'), 0, -1)
  local counts = {}
  for n = 1, #ids, 1000 do
    local part = {unpack(ids, n, math.min(n + 999, #ids))}
    local metas = redis.call('HMGET', key('meta'), unpack(part))
    for m = 1, #part do
      if metas[m] then
        local tenant = meta_tenant(metas[m])
        counts[tenant] = (counts[tenant] or 0) + 1
      end
    end
  end
  redis.call('DEL', key('running'))
  for tenant, k in pairs(counts) do
    redis.call('HSET', key('running'), tenant, k)
  end
end

-- Drops a job's lease, if it has one.
local function lease_remove(id, tenant)
  lease_remove_many({id}, {tenant})
end

-- admit() for many jobs at once, each {id, rank, cost, tenant, run_at}, with a few commands per
-- batch instead of five per job (the queue's Redis time per job was mostly these calls). The
-- jobs take places in the arrival order in the order given, as one by one.
local function admit_many(jobs, now, step)
  if #jobs == 0 then
    return
  end
  local metas, delayed, ready = {}, {}, {}
  for _, j in ipairs(jobs) do
    metas[#metas + 1] = j[1]
    metas[#metas + 1] = j[2] .. ':' .. j[3] .. ':' .. j[4]
    if j[5] > now then
      delayed[#delayed + 1] = j[5]
      delayed[#delayed + 1] = j[1]
    else
      ready[#ready + 1] = j
    end
  end
  redis.call('HSET', key('meta'), unpack(metas))
  if #delayed > 0 then
    redis.call('ZADD', key('delayed'), unpack(delayed))
  end
  if #ready == 0 then
    return
  end
  local first = next_arrival(key('arrivals'), now, #ready)
  -- Grouped by rank, and by rank and tenant: one ZADD per set.
  local by_rank, by_tenant, groups = {}, {}, {}
  for n, j in ipairs(ready) do
    local rank, tenant = j[2], j[4]
    local score = ready_score(first + n - 1, rank, step)
    by_rank[rank] = by_rank[rank] or {}
    local r = by_rank[rank]
    r[#r + 1] = score
    r[#r + 1] = j[1]
    local g = rank .. ':' .. tenant
    if not by_tenant[g] then
      by_tenant[g] = {}
      groups[#groups + 1] = {rank, tenant}
    end
    local t = by_tenant[g]
    t[#t + 1] = score
    t[#t + 1] = j[1]
  end
  for rank, members in pairs(by_rank) do
    redis.call('ZADD', rank_key(rank), unpack(members))
  end
  for _, g in ipairs(groups) do
    redis.call('ZADD', tenant_key(g[1], g[2]), unpack(by_tenant[g[1] .. ':' .. g[2]]))
    join_turns(g[1], g[2])
  end
end

-- Puts a waiting job in its delayed set (run_at still ahead) or its ready sets, and records its
-- metadata. Used by enqueue and restore.
local function admit(id, rank, cost, tenant, run_at, now, step)
  admit_many({{id, rank, cost, tenant, run_at}}, now, step)
end
