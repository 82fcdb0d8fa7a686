-- Take leases whose deadline passed (their worker died or stalled).
-- KEYS[1] the kind's key base
-- ARGV[1] max leases to take
-- Returns a flat array: id, fencing token ('' if unknown), per expired lease. Each expired lease
-- is taken by exactly one caller, so several reapers may run at once.
local expired = redis.call('ZRANGEBYSCORE', key('leases'), '-inf', now_ms(), 'LIMIT', 0, tonumber(ARGV[1]))
local out = {}
for _, id in ipairs(expired) do
  local token = redis.call('HGET', key('tokens'), id)
  local meta = redis.call('HGET', key('meta'), id)
  lease_remove(id, meta and meta_tenant(meta) or 'default')
  out[#out + 1] = id
  out[#out + 1] = token or ''
end
return out
