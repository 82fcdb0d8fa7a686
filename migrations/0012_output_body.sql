-- Small outputs live in Postgres instead of one S3 object each (issue 22): the output's exact
-- bytes, when the worker kept them here (at most TERN_OUTPUT_IN_POSTGRES_MAX_BYTES, 16 KiB by
-- default); jobs.output then has no key. Served by GET /v1/outputs/{id}, a signed link.
ALTER TABLE jobs ADD COLUMN output_body bytea;
