-- Enqueue jobs of one kind (after Postgres committed them).
-- KEYS[1] the kind's key base
-- ARGV[1] aging step (ms), then per job 5 values: id, rank (0..3), cost, tenant, run_at (ms; 0 = now)
-- A job already leased or already waiting is left as it is, so enqueueing twice is harmless.
-- A job without metadata is neither (every path to the ready sets or a lease writes it first),
-- so only a known job is looked for in the sets. Returns the number of jobs added.
local step = tonumber(ARGV[1])
local now = now_ms()
local added = 0
for i = 2, #ARGV, 5 do
  local id, rank, cost, tenant, run_at = ARGV[i], tonumber(ARGV[i + 1]), ARGV[i + 2], ARGV[i + 3], tonumber(ARGV[i + 4])
  if redis.call('HEXISTS', key('meta'), id) == 0 or (not redis.call('ZSCORE', key('leases'), id) and not is_ready(id)
      and not redis.call('ZSCORE', key('delayed'), id)) then
    admit(id, rank, cost, tenant, run_at, now, step)
    added = added + 1
  end
end
return added
