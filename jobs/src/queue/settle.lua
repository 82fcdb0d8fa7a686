-- Clear leases after Postgres recorded how their jobs ended, and requeue retries.
-- KEYS[1] the kind's key base
-- ARGV per job 3 values: id, fencing token, action:
--   'done'     finished for good: forget the job
--   'at:<ms>'  due again at that time (a retry, or a released job with its time = now)
--   'drop'     Postgres refused this lease: release it if it is still ours, keep the job
-- A lease is only cleared under its own token, so a stale worker never frees a newer lease.
for i = 1, #ARGV, 3 do
  local id, token, action = ARGV[i], ARGV[i + 1], ARGV[i + 2]
  local meta = redis.call('HGET', key('meta'), id)
  if redis.call('HGET', key('tokens'), id) == token then
    lease_remove(id, meta and meta_tenant(meta) or 'default')
  end
  redis.call('HDEL', key('progress'), id)
  if action == 'done' then
    redis.call('HDEL', key('meta'), id)
    redis.call('SREM', key('canceled'), id)
  elseif string.sub(action, 1, 3) == 'at:' then
    redis.call('ZADD', key('delayed'), tonumber(string.sub(action, 4)), id)
  end
end
return 1
