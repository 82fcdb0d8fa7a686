-- Every statement that adds to job timelines notifies channel `tern_job_events` with the ids of
-- the jobs it touched, comma-separated, at most 200 to a notification (a payload holds 8,000
-- bytes): each API process listens on one connection and wakes the waits and streams of those
-- jobs (api/src/job_watch.rs), instead of each of them polling Postgres. Notifications are sent
-- at commit, so a woken watch reads what woke it.
CREATE FUNCTION tern_notify_job_events() RETURNS trigger LANGUAGE plpgsql AS $$
DECLARE
    ids text;
BEGIN
    FOR ids IN
        SELECT string_agg(job_id, ',')
        FROM (SELECT job_id, (row_number() OVER ()) - 1 AS n
              FROM (SELECT DISTINCT job_id::text AS job_id FROM added) jobs) numbered
        GROUP BY n / 200
    LOOP
        PERFORM pg_notify('tern_job_events', ids);
    END LOOP;
    RETURN NULL;
END
$$;

CREATE TRIGGER job_events_notify AFTER INSERT ON job_events
    REFERENCING NEW TABLE AS added
    FOR EACH STATEMENT EXECUTE FUNCTION tern_notify_job_events();
