-- Shared fragment, prepended to every queue script (not a script of its own).
--
-- now_ms(): Redis's own clock, so API replicas and workers with skewed clocks agree.
-- ready_score(now, rank, step, seq): the score of a job entering its ready set. Lower runs
-- first. A job of rank r (0 urgent .. 3 low) is placed r aging steps behind an urgent job
-- arriving at the same moment, so a low job that has waited 3 steps outranks a newly arrived
-- urgent one, and one that waited a step outranks new normal jobs: nothing starves. The enqueue
-- sequence (mod 4096) is folded into the low bits so jobs of equal priority stay FIFO within a
-- millisecond. Milliseconds count from 2025-01-01 so the score stays an exact integer in a double.
local function now_ms()
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end

local EPOCH_MS = 1735689600000

local function ready_score(now, rank, step, seq)
  return ((now - EPOCH_MS) + rank * step) * 4096 + (seq % 4096)
end

-- Job metadata is kept as "rank:cost:tenant" (tenant names hold no ':' but any other
-- character would do, as the tenant is all that follows the second colon). Metadata written
-- before tenants shared the queue is "rank:cost": its tenant reads as 'default'.
local function meta_rank(meta)
  return tonumber(string.match(meta, '^(%d+):'))
end

local function meta_cost(meta)
  return tonumber(string.match(meta, '^%d+:(%d+)'))
end

local function meta_tenant(meta)
  return string.match(meta, '^%d+:%d+:(.*)$') or 'default'
end

-- The next value of a kind's sequence, which numbers ready jobs (FIFO) and issues fencing
-- tokens. A missing counter means Redis lost its data: it restarts from the clock in
-- microseconds, above every token issued before the loss unless those averaged over one a
-- microsecond, so a stale worker never holds a token that is issued again (Postgres fences
-- outcomes by it). Microseconds since 1970 stay exact in Lua's doubles until the year 2255.
-- A script uses one kind's counter, so it is checked once per script call.
local seq_checked = false
local function next_seq(seq)
  if not seq_checked and redis.call('EXISTS', seq) == 0 then
    local t = redis.call('TIME')
    redis.call('SET', seq, tonumber(t[1]) * 1000000 + tonumber(t[2]))
  end
  seq_checked = true
  return redis.call('INCR', seq)
end
