//! Moves batches along, in every API replica: validates a batch's file, makes its lines jobs
//! (a chunk at a time, waiting while the queue is full), cancels its jobs when it is canceled
//! or expires, and writes its output and error files once none of its jobs is left to run.
//!
//! A runner claims one batch at a time (a lease in Postgres, `claimed_until`), so replicas
//! share the work and a replica that dies mid-step leaves the batch to another once its claim
//! lapses (`TERN_BATCH_CLAIM_MS`). Every step can be run again: lines already submitted are
//! replayed by their idempotency keys, and the output files are written again whole.

use super::lines::{self, Line};
use super::{status, Batch};
use crate::error::ApiError;
use crate::openai::files::FileRecord;
use crate::openai::{job_output, OpenAiError};
use crate::routes::jobs::{admit, insert_and_enqueue};
use crate::state::AppState;
use crate::submission;
use axum::http::StatusCode;
use futures::StreamExt;
use serde_json::{json, Value};
use std::collections::HashMap;
use std::time::{Duration, Instant};
use tern_jobs::store::CancelOutcome;
use tern_jobs::{Job, JobState, NewJob};
use uuid::Uuid;

/// Lines made jobs at once, at most.
const CHUNK: usize = 500;
/// Lines whose files are checked and stored side by side.
const LINE_CONCURRENCY: usize = 16;
/// How long one step submits chunks before giving other batches a turn.
const STEP_BUDGET: Duration = Duration::from_secs(10);
/// Lines of the output files whose records (line, job) are read from Postgres at once.
const PAGE: usize = 500;
/// Job outputs read and held at once while the output files are written: an embedding line
/// of 2,048 texts is megabytes of JSON, so a page's outputs are never held together.
const OUTPUTS_IN_MEMORY: usize = 4;

pub struct Runner {
    pub state: AppState,
    /// The input file of the batch submitted last, kept between its steps: a batch of
    /// thousands of lines takes many steps (and a tenant's full queue many waits), and each
    /// would otherwise read the whole file again. One file, at most
    /// `TERN_MAX_BATCH_FILE_BYTES`.
    pub input_cache: tokio::sync::Mutex<Option<(String, bytes::Bytes)>>,
    /// Who holds claims: this replica.
    pub owner: String,
    /// How often it looks for batches with work.
    pub poll: Duration,
    /// How long a claim on a batch holds unless renewed: how soon another replica takes over
    /// the batch of one that died.
    pub claim: Duration,
}

/// What a step leaves: when to look at the batch again.
type Next = Duration;

/// Why a step stopped short: it is tried again later.
#[derive(Debug)]
enum Stop {
    /// Another runner holds the batch now.
    ClaimLost,
    /// A backing service failed, or the queue is full.
    Service(ApiError),
}

impl From<ApiError> for Stop {
    fn from(e: ApiError) -> Self {
        Stop::Service(e)
    }
}

impl From<sqlx::Error> for Stop {
    fn from(e: sqlx::Error) -> Self {
        Stop::Service(e.into())
    }
}

/// Whether an error of this status is the backing services' (or a full queue's), not the
/// line's: the line is tried again later rather than refused.
fn transient(status: StatusCode) -> bool {
    status == StatusCode::SERVICE_UNAVAILABLE || status == StatusCode::TOO_MANY_REQUESTS
}

/// Text as Postgres can store it: a NUL written out.
fn storable(text: &str) -> std::borrow::Cow<'_, str> {
    match text.contains('\0') {
        true => text.replace('\0', "\\u0000").into(),
        false => text.into(),
    }
}

impl Runner {
    pub async fn run(self, mut stop: tokio::sync::watch::Receiver<bool>) {
        loop {
            loop {
                if *stop.borrow() {
                    return;
                }
                match self.claim().await {
                    Ok(Some(batch)) => {
                        let next = match self.step(&batch).await {
                            Ok(next) => next,
                            Err(Stop::ClaimLost) => {
                                tracing::warn!(batch = %batch.id, "lost the claim on a batch mid-step; another runner has it");
                                continue;
                            }
                            Err(Stop::Service(e)) => {
                                tracing::warn!(batch = %batch.id, code = e.code, error = %e.message, "batch step stopped; retrying");
                                Duration::from_secs(e.retry_after.unwrap_or(5).min(5))
                            }
                        };
                        if let Err(e) = self.release(&batch.id, next).await {
                            tracing::warn!(batch = %batch.id, error = %e.message, "could not release a batch; its claim lapses");
                        }
                    }
                    Ok(None) => break,
                    Err(e) => {
                        tracing::warn!(error = %e.message, "could not look for batches");
                        break;
                    }
                }
            }
            tokio::select! {
                _ = tokio::time::sleep(self.poll) => {}
                _ = stop.changed() => {}
            }
        }
    }

    /// The batch due longest that no live claim holds, claimed.
    async fn claim(&self) -> Result<Option<Batch>, ApiError> {
        let row = sqlx::query(
            "UPDATE batches SET claimed_by = $1, claimed_until = now() + make_interval(secs => $2)
             WHERE id = (SELECT id FROM batches
                         WHERE status IN ('validating', 'in_progress', 'cancelling', 'finalizing')
                           AND next_check_at <= now() AND (claimed_until IS NULL OR claimed_until < now())
                         ORDER BY next_check_at LIMIT 1 FOR UPDATE SKIP LOCKED)
             RETURNING *",
        )
        .bind(&self.owner)
        .bind(self.claim.as_secs_f64())
        .fetch_optional(self.state.store.pool())
        .await
        .map_err(ApiError::from)?;
        row.as_ref().map(Batch::from_row).transpose().map_err(ApiError::from)
    }

    /// Keeps the claim for another `claim`; fails if another runner took it.
    async fn renew(&self, id: &str) -> Result<(), Stop> {
        let renewed = sqlx::query(
            "UPDATE batches SET claimed_until = now() + make_interval(secs => $3) WHERE id = $1 AND claimed_by = $2",
        )
        .bind(id)
        .bind(&self.owner)
        .bind(self.claim.as_secs_f64())
        .execute(self.state.store.pool())
        .await?;
        if renewed.rows_affected() == 0 {
            return Err(Stop::ClaimLost);
        }
        Ok(())
    }

    async fn release(&self, id: &str, next: Next) -> Result<(), ApiError> {
        sqlx::query(
            "UPDATE batches SET claimed_by = NULL, claimed_until = NULL, next_check_at = now() + make_interval(secs => $3)
             WHERE id = $1 AND claimed_by = $2",
        )
        .bind(id)
        .bind(&self.owner)
        .bind(next.as_secs_f64())
        .execute(self.state.store.pool())
        .await
        .map_err(ApiError::from)?;
        Ok(())
    }

    async fn step(&self, batch: &Batch) -> Result<Next, Stop> {
        match batch.status.as_str() {
            status::VALIDATING => self.validate(batch).await,
            status::IN_PROGRESS => {
                if batch.expired_at.is_none() && chrono::Utc::now() >= batch.expires_at {
                    sqlx::query("UPDATE batches SET expired_at = now() WHERE id = $1").bind(&batch.id).execute(self.state.store.pool()).await?;
                    tracing::info!(batch = %batch.id, "the batch's completion window passed: its jobs left are canceled");
                    return Ok(Duration::ZERO);
                }
                if batch.expired_at.is_some() {
                    return self.wind_down(batch).await;
                }
                if batch.submitted < batch.total {
                    return self.submit(batch).await;
                }
                if self.pending(batch).await? > 0 {
                    return Ok(self.poll);
                }
                self.finalize(batch).await
            }
            status::CANCELLING => self.wind_down(batch).await,
            status::FINALIZING => self.finalize(batch).await,
            _ => Ok(self.poll),
        }
    }

    /// The batch's input file, at most `TERN_MAX_BATCH_FILE_BYTES`; `None` if it is gone.
    async fn input(&self, batch: &Batch) -> Result<Option<bytes::Bytes>, Stop> {
        let file = match FileRecord::get(&self.state, &batch.tenant, &batch.input_file_id).await {
            Ok(file) => file,
            Err(e) if e.status == StatusCode::NOT_FOUND => return Ok(None),
            Err(e) => return Err(Stop::Service(ApiError::new(e.status, "database_unavailable", e.message))),
        };
        Ok(Some(self.state.objects.get(&file.object_key, self.state.limits.max_batch_file_bytes as u64).await.map_err(ApiError::from)?))
    }

    /// Checks the file's format: `in_progress` with its count, or `failed` with the errors.
    async fn validate(&self, batch: &Batch) -> Result<Next, Stop> {
        let checked = match self.input(batch).await? {
            None => Err(vec![lines::FormatError {
                code: "input_file_missing",
                message: format!("the input file {} was deleted", batch.input_file_id),
                param: Some("input_file_id"),
                line: None,
            }]),
            Some(bytes) => lines::validate(&bytes),
        };
        let pool = self.state.store.pool();
        match checked {
            Ok(total) => {
                sqlx::query(
                    "UPDATE batches SET status = 'in_progress', in_progress_at = now(), total = $2 WHERE id = $1 AND status = 'validating'",
                )
                .bind(&batch.id)
                .bind(total as i32)
                .execute(pool)
                .await?;
                tracing::info!(batch = %batch.id, requests = total, "batch validated");
            }
            Err(errors) => {
                let errors: Vec<Value> = errors.iter().map(lines::FormatError::to_json).collect();
                sqlx::query(
                    "UPDATE batches SET status = 'failed', failed_at = now(), errors = $2, completed = 0, failed = 0
                     WHERE id = $1 AND status = 'validating'",
                )
                .bind(&batch.id)
                .bind(json!(errors))
                .execute(pool)
                .await?;
                metrics::counter!("tern_batches_finished_total", "status" => status::FAILED).increment(1);
                tracing::info!(batch = %batch.id, errors = errors.len(), "batch failed validation");
            }
        }
        Ok(Duration::ZERO)
    }

    /// The input file while its batch is submitted: read once, then kept ([`Runner::input_cache`]).
    async fn cached_input(&self, batch: &Batch) -> Result<Option<bytes::Bytes>, Stop> {
        let mut cache = self.input_cache.lock().await;
        if let Some((id, bytes)) = cache.as_ref() {
            if *id == batch.id {
                return Ok(Some(bytes.clone()));
            }
        }
        // The file of another batch goes before this one is read, so one is held at a time.
        *cache = None;
        let bytes = self.input(batch).await?;
        if let Some(bytes) = &bytes {
            *cache = Some((batch.id.clone(), bytes.clone()));
        }
        Ok(bytes)
    }

    /// Makes lines jobs, a chunk at a time, for up to [`STEP_BUDGET`]. A full queue shrinks
    /// the chunk; when even one line does not fit, it waits (the file kept, not read again).
    /// A chunk refused for one of its lines (an error of the request, 4xx) is halved down to
    /// that line, which is recorded as refused while the rest go on.
    async fn submit(&self, batch: &Batch) -> Result<Next, Stop> {
        let Some(bytes) = self.cached_input(batch).await? else {
            // The file went while the batch ran (deleting it is refused then; a race).
            return self.refuse_rest(batch, "input_file_missing", "the input file was deleted").await;
        };
        let text = std::str::from_utf8(&bytes).map_err(|_| ApiError::new(StatusCode::INTERNAL_SERVER_ERROR, "internal", "the validated file is not UTF-8"))?;
        let requests: Vec<(usize, &str)> = lines::requests(text).collect();
        let started = Instant::now();
        let (mut submitted, mut chunk) = (batch.submitted as usize, CHUNK);
        while submitted < requests.len() && started.elapsed() < STEP_BUDGET {
            let end = (submitted + chunk).min(requests.len());
            match self.submit_lines(batch, submitted, &requests[submitted..end]).await {
                Ok(()) => submitted = end,
                Err(Stop::Service(e)) if e.status.is_client_error() && !transient(e.status) && chunk > 1 => chunk /= 2,
                Err(Stop::Service(e)) if e.status.is_client_error() && !transient(e.status) => {
                    tracing::info!(batch = %batch.id, line = submitted, code = e.code, "a line refused where its job was written");
                    self.refuse_line(batch, submitted, requests[submitted], &e).await?;
                    submitted += 1;
                    chunk = CHUNK;
                }
                Err(Stop::Service(e)) if transient(e.status) && chunk > 1 => chunk /= 2,
                Err(Stop::Service(e)) if transient(e.status) => {
                    tracing::debug!(batch = %batch.id, code = e.code, "the queue is full: the batch waits");
                    return Ok(Duration::from_secs(1));
                }
                Err(stop) => return Err(stop),
            }
            self.renew(&batch.id).await?;
        }
        Ok(Duration::ZERO)
    }

    /// Lines `requests` (the file's from `first` on) made jobs, or refused, and recorded.
    async fn submit_lines(&self, batch: &Batch, first: usize, requests: &[(usize, &str)]) -> Result<(), Stop> {
        let mut prepared = Vec::with_capacity(requests.len());
        for (offset, (number, text)) in requests.iter().enumerate() {
            let index = first + offset;
            prepared.push(self.prepare(batch, index, lines::parse(*number, text)));
        }
        let prepared: Vec<(usize, String, Result<NewJob, OpenAiError>)> =
            futures::stream::iter(prepared).buffered(LINE_CONCURRENCY).collect().await;
        if let Some(e) = prepared.iter().find_map(|(_, _, r)| r.as_ref().err().filter(|e| transient(e.status))) {
            tracing::debug!(batch = %batch.id, code = %e.code, "a line's checks hit a service failure");
            return Err(Stop::Service(ApiError::new(e.status, "queue_unavailable", e.message.clone())));
        }
        let jobs: Vec<NewJob> = prepared.iter().filter_map(|(_, _, r)| r.as_ref().ok().cloned()).collect();
        admit(&self.state, &batch.tenant, &jobs).await?;
        insert_and_enqueue(&self.state, &jobs).await?;
        // New and replayed alike: the job each key names now.
        let keys: Vec<&str> = jobs.iter().filter_map(|j| j.idempotency_key.as_deref()).collect();
        let ids: HashMap<String, Uuid> = sqlx::query_as::<_, (String, Uuid)>(
            "SELECT idempotency_key, id FROM jobs WHERE tenant = $1 AND idempotency_key = ANY($2)",
        )
        .bind(&batch.tenant)
        .bind(&keys)
        .fetch_all(self.state.store.pool())
        .await?
        .into_iter()
        .collect();
        let (mut indexes, mut custom_ids, mut job_ids, mut statuses, mut codes, mut messages) =
            (Vec::new(), Vec::new(), Vec::new(), Vec::new(), Vec::new(), Vec::new());
        for (index, custom_id, result) in &prepared {
            let (job, status, code, message) = match result {
                Ok(job) => {
                    let id = job.idempotency_key.as_ref().and_then(|k| ids.get(k)).copied();
                    (Some(id.ok_or_else(|| ApiError::new(StatusCode::INTERNAL_SERVER_ERROR, "internal", "a submitted line has no job"))?), None, None, None)
                }
                Err(e) => (None, Some(e.status.as_u16() as i32), Some(e.code.as_str()), Some(storable(&e.message).into_owned())),
            };
            indexes.push(*index as i32);
            custom_ids.push(custom_id.as_str());
            job_ids.push(job);
            statuses.push(status);
            codes.push(code);
            messages.push(message);
        }
        let mut tx = self.state.store.pool().begin().await?;
        sqlx::query(
            "INSERT INTO batch_requests (batch_id, line, custom_id, job_id, error_status, error_code, error_message)
             SELECT $1, * FROM unnest($2::int4[], $3::text[], $4::uuid[], $5::int4[], $6::text[], $7::text[])
             ON CONFLICT DO NOTHING",
        )
        .bind(&batch.id)
        .bind(&indexes)
        .bind(&custom_ids)
        .bind(&job_ids)
        .bind(&statuses)
        .bind(&codes)
        .bind(&messages)
        .execute(&mut *tx)
        .await?;
        self.advance(&mut tx, batch, first + requests.len()).await?;
        tx.commit().await?;
        Ok(())
    }

    /// Moves the batch's count of submitted lines to at least `to` in `tx`, while this runner
    /// holds the batch.
    async fn advance(&self, tx: &mut sqlx::PgConnection, batch: &Batch, to: usize) -> Result<(), Stop> {
        let moved = sqlx::query("UPDATE batches SET submitted = greatest(submitted, $3) WHERE id = $1 AND claimed_by = $2")
            .bind(&batch.id)
            .bind(&self.owner)
            .bind(to as i32)
            .execute(&mut *tx)
            .await?;
        if moved.rows_affected() == 0 {
            return Err(Stop::ClaimLost);
        }
        Ok(())
    }

    /// A line as a checked job with its files stored, or why it is refused. Returns the
    /// line's index and custom id with it.
    fn prepare(&self, batch: &Batch, index: usize, line: Result<Line, lines::FormatError>) -> impl std::future::Future<Output = (usize, String, Result<NewJob, OpenAiError>)> + Send + 'static {
        let state = self.state.clone();
        let (batch_id, tenant, priority) = (batch.id.clone(), batch.tenant.clone(), batch.priority.clone());
        async move {
            let line = match line {
                Ok(line) => line,
                // The file was validated; a line that no longer reads is refused, not retried.
                Err(e) => {
                    return (index, String::new(), Err(OpenAiError::invalid(e.code, e.message, e.param.unwrap_or("body"))));
                }
            };
            let result = async {
                // As POST /v1/jobs refuses it: Postgres cannot store a NUL.
                if let Some(path) = crate::extract::nul_in(&line.body, "body") {
                    let e = crate::extract::nul_error(&path);
                    return Err(OpenAiError::invalid(e.code, e.message, "body"));
                }
                let request = line.route.request(&line.body)?;
                let mut value = request.job_request();
                value["priority"] = json!(priority);
                value["idempotency_key"] = json!(format!("{batch_id}/{}", line.custom_id));
                value["metadata"] = json!({ "batch_id": batch_id, "custom_id": line.custom_id });
                let mut job = submission::parse(&value, None).map_err(OpenAiError::from)?.job;
                job.tenant = tenant.clone();
                submission::check_upload_tenant(&job, &tenant).map_err(OpenAiError::from)?;
                submission::check_urls(&job, state.allow_private_urls).await.map_err(OpenAiError::from)?;
                submission::store_inline_files(&mut job, &state.objects, state.limits.max_audio_seconds).await.map_err(OpenAiError::from)?;
                Ok::<_, OpenAiError>(job)
            }
            .await;
            (index, line.custom_id, result)
        }
    }

    /// Records the line at `index` as refused with `e` and moves the batch past it.
    async fn refuse_line(&self, batch: &Batch, index: usize, (number, text): (usize, &str), e: &ApiError) -> Result<(), Stop> {
        let custom_id = lines::parse(number, text).map(|l| l.custom_id).unwrap_or_default();
        let mut tx = self.state.store.pool().begin().await?;
        sqlx::query(
            "INSERT INTO batch_requests (batch_id, line, custom_id, error_status, error_code, error_message)
             VALUES ($1, $2, $3, $4, $5, $6) ON CONFLICT DO NOTHING",
        )
        .bind(&batch.id)
        .bind(index as i32)
        .bind(&custom_id)
        .bind(e.status.as_u16() as i32)
        .bind(e.code)
        .bind(storable(&e.message).as_ref())
        .execute(&mut *tx)
        .await?;
        self.advance(&mut tx, batch, index + 1).await?;
        tx.commit().await?;
        Ok(())
    }

    /// Records every line not yet submitted as refused with `code`, so the batch can end.
    async fn refuse_rest(&self, batch: &Batch, code: &str, message: &str) -> Result<Next, Stop> {
        sqlx::query(
            "INSERT INTO batch_requests (batch_id, line, custom_id, error_status, error_code, error_message)
             SELECT $1, n, '', 500, $3, $4 FROM generate_series($2, $5 - 1) AS n ON CONFLICT DO NOTHING",
        )
        .bind(&batch.id)
        .bind(batch.submitted)
        .bind(code)
        .bind(message)
        .bind(batch.total)
        .execute(self.state.store.pool())
        .await?;
        sqlx::query("UPDATE batches SET submitted = total WHERE id = $1").bind(&batch.id).execute(self.state.store.pool()).await?;
        Ok(Duration::ZERO)
    }

    /// Jobs of the batch not yet finished.
    async fn pending(&self, batch: &Batch) -> Result<i64, Stop> {
        Ok(sqlx::query_scalar(
            "SELECT count(*) FROM batch_requests r JOIN jobs j ON j.id = r.job_id
             WHERE r.batch_id = $1 AND j.state NOT IN ('succeeded', 'failed', 'canceled')",
        )
        .bind(&batch.id)
        .fetch_one(self.state.store.pool())
        .await?)
    }

    /// A canceled or expired batch: cancels its waiting jobs, asks its running ones to stop,
    /// and writes its files once none runs.
    async fn wind_down(&self, batch: &Batch) -> Result<Next, Stop> {
        loop {
            let ids: Vec<Uuid> = sqlx::query_scalar(
                "SELECT j.id FROM batch_requests r JOIN jobs j ON j.id = r.job_id
                 WHERE r.batch_id = $1 AND j.state IN ('queued', 'scheduled', 'retrying', 'running') AND NOT j.cancel_requested
                 LIMIT 1000",
            )
            .bind(&batch.id)
            .fetch_all(self.state.store.pool())
            .await?;
            if ids.is_empty() {
                break;
            }
            for id in ids {
                match self.state.store.cancel(id).await.map_err(ApiError::from)? {
                    CancelOutcome::Canceled(job) => self.state.queue.cancel(job.kind, job.id, false).await.map_err(ApiError::from)?,
                    CancelOutcome::Requested(job) => self.state.queue.cancel(job.kind, job.id, true).await.map_err(ApiError::from)?,
                    CancelOutcome::NotFound | CancelOutcome::AlreadyFinished(_) => {}
                }
            }
            self.renew(&batch.id).await?;
        }
        if self.pending(batch).await? > 0 {
            return Ok(self.poll);
        }
        self.finalize(batch).await
    }

    /// Writes the output and error files, one line for every request of the file, in its
    /// order, and ends the batch: `completed`, `cancelled` or `expired`.
    async fn finalize(&self, batch: &Batch) -> Result<Next, Stop> {
        let pool = self.state.store.pool();
        if batch.status == status::IN_PROGRESS {
            let moved = sqlx::query(
                "UPDATE batches SET status = 'finalizing', finalizing_at = now() WHERE id = $1 AND status = 'in_progress'",
            )
            .bind(&batch.id)
            .execute(pool)
            .await?;
            if moved.rows_affected() == 0 {
                // Canceled meanwhile: the next step winds it down.
                return Ok(Duration::ZERO);
            }
        }
        let (ending, unrun) = if batch.cancelling_at.is_some() || batch.status == status::CANCELLING {
            (status::CANCELLED, ("batch_cancelled", "the batch was canceled before this request ran"))
        } else if batch.expired_at.is_some() {
            (status::EXPIRED, ("batch_expired", "the batch's completion window passed before this request ran"))
        } else {
            (status::COMPLETED, ("request_not_run", "this request was not run"))
        };
        let input = if batch.total > 0 { self.input(batch).await? } else { None };
        let text = input.as_deref().map(|b| String::from_utf8_lossy(b).into_owned()).unwrap_or_default();
        let requests: Vec<(usize, &str)> = lines::requests(&text).collect();
        let segment = crate::routes::uploads::tenant_segment(&batch.tenant);
        let mut out = self.state.objects.writer(&format!("files/{segment}/{}-output", batch.id), "application/jsonl");
        let mut errors = self.state.objects.writer(&format!("files/{segment}/{}-errors", batch.id), "application/jsonl");
        let (mut completed, mut failed) = (0i32, 0i32);
        for (page, chunk) in requests.chunks(PAGE).enumerate() {
            let first = page * PAGE;
            let rows: Vec<RequestRow> = sqlx::query_as(
                "SELECT line, job_id, error_status, error_code, error_message FROM batch_requests
                 WHERE batch_id = $1 AND line >= $2 AND line < $3",
            )
            .bind(&batch.id)
            .bind(first as i32)
            .bind((first + chunk.len()) as i32)
            .fetch_all(pool)
            .await?;
            let mut rows: HashMap<i32, _> = rows.into_iter().map(|r| (r.0, r)).collect();
            let job_ids: Vec<Uuid> = rows.values().filter_map(|r| r.1).collect();
            let mut jobs: HashMap<Uuid, Job> =
                self.state.store.get_many(&job_ids).await.map_err(ApiError::from)?.into_iter().map(|j| (j.id, j)).collect();
            // Each line's record is made (its job's output read) a few at a time and written in
            // the file's order as it is ready, so at most OUTPUTS_IN_MEMORY outputs are held
            // whatever the page's size. The futures own their line's job: a closure over the
            // page's maps is not `Send` for the spawned runner.
            let mut work = Vec::with_capacity(chunk.len());
            for (offset, (number, line_text)) in chunk.iter().enumerate() {
                let index = first + offset;
                let row = rows.remove(&(index as i32));
                let job = row.as_ref().and_then(|r| r.1).and_then(|id| jobs.remove(&id));
                work.push((index, lines::parse(*number, line_text).ok(), row, job));
            }
            let records = futures::stream::iter(work)
                .map(|(index, line, row, job)| {
                    let state = self.state.clone();
                    let batch = batch.clone();
                    async move {
                        let output = match &job {
                            Some(job) if job.state == JobState::Succeeded => Some(job_output(&state, job).await),
                            _ => None,
                        };
                        // Images are answered by URL, presigned as the file is written.
                        let output = match output {
                            Some(Ok(mut value)) if line.as_ref().is_some_and(|l| l.route.names_images()) => {
                                Some(crate::openai::images::add_urls(&state, &mut value).await.map(|()| value).map_err(OpenAiError::from))
                            }
                            other => other,
                        };
                        let answer = answer(&batch, index, line.as_ref(), row.as_ref(), job.as_ref(), output, unrun);
                        let mut record = answer.record;
                        record["custom_id"] = json!(line.map(|l| l.custom_id));
                        let mut bytes = record.to_string().into_bytes();
                        bytes.push(b'\n');
                        (answer.ok, bytes)
                    }
                })
                .buffered(OUTPUTS_IN_MEMORY);
            futures::pin_mut!(records);
            while let Some((ok, bytes)) = records.next().await {
                if ok {
                    completed += 1;
                    out.write(&bytes).await.map_err(ApiError::from)?;
                } else {
                    failed += 1;
                    errors.write(&bytes).await.map_err(ApiError::from)?;
                }
            }
            self.renew(&batch.id).await?;
        }
        let mut output_file = None;
        if completed > 0 {
            let stored = out.finish().await.map_err(ApiError::from)?;
            output_file = Some(self.file_record(batch, &stored, "output"));
        }
        let mut error_file = None;
        if failed > 0 {
            let stored = errors.finish().await.map_err(ApiError::from)?;
            error_file = Some(self.file_record(batch, &stored, "errors"));
        }
        let mut tx = pool.begin().await?;
        for file in output_file.iter().chain(&error_file) {
            file.insert(&mut *tx).await?;
        }
        let ended = sqlx::query(&format!(
            "UPDATE batches SET status = $3, {ending}_at = now(), output_file_id = $4, error_file_id = $5, completed = $6, failed = $7
             WHERE id = $1 AND claimed_by = $2 AND status IN ('in_progress', 'finalizing', 'cancelling')"
        ))
        .bind(&batch.id)
        .bind(&self.owner)
        .bind(ending)
        .bind(output_file.as_ref().map(|f| &f.id))
        .bind(error_file.as_ref().map(|f| &f.id))
        .bind(completed)
        .bind(failed)
        .execute(&mut *tx)
        .await?;
        if ended.rows_affected() == 0 {
            return Err(Stop::ClaimLost);
        }
        tx.commit().await?;
        metrics::counter!("tern_batches_finished_total", "status" => ending).increment(1);
        metrics::counter!("tern_batch_requests_total", "outcome" => "completed").increment(completed as u64);
        metrics::counter!("tern_batch_requests_total", "outcome" => "failed").increment(failed as u64);
        tracing::info!(batch = %batch.id, status = ending, completed, failed, "batch ended");
        Ok(Duration::ZERO)
    }

    fn file_record(&self, batch: &Batch, stored: &tern_jobs::JobOutput, which: &str) -> FileRecord {
        let mut record = FileRecord::new(&batch.tenant, "batch_output", &format!("{}_{which}.jsonl", batch.id));
        // Batch files are always written to S3, so they have a key.
        record.object_key = stored.key.clone().unwrap_or_default();
        record.bytes = stored.size;
        record
    }
}

/// A line's record: index, job, and the status, code and message of its refusal.
type RequestRow = (i32, Option<Uuid>, Option<i32>, Option<String>, Option<String>);

/// One line of the output or error file.
struct Answer {
    /// Whether it goes to the output file (else the error file).
    ok: bool,
    record: Value,
}

/// The line at `index`'s answer: its job's response (from `output`, the job's output where it
/// succeeded), or why it has none.
fn answer(
    batch: &Batch,
    index: usize,
    line: Option<&Line>,
    row: Option<&RequestRow>,
    job: Option<&Job>,
    output: Option<Result<Value, OpenAiError>>,
    unrun: (&str, &str),
) -> Answer {
    let request_id = format!("batch_req_{}_{index}", batch.id.trim_start_matches("batch_"));
    let not_run = |code: &str, message: &str| Answer {
        ok: false,
        record: json!({ "id": request_id, "response": null, "error": { "code": code, "message": message } }),
    };
    let refused = |job: Option<Uuid>, status: u16, code: &str, message: &str| Answer {
        ok: false,
        record: json!({
            "id": request_id,
            "response": { "status_code": status, "request_id": job, "body": { "error": {
                "message": message, "type": if status >= 500 { "server_error" } else { "invalid_request_error" }, "param": null, "code": code,
            }}},
            "error": null,
        }),
    };
    let Some((_, job_id, status, code, message)) = row else { return not_run(unrun.0, unrun.1) };
    if job_id.is_none() {
        return refused(None, status.unwrap_or(400) as u16, code.as_deref().unwrap_or("invalid_request"), message.as_deref().unwrap_or(""));
    }
    let Some(job) = job else { return not_run("job_deleted", "this request's job was deleted before the batch ended") };
    match job.state {
        JobState::Canceled if unrun.0 != "request_not_run" => not_run(unrun.0, unrun.1),
        JobState::Canceled => not_run("job_canceled", "this request's job was canceled"),
        JobState::Failed => {
            let failure = job.error.as_ref();
            let code = failure.map_or("failed", |f| f.code.as_str());
            let status = if super::super::CLIENT_FAULTS.contains(&code) { 400 } else { 500 };
            refused(Some(job.id), status, code, failure.map_or("the job failed", |f| f.message.as_str()))
        }
        _ => {
            let response = match (output, line) {
                (Some(Ok(output)), Some(line)) => line.route.request(&line.body).and_then(|r| r.response(job, &output)),
                (Some(Err(e)), _) => Err(e),
                _ => Err(OpenAiError { status: StatusCode::INTERNAL_SERVER_ERROR, code: "internal".into(), message: "no output".into(), param: None }),
            };
            match response {
                Ok(body) => Answer {
                    ok: true,
                    record: json!({
                        "id": format!("batch_req_{}", job.id.simple()),
                        "response": { "status_code": 200, "request_id": job.id, "body": body },
                        "error": null,
                    }),
                },
                Err(e) => refused(Some(job.id), e.status.as_u16(), &e.code, &e.message),
            }
        }
    }
}
