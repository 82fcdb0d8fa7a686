-- Small outputs live in Postgres instead of one S3 object each (issue 22): the output's exact
-- bytes, when the worker kept them here (at most TERN_OUTPUT_IN_POSTGRES_MAX_BYTES, 16 KiB by
-- default); jobs.output then has no key. Served by GET /outputs/{id}, a signed link.
ALTER TABLE jobs ADD COLUMN output_body bytea;

-- Every job is one insert and two updates, each a dead tuple once the next lands: vacuum and
-- analyse the queue's tables long before autovacuum's default 20% of a large table is dead.
ALTER TABLE jobs SET (autovacuum_vacuum_scale_factor = 0.02, autovacuum_analyze_scale_factor = 0.02);
ALTER TABLE job_events SET (autovacuum_vacuum_scale_factor = 0.05, autovacuum_analyze_scale_factor = 0.05);
