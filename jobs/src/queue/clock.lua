-- Shared fragment, prepended to every queue script (not a script of its own).
--
-- now_ms(): Redis's own clock, so API replicas and workers with skewed clocks agree.
-- ready_score(place, rank, step): the score of a job entering its ready set, from its place in
-- the kind's arrival order (next_arrival). Lower runs first. A job of rank r (0 urgent .. 3 low)
-- is placed r aging steps behind an urgent job arriving at the same moment, so a low job that
-- has waited 3 steps outranks a newly arrived urgent one, and one that waited a step outranks
-- new normal jobs: nothing starves. Milliseconds count from 2025-01-01, 4,096 places each, so
-- the score stays an exact integer in a double.
local function now_ms()
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end

local EPOCH_MS = 1735689600000

local function ready_score(place, rank, step)
  return place + rank * step * 4096
end

-- The first of `n` consecutive places in a kind's arrival order (key `arrivals`): the
-- milliseconds since EPOCH_MS times 4,096, or one past the last place issued where that is
-- later. Places only grow, so jobs of one priority leave in the order they came, even when more
-- than 4,096 arrive in a millisecond (they borrow the next one's places) or Redis's clock steps
-- back. The sequence below is not used for this: it starts from the clock in microseconds, and
-- its value mod 4,096 wrapped inside batches and put later jobs first.
local function next_arrival(arrivals, now, n)
  local last = tonumber(redis.call('GET', arrivals) or '0')
  local first = math.max((now - EPOCH_MS) * 4096, last + 1)
  redis.call('SET', arrivals, first + n - 1)
  return first
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

-- The next value of a kind's sequence, which issues fencing tokens. A missing counter means
-- Redis lost its data: it restarts from the clock in microseconds, above every token issued
-- before the loss unless those averaged over one a microsecond, so a stale worker never holds
-- a token that is issued again (Postgres fences outcomes by it). Microseconds since 1970 stay
-- exact in Lua's doubles until the year 2255.
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
