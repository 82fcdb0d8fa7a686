-- Put back jobs that Postgres holds as unfinished but Redis does not know (Redis lost its
-- data, or a process died between a Postgres commit and the matching Redis call).
-- KEYS[1] the kind's key base
-- ARGV[1] aging step (ms)   ARGV[2] lease (ms)
-- then per job 6 values: id, rank, cost, tenant, run_at (ms; 0 = now), lease token ('' unless
-- running)
-- A running job gets its lease back (its worker keeps heartbeating it, or it expires and is
-- reaped); a waiting job goes back to its ready or delayed set. Jobs Redis knows are untouched,
-- so nothing is queued twice. Returns the number of jobs restored.
local step, lease_ms = tonumber(ARGV[1]), tonumber(ARGV[2])
local now = now_ms()
local restored = 0
for i = 3, #ARGV, 6 do
  local id, rank, cost, tenant = ARGV[i], tonumber(ARGV[i + 1]), ARGV[i + 2], ARGV[i + 3]
  local run_at, token = tonumber(ARGV[i + 4]), ARGV[i + 5]
  local leased = redis.call('ZSCORE', key('leases'), id)
  if token ~= '' then
    if not leased then
      redis.call('HSET', key('meta'), id, rank .. ':' .. cost .. ':' .. tenant)
      if lease_add(id, token, now + lease_ms) then
        count_leases(tenant, 1)
      end
      restored = restored + 1
    end
  elseif not leased and not is_ready(id) and not redis.call('ZSCORE', key('delayed'), id) then
    admit(id, rank, cost, tenant, run_at, now, step)
    restored = restored + 1
  end
end
return restored
