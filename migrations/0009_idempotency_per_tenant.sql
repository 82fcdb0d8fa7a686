-- Idempotency keys belong to their tenant: one tenant's key neither collides with another's
-- nor tells it that the key was used.
DROP INDEX jobs_idempotency_key;
CREATE UNIQUE INDEX jobs_tenant_idempotency_key ON jobs (tenant, idempotency_key) WHERE idempotency_key IS NOT NULL;
