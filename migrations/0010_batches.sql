-- OpenAI's Files and Batch APIs over jobs.

-- A file a tenant uploaded (`batch` JSONL) or a batch wrote (`batch_output`). The bytes live in
-- object storage under `object_key`.
CREATE TABLE files (
    id text PRIMARY KEY,
    tenant text NOT NULL,
    purpose text NOT NULL,
    filename text NOT NULL,
    bytes bigint NOT NULL,
    object_key text NOT NULL,
    created_at timestamptz NOT NULL DEFAULT now()
);
CREATE INDEX files_tenant_created ON files (tenant, created_at DESC, id DESC);

-- A batch: each line of its input file becomes a job. A runner (in any API replica) claims a
-- batch that needs work (`next_check_at` passed, no live claim) to validate its file, submit
-- its lines, cancel its jobs or write its output files.
CREATE TABLE batches (
    id text PRIMARY KEY,
    tenant text NOT NULL,
    endpoint text NOT NULL,
    -- File ids are kept after a file is deleted (they then answer 404), as OpenAI keeps them.
    input_file_id text NOT NULL,
    completion_window text NOT NULL,
    -- The priority of its jobs.
    priority text NOT NULL,
    metadata jsonb,
    status text NOT NULL,
    -- Why validation failed: [{code, message, param, line}].
    errors jsonb,
    -- Lines in the input file, known once it is validated.
    total integer NOT NULL DEFAULT 0,
    -- Lines turned into jobs (or refused) so far, in file order.
    submitted integer NOT NULL DEFAULT 0,
    -- Lines answered and lines failed, fixed once the batch ended (counted live before).
    completed integer,
    failed integer,
    output_file_id text,
    error_file_id text,
    created_at timestamptz NOT NULL DEFAULT now(),
    expires_at timestamptz NOT NULL,
    in_progress_at timestamptz,
    finalizing_at timestamptz,
    completed_at timestamptz,
    failed_at timestamptz,
    expired_at timestamptz,
    cancelling_at timestamptz,
    cancelled_at timestamptz,
    next_check_at timestamptz NOT NULL DEFAULT now(),
    claimed_by text,
    claimed_until timestamptz
);
CREATE INDEX batches_tenant_created ON batches (tenant, created_at DESC, id DESC);
CREATE INDEX batches_open ON batches (next_check_at)
    WHERE status IN ('validating', 'in_progress', 'cancelling', 'finalizing');

-- One line of a batch: its job, or why it was refused before it became one.
CREATE TABLE batch_requests (
    batch_id text NOT NULL REFERENCES batches (id) ON DELETE CASCADE,
    line integer NOT NULL,
    custom_id text NOT NULL,
    job_id uuid,
    error_status integer,
    error_code text,
    error_message text,
    PRIMARY KEY (batch_id, line)
);
CREATE INDEX batch_requests_job ON batch_requests (job_id) WHERE job_id IS NOT NULL;
