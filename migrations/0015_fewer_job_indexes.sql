-- Two indexes fewer on `jobs` (issue 22). Every state change rewrites a job's row, and with it
-- an entry in every index of the table; `jobs_state_id` and `jobs_kind_id` together were about
-- a fifth of the Postgres time of a job's insert and settle. What they served:
-- - states that are not finished: `jobs_active` holds exactly those jobs, by id;
-- - failed (and canceled) jobs, which admins list, count and retry: the partial index below,
--   which a job only enters when it ends so;
-- - succeeded jobs, most of any history: the primary key, newest first;
-- - a kind: the primary key newest first with the kind as a filter (per tenant,
--   `jobs_tenant_id`), quick for any kind that is not rare in the history.
DROP INDEX jobs_state_id;
DROP INDEX jobs_kind_id;
CREATE INDEX jobs_ended_badly ON jobs (id) WHERE state IN ('failed', 'canceled');
