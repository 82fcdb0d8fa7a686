-- Extend a worker's leases and tell it which of its jobs were canceled or lost.
-- KEYS[1] leases zset   KEYS[2] lease tokens hash   KEYS[3] canceled set
-- ARGV[1] lease (ms), then per job: id, fencing token
-- Returns one status per job: 0 held (extended), 1 lost (another lease holds it), 2 held but
-- cancel requested. A lease Redis no longer knows (it lost its data) is restored: Postgres
-- still fences the outcome by token.
local lease_ms = tonumber(ARGV[1])
local deadline = now_ms() + lease_ms
local out = {}
for i = 2, #ARGV, 2 do
  local id, token = ARGV[i], ARGV[i + 1]
  local current = redis.call('HGET', KEYS[2], id)
  if current == false or current == token then
    redis.call('HSET', KEYS[2], id, token)
    redis.call('ZADD', KEYS[1], deadline, id)
    if redis.call('SISMEMBER', KEYS[3], id) == 1 then
      out[#out + 1] = 2
    else
      out[#out + 1] = 0
    end
  else
    out[#out + 1] = 1
  end
end
return out
