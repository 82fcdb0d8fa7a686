-- Admin views: throughput over the last minutes reads recently finished jobs only.
CREATE INDEX jobs_finished_at ON jobs (finished_at) WHERE finished_at IS NOT NULL;

-- Workers report here every couple of seconds; one that stops reporting for a lease period is
-- shown as lost (the reaper has returned its jobs to the queue by then).
CREATE TABLE workers (
    id             text PRIMARY KEY,
    host           text NOT NULL,
    kinds          text[] NOT NULL,
    device         text NOT NULL,
    started_at     timestamptz NOT NULL DEFAULT now(),
    last_heartbeat timestamptz NOT NULL DEFAULT now(),
    stopped_at     timestamptz,                      -- set on a clean shutdown
    draining       boolean NOT NULL DEFAULT false,   -- set by an admin: finish the batch, pull no more
    status         jsonb NOT NULL DEFAULT '{}'::jsonb -- memory, models, batch in hand, jobs done
);
