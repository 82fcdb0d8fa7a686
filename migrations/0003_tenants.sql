-- Tenants and API keys. Every job belongs to the tenant of the key that submitted it; no
-- endpoint shows or touches another tenant's jobs.

CREATE TABLE api_keys (
    id           uuid PRIMARY KEY,
    prefix       text NOT NULL UNIQUE,     -- the visible part, `tern_XXXXXXXX`: names the key in lists and logs
    sha256       text NOT NULL,            -- hex SHA-256 of the whole key; the key itself is never stored
    tenant       text NOT NULL,
    scopes       text[] NOT NULL,          -- jobs:write, jobs:read, admin
    name         text,
    created_at   timestamptz NOT NULL DEFAULT now(),
    revoked_at   timestamptz,
    last_used_at timestamptz
);

ALTER TABLE jobs ADD COLUMN tenant text NOT NULL DEFAULT 'default';
CREATE INDEX jobs_tenant_id ON jobs (tenant, id DESC);
-- Counting a tenant's waiting jobs for its cap reads only waiting rows.
CREATE INDEX jobs_tenant_waiting ON jobs (tenant) WHERE state IN ('queued', 'scheduled', 'retrying');
