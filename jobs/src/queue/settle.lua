-- Clear leases after Postgres recorded how their jobs ended, and requeue retries.
-- KEYS[1] the kind's key base
-- ARGV per job 3 values: id, fencing token, action:
--   'done'     finished for good: forget the job
--   'at:<ms>'  due again at that time (a retry, or a released job with its time = now)
--   'drop'     Postgres refused this lease: release it if it is still ours, keep the job;
--              a job then in no set and under no lease (canceled or finished, its start
--              refused) loses its metadata too, which would otherwise stay for good
-- A lease is only cleared under its own token, so a stale worker never frees a newer lease.
-- The whole batch is read with one command per hash or set and written likewise, not a few
-- commands per job.
local ids = {}
for i = 1, #ARGV, 3 do
  ids[#ids + 1] = ARGV[i]
end
local metas = redis.call('HMGET', key('meta'), unpack(ids))
local tokens = redis.call('HMGET', key('tokens'), unpack(ids))
local unlease, tenants, forget, delayed, dropped = {}, {}, {}, {}, {}
for n, id in ipairs(ids) do
  local token, action = ARGV[3 * n - 1], ARGV[3 * n]
  if tokens[n] == token then
    unlease[#unlease + 1] = id
    tenants[#tenants + 1] = metas[n] and meta_tenant(metas[n]) or false
  end
  if action == 'drop' then
    dropped[#dropped + 1] = id
  elseif action == 'done' then
    forget[#forget + 1] = id
  elseif string.sub(action, 1, 3) == 'at:' then
    delayed[#delayed + 1] = tonumber(string.sub(action, 4))
    delayed[#delayed + 1] = id
  end
end
lease_remove_many(unlease, tenants)
redis.call('HDEL', key('progress'), unpack(ids))
if #forget > 0 then
  redis.call('HDEL', key('meta'), unpack(forget))
  redis.call('SREM', key('canceled'), unpack(forget))
end
if #delayed > 0 then
  redis.call('ZADD', key('delayed'), unpack(delayed))
end
for _, id in ipairs(dropped) do
  if not redis.call('ZSCORE', key('leases'), id) and not is_ready(id) and not redis.call('ZSCORE', key('delayed'), id) then
    redis.call('HDEL', key('meta'), id)
  end
end
return 1
