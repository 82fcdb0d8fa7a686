-- Estimate how many ready jobs run before one, under fair sharing.
-- KEYS[1] the kind's key base
-- ARGV[1] job id
-- Returns -1 unless the job is ready. Otherwise its tenant's ready jobs ahead of it (k, by
-- score, across ranks), plus from each other tenant with jobs ready as many of theirs ahead of
-- it as its weight earns while k of the job's own tenant run (k × their weight / its weight).
-- An estimate: it leaves out the tenants' current leads in virtual time and their caps.
local id = ARGV[1]
local meta = redis.call('HGET', key('meta'), id)
if not meta then
  return -1
end
local score = redis.call('ZSCORE', rank_key(meta_rank(meta)), id)
if not score then
  return -1
end
local below = '(' .. score
local function ahead(tenant)
  local n = 0
  for rank = 0, LOWEST_RANK do
    n = n + redis.call('ZCOUNT', tenant_key(rank, tenant), '-inf', below)
  end
  return n
end
local own = meta_tenant(meta)
local k = ahead(own)
local total = k
local seen = { [own] = true }
for rank = 0, LOWEST_RANK do
  for _, tenant in ipairs(redis.call('ZRANGE', turns_key(rank), 0, -1)) do
    if not seen[tenant] then
      seen[tenant] = true
      total = total + math.min(ahead(tenant), math.floor(k * tenant_weight(tenant) / tenant_weight(own) + 0.5))
    end
  end
end
return total
