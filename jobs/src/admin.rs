//! What operators see and steer: per-queue counts and throughput, retrying failed jobs,
//! purging a queue and deleting finished jobs. A paused kind is recorded here and flagged in
//! Redis ([`crate::Queue::pause`]), where workers read it.

use crate::store::{job_from_row, prefixed_columns};
use crate::{Job, JobKind, Queue, Result, Store};
use serde::Serialize;
use sqlx::Row;
use std::collections::BTreeMap;
use uuid::Uuid;

/// Most jobs one retry or purge call changes; call again for more.
pub const ACTION_LIMIT: i64 = 1000;

/// Jobs of one kind and priority in each state an operator watches.
#[derive(Debug, Clone, Default, Serialize, PartialEq, Eq)]
pub struct StateCounts {
    pub queued: i64,
    pub scheduled: i64,
    pub running: i64,
    pub retrying: i64,
    /// Failed for good: the dead letters, retried with `POST /v1/admin/jobs/retry`.
    pub failed: i64,
}

/// Jobs finished in the last 1, 5 and 15 minutes.
#[derive(Debug, Clone, Default, Serialize, PartialEq, Eq)]
pub struct Throughput {
    pub last_1m: i64,
    pub last_5m: i64,
    pub last_15m: i64,
}

/// One kind's queue.
#[derive(Debug, Clone, Serialize)]
pub struct KindStats {
    pub kind: JobKind,
    /// Workers pull nothing of this kind while it is paused; submissions are still accepted.
    pub paused: bool,
    /// Per priority (`urgent`, `high`, `normal`, `low`); every priority is present.
    pub priorities: BTreeMap<String, StateCounts>,
    /// Summed over priorities.
    pub total: StateCounts,
    /// Seconds since the oldest queued job was submitted; `None` with nothing queued.
    pub oldest_queued_seconds: Option<f64>,
    pub succeeded: Throughput,
    pub failed: Throughput,
}

fn add(counts: &mut StateCounts, state: &str, n: i64) {
    match state {
        "queued" => counts.queued += n,
        "scheduled" => counts.scheduled += n,
        "running" => counts.running += n,
        "retrying" => counts.retrying += n,
        "failed" => counts.failed += n,
        _ => {}
    }
}

impl Store {
    /// Counts for every kind (`paused` left false: the queue knows it). Three indexed queries:
    /// the unfinished jobs, the failed ones, and those finished in the last 15 minutes.
    pub async fn queue_stats(&self) -> Result<Vec<KindStats>> {
        let mut stats: BTreeMap<JobKind, KindStats> = JobKind::ALL
            .iter()
            .map(|&kind| {
                let priorities = crate::Priority::ALL
                    .iter()
                    .map(|p| (p.as_str().to_string(), StateCounts::default()))
                    .collect();
                let s = KindStats {
                    kind,
                    paused: false,
                    priorities,
                    total: StateCounts::default(),
                    oldest_queued_seconds: None,
                    succeeded: Throughput::default(),
                    failed: Throughput::default(),
                };
                (kind, s)
            })
            .collect();
        let rows = sqlx::query(
            "SELECT kind, priority, state, count(*) AS n,
                    extract(epoch FROM now() - min(created_at) FILTER (WHERE state = 'queued'))::float8 AS oldest
             FROM jobs WHERE state IN ('queued', 'scheduled', 'running', 'retrying')
             GROUP BY kind, priority, state
             UNION ALL
             SELECT kind, priority, state, count(*), NULL FROM jobs WHERE state = 'failed'
             GROUP BY kind, priority, state",
        )
        .fetch_all(self.pool())
        .await?;
        for r in rows {
            let kind: String = r.try_get("kind")?;
            let Some(s) = kind.parse::<JobKind>().ok().and_then(|k| stats.get_mut(&k)) else { continue };
            let (priority, state): (String, String) = (r.try_get("priority")?, r.try_get("state")?);
            let n: i64 = r.try_get("n")?;
            add(s.priorities.entry(priority).or_default(), &state, n);
            add(&mut s.total, &state, n);
            if let Some(oldest) = r.try_get::<Option<f64>, _>("oldest")? {
                s.oldest_queued_seconds = Some(s.oldest_queued_seconds.map_or(oldest, |o: f64| o.max(oldest)));
            }
        }
        let rows = sqlx::query(
            "SELECT kind, state,
                    count(*) FILTER (WHERE finished_at > now() - interval '1 minute') AS m1,
                    count(*) FILTER (WHERE finished_at > now() - interval '5 minutes') AS m5,
                    count(*) AS m15
             FROM jobs WHERE finished_at > now() - interval '15 minutes' AND state IN ('succeeded', 'failed')
             GROUP BY kind, state",
        )
        .fetch_all(self.pool())
        .await?;
        for r in rows {
            let kind: String = r.try_get("kind")?;
            let Some(s) = kind.parse::<JobKind>().ok().and_then(|k| stats.get_mut(&k)) else { continue };
            let t = Throughput { last_1m: r.try_get("m1")?, last_5m: r.try_get("m5")?, last_15m: r.try_get("m15")? };
            match r.try_get::<String, _>("state")?.as_str() {
                "succeeded" => s.succeeded = t,
                _ => s.failed = t,
            }
        }
        Ok(stats.into_values().collect())
    }

    /// Puts failed jobs back in the queue with one more attempt (their error is kept in the
    /// timeline): those of `ids`, or when `ids` is empty the oldest failed jobs of `kind`, at
    /// most [`ACTION_LIMIT`]. Returns the jobs now queued; enqueue them in Redis.
    pub async fn retry_failed(&self, ids: &[Uuid], kind: Option<JobKind>) -> Result<Vec<Job>> {
        let sql = format!(
            "WITH target AS (
                SELECT id FROM jobs
                WHERE state = 'failed'
                  AND (cardinality($1::uuid[]) = 0 OR id = ANY($1))
                  AND ($2::text IS NULL OR kind = $2)
                ORDER BY id LIMIT $3 FOR UPDATE SKIP LOCKED
            ), changed AS (
                UPDATE jobs j SET state = 'queued', state_changed_at = now(), finished_at = NULL,
                    run_at = NULL, error = NULL, worker_id = NULL, cancel_requested = false,
                    max_attempts = greatest(j.max_attempts, j.attempts + 1)
                FROM target t WHERE j.id = t.id
                RETURNING {cols}
            ), events AS (
                INSERT INTO job_events (job_id, state, attempt, detail)
                SELECT id, 'queued', attempts, '{{\"retried_by\": \"admin\"}}'::jsonb FROM changed
            )
            SELECT * FROM changed",
            cols = prefixed_columns("j")
        );
        let rows = sqlx::query(&sql)
            .bind(ids)
            .bind(kind.map(JobKind::as_str))
            .bind(ACTION_LIMIT)
            .fetch_all(self.pool())
            .await?;
        rows.iter().map(job_from_row).collect()
    }

    /// Makes a scheduled job, or one waiting to retry, due now: `queued`, its `run_at` now.
    /// `Ok(None)` if there is no such job waiting; make it due in Redis too
    /// ([`Queue::run_now`](crate::Queue::run_now)).
    pub async fn run_now(&self, id: Uuid) -> Result<Option<Job>> {
        let sql = format!(
            "WITH changed AS (
                UPDATE jobs j SET state = 'queued', state_changed_at = now(), run_at = now()
                WHERE j.id = $1 AND j.state IN ('scheduled', 'retrying')
                RETURNING {cols}
            ), events AS (
                INSERT INTO job_events (job_id, state, attempt, detail)
                SELECT id, 'queued', attempts, '{{\"run_now_by\": \"admin\"}}'::jsonb FROM changed
            )
            SELECT * FROM changed",
            cols = prefixed_columns("j")
        );
        let row = sqlx::query(&sql).bind(id).fetch_optional(self.pool()).await?;
        row.as_ref().map(job_from_row).transpose()
    }

    /// Cancels the waiting (queued, scheduled, retrying) jobs of `kind`, at most
    /// [`ACTION_LIMIT`]; running jobs are left to finish. Returns the canceled ids.
    pub async fn purge_waiting(&self, kind: JobKind) -> Result<Vec<Uuid>> {
        let ids: Vec<Uuid> = sqlx::query_scalar(
            "WITH target AS (
                SELECT id FROM jobs WHERE kind = $1 AND state IN ('queued', 'scheduled', 'retrying')
                ORDER BY id LIMIT $2 FOR UPDATE SKIP LOCKED
            ), changed AS (
                UPDATE jobs j SET state = 'canceled', state_changed_at = now(), finished_at = now(), run_at = NULL
                FROM target t WHERE j.id = t.id
                RETURNING j.id, j.attempts
            ), events AS (
                INSERT INTO job_events (job_id, state, attempt, detail)
                SELECT id, 'canceled', attempts, '{\"purged_by\": \"admin\"}'::jsonb FROM changed
            )
            SELECT id FROM changed",
        )
        .bind(kind.as_str())
        .bind(ACTION_LIMIT)
        .fetch_all(self.pool())
        .await?;
        Ok(ids)
    }

    /// Deletes a finished job with its timeline and deliveries. `Ok(None)` if there is no such
    /// job, `Ok(Some(false))` if it has not finished.
    pub async fn delete_finished(&self, id: Uuid) -> Result<Option<bool>> {
        let row = sqlx::query(
            "WITH target AS (SELECT id, state FROM jobs WHERE id = $1),
                  gone AS (DELETE FROM jobs WHERE id = $1 AND state IN ('succeeded', 'failed', 'canceled') RETURNING id),
                  -- Events have no foreign key to cascade along (migration 0014).
                  gone_events AS (DELETE FROM job_events WHERE job_id IN (SELECT id FROM gone))
             SELECT (SELECT count(*) FROM target) AS found, (SELECT count(*) FROM gone) AS deleted",
        )
        .bind(id)
        .fetch_one(self.pool())
        .await?;
        let (found, deleted): (i64, i64) = (row.try_get("found")?, row.try_get("deleted")?);
        Ok((found > 0).then_some(deleted > 0))
    }
}

/// The advisory lock that writers of the pause flags hold while they write Postgres and then
/// Redis: without it the reconciler could read the paused kinds, an admin pause or resume
/// both, and the reconciler then write its stale reading over the admin's flag.
const PAUSE_LOCK: i64 = 0x7465_726e_7061_7573; // "ternpaus"

impl Store {
    /// Records that `kind` is paused (or no longer is), and flags it so in Redis, where
    /// workers read it.
    pub async fn set_paused(&self, queue: &Queue, kind: JobKind, paused: bool) -> Result<()> {
        let mut tx = self.pool().begin().await?;
        sqlx::query("SELECT pg_advisory_xact_lock($1)")
            .bind(PAUSE_LOCK)
            .execute(&mut *tx)
            .await?;
        let sql = if paused {
            "INSERT INTO paused_kinds (kind) VALUES ($1) ON CONFLICT DO NOTHING"
        } else {
            "DELETE FROM paused_kinds WHERE kind = $1"
        };
        sqlx::query(sql)
            .bind(kind.as_str())
            .execute(&mut *tx)
            .await?;
        if paused {
            queue.pause(kind).await?;
        } else {
            queue.resume(kind).await?;
        }
        tx.commit().await?;
        Ok(())
    }

    /// Sets the Redis pause flags to the kinds Postgres records as paused (after Redis lost
    /// them). Returns the kinds whose flag changed.
    pub async fn restore_pause_flags(&self, queue: &Queue) -> Result<Vec<(JobKind, bool)>> {
        let mut tx = self.pool().begin().await?;
        sqlx::query("SELECT pg_advisory_xact_lock($1)")
            .bind(PAUSE_LOCK)
            .execute(&mut *tx)
            .await?;
        let kinds: Vec<String> = sqlx::query_scalar("SELECT kind FROM paused_kinds")
            .fetch_all(&mut *tx)
            .await?;
        let paused: Vec<JobKind> = kinds.iter().filter_map(|k| k.parse().ok()).collect();
        let mut changed = Vec::new();
        for &kind in JobKind::ALL {
            let want = paused.contains(&kind);
            if want != queue.is_paused(kind).await? {
                if want {
                    queue.pause(kind).await?;
                } else {
                    queue.resume(kind).await?;
                }
                changed.push((kind, want));
            }
        }
        tx.commit().await?;
        Ok(changed)
    }
}
