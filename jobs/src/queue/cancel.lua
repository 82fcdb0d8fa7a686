-- Reflect a cancel that Postgres recorded.
-- KEYS[1] ready zset   KEYS[2] delayed zset   KEYS[3] meta hash   KEYS[4] canceled set
-- KEYS[5] leases zset  KEYS[6] lease tokens hash
-- ARGV[1] job id   ARGV[2] 'waiting' (it is canceled: remove it, with any lease a worker took
-- but never started under, since Postgres will refuse that start) or 'running' (flag it for its
-- worker, which sees the flag on its next heartbeat)
if ARGV[2] == 'waiting' then
  redis.call('ZREM', KEYS[1], ARGV[1])
  redis.call('ZREM', KEYS[2], ARGV[1])
  redis.call('HDEL', KEYS[3], ARGV[1])
  redis.call('ZREM', KEYS[5], ARGV[1])
  redis.call('HDEL', KEYS[6], ARGV[1])
else
  redis.call('SADD', KEYS[4], ARGV[1])
end
return 1
