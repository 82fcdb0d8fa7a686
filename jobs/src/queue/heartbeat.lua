-- Extend a worker's leases and tell it which of its jobs were canceled or lost.
-- KEYS[1] the kind's key base (leases, lease tokens, canceled set, and the `restored` marker
-- the reconciler sets once it has put back what Postgres holds)
-- ARGV[1] lease (ms), then per job: id, fencing token
-- Returns one status per job: 0 held (extended), 1 lost (another lease holds it, or it was
-- reaped or settled), 2 held but cancel requested, 3 unconfirmed: Redis lost its data and the
-- reconciler has not restored the leases yet. A heartbeat never recreates a lease: only the
-- reconciler does, with the token Postgres holds, so a stale worker cannot take a job back
-- from a reaper or from the worker that holds it now.
local lease_ms = tonumber(ARGV[1])
local deadline = now_ms() + lease_ms
local restored = redis.call('EXISTS', key('restored')) == 1
local out = {}
for i = 2, #ARGV, 2 do
  local id, token = ARGV[i], ARGV[i + 1]
  local current = redis.call('HGET', key('tokens'), id)
  if current == false and not restored then
    out[#out + 1] = 3
  elseif current == token then
    -- XX: a heartbeat extends a lease, never makes one (lease_add does, counting it)
    redis.call('ZADD', key('leases'), 'XX', deadline, id)
    if redis.call('SISMEMBER', key('canceled'), id) == 1 then
      out[#out + 1] = 2
    else
      out[#out + 1] = 0
    end
  else
    out[#out + 1] = 1
  end
end
return out
