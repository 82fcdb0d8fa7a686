-- Reflect a cancel that Postgres recorded.
-- KEYS[1] the kind's key base
-- ARGV[1] job id   ARGV[2] 'waiting' (it is canceled: remove it, with any lease a worker took
-- but never started under, since Postgres will refuse that start) or 'running' (flag it for its
-- worker, which sees the flag on its next heartbeat)
local id = ARGV[1]
if ARGV[2] == 'waiting' then
  local meta = redis.call('HGET', key('meta'), id)
  local tenant = false
  if meta then
    tenant = meta_tenant(meta)
    ready_remove(id, meta_rank(meta), tenant)
  end
  redis.call('ZREM', key('delayed'), id)
  redis.call('HDEL', key('meta'), id)
  lease_remove(id, tenant)
else
  redis.call('SADD', key('canceled'), id)
end
return 1
