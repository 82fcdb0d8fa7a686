-- Put back jobs that Postgres holds as unfinished but Redis does not know (Redis lost its
-- data, or a process died between a Postgres commit and the matching Redis call).
-- KEYS[1] ready zset   KEYS[2] delayed zset   KEYS[3] leases zset   KEYS[4] meta hash
-- KEYS[5] seq counter  KEYS[6] lease tokens hash
-- ARGV[1] aging step (ms)   ARGV[2] lease (ms)
-- then per job 5 values: id, rank, cost, run_at (ms; 0 = now), lease token ('' unless running)
-- A running job gets its lease back (its worker keeps heartbeating it, or it expires and is
-- reaped); a waiting job goes back to its ready or delayed set. Jobs Redis knows are untouched,
-- so nothing is queued twice. Returns the number of jobs restored.
local step, lease_ms = tonumber(ARGV[1]), tonumber(ARGV[2])
local now = now_ms()
local restored = 0
for i = 3, #ARGV, 5 do
  local id, rank, cost = ARGV[i], tonumber(ARGV[i + 1]), ARGV[i + 2]
  local run_at, token = tonumber(ARGV[i + 3]), ARGV[i + 4]
  local leased = redis.call('ZSCORE', KEYS[3], id)
  if token ~= '' then
    if not leased then
      redis.call('HSET', KEYS[4], id, rank .. ':' .. cost)
      redis.call('HSET', KEYS[6], id, token)
      redis.call('ZADD', KEYS[3], now + lease_ms, id)
      restored = restored + 1
    end
  elseif not leased and not redis.call('ZSCORE', KEYS[1], id) and not redis.call('ZSCORE', KEYS[2], id) then
    admit(KEYS[1], KEYS[2], KEYS[4], KEYS[5], id, rank, cost, run_at, now, step)
    restored = restored + 1
  end
end
return restored
