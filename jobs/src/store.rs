//! Postgres access. Each function is one statement and so one transaction; the batch ones take
//! arrays (`unnest`) so a whole batch changes state in a single round trip and commit, and every
//! transition appends to `job_events` in the same statement.

use crate::job::JobEvent;
use crate::{Failure, Job, JobKind, JobOutput, JobState, NewJob, Priority, Result, RetryPolicy};
use chrono::{DateTime, Utc};
use serde_json::Value;
use sqlx::postgres::{PgPoolOptions, PgRow};
use sqlx::{PgPool, Row};
use std::time::Duration;
use uuid::Uuid;

pub(crate) const JOB_COLUMNS: &str = "id, tenant, kind, priority, state, input, cost, attempts, max_attempts, run_at, \
    timeout_ms, metadata, idempotency_key, request_sha256, created_at, started_at, finished_at, \
    worker_id, lease_token, cancel_requested, error, output, webhook";

/// The Postgres side of tern: the record of every job and every state change.
#[derive(Clone)]
pub struct Store {
    pool: PgPool,
}

/// Filters of [`Store::list`].
#[derive(Debug, Clone, Default)]
pub struct ListFilter {
    /// Only this tenant's jobs.
    pub tenant: Option<String>,
    pub state: Option<JobState>,
    pub kind: Option<JobKind>,
    pub priority: Option<crate::Priority>,
    /// Only jobs older than this id (ids are UUID v7, so this is keyset pagination by age).
    pub before: Option<Uuid>,
    pub limit: i64,
}

/// How an attempt ended, as the worker or the reaper reports it.
#[derive(Debug, Clone)]
pub enum Outcome {
    Succeeded(JobOutput),
    /// Failed, may run again; becomes `failed` if it was the last attempt.
    Retry(Failure),
    /// Failed for good (bad input): no further attempt.
    Failed(Failure),
    Canceled,
    /// Handed back unrun (worker shutting down): queued again, the attempt not counted.
    Released,
}

/// A lease's report of how its job ended.
#[derive(Debug, Clone)]
pub struct Settlement {
    pub id: Uuid,
    pub token: i64,
    pub outcome: Outcome,
    /// `None`: Postgres recorded the attempt's start (the job is `running` under `token`).
    /// `Some`: it did not (the batch ended before its start was due to be recorded, or the
    /// reaper charges an expired lease); the start is recorded with the outcome.
    pub unrecorded: Option<UnrecordedStart>,
}

/// An attempt whose start Postgres has not recorded: what [`Store::settle`] records it with,
/// and the version of the job it ran, so a settle is refused when anything else changed the
/// job's attempts or lease meanwhile (another lease ran it, or the reaper charged this one).
#[derive(Debug, Clone)]
pub struct UnrecordedStart {
    /// When the attempt began, by Postgres' clock ([`Store::waiting_jobs`]); `None`: now.
    pub at: Option<DateTime<Utc>>,
    /// The job's attempts when it was read.
    pub attempts: i32,
    /// The job's lease token when it was read.
    pub lease_token: Option<i64>,
    /// Recorded as the job's worker; `None` keeps the one recorded before.
    pub worker_id: Option<String>,
}

/// What [`Store::settle`] recorded for one job.
#[derive(Debug, Clone)]
pub struct Settled {
    pub id: Uuid,
    pub kind: JobKind,
    pub state: JobState,
    /// When a `retrying` job is due again.
    pub run_at: Option<DateTime<Utc>>,
}

/// The result of [`Store::cancel`].
#[derive(Debug, Clone)]
pub enum CancelOutcome {
    /// It was waiting and is now canceled.
    Canceled(Job),
    /// It is running; its worker is to stop it.
    Requested(Job),
    /// It had already finished.
    AlreadyFinished(Job),
    NotFound,
}

/// A job that should be somewhere in Redis, as the reconciler sees it.
#[derive(Debug, Clone)]
pub struct ActiveJob {
    pub id: Uuid,
    pub kind: JobKind,
    pub priority: Priority,
    pub state: JobState,
    pub cost: i32,
    pub run_at: Option<DateTime<Utc>>,
    pub lease_token: Option<i64>,
    pub attempts: i32,
    pub tenant: String,
}

/// What the reconciler and reaper read of a job: [`ActiveJob`]'s fields.
const ACTIVE_COLUMNS: &str = "id, kind, priority, state, cost, run_at, lease_token, attempts, tenant";

impl Store {
    /// Connects with at most `max_connections` pooled connections.
    pub async fn connect(url: &str, max_connections: u32) -> Result<Store> {
        Self::connect_with(url, max_connections, &[]).await
    }

    /// [`Store::connect`] for a worker, whose statements are all batches addressed by job id
    /// (start, settle, reads of leased jobs). Its sessions plan each statement once, generically
    /// (`plan_cache_mode = force_generic_plan`): a generic plan takes a batch's jobs by index,
    /// one probe per row, whatever the table's size, where a plan made for a 512-row batch
    /// hashes the whole table whenever the planner thinks it small, as it does of a young table
    /// whose statistics lag (every batch then costs as much as the table is large). It also
    /// spares planning the same statement on every batch.
    pub async fn connect_for_batches(url: &str, max_connections: u32) -> Result<Store> {
        Self::connect_with(url, max_connections, &[("plan_cache_mode", "force_generic_plan")]).await
    }

    async fn connect_with(url: &str, max_connections: u32, settings: &[(&str, &str)]) -> Result<Store> {
        let options: sqlx::postgres::PgConnectOptions = url.parse()?;
        let pool = PgPoolOptions::new()
            .max_connections(max_connections)
            .acquire_timeout(Duration::from_secs(10))
            .connect_with(options.options(settings.iter().copied()))
            .await?;
        Ok(Store { pool })
    }

    pub fn pool(&self) -> &PgPool {
        &self.pool
    }

    /// Applies the embedded migrations; safe to run from several processes at once.
    pub async fn migrate(&self) -> Result<()> {
        crate::MIGRATOR.run(&self.pool).await.map_err(|e| crate::Error::Database(e.into()))
    }

    pub async fn ping(&self) -> Result<()> {
        sqlx::query("SELECT 1").execute(&self.pool).await?;
        Ok(())
    }

    /// Inserts jobs in one transaction. Jobs whose idempotency key their tenant already used
    /// for the same request are skipped: the returned list holds only the jobs inserted now.
    /// A key used for a different request (earlier, or by another job of `jobs`) fails the
    /// whole insert with [`Error::IdempotencyConflict`](crate::Error::IdempotencyConflict).
    pub async fn insert(&self, jobs: &[NewJob]) -> Result<Vec<Job>> {
        if jobs.is_empty() {
            return Ok(Vec::new());
        }
        let now = Utc::now();
        let mut ids = Vec::with_capacity(jobs.len());
        let mut kinds = Vec::with_capacity(jobs.len());
        let mut priorities = Vec::with_capacity(jobs.len());
        let mut states = Vec::with_capacity(jobs.len());
        let mut inputs = Vec::with_capacity(jobs.len());
        let mut costs = Vec::with_capacity(jobs.len());
        let mut max_attempts = Vec::with_capacity(jobs.len());
        let mut run_ats = Vec::with_capacity(jobs.len());
        let mut timeouts = Vec::with_capacity(jobs.len());
        let mut metadata = Vec::with_capacity(jobs.len());
        let mut keys = Vec::with_capacity(jobs.len());
        let mut hashes = Vec::with_capacity(jobs.len());
        let mut webhooks = Vec::with_capacity(jobs.len());
        let mut tenants = Vec::with_capacity(jobs.len());
        for job in jobs {
            tenants.push(job.tenant.as_str());
            ids.push(job.id);
            kinds.push(job.kind.as_str());
            priorities.push(job.priority.as_str());
            states.push(job.initial_state(now).as_str());
            inputs.push(job.input.to_string());
            costs.push(job.cost);
            max_attempts.push(job.max_attempts);
            run_ats.push(job.run_at);
            timeouts.push(job.timeout_ms);
            metadata.push(job.metadata.to_string());
            keys.push(job.idempotency_key.as_deref());
            hashes.push(job.request_sha256.as_deref());
            webhooks.push(job.webhook.as_ref().map(|w| serde_json::to_string(w).expect("webhooks serialise")));
        }
        let sql = format!(
            "WITH inserted AS (
                INSERT INTO jobs (id, kind, priority, state, input, cost, max_attempts, run_at,
                                  timeout_ms, metadata, idempotency_key, request_sha256, webhook, tenant)
                SELECT id, kind, priority, state, input::jsonb, cost, max_attempts, run_at,
                       timeout_ms, metadata::jsonb, idempotency_key, request_sha256, webhook::jsonb, tenant
                FROM unnest($1::uuid[], $2::text[], $3::text[], $4::text[], $5::text[], $6::int4[],
                            $7::int4[], $8::timestamptz[], $9::int8[], $10::text[], $11::text[],
                            $12::text[], $13::text[], $14::text[])
                     AS t(id, kind, priority, state, input, cost, max_attempts, run_at, timeout_ms,
                          metadata, idempotency_key, request_sha256, webhook, tenant)
                ON CONFLICT (tenant, idempotency_key) WHERE idempotency_key IS NOT NULL DO NOTHING
                RETURNING {JOB_COLUMNS}
            ), events AS (
                INSERT INTO job_events (job_id, state, attempt) SELECT id, state, 0 FROM inserted
            )
            SELECT {JOB_COLUMNS} FROM inserted"
        );
        let mut tx = self.pool.begin().await?;
        let rows = sqlx::query(&sql)
            .bind(&ids)
            .bind(&kinds)
            .bind(&priorities)
            .bind(&states)
            .bind(&inputs)
            .bind(&costs)
            .bind(&max_attempts)
            .bind(&run_ats)
            .bind(&timeouts)
            .bind(&metadata)
            .bind(&keys)
            .bind(&hashes)
            .bind(&webhooks)
            .bind(&tenants)
            .fetch_all(&mut *tx)
            .await?;
        let inserted: Vec<Job> = rows.iter().map(job_from_row).collect::<Result<_>>()?;
        // A skipped job's key is taken: by the same request (a replay) or by another one.
        let fresh: std::collections::HashSet<Uuid> = inserted.iter().map(|j| j.id).collect();
        let skipped: Vec<&NewJob> = jobs
            .iter()
            .filter(|j| j.idempotency_key.is_some() && !fresh.contains(&j.id))
            .collect();
        if !skipped.is_empty() {
            let conflict: Option<String> = sqlx::query_scalar(
                "SELECT s.key FROM unnest($1::text[], $2::text[], $3::text[]) AS s(tenant, key, sha)
                 JOIN jobs j ON j.tenant = s.tenant AND j.idempotency_key = s.key
                 WHERE j.request_sha256 IS DISTINCT FROM s.sha LIMIT 1",
            )
            .bind(skipped.iter().map(|j| j.tenant.as_str()).collect::<Vec<_>>())
            .bind(skipped.iter().map(|j| j.idempotency_key.as_deref()).collect::<Vec<_>>())
            .bind(skipped.iter().map(|j| j.request_sha256.as_deref()).collect::<Vec<_>>())
            .fetch_optional(&mut *tx)
            .await?;
            if let Some(key) = conflict {
                return Err(crate::Error::IdempotencyConflict(key));
            }
        }
        tx.commit().await?;
        Ok(inserted)
    }

    pub async fn get(&self, id: Uuid) -> Result<Option<Job>> {
        let sql = format!("SELECT {JOB_COLUMNS} FROM jobs WHERE id = $1");
        let row = sqlx::query(&sql).bind(id).fetch_optional(&self.pool).await?;
        row.as_ref().map(job_from_row).transpose()
    }

    /// Job `id`'s output when it lives in Postgres (see [`JobOutput::key`]): its content type
    /// and bytes; `None` for a job that has none there.
    pub async fn output_body(&self, id: Uuid) -> Result<Option<(String, Vec<u8>)>> {
        let row: Option<(Option<String>, Option<Vec<u8>>)> = sqlx::query_as(
            "SELECT output->>'content_type', output_body FROM jobs WHERE id = $1 AND state = 'succeeded'",
        )
        .bind(id)
        .fetch_optional(&self.pool)
        .await?;
        Ok(row.and_then(|(content_type, body)| Some((content_type.unwrap_or_default(), body?))))
    }

    /// The jobs of `ids` that exist, in no particular order.
    pub async fn get_many(&self, ids: &[Uuid]) -> Result<Vec<Job>> {
        let sql = format!("SELECT {JOB_COLUMNS} FROM jobs WHERE id = ANY($1)");
        let rows = sqlx::query(&sql).bind(ids).fetch_all(&self.pool).await?;
        rows.iter().map(job_from_row).collect()
    }

    /// `tenant`'s job under idempotency key `key`.
    pub async fn get_by_idempotency_key(&self, tenant: &str, key: &str) -> Result<Option<Job>> {
        let sql =
            format!("SELECT {JOB_COLUMNS} FROM jobs WHERE tenant = $1 AND idempotency_key = $2");
        let row = sqlx::query(&sql)
            .bind(tenant)
            .bind(key)
            .fetch_optional(&self.pool)
            .await?;
        row.as_ref().map(job_from_row).transpose()
    }

    /// Jobs newest first, filtered; at most `filter.limit`.
    pub async fn list(&self, filter: &ListFilter) -> Result<Vec<Job>> {
        let sql = format!(
            "SELECT {JOB_COLUMNS} FROM jobs
             WHERE ($1::text IS NULL OR state = $1) AND ($2::text IS NULL OR kind = $2)
               AND ($3::uuid IS NULL OR id < $3) AND ($5::text IS NULL OR tenant = $5)
               AND ($6::text IS NULL OR priority = $6)
             ORDER BY id DESC LIMIT $4"
        );
        let rows = sqlx::query(&sql)
            .bind(filter.state.map(JobState::as_str))
            .bind(filter.kind.map(JobKind::as_str))
            .bind(filter.before)
            .bind(filter.limit)
            .bind(filter.tenant.as_deref())
            .bind(filter.priority.map(crate::Priority::as_str))
            .fetch_all(&self.pool)
            .await?;
        rows.iter().map(job_from_row).collect()
    }

    /// Queues a `job.progress` webhook delivery for a running job that asked for them, unless one
    /// was queued in the last second (receivers get at most one a second per job).
    pub async fn progress_event(&self, id: Uuid) -> Result<()> {
        sqlx::query(
            "INSERT INTO webhook_deliveries (id, job_id, event, url)
             SELECT gen_random_uuid(), j.id, 'job.progress', j.webhook->>'url' FROM jobs j
             WHERE j.id = $1 AND j.state = 'running' AND (j.webhook->'events') ? 'job.progress'
               AND NOT coalesce((j.webhook->>'disabled')::boolean, false)
               AND NOT EXISTS (SELECT 1 FROM webhook_deliveries d
                               WHERE d.job_id = j.id AND d.event = 'job.progress'
                                 AND d.created_at > clock_timestamp() - interval '1 second')",
        )
        .bind(id)
        .execute(&self.pool)
        .await?;
        Ok(())
    }

    /// Jobs of `tenant` waiting to run (queued, scheduled or retrying).
    pub async fn waiting_for_tenant(&self, tenant: &str) -> Result<i64> {
        Ok(sqlx::query_scalar(
            "SELECT count(*) FROM jobs WHERE tenant = $1 AND state IN ('queued', 'scheduled', 'retrying')",
        )
        .bind(tenant)
        .fetch_one(&self.pool)
        .await?)
    }

    /// The job's timeline, oldest first.
    pub async fn events(&self, id: Uuid) -> Result<Vec<JobEvent>> {
        Ok(self.events_after(id, 0).await?.into_iter().map(|(_, e)| e).collect())
    }

    /// The job's timeline after event `after` (an event's id; 0 for all), oldest first, each
    /// with its id.
    pub async fn events_after(&self, id: Uuid, after: i64) -> Result<Vec<(i64, JobEvent)>> {
        let rows = sqlx::query(
            "SELECT id, at, state, attempt, worker_id, detail FROM job_events WHERE job_id = $1 AND id > $2 ORDER BY id",
        )
        .bind(id)
        .bind(after)
        .fetch_all(&self.pool)
        .await?;
        rows.iter()
            .map(|r| {
                Ok((
                    r.try_get("id")?,
                    JobEvent {
                        at: r.try_get("at")?,
                        state: parse_state(r.try_get("state")?)?,
                        attempt: r.try_get("attempt")?,
                        worker_id: r.try_get("worker_id")?,
                        detail: r.try_get("detail")?,
                    },
                ))
            })
            .collect()
    }

    /// Cancels a waiting job at once; marks a running one so its worker stops it.
    pub async fn cancel(&self, id: Uuid) -> Result<CancelOutcome> {
        let sql = format!(
            "WITH target AS (
                SELECT id, state AS old_state FROM jobs WHERE id = $1 FOR UPDATE
            ), changed AS (
                UPDATE jobs j SET
                    state = CASE WHEN t.old_state IN ('queued', 'scheduled', 'retrying')
                                 THEN 'canceled' ELSE j.state END,
                    finished_at = CASE WHEN t.old_state IN ('queued', 'scheduled', 'retrying')
                                       THEN now() ELSE j.finished_at END,
                    state_changed_at = CASE WHEN t.old_state IN ('queued', 'scheduled', 'retrying')
                                            THEN now() ELSE j.state_changed_at END,
                    run_at = CASE WHEN t.old_state IN ('queued', 'scheduled', 'retrying')
                                  THEN NULL ELSE j.run_at END,
                    cancel_requested = j.cancel_requested OR t.old_state = 'running'
                FROM target t WHERE j.id = t.id
                RETURNING {cols}, t.old_state
            ), events AS (
                INSERT INTO job_events (job_id, state, attempt)
                SELECT id, 'canceled', attempts FROM changed
                WHERE old_state IN ('queued', 'scheduled', 'retrying')
            )
            SELECT * FROM changed",
            cols = prefixed_columns("j")
        );
        let Some(row) = sqlx::query(&sql).bind(id).fetch_optional(&self.pool).await? else {
            return Ok(CancelOutcome::NotFound);
        };
        let old_state = parse_state(row.try_get("old_state")?)?;
        let job = job_from_row(&row)?;
        Ok(match old_state {
            JobState::Queued | JobState::Scheduled | JobState::Retrying => CancelOutcome::Canceled(job),
            JobState::Running => CancelOutcome::Requested(job),
            _ => CancelOutcome::AlreadyFinished(job),
        })
    }

    /// Records a job's cost once it is known: audio given by URL is priced at one window until
    /// its worker has decoded it.
    pub async fn set_cost(&self, id: Uuid, cost: i32) -> Result<()> {
        sqlx::query("UPDATE jobs SET cost = $2 WHERE id = $1").bind(id).bind(cost).execute(&self.pool).await?;
        Ok(())
    }

    /// Marks leased jobs running under their fencing tokens, in one statement. Returns the jobs
    /// that may run: those that were still waiting. A job canceled, finished or taken by another
    /// lease in the meantime is left out, and its lease should be dropped.
    pub async fn start(&self, worker_id: &str, leases: &[(Uuid, i64)]) -> Result<Vec<Job>> {
        self.start_at(worker_id, leases, None).await
    }

    /// [`Store::start`], for attempts that began at `began` (Postgres' clock, from
    /// [`Store::waiting_jobs`]) and are recorded later: `started_at` and the `running` event
    /// carry that time. `None`: now.
    pub async fn start_at(&self, worker_id: &str, leases: &[(Uuid, i64)], began: Option<DateTime<Utc>>) -> Result<Vec<Job>> {
        let mut in_order = leases.to_vec();
        in_order.sort_unstable_by_key(|l| l.0);
        let (ids, tokens): (Vec<Uuid>, Vec<i64>) = in_order.into_iter().unzip();
        let sql = format!(
            "WITH started AS (
                UPDATE jobs j SET state = 'running', attempts = j.attempts + 1,
                       lease_token = b.token, worker_id = $3, started_at = COALESCE($4, now()),
                       state_changed_at = now(), run_at = NULL
                FROM unnest($1::uuid[], $2::int8[]) AS b(id, token)
                WHERE j.id = b.id AND j.state IN ('queued', 'scheduled', 'retrying')
                RETURNING {cols}
            ), events AS (
                INSERT INTO job_events (job_id, state, attempt, worker_id, at)
                SELECT id, 'running', attempts, worker_id, started_at FROM started
            )
            SELECT * FROM started",
            cols = prefixed_columns("j")
        );
        let rows = sqlx::query(&sql).bind(&ids).bind(&tokens).bind(worker_id).bind(began).fetch_all(&self.pool).await?;
        rows.iter().map(job_from_row).collect()
    }

    /// Postgres' clock now, and those of `ids` that are waiting (queued, scheduled or
    /// retrying), read without changing them: a worker runs them and records their start with
    /// their outcome ([`UnrecordedStart`]), or later with [`Store::start_at`].
    pub async fn waiting_jobs(&self, ids: &[Uuid]) -> Result<(DateTime<Utc>, Vec<Job>)> {
        let rows = sqlx::query(&format!(
            "SELECT now() AS read_at, {JOB_COLUMNS} FROM jobs
             WHERE id = ANY($1) AND state IN ('queued', 'scheduled', 'retrying') ORDER BY id"
        ))
        .bind(ids)
        .fetch_all(&self.pool)
        .await?;
        let now = match rows.first() {
            Some(r) => r.try_get("read_at")?,
            None => Utc::now(),
        };
        Ok((now, rows.iter().map(job_from_row).collect::<Result<_>>()?))
    }

    /// Records how attempts ended, in one statement. Only a running job whose fencing token
    /// matches is changed: a report from a lease that expired (the job was re-run elsewhere, or
    /// already settled) is refused and left out of the result. An attempt whose start was not
    /// recorded ([`Settlement::unrecorded`]) is recorded with its outcome, `running` event
    /// first, if the job is still waiting as it was read; a `Released` one changes nothing.
    ///
    /// A `Retry` of a job that used its last attempt makes it `failed`; otherwise the job becomes
    /// `retrying`, due after `policy`'s backoff. A job whose cancel was requested while it ran
    /// ends `canceled` instead of running again.
    pub async fn settle(&self, settlements: &[Settlement], policy: RetryPolicy) -> Result<Vec<Settled>> {
        if settlements.is_empty() {
            return Ok(Vec::new());
        }
        let n = settlements.len();
        let mut ids = Vec::with_capacity(n);
        let mut tokens = Vec::with_capacity(n);
        let mut states = Vec::with_capacity(n);
        let mut outputs: Vec<Option<String>> = Vec::with_capacity(n);
        let mut errors: Vec<Option<String>> = Vec::with_capacity(n);
        let mut bodies: Vec<Option<&[u8]>> = Vec::with_capacity(n);
        let mut unrecorded = Vec::with_capacity(n);
        let mut began: Vec<Option<DateTime<Utc>>> = Vec::with_capacity(n);
        let mut prior_attempts: Vec<Option<i32>> = Vec::with_capacity(n);
        let mut prior_tokens: Vec<Option<i64>> = Vec::with_capacity(n);
        let mut worker_ids: Vec<Option<&str>> = Vec::with_capacity(n);
        let mut in_order: Vec<&Settlement> = settlements
            .iter()
            // An attempt handed back before Postgres saw it start changes nothing there.
            .filter(|s| !(s.unrecorded.is_some() && matches!(s.outcome, Outcome::Released)))
            .collect();
        if in_order.is_empty() {
            return Ok(Vec::new());
        }
        in_order.sort_unstable_by_key(|s| s.id);
        for s in in_order {
            ids.push(s.id);
            tokens.push(s.token);
            let (state, output, error) = match &s.outcome {
                Outcome::Succeeded(out) => (JobState::Succeeded, Some(to_json(out)), None),
                Outcome::Retry(f) => (JobState::Retrying, None, Some(to_json(f))),
                Outcome::Failed(f) => (JobState::Failed, None, Some(to_json(f))),
                Outcome::Canceled => (
                    JobState::Canceled,
                    None,
                    Some(to_json(&Failure::new("canceled", "canceled while running"))),
                ),
                Outcome::Released => (JobState::Queued, None, None),
            };
            states.push(state.as_str());
            bodies.push(match &s.outcome {
                Outcome::Succeeded(out) => out.body.as_deref(),
                _ => None,
            });
            outputs.push(output);
            errors.push(error);
            unrecorded.push(s.unrecorded.is_some());
            began.push(s.unrecorded.as_ref().and_then(|u| u.at));
            prior_attempts.push(s.unrecorded.as_ref().map(|u| u.attempts));
            prior_tokens.push(s.unrecorded.as_ref().and_then(|u| u.lease_token));
            worker_ids.push(s.unrecorded.as_ref().and_then(|u| u.worker_id.as_deref()));
        }
        // One UPDATE, no separate locking pass: it locks each row as it reaches it, and when a
        // row was changed meanwhile (a cancel committing) Postgres re-reads its latest version
        // and evaluates the new state on that, so a cancel that commits while this runs is seen,
        // not overwritten by a retry. Rows are given in id order, as every batch statement
        // gives them, so two settles of overlapping jobs (a worker and the reaper) take their
        // locks in one order.
        //
        // `attempt` is the number of the attempt that ended: an unrecorded one is counted here.
        let attempt = "(CASE WHEN u.unrecorded THEN j.attempts + 1 ELSE j.attempts END)";
        let state = format!(
            "(CASE WHEN u.state IN ('retrying', 'queued') AND j.cancel_requested THEN 'canceled' \
                   WHEN u.state = 'retrying' AND {attempt} >= j.max_attempts THEN 'failed' \
                   ELSE u.state END)"
        );
        let sql = format!(
            "WITH settled AS (
                UPDATE jobs j SET
                    state = {state},
                    state_changed_at = now(),
                    attempts = CASE WHEN {state} = 'queued' THEN {attempt} - 1 ELSE {attempt} END,
                    started_at = CASE WHEN u.unrecorded THEN COALESCE(u.began, now()) ELSE j.started_at END,
                    worker_id = CASE WHEN u.unrecorded THEN COALESCE(u.worker_id, j.worker_id) ELSE j.worker_id END,
                    lease_token = u.token,
                    finished_at = CASE WHEN {state} IN ('succeeded', 'failed', 'canceled') THEN now() END,
                    run_at = CASE WHEN {state} = 'retrying' THEN tern_retry_at({attempt}, $6, $7) END,
                    output = u.output::jsonb,
                    output_body = u.body,
                    error = CASE WHEN {state} = 'queued' THEN j.error ELSE u.error::jsonb END
                FROM unnest($1::uuid[], $2::int8[], $3::text[], $4::text[], $5::text[], $8::bytea[],
                            $9::bool[], $10::timestamptz[], $11::int4[], $12::int8[], $13::text[])
                     AS u(id, token, state, output, error, body,
                          unrecorded, began, prior_attempts, prior_token, worker_id)
                WHERE j.id = u.id AND CASE
                    -- Unrecorded: still waiting, and nothing else ran or charged it meanwhile.
                    WHEN u.unrecorded THEN j.state IN ('queued', 'scheduled', 'retrying')
                         AND j.attempts = u.prior_attempts
                         AND j.lease_token IS NOT DISTINCT FROM u.prior_token
                    ELSE j.state = 'running' AND j.lease_token = u.token END
                RETURNING j.id, j.kind, j.state, j.run_at, j.attempts, j.worker_id, j.started_at,
                          u.unrecorded, COALESCE(u.output, u.error) AS detail
            ), events AS (
                -- An unrecorded attempt's `running` event first, at the time it began.
                INSERT INTO job_events (job_id, state, attempt, worker_id, detail, at)
                SELECT s.id, e.state, s.attempts, s.worker_id, e.detail, e.at
                FROM settled s
                CROSS JOIN LATERAL (VALUES (1, 'running', NULL::jsonb, s.started_at),
                                           (2, s.state, s.detail::jsonb, now())) AS e(ord, state, detail, at)
                WHERE e.ord = 2 OR s.unrecorded
                ORDER BY s.id, e.ord
            )
            SELECT id, kind, state, run_at FROM settled"
        );
        let rows = sqlx::query(&sql)
            .bind(&ids)
            .bind(&tokens)
            .bind(&states)
            .bind(&outputs)
            .bind(&errors)
            .bind(policy.base.as_millis() as i64)
            .bind(policy.cap.as_millis() as i64)
            .bind(&bodies)
            .bind(&unrecorded)
            .bind(&began)
            .bind(&prior_attempts)
            .bind(&prior_tokens)
            .bind(&worker_ids)
            .fetch_all(&self.pool)
            .await?;
        rows.iter()
            .map(|r| {
                Ok(Settled {
                    id: r.try_get("id")?,
                    kind: parse_kind(r.try_get("kind")?)?,
                    state: parse_state(r.try_get("state")?)?,
                    run_at: r.try_get("run_at")?,
                })
            })
            .collect()
    }

    /// Running jobs whose cancel was requested: their workers are to stop them.
    pub async fn cancel_requested(&self) -> Result<Vec<(Uuid, JobKind)>> {
        let rows: Vec<(Uuid, String)> = sqlx::query_as(
            "SELECT id, kind FROM jobs WHERE state = 'running' AND cancel_requested",
        )
        .fetch_all(&self.pool)
        .await?;
        rows.into_iter()
            .map(|(id, kind)| Ok((id, parse_kind(kind)?)))
            .collect()
    }

    /// Those of `ids` that Postgres holds as waiting (queued, scheduled or retrying).
    pub async fn waiting_among(&self, ids: &[Uuid]) -> Result<Vec<ActiveJob>> {
        let rows = sqlx::query(&format!(
            "SELECT {ACTIVE_COLUMNS} FROM jobs WHERE id = ANY($1) AND state IN ('queued', 'scheduled', 'retrying')"
        ))
        .bind(ids)
        .fetch_all(&self.pool)
        .await?;
        rows.iter().map(active_job).collect()
    }

    /// A page of jobs that are not finished, by id, after `after`. With `settled_before`, only
    /// jobs whose state has not changed since then (the reconciler leaves fresh jobs alone: the
    /// API may be about to enqueue them).
    pub async fn active_page(
        &self,
        after: Option<Uuid>,
        settled_before: Option<DateTime<Utc>>,
        limit: i64,
    ) -> Result<Vec<ActiveJob>> {
        let rows = sqlx::query(&format!(
            "SELECT {ACTIVE_COLUMNS} FROM jobs
             WHERE state IN ('queued', 'scheduled', 'running', 'retrying')
               AND ($1::uuid IS NULL OR id > $1)
               AND ($2::timestamptz IS NULL OR state_changed_at < $2)
             ORDER BY id LIMIT $3"
        ))
        .bind(after)
        .bind(settled_before)
        .bind(limit)
        .fetch_all(&self.pool)
        .await?;
        rows.iter().map(active_job).collect()
    }
}

fn active_job(r: &sqlx::postgres::PgRow) -> Result<ActiveJob> {
    Ok(ActiveJob {
        id: r.try_get("id")?,
        kind: parse_kind(r.try_get("kind")?)?,
        priority: parse_priority(r.try_get("priority")?)?,
        state: parse_state(r.try_get("state")?)?,
        cost: r.try_get("cost")?,
        run_at: r.try_get("run_at")?,
        lease_token: r.try_get("lease_token")?,
        attempts: r.try_get("attempts")?,
        tenant: r.try_get("tenant")?,
    })
}

fn to_json<T: serde::Serialize>(value: &T) -> String {
    serde_json::to_string(value).expect("plain structs serialise")
}

pub(crate) fn prefixed_columns(table: &str) -> String {
    JOB_COLUMNS.split(", ").map(|c| format!("{table}.{}", c.trim())).collect::<Vec<_>>().join(", ")
}

fn decode_err(what: &str, value: &str) -> crate::Error {
    crate::Error::Database(sqlx::Error::Decode(format!("unknown {what} {value:?} in the database").into()))
}

fn parse_state(s: String) -> Result<JobState> {
    s.parse().map_err(|()| decode_err("state", &s))
}

fn parse_kind(s: String) -> Result<JobKind> {
    s.parse().map_err(|()| decode_err("kind", &s))
}

fn parse_priority(s: String) -> Result<Priority> {
    s.parse().map_err(|()| decode_err("priority", &s))
}

pub(crate) fn job_from_row(r: &PgRow) -> Result<Job> {
    let error: Option<Value> = r.try_get("error")?;
    let output: Option<Value> = r.try_get("output")?;
    let webhook: Option<Value> = r.try_get("webhook")?;
    Ok(Job {
        id: r.try_get("id")?,
        tenant: r.try_get("tenant")?,
        kind: parse_kind(r.try_get("kind")?)?,
        priority: parse_priority(r.try_get("priority")?)?,
        state: parse_state(r.try_get("state")?)?,
        input: r.try_get("input")?,
        cost: r.try_get("cost")?,
        attempts: r.try_get("attempts")?,
        max_attempts: r.try_get("max_attempts")?,
        run_at: r.try_get("run_at")?,
        timeout_ms: r.try_get("timeout_ms")?,
        metadata: r.try_get("metadata")?,
        idempotency_key: r.try_get("idempotency_key")?,
        request_sha256: r.try_get("request_sha256")?,
        created_at: r.try_get("created_at")?,
        started_at: r.try_get("started_at")?,
        finished_at: r.try_get("finished_at")?,
        worker_id: r.try_get("worker_id")?,
        lease_token: r.try_get("lease_token")?,
        cancel_requested: r.try_get("cancel_requested")?,
        error: error.and_then(|v| serde_json::from_value(v).ok()),
        output: output.and_then(|v| serde_json::from_value(v).ok()),
        webhook: webhook.and_then(|v| serde_json::from_value(v).ok()),
    })
}
