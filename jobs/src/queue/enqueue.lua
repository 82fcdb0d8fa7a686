-- Enqueue jobs of one kind (after Postgres committed them).
-- KEYS[1] the kind's key base
-- ARGV[1] aging step (ms), then per job 5 values: id, rank (0..3), cost, tenant, run_at (ms; 0 = now)
-- A job already leased or already waiting is left as it is, so enqueueing twice is harmless.
-- A job without metadata is neither (every path to the ready sets or a lease writes it first),
-- so only a known job is looked for in the sets; the others, the usual case, are admitted
-- together. Returns the number of jobs added.
local step = tonumber(ARGV[1])
local now = now_ms()
local ids = {}
for i = 2, #ARGV, 5 do
  ids[#ids + 1] = ARGV[i]
end
local metas = redis.call('HMGET', key('meta'), unpack(ids))
local added, fresh, seen = 0, {}, {}
for n, id in ipairs(ids) do
  local i = 2 + (n - 1) * 5
  local rank, cost, tenant, run_at = tonumber(ARGV[i + 1]), ARGV[i + 2], ARGV[i + 3], tonumber(ARGV[i + 4])
  if not metas[n] then
    if not seen[id] then
      seen[id] = true
      fresh[#fresh + 1] = {id, rank, cost, tenant, run_at}
      added = added + 1
    end
  elseif not redis.call('ZSCORE', key('leases'), id) and not is_ready(id)
      and not redis.call('ZSCORE', key('delayed'), id) then
    admit(id, rank, cost, tenant, run_at, now, step)
    added = added + 1
  end
end
admit_many(fresh, now, step)
return added
