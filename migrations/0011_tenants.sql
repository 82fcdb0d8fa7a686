-- How tenants share the workers. Within a priority, a kind's ready jobs are served to tenants
-- in proportion to their weight (on job cost: windows, tokens), and a tenant's leased jobs of
-- one kind stop at max_running. A tenant without a row has weight 1 and no cap. Postgres holds
-- the truth; the reconciler copies it into each kind's Redis hashes, which the pull reads.
CREATE TABLE tenants (
    tenant      text PRIMARY KEY,
    weight      integer NOT NULL DEFAULT 1 CHECK (weight BETWEEN 1 AND 1000),
    max_running integer CHECK (max_running > 0),
    updated_at  timestamptz NOT NULL DEFAULT now()
);
