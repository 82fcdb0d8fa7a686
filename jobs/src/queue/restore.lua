-- Put back jobs that Postgres holds as unfinished but Redis does not know (Redis lost its
-- data, or a process died between a Postgres commit and the matching Redis call).
-- KEYS[1] the kind's key base
-- ARGV[1] aging step (ms)   ARGV[2] lease (ms)   ARGV[3] hold (ms): after a loss of Redis
-- data, how long a waiting job is held back (one lease), else 0
-- then per job 6 values: id, rank, cost, tenant, run_at (ms; 0 = now), lease token ('' unless
-- running)
-- A running job gets its lease back (its worker keeps heartbeating it, or it expires and is
-- reaped), leaving any waiting set an earlier restore put it in; a waiting job goes back to
-- its ready or delayed set. After a loss a waiting job may be one a live worker holds with its
-- start not yet recorded (the lease that said so is gone): it is due only a lease from now, by
-- when that worker has recorded the start (its lease is then restored and it leaves the
-- delayed set), settled it, or been told its lease is lost and dropped it. Jobs Redis knows are
-- untouched, so nothing is queued twice. Then each tenant's running count is counted again
-- from the leases, as a loss or a lease released without its metadata may have left it wrong.
-- Returns the number of jobs restored.
local step, lease_ms, hold_ms = tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[3])
local now = now_ms()
local restored = 0
for i = 4, #ARGV, 6 do
  local id, rank, cost, tenant = ARGV[i], tonumber(ARGV[i + 1]), ARGV[i + 2], ARGV[i + 3]
  local run_at, token = tonumber(ARGV[i + 4]), ARGV[i + 5]
  local leased = redis.call('ZSCORE', key('leases'), id)
  if token ~= '' then
    if not leased then
      ready_remove(id, rank, tenant)
      redis.call('ZREM', key('delayed'), id)
      redis.call('HSET', key('meta'), id, rank .. ':' .. cost .. ':' .. tenant)
      lease_add(id, token, now + lease_ms)
      restored = restored + 1
    end
  elseif not leased and not is_ready(id) and not redis.call('ZSCORE', key('delayed'), id) then
    if hold_ms > 0 then
      run_at = math.max(run_at, now + hold_ms)
    end
    admit(id, rank, cost, tenant, run_at, now, step)
    restored = restored + 1
  end
end
recount_leases()
return restored
