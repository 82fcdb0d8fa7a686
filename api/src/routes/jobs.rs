//! `/v1/jobs`: submit, batch submit, get, list, timeline, cancel.

use crate::auth::Caller;
use crate::error::ApiError;
use crate::openapi;
use crate::state::AppState;
use crate::submission::{self, Submission};
use axum::body::Bytes;
use futures::{StreamExt, TryStreamExt};
use axum::extract::rejection::BytesRejection;
use axum::extract::{Path, State};
use crate::extract::ApiQuery;
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde::Deserialize;
use serde_json::{json, Value};
use std::collections::HashMap;
use std::time::Duration;
use tern_jobs::queue::Enqueue;
use tern_jobs::store::{CancelOutcome, ListFilter};
use tern_jobs::{Job, JobKind, JobState, NewJob};
use uuid::Uuid;

/// Jobs of one batch submit whose files are stored at the same time.
const STORE_CONCURRENCY: usize = 16;

/// Most jobs in one `POST /v1/jobs/batch`.
pub const BATCH_MAX: usize = 1000;
/// Default and largest page of `GET /v1/jobs`.
pub const LIST_LIMIT_DEFAULT: i64 = 50;
pub const LIST_LIMIT_MAX: i64 = 500;

fn idempotency_header(headers: &HeaderMap) -> Result<Option<&str>, ApiError> {
    headers
        .get("idempotency-key")
        .map(|v| v.to_str().map_err(|_| ApiError::bad_request("invalid_request", "Idempotency-Key must be ASCII")))
        .transpose()
}

/// The job as the API shows it: the record, plus its queue position while it waits and a
/// presigned download URL once it succeeded.
pub async fn job_view(state: &AppState, job: &Job, with_position: bool) -> Result<Value, ApiError> {
    let mut v = serde_json::to_value(job).expect("jobs serialise");
    let position = if with_position && job.state == JobState::Queued {
        state.queue.position(job.kind, job.id).await?
    } else {
        None
    };
    v["queue_position"] = json!(position);
    if job.state == JobState::Running {
        if let Some(progress) = state.queue.progress(job.kind, job.id).await? {
            v["progress"] = json!(progress);
        }
    }
    if let Some(output) = &job.output {
        v["output"]["url"] = json!(match &output.key {
            Some(key) => state.objects.presign_get(key).await?,
            None => state.output_links.url(job.id),
        });
        // Renderings are always S3 objects.
        for (format, file) in &output.formats {
            if let Some(key) = &file.key {
                v["output"]["formats"][format]["url"] = json!(state.objects.presign_get(key).await?);
            }
        }
        // An image job's output names its PNGs by key: each gets its download URL beside it.
        if let Some(inline) = v.pointer_mut("/output/inline").filter(|_| job.kind == JobKind::Image) {
            crate::openai::images::add_urls(state, inline).await?;
        }
    }
    Ok(v)
}

async fn views(state: &AppState, jobs: &[Job]) -> Result<Vec<Value>, ApiError> {
    let mut out = Vec::with_capacity(jobs.len());
    for job in jobs {
        out.push(job_view(state, job, false).await?);
    }
    Ok(out)
}

/// Refuses work past the queue's configured depth.
pub(crate) async fn admit(state: &AppState, tenant: &str, jobs: &[NewJob]) -> Result<(), ApiError> {
    if let (Some(cap), false) = (state.limits.max_queued_per_tenant, jobs.is_empty()) {
        let waiting = state.store.waiting_for_tenant(tenant).await?;
        if waiting + jobs.len() as i64 > cap {
            return Err(ApiError::new(
                StatusCode::TOO_MANY_REQUESTS,
                "tenant_queue_full",
                format!("tenant {tenant} has {waiting} jobs waiting; its limit is {cap}"),
            )
            .retry_after(5));
        }
    }
    if !state.webhooks_enabled && jobs.iter().any(|j| j.webhook.is_some()) {
        return Err(ApiError::new(
            StatusCode::UNPROCESSABLE_ENTITY,
            "webhooks_not_configured",
            "this server has no webhook signing secret (TERN_WEBHOOK_SECRETS): jobs cannot name a webhook",
        ));
    }
    let mut per_kind: HashMap<JobKind, u64> = HashMap::new();
    for job in jobs {
        *per_kind.entry(job.kind).or_default() += 1;
    }
    for (kind, n) in per_kind {
        let depth = state.queue.depth(kind).await?;
        if depth + n > state.limits.max_queued {
            return Err(ApiError::new(
                StatusCode::SERVICE_UNAVAILABLE,
                "queue_full",
                format!("the {kind} queue holds {depth} jobs, its limit is {}; retry later", state.limits.max_queued),
            )
            .retry_after(5));
        }
    }
    Ok(())
}

/// Inserts checked jobs in one transaction and enqueues them. A Redis failure after the commit
/// is not the client's problem: the jobs are recorded, and the reconciler enqueues them.
pub(crate) async fn insert_and_enqueue(state: &AppState, jobs: &[NewJob]) -> Result<Vec<Job>, ApiError> {
    let inserted = state.store.insert(jobs).await?;
    for j in &inserted {
        metrics::counter!("tern_jobs_submitted_total", "kind" => j.kind.as_str(), "priority" => j.priority.as_str()).increment(1);
    }
    let entries: Vec<Enqueue> = inserted
        .iter()
        .map(Enqueue::from)
        .collect();
    if let Err(e) = state.queue.enqueue(&entries).await {
        tracing::error!(error = %e, jobs = entries.len(), "enqueue failed after commit; the reconciler will enqueue them");
    }
    Ok(inserted)
}

/// What an earlier request with the same idempotency key left, if any.
async fn replayed(state: &AppState, job: &NewJob) -> Result<Option<Job>, ApiError> {
    let Some(key) = &job.idempotency_key else {
        return Ok(None);
    };
    let Some(existing) = state.store.get_by_idempotency_key(&job.tenant, key).await? else {
        return Ok(None);
    };
    if existing.request_sha256 != job.request_sha256 {
        return Err(ApiError::new(
            StatusCode::CONFLICT,
            "idempotency_conflict",
            format!("idempotency key {key:?} was used for a different request"),
        ));
    }
    Ok(Some(existing))
}

/// Submit a job.
///
/// `POST /v1/jobs`: 201 with the new job; 200 with the earlier job when an `Idempotency-Key`
/// replays the same request.
#[utoipa::path(
    post,
    path = "/v1/jobs",
    operation_id = "submit_job",
    tag = "jobs",
    params(
        ("Idempotency-Key" = Option<String>, Header, min_length = 1, max_length = 255, pattern = "^[ -~]+$", description = "1 to 255 ASCII characters, scoped to the caller's tenant. The same key with the same body returns the first request's job (200); with another body, 409 `idempotency_conflict`. Equivalent to the body's `idempotency_key`, which it may not contradict."),
    ),
    request_body(content = openapi::JobRequest, description = "The job: its kind, the kind's input, and options."),
    responses(
        (status = 201, description = "Accepted: the new job, `queued` (or `scheduled` with a future `run_at`)", body = openapi::Job),
        (status = 200, description = "The idempotency key replayed the same request: the earlier job", body = openapi::Job),
        (status = 400, description = "`invalid_json`, `invalid_body`, `invalid_character` (a NUL, `\\u0000`, anywhere in the body), `invalid_request` (unknown field, bad option, header and body keys differ), `unknown_kind`, `invalid_priority`, `metadata_too_large`, `invalid_url`, `invalid_base64`", body = openapi::Error),
        (status = 404, description = "`upload_not_found`: no upload under the `upload_key` given, for this tenant", body = openapi::Error),
        (status = 409, description = "`idempotency_conflict`: the key was used for another request", body = openapi::Error),
        (status = 413, description = "`body_too_large` (`TERN_MAX_BODY_BYTES`), `file_too_large` (base64 over 10 MiB), `audio_too_long` (`TERN_MAX_AUDIO_SECONDS`)", body = openapi::Error),
        (status = 422, description = "`invalid_input` (the input fails its kind's schema), `invalid_webhook`, `webhooks_not_configured`, `url_forbidden`, `audio_unreadable`, `audio_empty`", body = openapi::Error),
        (status = 429, description = "`rate_limited` (the key's request rate) or `tenant_queue_full` (`TERN_MAX_QUEUED_PER_TENANT`)", body = openapi::Error,
            headers(("Retry-After" = u64, description = "Seconds to wait before trying again"))),
        (status = 500, description = "`internal`: probing the audio's duration failed unexpectedly", body = openapi::Error),
        (status = 503, description = "`queue_full` (`TERN_MAX_QUEUED` jobs of the kind wait), or a backing service did not answer (`database_unavailable`, `queue_unavailable`, `storage_unavailable`)", body = openapi::Error,
            headers(("Retry-After" = u64, description = "Seconds to wait before trying again"))),
    ),
    security(("bearer" = ["jobs:write"]), ("api_key" = ["jobs:write"])),
)]
pub async fn submit(
    State(state): State<AppState>,
    caller: Caller,
    headers: HeaderMap,
    body: Result<Bytes, BytesRejection>,
) -> Result<Response, ApiError> {
    let tenant = caller.require("jobs:write")?.tenant.clone();
    let value = crate::extract::json_value(body)?;
    match create(&state, &tenant, &value, idempotency_header(&headers)?).await? {
        Created::New(job) => Ok((StatusCode::CREATED, Json(job_view(&state, &job, false).await?)).into_response()),
        Created::Replayed(job) => Ok((StatusCode::OK, Json(job_view(&state, &job, true).await?)).into_response()),
    }
}

/// What [`create`] did.
pub enum Created {
    New(Job),
    /// The idempotency key named an earlier request with the same body: its job.
    Replayed(Job),
}

impl Created {
    pub fn job(&self) -> &Job {
        match self {
            Created::New(job) | Created::Replayed(job) => job,
        }
    }
}

/// One job request of `tenant` checked, admitted, its files stored, inserted and enqueued, as
/// `POST /v1/jobs` takes it; the OpenAI-compatible routes come in here too. `header_key` is
/// the `Idempotency-Key` header.
pub async fn create(state: &AppState, tenant: &str, value: &Value, header_key: Option<&str>) -> Result<Created, ApiError> {
    create_as(state, tenant, value, header_key, None).await
}

/// [`create`], with `fingerprint` (when given) telling an idempotent replay from another
/// request in place of the fingerprint of `value`.
pub async fn create_as(state: &AppState, tenant: &str, value: &Value, header_key: Option<&str>, fingerprint: Option<String>) -> Result<Created, ApiError> {
    let Submission { mut job } = submission::parse(value, header_key)?;
    if job.idempotency_key.is_some() && fingerprint.is_some() {
        job.request_sha256 = fingerprint;
    }
    job.tenant = tenant.to_string();
    submission::check_upload_tenant(&job, tenant)?;
    if let Some(existing) = replayed(state, &job).await? {
        return Ok(Created::Replayed(existing));
    }
    admit(state, tenant, std::slice::from_ref(&job)).await?;
    submission::check_urls(&job, state.allow_private_urls).await?;
    submission::store_inline_files(&mut job, &state.objects, state.limits.max_audio_seconds).await?;
    let inserted = insert_and_enqueue(state, std::slice::from_ref(&job)).await?;
    match inserted.into_iter().next() {
        Some(created) => Ok(Created::New(created)),
        // Lost a race with a concurrent request carrying the same key.
        None => match replayed(state, &job).await? {
            Some(existing) => Ok(Created::Replayed(existing)),
            None => Err(ApiError::new(StatusCode::CONFLICT, "idempotency_conflict", "retry the request")),
        },
    }
}

/// Submit up to 1,000 jobs at once.
///
/// `POST /v1/jobs/batch` with `{"jobs": [...]}`: up to 1,000 jobs checked together and inserted
/// in one transaction; any bad job refuses the whole batch, with the index of the first one.
#[utoipa::path(
    post,
    path = "/v1/jobs/batch",
    operation_id = "submit_jobs",
    tag = "jobs",
    request_body(content = openapi::BatchRequest, description = "1 to 1,000 jobs, each as `POST /v1/jobs` takes it (idempotency keys in the body)."),
    responses(
        (status = 201, description = "Every job of the batch in request order; a replayed request shows its earlier job", body = openapi::JobBatch),
        (status = 400, description = "`invalid_json`, `invalid_body`, `invalid_character` (a NUL anywhere), `invalid_request` (not `{\"jobs\": [...]}`), `batch_too_large` (0 or over 1,000 jobs), or a job's own error (its message starts `jobs[i]:`)", body = openapi::Error),
        (status = 404, description = "`upload_not_found`: a job names an upload this tenant does not have", body = openapi::Error),
        (status = 409, description = "`idempotency_conflict`: a job's key was used for another request, earlier or within this batch; no job of the batch is committed", body = openapi::Error),
        (status = 413, description = "`body_too_large`, `file_too_large`, `audio_too_long`", body = openapi::Error),
        (status = 422, description = "A job's `invalid_input`, `invalid_webhook`, `webhooks_not_configured`, `url_forbidden`, `audio_unreadable`, `audio_empty`", body = openapi::Error),
        (status = 429, description = "`rate_limited` or `tenant_queue_full`", body = openapi::Error,
            headers(("Retry-After" = u64, description = "Seconds to wait before trying again"))),
        (status = 500, description = "`internal`: probing an audio's duration failed unexpectedly", body = openapi::Error),
        (status = 503, description = "`queue_full`, or a backing service did not answer", body = openapi::Error,
            headers(("Retry-After" = u64, description = "Seconds to wait before trying again"))),
    ),
    security(("bearer" = ["jobs:write"]), ("api_key" = ["jobs:write"])),
)]
pub async fn submit_batch(
    State(state): State<AppState>,
    caller: Caller,
    body: Result<Bytes, BytesRejection>,
) -> Result<Response, ApiError> {
    let tenant = caller.require("jobs:write")?.tenant.clone();
    let value = crate::extract::json_value(body)?;
    let items = value
        .get("jobs")
        .and_then(Value::as_array)
        .ok_or_else(|| ApiError::bad_request("invalid_request", "the body must be {\"jobs\": [...]}"))?;
    if items.is_empty() || items.len() > BATCH_MAX {
        return Err(ApiError::bad_request(
            "batch_too_large",
            format!("a batch holds 1 to {BATCH_MAX} jobs, this one has {}", items.len()),
        ));
    }
    let mut jobs = Vec::with_capacity(items.len());
    for (i, item) in items.iter().enumerate() {
        let Submission { mut job } = submission::parse(item, None).map_err(|mut e| {
            e.message = format!("jobs[{i}]: {}", e.message);
            e
        })?;
        job.tenant = tenant.clone();
        submission::check_upload_tenant(&job, &tenant)?;
        jobs.push(job);
    }
    // Replays keep their earlier job; only new requests are inserted.
    let mut results: Vec<Option<Job>> = Vec::with_capacity(jobs.len());
    for job in &jobs {
        results.push(replayed(&state, job).await?);
    }
    let mut fresh: Vec<NewJob> = jobs.into_iter().zip(&results).filter(|(_, r)| r.is_none()).map(|(j, _)| j).collect();
    admit(&state, &tenant, &fresh).await?;
    for job in &fresh {
        submission::check_urls(job, state.allow_private_urls).await?;
    }
    // Each job's files are probed and stored in S3 in turn, so the jobs go side by side. In
    // order, so the error is the first failing job's whatever finishes first. (The futures
    // are made in a loop: a closure over `iter_mut` here is not `Send` for axum.)
    let mut stores = Vec::with_capacity(fresh.len());
    for job in fresh.iter_mut() {
        stores.push(submission::store_inline_files(job, &state.objects, state.limits.max_audio_seconds));
    }
    futures::stream::iter(stores).buffered(STORE_CONCURRENCY).try_collect::<Vec<()>>().await?;
    let mut inserted: HashMap<Uuid, Job> =
        insert_and_enqueue(&state, &fresh).await?.into_iter().map(|j| (j.id, j)).collect();
    let mut fresh_iter = fresh.iter();
    let mut out = Vec::with_capacity(results.len());
    for r in results {
        let job = match r {
            Some(existing) => existing,
            None => {
                let new = fresh_iter.next().expect("one fresh job per empty result");
                match inserted.remove(&new.id) {
                    Some(job) => job,
                    None => replayed(&state, new).await?.ok_or_else(|| {
                        ApiError::new(StatusCode::CONFLICT, "idempotency_conflict", "retry the request")
                    })?,
                }
            }
        };
        out.push(job);
    }
    Ok((StatusCode::CREATED, Json(json!({ "jobs": views(&state, &out).await? }))).into_response())
}

pub(crate) fn parse_id(id: &str) -> Result<Uuid, ApiError> {
    Uuid::parse_str(id).map_err(|_| ApiError::not_found())
}

/// The caller's job `id`: another tenant's job is 404, exactly like a missing one.
pub(crate) async fn own_job(state: &AppState, tenant: &str, id: Uuid) -> Result<Job, ApiError> {
    state.store.get(id).await?.filter(|j| j.tenant == tenant).ok_or_else(ApiError::not_found)
}

/// Longest `?wait=` of `GET /v1/jobs/{id}`.
pub const WAIT_MAX: Duration = Duration::from_secs(60);

#[derive(Debug, Deserialize)]
pub struct GetQuery {
    wait: Option<String>,
}

/// A wait as `?wait=` gives it: whole seconds, 0 to 60, `s` optional (`30s`, `30`); no
/// leading zeros, exactly as the documented pattern says.
fn parse_wait(wait: &str) -> Option<Duration> {
    let digits = wait.strip_suffix('s').unwrap_or(wait);
    let canonical = !digits.is_empty() && digits.bytes().all(|b| b.is_ascii_digit()) && (digits == "0" || !digits.starts_with('0'));
    let seconds: u64 = digits.parse().ok().filter(|_| canonical && digits.len() <= 2)?;
    Some(Duration::from_secs(seconds)).filter(|d| *d <= WAIT_MAX)
}

/// Get a job.
///
/// `GET /v1/jobs/{id}`: its state, timings, attempts, error, `queue_position` while queued,
/// `progress` while it runs, `output` with presigned URLs once it succeeded. With
/// `?wait=30s` (0 to 60 s) it answers once the job has finished, or when the wait is over.
#[utoipa::path(
    get,
    path = "/v1/jobs/{id}",
    operation_id = "get_job",
    tag = "jobs",
    params(
        ("id" = uuid::Uuid, Path, description = "The job's id"),
        ("wait" = Option<String>, Query, pattern = "^([0-9]|[1-5][0-9]|60)s?$", description = "Long-poll: answer once the job finished, or after this many seconds (`30s` or `30`; 0 to 60), whichever comes first"),
    ),
    responses(
        (status = 200, description = "The job", body = openapi::Job),
        (status = 400, description = "`invalid_wait`: not whole seconds from 0 to 60", body = openapi::Error),
        (status = 404, description = "`not_found`: no such job of this tenant", body = openapi::Error),
        (status = 429, description = "`too_many_streams`: with `wait`, this API key or this server has as many streams and waits open as allowed", body = openapi::Error,
            headers(("Retry-After" = u64, description = "Seconds to wait before trying again"))),
    ),
    security(("bearer" = ["jobs:read"]), ("api_key" = ["jobs:read"])),
)]
pub async fn get(
    State(state): State<AppState>,
    caller: Caller,
    Path(id): Path<String>,
    ApiQuery(q): ApiQuery<GetQuery>,
) -> Result<Json<Value>, ApiError> {
    let principal = caller.require("jobs:read")?;
    let tenant = &principal.tenant;
    let wait = q
        .wait
        .as_deref()
        .map(|w| parse_wait(w).ok_or_else(|| ApiError::bad_request("invalid_wait", format!("wait {w:?}: whole seconds from 0 to 60, like 30s"))))
        .transpose()?;
    let id = parse_id(&id)?;
    let mut job = own_job(&state, tenant, id).await?;
    if let Some(wait) = wait.filter(|_| !job.state.is_terminal()) {
        // Woken by the job's changes (crate::job_watch), not a poll: the job is read again
        // only when its timeline grew.
        let deadline = tokio::time::Instant::now() + wait;
        let mut watch = state.watches.watch(principal.key_id, id)?;
        // A change between the read above and the watch: read once more now it is open.
        job = own_job(&state, tenant, id).await?;
        while !job.state.is_terminal() {
            let left = deadline.saturating_duration_since(tokio::time::Instant::now());
            if left.is_zero() {
                break;
            }
            watch.changed(left).await;
            job = own_job(&state, tenant, id).await?;
        }
    }
    Ok(Json(job_view(&state, &job, true).await?))
}

/// A job's timeline.
///
/// `GET /v1/jobs/{id}/events`: the job's timeline, oldest first.
#[utoipa::path(
    get,
    path = "/v1/jobs/{id}/events",
    operation_id = "job_events",
    tag = "jobs",
    params(("id" = uuid::Uuid, Path, description = "The job's id")),
    responses(
        (status = 200, description = "Every state the job entered, when, on which worker", body = openapi::JobEvents),
        (status = 404, description = "`not_found`: no such job of this tenant", body = openapi::Error),
    ),
    security(("bearer" = ["jobs:read"]), ("api_key" = ["jobs:read"])),
)]
pub async fn events(State(state): State<AppState>, caller: Caller, Path(id): Path<String>) -> Result<Json<Value>, ApiError> {
    let tenant = &caller.require("jobs:read")?.tenant;
    let id = parse_id(&id)?;
    own_job(&state, tenant, id).await?;
    Ok(Json(json!({ "events": state.store.events(id).await? })))
}

#[derive(Debug, Deserialize)]
pub struct ListQuery {
    state: Option<String>,
    kind: Option<String>,
    priority: Option<String>,
    limit: Option<String>,
    cursor: Option<String>,
    /// Admin listing only: one tenant's jobs.
    pub tenant: Option<String>,
}

/// List jobs.
///
/// `GET /v1/jobs?state=&kind=&priority=&limit=&cursor=`: newest first; `next_cursor` fetches the
/// next page.
#[utoipa::path(
    get,
    path = "/v1/jobs",
    operation_id = "list_jobs",
    tag = "jobs",
    params(
        ("state" = Option<openapi::JobState>, Query, description = "Only jobs in this state"),
        ("kind" = Option<openapi::JobKind>, Query, description = "Only jobs of this kind"),
        ("priority" = Option<openapi::Priority>, Query, description = "Only jobs of this priority"),
        ("limit" = Option<i64>, Query, minimum = 1, maximum = 500, description = "Jobs per page, 1 to 500; default 50"),
        ("cursor" = Option<uuid::Uuid>, Query, description = "The previous page's `next_cursor`"),
    ),
    responses(
        (status = 200, description = "One page of the tenant's jobs, newest first", body = openapi::JobList),
        (status = 400, description = "`invalid_state`, `unknown_kind`, `invalid_priority`, `invalid_limit`, `invalid_cursor`, `invalid_query` (a query string that cannot be read: a repeated key), `invalid_character` (a NUL)", body = openapi::Error),
    ),
    security(("bearer" = ["jobs:read"]), ("api_key" = ["jobs:read"])),
)]
pub async fn list(State(state): State<AppState>, caller: Caller, ApiQuery(q): ApiQuery<ListQuery>) -> Result<Json<Value>, ApiError> {
    let tenant = caller.require("jobs:read")?.tenant.clone();
    list_page(&state, &q, Some(tenant)).await
}

/// One page of jobs matching `q`, of `tenant` or (admin) of every tenant.
pub async fn list_page(state: &AppState, q: &ListQuery, tenant: Option<String>) -> Result<Json<Value>, ApiError> {
    let filter = ListFilter {
        tenant,
        state: q
            .state
            .as_deref()
            .map(|s| s.parse().map_err(|()| ApiError::bad_request("invalid_state", format!("unknown state {s:?}"))))
            .transpose()?,
        kind: q
            .kind
            .as_deref()
            .map(|k| k.parse().map_err(|()| ApiError::bad_request("unknown_kind", format!("unknown job kind {k:?}"))))
            .transpose()?,
        priority: q
            .priority
            .as_deref()
            .map(|p| p.parse().map_err(|()| ApiError::bad_request("invalid_priority", format!("unknown priority {p:?}"))))
            .transpose()?,
        before: q
            .cursor
            .as_deref()
            .map(|c| Uuid::parse_str(c).map_err(|_| ApiError::bad_request("invalid_cursor", "unknown cursor")))
            .transpose()?,
        limit: match q.limit.as_deref() {
            None => LIST_LIMIT_DEFAULT,
            Some(l) => l.parse::<i64>().ok().filter(|n| (1..=LIST_LIMIT_MAX).contains(n)).ok_or_else(|| {
                ApiError::bad_request("invalid_limit", format!("limit must be an integer from 1 to {LIST_LIMIT_MAX}"))
            })?,
        },
    };
    let mut page = filter.clone();
    page.limit += 1;
    let mut jobs = state.store.list(&page).await?;
    let next_cursor = if jobs.len() as i64 > filter.limit {
        jobs.truncate(filter.limit as usize);
        jobs.last().map(|j| j.id.to_string())
    } else {
        None
    };
    Ok(Json(json!({ "jobs": views(state, &jobs).await?, "next_cursor": next_cursor })))
}

/// Cancel a job.
///
/// `POST /v1/jobs/{id}/cancel`: 200 with the canceled job if it was waiting; 202 if it is
/// running (its worker stops it at its next check, within about a second); 409 if it finished.
#[utoipa::path(
    post,
    path = "/v1/jobs/{id}/cancel",
    operation_id = "cancel_job",
    tag = "jobs",
    params(("id" = uuid::Uuid, Path, description = "The job's id")),
    responses(
        (status = 200, description = "It was waiting: now `canceled`", body = openapi::Job),
        (status = 202, description = "It runs: `cancel_requested`, its worker stops it within about a second", body = openapi::Job),
        (status = 404, description = "`not_found`: no such job of this tenant", body = openapi::Error),
        (status = 409, description = "`job_finished`: it already succeeded, failed or was canceled", body = openapi::Error),
    ),
    security(("bearer" = ["jobs:write"]), ("api_key" = ["jobs:write"])),
)]
pub async fn cancel(State(state): State<AppState>, caller: Caller, Path(id): Path<String>) -> Result<Response, ApiError> {
    let tenant = &caller.require("jobs:write")?.tenant;
    let id = parse_id(&id)?;
    own_job(&state, tenant, id).await?;
    cancel_job(&state, id).await
}

/// Cancels job `id` (whoever's it is): 200 if it was waiting, 202 if it runs, 409 if finished.
pub async fn cancel_job(state: &AppState, id: Uuid) -> Result<Response, ApiError> {
    match state.store.cancel(id).await? {
        CancelOutcome::NotFound => Err(ApiError::not_found()),
        CancelOutcome::Canceled(job) => {
            state.queue.cancel(job.kind, job.id, false).await?;
            Ok((StatusCode::OK, Json(job_view(state, &job, false).await?)).into_response())
        }
        CancelOutcome::Requested(job) => {
            state.queue.cancel(job.kind, job.id, true).await?;
            Ok((StatusCode::ACCEPTED, Json(job_view(state, &job, false).await?)).into_response())
        }
        CancelOutcome::AlreadyFinished(job) => Err(ApiError::new(
            StatusCode::CONFLICT,
            "job_finished",
            format!("the job already finished as {}", job.state),
        )),
    }
}

/// A job's webhook deliveries.
///
/// `GET /v1/jobs/{id}/deliveries`: the job's webhook deliveries, oldest first, each with its
/// attempts (status, latency, error).
#[utoipa::path(
    get,
    path = "/v1/jobs/{id}/deliveries",
    operation_id = "job_deliveries",
    tag = "webhooks",
    params(("id" = uuid::Uuid, Path, description = "The job's id")),
    responses(
        (status = 200, description = "The job's deliveries, to its own webhook and to the tenant's endpoints", body = openapi::DeliveryList),
        (status = 404, description = "`not_found`: no such job of this tenant", body = openapi::Error),
    ),
    security(("bearer" = ["jobs:read"]), ("api_key" = ["jobs:read"])),
)]
pub async fn deliveries(State(state): State<AppState>, caller: Caller, Path(id): Path<String>) -> Result<Json<Value>, ApiError> {
    let tenant = &caller.require("jobs:read")?.tenant;
    let id = parse_id(&id)?;
    own_job(&state, tenant, id).await?;
    Ok(Json(json!({ "deliveries": deliveries_of(&state, id).await? })))
}

/// Job `id`'s webhook deliveries, oldest first, each with its attempts.
pub async fn deliveries_of(state: &AppState, id: Uuid) -> Result<Vec<Value>, ApiError> {
    let rows: Vec<Value> = sqlx::query_scalar(
        "SELECT jsonb_build_object(
                'id', 'msg_' || replace(d.id::text, '-', ''), 'delivery_id', d.id, 'event', d.event,
                'url', d.url, 'state', d.state, 'attempts', d.attempts, 'created_at', d.created_at,
                'delivered_at', d.delivered_at, 'next_attempt_at', CASE WHEN d.state = 'pending' THEN d.next_attempt_at END,
                'last_status', d.last_status, 'last_error', d.last_error,
                'history', coalesce((SELECT jsonb_agg(jsonb_build_object('at', a.at, 'status', a.status,
                                         'latency_ms', a.latency_ms, 'error', a.error) ORDER BY a.id)
                                     FROM webhook_attempts a WHERE a.delivery_id = d.id), '[]'::jsonb))
         FROM webhook_deliveries d WHERE d.job_id = $1 ORDER BY d.created_at",
    )
    .bind(id)
    .fetch_all(state.store.pool())
    .await
    .map_err(tern_jobs::Error::from)?;
    Ok(rows)
}

/// Send a webhook delivery again.
///
/// `POST /v1/deliveries/{delivery_id}/replay`: sends a delivery again (whatever became of it),
/// with a fresh retry schedule. 202.
#[utoipa::path(
    post,
    path = "/v1/deliveries/{id}/replay",
    operation_id = "replay_delivery",
    tag = "webhooks",
    params(("id" = uuid::Uuid, Path, description = "The delivery's `delivery_id`")),
    responses(
        (status = 202, description = "Queued again with a fresh retry schedule", body = openapi::Replayed),
        (status = 404, description = "`not_found`: no such delivery of this tenant's jobs", body = openapi::Error),
    ),
    security(("bearer" = ["jobs:write"]), ("api_key" = ["jobs:write"])),
)]
pub async fn replay(State(state): State<AppState>, caller: Caller, Path(id): Path<String>) -> Result<Response, ApiError> {
    let tenant = &caller.require("jobs:write")?.tenant;
    let id = Uuid::parse_str(&id).map_err(|_| ApiError::new(StatusCode::NOT_FOUND, "not_found", "no such delivery"))?;
    let updated = sqlx::query(
        "UPDATE webhook_deliveries d SET state = 'pending', attempts = 0, next_attempt_at = now(), claim = NULL
         FROM jobs j WHERE d.id = $1 AND j.id = d.job_id AND j.tenant = $2",
    )
    .bind(id)
    .bind(tenant)
    .execute(state.store.pool())
    .await
    .map_err(tern_jobs::Error::from)?;
    if updated.rows_affected() == 0 {
        return Err(ApiError::new(StatusCode::NOT_FOUND, "not_found", format!("no delivery {id}")));
    }
    Ok((StatusCode::ACCEPTED, Json(json!({ "delivery_id": id, "state": "pending" }))).into_response())
}

#[cfg(test)]
mod wait_tests {
    use super::*;

    #[test]
    fn waits_are_whole_seconds_up_to_a_minute() {
        assert_eq!(parse_wait("30s"), Some(Duration::from_secs(30)));
        assert_eq!(parse_wait("30"), Some(Duration::from_secs(30)));
        assert_eq!(parse_wait("0"), Some(Duration::ZERO));
        assert_eq!(parse_wait("60s"), Some(WAIT_MAX));
        for bad in ["61s", "", "s", "-1s", "1.5s", "1m", "05s", "1500ms", "99999999999999999999"] {
            assert_eq!(parse_wait(bad), None, "{bad}");
        }
    }
}
