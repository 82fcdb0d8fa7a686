-- Model versions an admin registers per kind for hot swaps. At most one candidate (being rolled
-- out), one active and one previous (kept for rollback) per kind; a kind with no active version
-- runs the model each worker was started with.
CREATE TABLE model_versions (
    id           uuid PRIMARY KEY,
    kind         text NOT NULL CHECK (kind IN ('transcribe', 'embed', 'generate')),
    model        text NOT NULL,                 -- folder under the models directory or hf:OWNER/NAME
    state        text NOT NULL CHECK (state IN ('candidate', 'active', 'previous', 'retired', 'failed')),
    error        text,                          -- why a candidate failed
    created_at   timestamptz NOT NULL DEFAULT now(),
    activated_at timestamptz
);
CREATE UNIQUE INDEX model_versions_one_per_kind ON model_versions (kind, state)
    WHERE state IN ('candidate', 'active', 'previous');

-- Where each worker stands with each version: loading, health_check, ready, active, deprecated
-- (replaced, still resident for an instant rollback) or failed.
CREATE TABLE worker_models (
    worker_id           text NOT NULL,
    version_id          uuid NOT NULL REFERENCES model_versions (id) ON DELETE CASCADE,
    state               text NOT NULL
                        CHECK (state IN ('loading', 'health_check', 'ready', 'active', 'deprecated', 'failed')),
    error               text,
    -- Batches the worker ran on the old version while this one loaded: none of them waited.
    batches_during_load bigint NOT NULL DEFAULT 0,
    load_ms             bigint,
    updated_at          timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (worker_id, version_id)
);
