-- Endpoints a tenant registers: each receives the events of all the tenant's jobs, signed with
-- its own secrets (newest first; two during a rotation).

CREATE TABLE webhook_endpoints (
    id          uuid PRIMARY KEY,
    tenant      text NOT NULL,
    url         text NOT NULL,
    events      text[],                   -- NULL: job.started, job.succeeded, job.failed, job.canceled
    secrets     text[] NOT NULL,          -- whsec_...; the first is current
    created_at  timestamptz NOT NULL DEFAULT now(),
    disabled_at timestamptz               -- set by a 410 or by its owner
);

CREATE INDEX webhook_endpoints_tenant ON webhook_endpoints (tenant) WHERE disabled_at IS NULL;

ALTER TABLE webhook_deliveries ADD COLUMN endpoint_id uuid REFERENCES webhook_endpoints (id) ON DELETE CASCADE;

CREATE OR REPLACE FUNCTION tern_webhook_outbox() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    WITH ev AS (
        SELECT e.id AS event_id, e.job_id, j.tenant, j.webhook, CASE e.state
            WHEN 'running' THEN 'job.started'
            WHEN 'succeeded' THEN 'job.succeeded'
            WHEN 'failed' THEN 'job.failed'
            WHEN 'canceled' THEN 'job.canceled'
        END AS name
        FROM new_events e JOIN jobs j ON j.id = e.job_id
    )
    INSERT INTO webhook_deliveries (id, job_id, event, url, endpoint_id, created_at)
    SELECT gen_random_uuid(), job_id, name, url, endpoint_id, clock_timestamp() FROM (
        -- The job's own webhook.
        SELECT ev.event_id, ev.job_id, ev.name, ev.webhook->>'url' AS url, NULL::uuid AS endpoint_id
        FROM ev
        WHERE ev.name IS NOT NULL AND ev.webhook IS NOT NULL
          AND NOT coalesce((ev.webhook->>'disabled')::boolean, false)  -- set when the receiver said 410
          AND (NOT (ev.webhook ? 'events') OR (ev.webhook->'events') ? ev.name)
        UNION ALL
        -- The tenant's endpoints.
        SELECT ev.event_id, ev.job_id, ev.name, w.url, w.id
        FROM ev JOIN webhook_endpoints w ON w.tenant = ev.tenant AND w.disabled_at IS NULL
        WHERE ev.name IS NOT NULL AND (w.events IS NULL OR ev.name = ANY (w.events))
    ) d
    ORDER BY event_id;
    RETURN NULL;
END $$;
