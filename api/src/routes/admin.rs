//! `/v1/admin/...` (admin scope): API keys, queues (counts, pause, resume, purge) and jobs of
//! every tenant (list, timeline, retry, cancel, delete). The first admin key comes from the
//! command line: `tern-api keys create --tenant T --scope admin`.

use super::jobs::{cancel_job, deliveries_of, job_view, list_page, parse_id, ListQuery};
use crate::auth::Caller;
use crate::error::ApiError;
use chrono::DurationRound;
use crate::extract::{ApiJson, ApiQuery};
use crate::openapi;
use crate::state::AppState;
use axum::extract::{Path, State};
use axum::http::StatusCode;
use axum::response::Response;
use axum::Json;
use serde::Deserialize;
use serde_json::{json, Value};
use tern_jobs::admin::ACTION_LIMIT;
use tern_jobs::api_keys::SCOPES;
use tern_jobs::queue::Enqueue;
use tern_jobs::JobKind;
use uuid::Uuid;

#[derive(Deserialize)]
pub struct NewKey {
    tenant: String,
    scopes: Vec<String>,
    name: Option<String>,
}

/// Checks a tenant name; the message says what is allowed.
pub fn check_tenant(tenant: &str) -> Result<(), String> {
    if tenant.is_empty() || tenant.len() > 64 || !tenant.chars().all(|c| c.is_ascii_alphanumeric() || "-_.".contains(c)) {
        return Err("a tenant is 1 to 64 characters of letters, digits, '-', '_' and '.'".into());
    }
    Ok(())
}

/// Checks a tenant name and scopes; the message says what is allowed.
pub fn check_key_request(tenant: &str, scopes: &[String]) -> Result<(), String> {
    check_tenant(tenant)?;
    if scopes.is_empty() {
        return Err(format!("give at least one scope of {}", SCOPES.join(", ")));
    }
    if let Some(s) = scopes.iter().find(|s| !SCOPES.contains(&s.as_str())) {
        return Err(format!("unknown scope {s:?}; scopes are {}", SCOPES.join(", ")));
    }
    Ok(())
}

/// Create an API key.
///
/// `POST /v1/admin/keys` `{tenant, scopes, name?}`: 201 with the key, shown this once.
#[utoipa::path(
    post,
    path = "/v1/admin/keys",
    operation_id = "admin_create_key",
    tag = "admin",
    request_body(content = openapi::NewKey, description = "The tenant the key acts for, and its scopes."),
    responses(
        (status = 201, description = "The key with its secret, shown this once", body = openapi::CreatedKey),
        (status = 400, description = "`invalid_json` (the body is not JSON), `invalid_body`, `invalid_character` (a NUL, `\\u0000`, anywhere in the body)", body = openapi::Error),
        (status = 413, description = "`body_too_large`: the body is larger than `TERN_MAX_BODY_BYTES`", body = openapi::Error),
        (status = 415, description = "`unsupported_media_type`: the body was not sent as `Content-Type: application/json`", body = openapi::Error),
        (status = 422, description = "`invalid_key_request` (a bad tenant name, no scope or an unknown one); `invalid_request`: a body of the wrong shape", body = openapi::Error),
    ),
    security(("bearer" = ["admin"]), ("api_key" = ["admin"])),
)]
pub async fn create_key(
    State(state): State<AppState>,
    caller: Caller,
    ApiJson(req): ApiJson<NewKey>,
) -> Result<(StatusCode, Json<Value>), ApiError> {
    caller.require("admin")?;
    check_key_request(&req.tenant, &req.scopes)
        .map_err(|m| ApiError::new(StatusCode::UNPROCESSABLE_ENTITY, "invalid_key_request", m))?;
    let (info, key) = state.keys.create(&req.tenant, &req.scopes, req.name.as_deref()).await?;
    let mut v = serde_json::to_value(info).expect("keys serialise");
    v["key"] = json!(key);
    Ok((StatusCode::CREATED, Json(v)))
}

/// List API keys.
///
/// `GET /v1/admin/keys`: every key, without secrets.
#[utoipa::path(
    get,
    path = "/v1/admin/keys",
    operation_id = "admin_list_keys",
    tag = "admin",
    responses((status = 200, description = "Every key of every tenant, oldest first", body = openapi::KeyList)),
    security(("bearer" = ["admin"]), ("api_key" = ["admin"])),
)]
pub async fn list_keys(State(state): State<AppState>, caller: Caller) -> Result<Json<Value>, ApiError> {
    caller.require("admin")?;
    Ok(Json(json!({ "keys": state.keys.list().await? })))
}

/// Revoke an API key.
///
/// `POST /v1/admin/keys/{id or prefix}/revoke`: the key stops working at once.
#[utoipa::path(
    post,
    path = "/v1/admin/keys/{id}/revoke",
    operation_id = "admin_revoke_key",
    tag = "admin",
    params(("id" = String, Path, description = "The key's id, or its prefix (`tern_` and 8 characters)")),
    responses(
        (status = 200, description = "Revoked (a revoked key stays revoked)", body = openapi::RevokedKey),
        (status = 404, description = "`not_found`: no such key", body = openapi::Error),
    ),
    security(("bearer" = ["admin"]), ("api_key" = ["admin"])),
)]
pub async fn revoke_key(State(state): State<AppState>, caller: Caller, Path(id): Path<String>) -> Result<Json<Value>, ApiError> {
    caller.require("admin")?;
    if !state.keys.revoke(&id).await? {
        return Err(ApiError::new(StatusCode::NOT_FOUND, "not_found", format!("no API key {id}")));
    }
    Ok(Json(json!({ "revoked": id })))
}

/// A kind from the path, or 404 `unknown_kind`.
fn path_kind(kind: &str) -> Result<JobKind, ApiError> {
    kind.parse()
        .map_err(|()| ApiError::new(StatusCode::NOT_FOUND, "unknown_kind", format!("unknown job kind {kind:?}")))
}

/// Every queue's counts.
///
/// `GET /v1/admin/queues`: every kind's counts per priority and state, the age of its oldest
/// queued job, jobs finished in the last 1/5/15 minutes, whether it is paused, and the Redis
/// depth (ready + delayed) next to Postgres's counts.
#[utoipa::path(
    get,
    path = "/v1/admin/queues",
    operation_id = "admin_list_queues",
    tag = "admin",
    responses((status = 200, description = "One entry per kind", body = openapi::QueueList)),
    security(("bearer" = ["admin"]), ("api_key" = ["admin"])),
)]
pub async fn queues(State(state): State<AppState>, caller: Caller) -> Result<Json<Value>, ApiError> {
    caller.require("admin")?;
    let mut stats = state.store.queue_stats().await?;
    let mut out = Vec::with_capacity(stats.len());
    for s in &mut stats {
        s.paused = state.queue.is_paused(s.kind).await?;
        let mut v = serde_json::to_value(&*s).expect("stats serialise");
        v["redis_depth"] = json!(state.queue.depth(s.kind).await?);
        out.push(v);
    }
    Ok(Json(json!({ "queues": out })))
}

/// Pause a queue.
///
/// `POST /v1/admin/queues/{kind}/pause`: workers stop pulling the kind; submissions go on.
#[utoipa::path(
    post,
    path = "/v1/admin/queues/{kind}/pause",
    operation_id = "admin_pause_queue",
    tag = "admin",
    params(("kind" = inline(openapi::JobKind), Path, description = "The queue's job kind")),
    responses(
        (status = 200, description = "Paused (again, if it already was)", body = openapi::QueuePaused),
        (status = 404, description = "`unknown_kind`", body = openapi::Error),
    ),
    security(("bearer" = ["admin"]), ("api_key" = ["admin"])),
)]
pub async fn pause(State(state): State<AppState>, caller: Caller, Path(kind): Path<String>) -> Result<Json<Value>, ApiError> {
    caller.require("admin")?;
    let kind = path_kind(&kind)?;
    state.store.set_paused(&state.queue, kind, true).await?;
    tracing::info!(kind = kind.as_str(), "queue paused");
    Ok(Json(json!({ "kind": kind, "paused": true })))
}

/// Resume a queue.
///
/// `POST /v1/admin/queues/{kind}/resume`: workers pull the kind again.
#[utoipa::path(
    post,
    path = "/v1/admin/queues/{kind}/resume",
    operation_id = "admin_resume_queue",
    tag = "admin",
    params(("kind" = inline(openapi::JobKind), Path, description = "The queue's job kind")),
    responses(
        (status = 200, description = "Resumed (or was not paused)", body = openapi::QueuePaused),
        (status = 404, description = "`unknown_kind`", body = openapi::Error),
    ),
    security(("bearer" = ["admin"]), ("api_key" = ["admin"])),
)]
pub async fn resume(State(state): State<AppState>, caller: Caller, Path(kind): Path<String>) -> Result<Json<Value>, ApiError> {
    caller.require("admin")?;
    let kind = path_kind(&kind)?;
    state.store.set_paused(&state.queue, kind, false).await?;
    tracing::info!(kind = kind.as_str(), "queue resumed");
    Ok(Json(json!({ "kind": kind, "paused": false })))
}

#[derive(Deserialize)]
pub struct PurgeQuery {
    confirm: Option<String>,
}

/// Cancel a queue's waiting jobs.
///
/// `POST /v1/admin/queues/{kind}/purge?confirm={kind}`: cancels up to 1,000 waiting jobs of
/// the kind (running ones finish); without `confirm` naming the kind, 400 `confirm_required`.
#[utoipa::path(
    post,
    path = "/v1/admin/queues/{kind}/purge",
    operation_id = "admin_purge_queue",
    tag = "admin",
    params(
        ("kind" = inline(openapi::JobKind), Path, description = "The queue's job kind"),
        ("confirm" = String, Query, description = "The kind again, as `kind`: anything else (or nothing) is refused with 400 `confirm_required`"),
    ),
    responses(
        (status = 200, description = "Waiting jobs canceled; `more` when the 1,000 limit was reached", body = openapi::Purged),
        (status = 400, description = "`confirm_required`, `invalid_query` (a query string that cannot be read: a repeated key), `invalid_character` (a NUL)", body = openapi::Error),
        (status = 404, description = "`unknown_kind`", body = openapi::Error),
    ),
    security(("bearer" = ["admin"]), ("api_key" = ["admin"])),
)]
pub async fn purge(
    State(state): State<AppState>,
    caller: Caller,
    Path(kind): Path<String>,
    ApiQuery(q): ApiQuery<PurgeQuery>,
) -> Result<Json<Value>, ApiError> {
    caller.require("admin")?;
    let kind = path_kind(&kind)?;
    if q.confirm.as_deref() != Some(kind.as_str()) {
        return Err(ApiError::bad_request(
            "confirm_required",
            format!("purging cancels every waiting {kind} job: repeat the kind as ?confirm={kind}", kind = kind.as_str()),
        ));
    }
    let ids = state.store.purge_waiting(kind).await?;
    for id in &ids {
        state.queue.cancel(kind, *id, false).await?;
    }
    tracing::warn!(kind = kind.as_str(), canceled = ids.len(), "queue purged");
    Ok(Json(json!({ "kind": kind, "canceled": ids.len(), "more": ids.len() as i64 >= ACTION_LIMIT })))
}

#[derive(Deserialize)]
pub struct RetryRequest {
    #[serde(default)]
    ids: Vec<Uuid>,
    kind: Option<String>,
}

/// Retry failed jobs.
///
/// `POST /v1/admin/jobs/retry` `{ids: [...]}` or `{kind}`: failed jobs go back to the queue
/// with one more attempt (at most 1,000 per call). 200 with the ids retried.
#[utoipa::path(
    post,
    path = "/v1/admin/jobs/retry",
    operation_id = "admin_retry_jobs",
    tag = "admin",
    request_body(content = openapi::RetryRequest, description = "The failed jobs' ids, or a kind to retry its failed jobs."),
    responses(
        (status = 200, description = "The jobs queued again; ids of jobs that were not failed are skipped", body = openapi::Retried),
        (status = 400, description = "`unknown_kind`, `nothing_to_retry`, `too_many_ids`, `invalid_json`, `invalid_character`", body = openapi::Error),
        (status = 413, description = "`body_too_large`: the body is larger than `TERN_MAX_BODY_BYTES`", body = openapi::Error),
        (status = 415, description = "`unsupported_media_type`: the body was not sent as `Content-Type: application/json`", body = openapi::Error),
        (status = 422, description = "`invalid_request`: a body of the wrong shape (an id that is not a UUID)", body = openapi::Error),
    ),
    security(("bearer" = ["admin"]), ("api_key" = ["admin"])),
)]
pub async fn retry(State(state): State<AppState>, caller: Caller, ApiJson(req): ApiJson<RetryRequest>) -> Result<Json<Value>, ApiError> {
    caller.require("admin")?;
    let kind = req
        .kind
        .as_deref()
        .map(|k| k.parse::<JobKind>().map_err(|()| ApiError::bad_request("unknown_kind", format!("unknown job kind {k:?}"))))
        .transpose()?;
    if req.ids.is_empty() && kind.is_none() {
        return Err(ApiError::bad_request("nothing_to_retry", "give the failed jobs' ids, or a kind to retry its failed jobs"));
    }
    if req.ids.len() as i64 > ACTION_LIMIT {
        return Err(ApiError::bad_request("too_many_ids", format!("at most {ACTION_LIMIT} ids per call")));
    }
    let jobs = state.store.retry_failed(&req.ids, kind).await?;
    let enqueue: Vec<Enqueue> = jobs
        .iter()
        .map(|j| Enqueue { run_at: None, ..Enqueue::from(j) })
        .collect();
    state.queue.enqueue(&enqueue).await?;
    tracing::info!(retried = jobs.len(), "failed jobs retried");
    Ok(Json(json!({ "retried": jobs.iter().map(|j| j.id).collect::<Vec<_>>() })))
}

/// List the jobs of every tenant.
///
/// `GET /v1/admin/jobs?tenant=&state=&kind=&limit=&cursor=`: jobs of every tenant (or one).
#[utoipa::path(
    get,
    path = "/v1/admin/jobs",
    operation_id = "admin_list_jobs",
    tag = "admin",
    params(
        ("tenant" = Option<String>, Query, description = "Only this tenant's jobs"),
        ("state" = Option<openapi::JobState>, Query, description = "Only jobs in this state"),
        ("kind" = Option<openapi::JobKind>, Query, description = "Only jobs of this kind"),
        ("priority" = Option<openapi::Priority>, Query, description = "Only jobs of this priority"),
        ("limit" = Option<i64>, Query, minimum = 1, maximum = 500, description = "Jobs per page, 1 to 500; default 50"),
        ("cursor" = Option<uuid::Uuid>, Query, description = "The previous page's `next_cursor`"),
    ),
    responses(
        (status = 200, description = "One page of jobs, newest first", body = openapi::JobList),
        (status = 400, description = "`invalid_state`, `unknown_kind`, `invalid_priority`, `invalid_limit`, `invalid_cursor`, `invalid_query` (a query string that cannot be read: a repeated key), `invalid_character` (a NUL)", body = openapi::Error),
    ),
    security(("bearer" = ["admin"]), ("api_key" = ["admin"])),
)]
pub async fn jobs(State(state): State<AppState>, caller: Caller, ApiQuery(q): ApiQuery<ListQuery>) -> Result<Json<Value>, ApiError> {
    caller.require("admin")?;
    let tenant = q.tenant.clone();
    list_page(&state, &q, tenant).await
}

/// Get any tenant's job with its timeline.
///
/// `GET /v1/admin/jobs/{id}`: the job of any tenant with its whole timeline: events (attempts,
/// workers, errors) and webhook deliveries.
#[utoipa::path(
    get,
    path = "/v1/admin/jobs/{id}",
    operation_id = "admin_get_job",
    tag = "admin",
    params(("id" = uuid::Uuid, Path, description = "The job's id")),
    responses(
        (status = 200, description = "The job, its events and its webhook deliveries", body = openapi::AdminJob),
        (status = 404, description = "`not_found`", body = openapi::Error),
    ),
    security(("bearer" = ["admin"]), ("api_key" = ["admin"])),
)]
pub async fn job(State(state): State<AppState>, caller: Caller, Path(id): Path<String>) -> Result<Json<Value>, ApiError> {
    caller.require("admin")?;
    let id = parse_id(&id)?;
    let job = state.store.get(id).await?.ok_or_else(ApiError::not_found)?;
    let mut v = job_view(&state, &job, true).await?;
    v["events"] = json!(state.store.events(id).await?);
    v["deliveries"] = json!(deliveries_of(&state, id).await?);
    Ok(Json(v))
}

/// Cancel any tenant's job.
///
/// `POST /v1/admin/jobs/{id}/cancel`: as the tenant's cancel, for any tenant's job.
#[utoipa::path(
    post,
    path = "/v1/admin/jobs/{id}/cancel",
    operation_id = "admin_cancel_job",
    tag = "admin",
    params(("id" = uuid::Uuid, Path, description = "The job's id")),
    responses(
        (status = 200, description = "It was waiting: now `canceled`", body = openapi::Job),
        (status = 202, description = "It runs: `cancel_requested`, its worker stops it within about a second", body = openapi::Job),
        (status = 404, description = "`not_found`", body = openapi::Error),
        (status = 409, description = "`job_finished`: it already succeeded, failed or was canceled", body = openapi::Error),
    ),
    security(("bearer" = ["admin"]), ("api_key" = ["admin"])),
)]
pub async fn cancel(State(state): State<AppState>, caller: Caller, Path(id): Path<String>) -> Result<Response, ApiError> {
    caller.require("admin")?;
    cancel_job(&state, parse_id(&id)?).await
}

/// Delete a finished job.
///
/// `DELETE /v1/admin/jobs/{id}`: deletes a finished job with its timeline; 409 `job_not_finished`
/// while it may still run.
#[utoipa::path(
    delete,
    path = "/v1/admin/jobs/{id}",
    operation_id = "admin_delete_job",
    tag = "admin",
    params(("id" = uuid::Uuid, Path, description = "The job's id")),
    responses(
        (status = 204, description = "Deleted with its events and deliveries"),
        (status = 404, description = "`not_found`", body = openapi::Error),
        (status = 409, description = "`job_not_finished`: cancel it first", body = openapi::Error),
    ),
    security(("bearer" = ["admin"]), ("api_key" = ["admin"])),
)]
pub async fn delete(State(state): State<AppState>, caller: Caller, Path(id): Path<String>) -> Result<StatusCode, ApiError> {
    caller.require("admin")?;
    match state.store.delete_finished(parse_id(&id)?).await? {
        None => Err(ApiError::not_found()),
        Some(false) => Err(ApiError::new(StatusCode::CONFLICT, "job_not_finished", "only finished jobs can be deleted; cancel it first")),
        Some(true) => Ok(StatusCode::NO_CONTENT),
    }
}

/// List workers.
///
/// `GET /v1/admin/workers`: every worker that reported in the last day, newest first, with
/// `state`: `active`, `draining`, `stopped` (shut down cleanly) or `lost` (no report for a
/// lease period: it died or lost its network; the reaper has returned its jobs by then).
#[utoipa::path(
    get,
    path = "/v1/admin/workers",
    operation_id = "admin_list_workers",
    tag = "admin",
    responses((status = 200, description = "The workers, newest first", body = openapi::WorkerList)),
    security(("bearer" = ["admin"]), ("api_key" = ["admin"])),
)]
pub async fn workers(State(state): State<AppState>, caller: Caller) -> Result<Json<Value>, ApiError> {
    caller.require("admin")?;
    let lost_after_ms = state.queue.settings.lease.as_millis() as i64;
    let rows: Vec<Value> = sqlx::query_scalar(
        "SELECT jsonb_build_object(
                'id', id, 'host', host, 'kinds', kinds, 'device', device, 'started_at', started_at,
                'last_heartbeat', last_heartbeat, 'stopped_at', stopped_at, 'draining', draining,
                'seconds_since_heartbeat', extract(epoch FROM now() - last_heartbeat)::float8,
                'state', CASE WHEN stopped_at IS NOT NULL THEN 'stopped'
                              WHEN last_heartbeat < now() - make_interval(secs => $1 / 1000.0) THEN 'lost'
                              WHEN draining THEN 'draining'
                              ELSE 'active' END) || status
         FROM workers WHERE last_heartbeat > now() - interval '1 day'
         ORDER BY started_at DESC",
    )
    .bind(lost_after_ms as f64)
    .fetch_all(state.store.pool())
    .await
    .map_err(tern_jobs::Error::from)?;
    Ok(Json(json!({ "workers": rows, "lost_after_seconds": lost_after_ms as f64 / 1000.0 })))
}

async fn set_draining(state: &AppState, id: &str, draining: bool) -> Result<Json<Value>, ApiError> {
    let found = sqlx::query("UPDATE workers SET draining = $2 WHERE id = $1")
        .bind(id)
        .bind(draining)
        .execute(state.store.pool())
        .await
        .map_err(tern_jobs::Error::from)?
        .rows_affected();
    if found == 0 {
        return Err(ApiError::new(StatusCode::NOT_FOUND, "not_found", format!("no worker {id}")));
    }
    tracing::info!(worker = id, draining, "worker drain set");
    Ok(Json(json!({ "id": id, "draining": draining })))
}

/// Drain a worker.
///
/// `POST /v1/admin/workers/{id}/drain`: the worker finishes its batch and pulls no more (it
/// learns within about 2 s); it keeps running and reporting until stopped or undrained.
#[utoipa::path(
    post,
    path = "/v1/admin/workers/{id}/drain",
    operation_id = "admin_drain_worker",
    tag = "admin",
    params(("id" = String, Path, description = "The worker's id")),
    responses(
        (status = 200, description = "Draining", body = openapi::Drained),
        (status = 404, description = "`not_found`: no such worker", body = openapi::Error),
    ),
    security(("bearer" = ["admin"]), ("api_key" = ["admin"])),
)]
pub async fn drain(State(state): State<AppState>, caller: Caller, Path(id): Path<String>) -> Result<Json<Value>, ApiError> {
    caller.require("admin")?;
    set_draining(&state, &id, true).await
}

/// Undrain a worker.
///
/// `POST /v1/admin/workers/{id}/undrain`: the worker pulls again.
#[utoipa::path(
    post,
    path = "/v1/admin/workers/{id}/undrain",
    operation_id = "admin_undrain_worker",
    tag = "admin",
    params(("id" = String, Path, description = "The worker's id")),
    responses(
        (status = 200, description = "Pulling again", body = openapi::Drained),
        (status = 404, description = "`not_found`: no such worker", body = openapi::Error),
    ),
    security(("bearer" = ["admin"]), ("api_key" = ["admin"])),
)]
pub async fn undrain(State(state): State<AppState>, caller: Caller, Path(id): Path<String>) -> Result<Json<Value>, ApiError> {
    caller.require("admin")?;
    set_draining(&state, &id, false).await
}

/// Memory pressure from the share of the budget in use: under 50% `low`, under 75%
/// `moderate`, under 90% `high`, else `critical`.
fn memory_state(used: f64, budget: f64) -> &'static str {
    match if budget > 0.0 { used / budget } else { 0.0 } {
        r if r < 0.50 => "low",
        r if r < 0.75 => "moderate",
        r if r < 0.90 => "high",
        _ => "critical",
    }
}

/// The service at a glance.
///
/// `GET /v1/admin/system`: the service at a glance: per live worker its memory state
/// (`low`/`moderate`/`high`/`critical`: resident models against the memory budget), models
/// cached, how its batches are sized (budgets from measured memory, batches split for want
/// of memory, the model thread's busy seconds) and the optimisations in effect; queue totals
/// over all kinds; whether the queue is on a Redis Cluster and over how many shards.
#[utoipa::path(
    get,
    path = "/v1/admin/system",
    operation_id = "admin_system",
    tag = "admin",
    responses((status = 200, description = "Live workers and queue totals", body = openapi::SystemView)),
    security(("bearer" = ["admin"]), ("api_key" = ["admin"])),
)]
pub async fn system(State(state): State<AppState>, caller: Caller) -> Result<Json<Value>, ApiError> {
    caller.require("admin")?;
    let Json(listing) = workers(State(state.clone()), caller).await?;
    let live: Vec<Value> = listing["workers"]
        .as_array()
        .into_iter()
        .flatten()
        .filter(|w| w["state"] == "active" || w["state"] == "draining")
        .map(|w| {
            let budget = w["memory"]["budget_bytes"].as_f64().unwrap_or(0.0);
            let used = w["memory"]["models_bytes"].as_f64().unwrap_or(0.0);
            json!({
                "id": w["id"], "device": w["device"], "state": w["state"],
                "memory": { "state": memory_state(used, budget), "budget_bytes": w["memory"]["budget_bytes"],
                            "models_bytes": w["memory"]["models_bytes"], "rss_bytes": w["memory"]["rss_bytes"] },
                "models": w["models"], "cache": w["cache"], "optimisations": w["optimisations"],
                "batch_in_hand": w["batch_in_hand"], "batching": w["batching"],
            })
        })
        .collect();
    let stats = state.store.queue_stats().await?;
    let total = |f: fn(&tern_jobs::admin::StateCounts) -> i64| stats.iter().map(|s| f(&s.total)).sum::<i64>();
    Ok(Json(json!({
        "workers": live,
        "queue": {
            "queued": total(|c| c.queued), "scheduled": total(|c| c.scheduled), "running": total(|c| c.running),
            "retrying": total(|c| c.retrying), "failed": total(|c| c.failed),
            "succeeded_last_1m": stats.iter().map(|s| s.succeeded.last_1m).sum::<i64>(),
        },
        "redis": { "cluster": state.queue.is_cluster(), "shards": state.queue.settings.shards },
    })))
}

/// Run a scheduled job now.
///
/// `POST /v1/admin/jobs/{id}/run-now`: a scheduled job, or one waiting to retry, becomes due
/// at once (`queued`); workers take it in priority order like any other.
#[utoipa::path(
    post,
    path = "/v1/admin/jobs/{id}/run-now",
    operation_id = "admin_run_job_now",
    tag = "admin",
    params(("id" = uuid::Uuid, Path, description = "The job's id")),
    responses(
        (status = 200, description = "Now `queued`", body = openapi::Job),
        (status = 404, description = "`not_found`", body = openapi::Error),
        (status = 409, description = "`job_not_waiting`: it is not scheduled or waiting to retry", body = openapi::Error),
    ),
    security(("bearer" = ["admin"]), ("api_key" = ["admin"])),
)]
pub async fn run_now(State(state): State<AppState>, caller: Caller, Path(id): Path<String>) -> Result<Json<Value>, ApiError> {
    caller.require("admin")?;
    let id = parse_id(&id)?;
    let Some(job) = state.store.run_now(id).await? else {
        let job = state.store.get(id).await?.ok_or_else(ApiError::not_found)?;
        return Err(ApiError::new(
            StatusCode::CONFLICT,
            "job_not_waiting",
            format!("the job is {}: only a scheduled job or one waiting to retry can run now", job.state),
        ));
    };
    state.queue.run_now(job.kind, job.id).await?;
    Ok(Json(job_view(&state, &job, true).await?))
}

/// Longest history `GET /v1/admin/history` gives, minutes.
pub const HISTORY_MAX_MINUTES: i32 = 1440;

#[derive(Debug, serde::Deserialize)]
pub struct HistoryQuery {
    minutes: Option<String>,
}

/// Queue history.
///
/// `GET /v1/admin/history?minutes=60`: per minute and kind, from the jobs' own timestamps in
/// Postgres (so it survives reloads and restarts): jobs waiting and running at the minute's
/// end, and jobs that succeeded and failed (or were canceled) within it; per kind, run and
/// wait times (p50, p90, p99 seconds) of the jobs that succeeded in the span.
#[utoipa::path(
    get,
    path = "/v1/admin/history",
    operation_id = "admin_history",
    tag = "admin",
    params(("minutes" = Option<i32>, Query, minimum = 1, maximum = 1440, description = "Minutes back from now, 1 to 1,440; default 60")),
    responses(
        (status = 200, description = "Per-minute series and run-time percentiles", body = openapi::History),
        (status = 400, description = "`invalid_minutes`, `invalid_query`, `invalid_character`", body = openapi::Error),
    ),
    security(("bearer" = ["admin"]), ("api_key" = ["admin"])),
)]
pub async fn history(State(state): State<AppState>, caller: Caller, ApiQuery(q): ApiQuery<HistoryQuery>) -> Result<Json<Value>, ApiError> {
    caller.require("admin")?;
    let minutes = match q.minutes.as_deref() {
        None => 60,
        Some(m) => m.parse::<i32>().ok().filter(|m| (1..=HISTORY_MAX_MINUTES).contains(m)).ok_or_else(|| {
            ApiError::bad_request("invalid_minutes", format!("minutes must be an integer from 1 to {HISTORY_MAX_MINUTES}"))
        })?,
    };
    let rows: Vec<(chrono::DateTime<chrono::Utc>, String, i64, i64, i64, i64)> = sqlx::query_as(
        "WITH m AS (
             SELECT generate_series(date_trunc('minute', now()) - make_interval(mins => $1 - 1), date_trunc('minute', now()), interval '1 minute') AS t
         ), j AS (
             SELECT kind, state, created_at, started_at, finished_at FROM jobs
             WHERE coalesce(finished_at, 'infinity') >= date_trunc('minute', now()) - make_interval(mins => $1 - 1)
         )
         SELECT m.t, j.kind,
             count(*) FILTER (WHERE j.created_at < m.t + interval '1 minute'
                 AND (j.state IN ('queued', 'scheduled', 'retrying')
                      OR coalesce(j.started_at, j.finished_at, 'infinity') >= m.t + interval '1 minute')) AS waiting,
             -- A job waiting again (retried, handed back) keeps its last start: not running.
             count(*) FILTER (WHERE j.state NOT IN ('queued', 'scheduled', 'retrying') AND j.started_at < m.t + interval '1 minute'
                 AND coalesce(j.finished_at, 'infinity') >= m.t + interval '1 minute') AS running,
             count(*) FILTER (WHERE j.state = 'succeeded' AND j.finished_at >= m.t AND j.finished_at < m.t + interval '1 minute') AS succeeded,
             count(*) FILTER (WHERE j.state IN ('failed', 'canceled') AND j.finished_at >= m.t AND j.finished_at < m.t + interval '1 minute') AS failed
         FROM m CROSS JOIN j GROUP BY m.t, j.kind ORDER BY m.t",
    )
    .bind(minutes)
    .fetch_all(state.store.pool())
    .await?;
    let mut times: Vec<chrono::DateTime<chrono::Utc>> = Vec::new();
    let mut series: std::collections::BTreeMap<String, Value> = std::collections::BTreeMap::new();
    let start = chrono::Utc::now().duration_trunc(chrono::TimeDelta::minutes(1)).unwrap_or_default() - chrono::TimeDelta::minutes(i64::from(minutes) - 1);
    for i in 0..minutes {
        times.push(start + chrono::TimeDelta::minutes(i64::from(i)));
    }
    for kind in tern_jobs::JobKind::ALL {
        let zeros = vec![0i64; minutes as usize];
        series.insert(kind.as_str().into(), json!({ "waiting": zeros, "running": zeros, "succeeded": zeros, "failed": zeros }));
    }
    for (t, kind, waiting, running, succeeded, failed) in rows {
        let Some(i) = times.iter().position(|m| *m == t) else { continue };
        let Some(s) = series.get_mut(&kind) else { continue };
        for (field, n) in [("waiting", waiting), ("running", running), ("succeeded", succeeded), ("failed", failed)] {
            s[field][i] = json!(n);
        }
    }
    let percentiles: Vec<(String, i64, Vec<f64>, Vec<f64>)> = sqlx::query_as(
        "SELECT kind, count(*),
                percentile_cont(ARRAY[0.5, 0.9, 0.99]) WITHIN GROUP (ORDER BY extract(epoch FROM finished_at - started_at)),
                percentile_cont(ARRAY[0.5, 0.9, 0.99]) WITHIN GROUP (ORDER BY extract(epoch FROM started_at - created_at))
         FROM jobs WHERE state = 'succeeded' AND started_at IS NOT NULL AND finished_at >= now() - make_interval(mins => $1)
         GROUP BY kind ORDER BY kind",
    )
    .bind(minutes)
    .fetch_all(state.store.pool())
    .await?;
    let timings: Vec<Value> = percentiles
        .into_iter()
        .map(|(kind, n, run, wait)| {
            let p = |v: &[f64]| json!({ "p50": v.first(), "p90": v.get(1), "p99": v.get(2) });
            json!({ "kind": kind, "succeeded": n, "run_seconds": p(&run), "wait_seconds": p(&wait) })
        })
        .collect();
    Ok(Json(json!({ "minutes": times, "kinds": series, "timings": timings })))
}
