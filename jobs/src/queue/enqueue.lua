-- Enqueue jobs of one kind (after Postgres committed them).
-- KEYS[1] ready zset   KEYS[2] delayed zset   KEYS[3] leases zset   KEYS[4] meta hash
-- KEYS[5] seq counter
-- ARGV[1] aging step (ms), then per job 4 values: id, rank (0..3), cost, run_at (ms; 0 = now)
-- A job already leased or already waiting is left as it is, so enqueueing twice is harmless.
-- Returns the number of jobs added.
local step = tonumber(ARGV[1])
local now = now_ms()
local added = 0
for i = 2, #ARGV, 4 do
  local id, rank, cost, run_at = ARGV[i], tonumber(ARGV[i + 1]), ARGV[i + 2], tonumber(ARGV[i + 3])
  if not redis.call('ZSCORE', KEYS[3], id) and not redis.call('ZSCORE', KEYS[1], id)
      and not redis.call('ZSCORE', KEYS[2], id) then
    admit(KEYS[1], KEYS[2], KEYS[4], KEYS[5], id, rank, cost, run_at, now, step)
    added = added + 1
  end
end
return added
