-- Take leases whose deadline passed (their worker died or stalled).
-- KEYS[1] leases zset   KEYS[2] lease tokens hash
-- ARGV[1] max leases to take
-- Returns a flat array: id, fencing token ('' if unknown), per expired lease. Each expired lease
-- is taken by exactly one caller, so several reapers may run at once.
local expired = redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', now_ms(), 'LIMIT', 0, tonumber(ARGV[1]))
local out = {}
for _, id in ipairs(expired) do
  redis.call('ZREM', KEYS[1], id)
  local token = redis.call('HGET', KEYS[2], id)
  redis.call('HDEL', KEYS[2], id)
  out[#out + 1] = id
  out[#out + 1] = token or ''
end
return out
