-- Webhooks: a job may name a URL and the events it wants. Deliveries are an outbox: a trigger
-- on job_events writes them in the same transaction as the state change they report, so a crash
-- between the two cannot lose one; the API's dispatcher sends them (at least once, with retries).

ALTER TABLE jobs ADD COLUMN webhook jsonb;  -- {url, events?: [...]}; events absent = all

CREATE TABLE webhook_deliveries (
    id              uuid PRIMARY KEY,         -- the webhook-id header: the same on every retry
    job_id          uuid NOT NULL REFERENCES jobs (id) ON DELETE CASCADE,
    event           text NOT NULL,            -- job.started, job.succeeded, job.failed, job.canceled
    url             text NOT NULL,
    created_at      timestamptz NOT NULL DEFAULT clock_timestamp(),
    state           text NOT NULL DEFAULT 'pending'
                    CHECK (state IN ('pending', 'delivered', 'failed', 'disabled')),
    attempts        integer NOT NULL DEFAULT 0,
    next_attempt_at timestamptz NOT NULL DEFAULT clock_timestamp(),
    delivered_at    timestamptz,
    last_status     integer,
    last_error      text
);

CREATE INDEX webhook_deliveries_due ON webhook_deliveries (next_attempt_at) WHERE state = 'pending';
CREATE INDEX webhook_deliveries_job ON webhook_deliveries (job_id, created_at);

-- Every attempt: what the receiver answered and how long it took.
CREATE TABLE webhook_attempts (
    id          bigserial PRIMARY KEY,
    delivery_id uuid NOT NULL REFERENCES webhook_deliveries (id) ON DELETE CASCADE,
    at          timestamptz NOT NULL DEFAULT now(),
    status      integer,                      -- HTTP status; NULL when no answer came
    latency_ms  integer NOT NULL,
    error       text
);

CREATE INDEX webhook_attempts_delivery ON webhook_attempts (delivery_id, id);

-- One statement-level trigger: a batch of state changes costs one INSERT ... SELECT.
CREATE FUNCTION tern_webhook_outbox() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    INSERT INTO webhook_deliveries (id, job_id, event, url)
    SELECT gen_random_uuid(), e.job_id, ev.name, j.webhook->>'url'
    FROM new_events e
    JOIN jobs j ON j.id = e.job_id AND j.webhook IS NOT NULL
    CROSS JOIN LATERAL (SELECT CASE e.state
        WHEN 'running' THEN 'job.started'
        WHEN 'succeeded' THEN 'job.succeeded'
        WHEN 'failed' THEN 'job.failed'
        WHEN 'canceled' THEN 'job.canceled'
    END AS name) ev
    WHERE ev.name IS NOT NULL
      AND NOT coalesce((j.webhook->>'disabled')::boolean, false)  -- set when the receiver said 410
      AND (NOT (j.webhook ? 'events') OR (j.webhook->'events') ? ev.name)
    ORDER BY e.id;
    RETURN NULL;
END $$;

CREATE TRIGGER job_events_webhook_outbox AFTER INSERT ON job_events
    REFERENCING NEW TABLE AS new_events
    FOR EACH STATEMENT EXECUTE FUNCTION tern_webhook_outbox();
