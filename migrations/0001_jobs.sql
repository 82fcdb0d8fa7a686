-- Jobs and their timelines. Postgres is the source of truth: Redis only holds what is queued.

CREATE TABLE jobs (
    id               uuid PRIMARY KEY,                 -- UUID v7: time-ordered, so it doubles as the list cursor
    kind             text NOT NULL,
    priority         text NOT NULL CHECK (priority IN ('urgent', 'high', 'normal', 'low')),
    state            text NOT NULL CHECK (state IN ('queued', 'scheduled', 'running', 'retrying',
                                                    'succeeded', 'failed', 'canceled')),
    input            jsonb NOT NULL,
    cost             integer NOT NULL DEFAULT 1 CHECK (cost > 0),
    attempts         integer NOT NULL DEFAULT 0,
    max_attempts     integer NOT NULL CHECK (max_attempts > 0),
    run_at           timestamptz,                      -- delayed start, or when the next retry is due
    timeout_ms       bigint NOT NULL CHECK (timeout_ms > 0),
    metadata         jsonb NOT NULL DEFAULT '{}'::jsonb,
    idempotency_key  text,
    request_sha256   text,                             -- fingerprint of the request that used the key
    created_at       timestamptz NOT NULL DEFAULT now(),
    state_changed_at timestamptz NOT NULL DEFAULT now(),
    started_at       timestamptz,
    finished_at      timestamptz,
    worker_id        text,
    lease_token      bigint,                           -- fencing token of the lease that may settle the job
    cancel_requested boolean NOT NULL DEFAULT false,
    error            jsonb,                            -- {code, message}
    output           jsonb                             -- {key, size, sha256, content_type}
);

CREATE UNIQUE INDEX jobs_idempotency_key ON jobs (idempotency_key) WHERE idempotency_key IS NOT NULL;
-- The reconciler walks the jobs that are not finished; keep that walk independent of history size.
CREATE INDEX jobs_active ON jobs (id) WHERE state IN ('queued', 'scheduled', 'running', 'retrying');
CREATE INDEX jobs_state_id ON jobs (state, id);
CREATE INDEX jobs_kind_id ON jobs (kind, id);

CREATE TABLE job_events (
    id        bigserial PRIMARY KEY,
    job_id    uuid NOT NULL REFERENCES jobs (id) ON DELETE CASCADE,
    at        timestamptz NOT NULL DEFAULT now(),
    state     text NOT NULL,          -- the state the job entered
    attempt   integer NOT NULL,
    worker_id text,
    detail    jsonb                   -- error or output summary, when there is one
);

CREATE INDEX job_events_job_id ON job_events (job_id, id);

-- When the retry after failed attempt `attempt` (1-based) is due: exponential backoff
-- min(cap, base * 2^(attempt-1)) with equal jitter (the second half random), so jobs that failed
-- together do not come back as a herd. Used by every transition to `retrying`, in the same
-- statement, so the worker and the lease reaper follow one policy.
CREATE FUNCTION tern_retry_at(attempt integer, base_ms bigint, cap_ms bigint) RETURNS timestamptz
LANGUAGE sql VOLATILE AS $$
    SELECT now() + make_interval(secs =>
        LEAST(cap_ms::float8, base_ms::float8 * power(2::float8, GREATEST(attempt, 1) - 1))
        * (0.5 + random() * 0.5) / 1000.0)
$$;
