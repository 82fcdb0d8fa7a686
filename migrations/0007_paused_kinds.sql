-- Kinds an admin paused. Postgres holds the truth; the Redis flag workers read is restored from
-- here by the reconciler, so a pause survives Redis losing its data.
CREATE TABLE paused_kinds (
    kind      text PRIMARY KEY,
    paused_at timestamptz NOT NULL DEFAULT now()
);
