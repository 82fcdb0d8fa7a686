-- `image` jobs (Stable Diffusion) have model versions for hot swaps, as the other model kinds do.
-- The check Postgres named for the column in 0006 is replaced by one that admits the kind.
ALTER TABLE model_versions DROP CONSTRAINT model_versions_kind_check;
ALTER TABLE model_versions ADD CONSTRAINT model_versions_kind_check
    CHECK (kind IN ('transcribe', 'embed', 'generate', 'image'));
