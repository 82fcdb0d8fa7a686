-- Clear leases after Postgres recorded how their jobs ended, and requeue retries.
-- KEYS[1] leases zset   KEYS[2] delayed zset   KEYS[3] meta hash   KEYS[4] lease tokens hash
-- KEYS[5] canceled set   KEYS[6] progress hash
-- ARGV per job 3 values: id, fencing token, action:
--   'done'     finished for good: forget the job
--   'at:<ms>'  due again at that time (a retry, or a released job with its time = now)
--   'drop'     Postgres refused this lease: release it if it is still ours, keep the job
-- A lease is only cleared under its own token, so a stale worker never frees a newer lease.
for i = 1, #ARGV, 3 do
  local id, token, action = ARGV[i], ARGV[i + 1], ARGV[i + 2]
  if redis.call('HGET', KEYS[4], id) == token then
    redis.call('ZREM', KEYS[1], id)
    redis.call('HDEL', KEYS[4], id)
  end
  redis.call('HDEL', KEYS[6], id)
  if action == 'done' then
    redis.call('HDEL', KEYS[3], id)
    redis.call('SREM', KEYS[5], id)
  elseif string.sub(action, 1, 3) == 'at:' then
    redis.call('ZADD', KEYS[2], tonumber(string.sub(action, 4)), id)
  end
end
return 1
