-- The webhook outbox without a join on `jobs` (issue 22). The trigger of 0004 joined the
-- statement's new events to `jobs`; on a young table whose statistics lag (a fresh deployment,
-- or autovacuum off) the planner hashed the whole table for that join on every batch, and the
-- outbox cost more than the state changes it followed, growing with the table. Now each event
-- that can be delivered looks its job up by key: one probe of a partial index that only jobs
-- with their own webhook are in, and the tenant only while some endpoint is registered.
-- Events that no webhook is sent for (`queued`, `retrying`) are dropped before any lookup.

CREATE INDEX jobs_with_webhook ON jobs (id) WHERE webhook IS NOT NULL;

CREATE OR REPLACE FUNCTION tern_webhook_outbox() RETURNS trigger LANGUAGE plpgsql AS $$
DECLARE
    endpoints boolean := EXISTS (SELECT 1 FROM webhook_endpoints WHERE disabled_at IS NULL);
BEGIN
    WITH named AS (
        SELECT e.id AS event_id, e.job_id, CASE e.state
            WHEN 'running' THEN 'job.started'
            WHEN 'succeeded' THEN 'job.succeeded'
            WHEN 'failed' THEN 'job.failed'
            WHEN 'canceled' THEN 'job.canceled'
        END AS name
        FROM new_events e
        WHERE e.state IN ('running', 'succeeded', 'failed', 'canceled')
    ), ev AS MATERIALIZED (
        SELECT n.event_id, n.job_id, n.name,
               (SELECT j.webhook FROM jobs j WHERE j.id = n.job_id AND j.webhook IS NOT NULL) AS webhook,
               CASE WHEN endpoints THEN (SELECT j.tenant FROM jobs j WHERE j.id = n.job_id) END AS tenant
        FROM named n
    )
    INSERT INTO webhook_deliveries (id, job_id, event, url, endpoint_id, created_at)
    SELECT gen_random_uuid(), job_id, name, url, endpoint_id, clock_timestamp() FROM (
        -- The job's own webhook.
        SELECT ev.event_id, ev.job_id, ev.name, ev.webhook->>'url' AS url, NULL::uuid AS endpoint_id
        FROM ev
        WHERE ev.webhook IS NOT NULL
          AND NOT coalesce((ev.webhook->>'disabled')::boolean, false)  -- set when the receiver said 410
          AND (NOT (ev.webhook ? 'events') OR (ev.webhook->'events') ? ev.name)
        UNION ALL
        -- The tenant's endpoints.
        SELECT ev.event_id, ev.job_id, ev.name, w.url, w.id
        FROM ev JOIN webhook_endpoints w ON w.tenant = ev.tenant AND w.disabled_at IS NULL
        WHERE endpoints AND (w.events IS NULL OR ev.name = ANY (w.events))
    ) d
    ORDER BY event_id;
    RETURN NULL;
END $$;
