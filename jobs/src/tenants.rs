//! How tenants share the workers (`tenants` table): a weight for fair queueing within a priority
//! and a cap on each kind's running jobs. Postgres holds the truth; every change, and every
//! reconciler sweep, copies it into each kind's Redis hashes, where the pull reads it
//! (`queue/fair.lua`).

use crate::{Queue, Result, Store};
use chrono::{DateTime, Utc};
use serde::Serialize;
use sqlx::Row;

/// Weight of a tenant without a row.
pub const WEIGHT_DEFAULT: i32 = 1;
/// Largest weight: a tenant may get at most 1,000 times another's share.
pub const WEIGHT_MAX: i32 = 1000;
/// Largest `max_running`.
pub const MAX_RUNNING_MAX: i32 = 1_000_000;

/// Serialises changes with the reconciler's copy, so an older read never overwrites a newer
/// setting in Redis.
const SHARES_LOCK: i64 = 0x7465_726e_7368_6172; // "ternshar"

/// A tenant's share of the workers.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct TenantShare {
    pub tenant: String,
    /// Its share relative to other tenants' within a priority: weight 3 gets three times the
    /// work (in cost: windows, tokens) of weight 1 while both have jobs waiting. Default 1.
    pub weight: i32,
    /// Most jobs of one kind it may have running at once; `None`: no cap.
    pub max_running: Option<i32>,
}

/// A tenant as the admin API lists it: its share and what it has in flight.
#[derive(Debug, Clone, Serialize)]
pub struct TenantView {
    #[serde(flatten)]
    pub share: TenantShare,
    /// When an admin last set its share; `None`: never (defaults).
    pub updated_at: Option<DateTime<Utc>>,
    /// Jobs queued, scheduled or retrying.
    pub waiting: i64,
    pub running: i64,
}

impl Store {
    /// Every tenant with a share set or jobs unfinished, by name.
    pub async fn tenants(&self) -> Result<Vec<TenantView>> {
        let rows = sqlx::query(
            "WITH counts AS (
                 SELECT tenant,
                        count(*) FILTER (WHERE state IN ('queued', 'scheduled', 'retrying')) AS waiting,
                        count(*) FILTER (WHERE state = 'running') AS running
                 FROM jobs WHERE state IN ('queued', 'scheduled', 'retrying', 'running') GROUP BY tenant)
             SELECT coalesce(t.tenant, c.tenant) AS tenant, coalesce(t.weight, $1) AS weight, t.max_running,
                    t.updated_at, coalesce(c.waiting, 0) AS waiting, coalesce(c.running, 0) AS running
             FROM tenants t FULL JOIN counts c ON c.tenant = t.tenant
             ORDER BY 1",
        )
        .bind(WEIGHT_DEFAULT)
        .fetch_all(self.pool())
        .await?;
        rows.iter()
            .map(|r| {
                Ok(TenantView {
                    share: TenantShare {
                        tenant: r.try_get("tenant")?,
                        weight: r.try_get("weight")?,
                        max_running: r.try_get("max_running")?,
                    },
                    updated_at: r.try_get("updated_at")?,
                    waiting: r.try_get("waiting")?,
                    running: r.try_get("running")?,
                })
            })
            .collect()
    }

    /// Sets a tenant's share (`None`: back to the defaults) in Postgres and then in Redis.
    pub async fn set_tenant_share(&self, queue: &Queue, tenant: &str, share: Option<(i32, Option<i32>)>) -> Result<()> {
        let mut tx = self.pool().begin().await?;
        sqlx::query("SELECT pg_advisory_xact_lock($1)").bind(SHARES_LOCK).execute(&mut *tx).await?;
        match share {
            Some((weight, max_running)) => {
                sqlx::query(
                    "INSERT INTO tenants (tenant, weight, max_running) VALUES ($1, $2, $3)
                     ON CONFLICT (tenant) DO UPDATE SET weight = $2, max_running = $3, updated_at = now()",
                )
                .bind(tenant)
                .bind(weight)
                .bind(max_running)
                .execute(&mut *tx)
                .await?;
            }
            None => {
                sqlx::query("DELETE FROM tenants WHERE tenant = $1").bind(tenant).execute(&mut *tx).await?;
            }
        }
        copy_shares(tx, queue).await
    }

    /// Copies every share into Redis (the reconciler, each sweep: Redis may have lost them).
    pub async fn restore_tenant_shares(&self, queue: &Queue) -> Result<()> {
        let mut tx = self.pool().begin().await?;
        sqlx::query("SELECT pg_advisory_xact_lock($1)").bind(SHARES_LOCK).execute(&mut *tx).await?;
        copy_shares(tx, queue).await
    }
}

/// Reads every share in `tx` (which holds the shares lock), writes them to Redis, commits.
async fn copy_shares(mut tx: sqlx::Transaction<'_, sqlx::Postgres>, queue: &Queue) -> Result<()> {
    let rows = sqlx::query("SELECT tenant, weight, max_running FROM tenants").fetch_all(&mut *tx).await?;
    let shares = rows
        .iter()
        .map(|r| Ok(TenantShare { tenant: r.try_get("tenant")?, weight: r.try_get("weight")?, max_running: r.try_get("max_running")? }))
        .collect::<Result<Vec<_>>>()?;
    queue.set_shares(&shares).await?;
    tx.commit().await?;
    Ok(())
}
