//! `/v1/webhooks/endpoints`: URLs a tenant registers to receive the events of all its jobs,
//! each signed with the endpoint's own secret (shown at creation and at rotation).

use crate::auth::Caller;
use crate::error::ApiError;
use crate::extract::ApiJson;
use crate::openapi;
use crate::state::AppState;
use axum::extract::{Path, State};
use axum::http::StatusCode;
use axum::Json;
use base64::Engine;
use rand::RngCore;
use serde::Deserialize;
use serde_json::{json, Value};
use sqlx::Row;
use tern_jobs::job::WEBHOOK_EVENTS;
use uuid::Uuid;

/// Most endpoints a tenant may register.
pub const ENDPOINTS_PER_TENANT: i64 = 20;

#[derive(Deserialize)]
pub struct NewEndpoint {
    url: String,
    events: Option<Vec<String>>,
}

fn new_secret() -> String {
    let mut key = [0u8; 32];
    rand::rng().fill_bytes(&mut key);
    format!("whsec_{}", base64::engine::general_purpose::STANDARD.encode(key))
}

fn unprocessable(code: &'static str, message: impl Into<String>) -> ApiError {
    ApiError::new(StatusCode::UNPROCESSABLE_ENTITY, code, message)
}

fn not_found() -> ApiError {
    ApiError::new(StatusCode::NOT_FOUND, "not_found", "no such webhook endpoint")
}

fn db(e: sqlx::Error) -> ApiError {
    tern_jobs::Error::from(e).into()
}

/// Register a webhook endpoint.
///
/// `POST /v1/webhooks/endpoints` `{url, events?}`: 201 with the endpoint and its `secret`. The
/// endpoint gets the events of all the tenant's jobs, at most 20 endpoints per tenant.
#[utoipa::path(
    post,
    path = "/v1/webhooks/endpoints",
    operation_id = "create_webhook_endpoint",
    tag = "webhooks",
    request_body(content = openapi::NewEndpoint, description = "Where to send events, and which."),
    responses(
        (status = 201, description = "The endpoint with its signing secret, shown this once", body = openapi::CreatedEndpoint),
        (status = 400, description = "`invalid_json` (the body is not JSON), `invalid_body`, `invalid_character` (a NUL, `\\u0000`, anywhere in the body)", body = openapi::Error),
        (status = 413, description = "`body_too_large`: the body is larger than `TERN_MAX_BODY_BYTES`", body = openapi::Error),
        (status = 415, description = "`unsupported_media_type`: the body was not sent as `Content-Type: application/json`", body = openapi::Error),
        (status = 422, description = "`invalid_webhook` (bad `events`, URL over 2,048 characters), `url_forbidden` (not http(s), or an internal address); `invalid_request`: a body of the wrong shape", body = openapi::Error),
        (status = 409, description = "`too_many_endpoints`: the tenant holds 20 endpoints that are not deleted", body = openapi::Error),
    ),
    security(("bearer" = ["jobs:write"]), ("api_key" = ["jobs:write"])),
)]
pub async fn create(State(state): State<AppState>, caller: Caller, ApiJson(req): ApiJson<NewEndpoint>) -> Result<(StatusCode, Json<Value>), ApiError> {
    let tenant = caller.require("jobs:write")?.tenant.clone();
    if let Some(events) = &req.events {
        if events.is_empty() {
            return Err(unprocessable("invalid_webhook", "\"events\", when given, names at least one event"));
        }
        if let Some(e) = events.iter().find(|e| !WEBHOOK_EVENTS.contains(&e.as_str()) || *e == "job.progress") {
            return Err(unprocessable("invalid_webhook", format!("endpoints take job.started, job.succeeded, job.failed and job.canceled, not {e:?}")));
        }
    }
    if req.url.len() > 2048 {
        return Err(unprocessable("invalid_webhook", "the url is longer than 2048 characters"));
    }
    if !req.url.chars().all(|c| c.is_ascii_graphic()) {
        return Err(unprocessable("invalid_webhook", "the url takes printable ASCII only: international names as punycode"));
    }
    tern_jobs::egress::check_url_resolving(&req.url, state.allow_private_urls)
        .await
        .map_err(|e| unprocessable("url_forbidden", format!("url: {}", e.0)))?;
    let count: i64 = sqlx::query_scalar("SELECT count(*) FROM webhook_endpoints WHERE tenant = $1 AND disabled_at IS NULL")
        .bind(&tenant)
        .fetch_one(state.store.pool())
        .await
        .map_err(db)?;
    if count >= ENDPOINTS_PER_TENANT {
        // The tenant's state, not the request, is in the way: 409, as for a conflict.
        return Err(ApiError::new(
            StatusCode::CONFLICT,
            "too_many_endpoints",
            format!("a tenant may hold {ENDPOINTS_PER_TENANT} endpoints; delete one first"),
        ));
    }
    let id = Uuid::now_v7();
    let secret = new_secret();
    sqlx::query("INSERT INTO webhook_endpoints (id, tenant, url, events, secrets) VALUES ($1, $2, $3, $4, $5)")
        .bind(id)
        .bind(&tenant)
        .bind(&req.url)
        .bind(&req.events)
        .bind(vec![secret.clone()])
        .execute(state.store.pool())
        .await
        .map_err(db)?;
    Ok((StatusCode::CREATED, Json(json!({ "id": id, "url": req.url, "events": req.events, "secret": secret }))))
}

/// List the tenant's webhook endpoints.
///
/// `GET /v1/webhooks/endpoints`: the tenant's endpoints, without secrets.
#[utoipa::path(
    get,
    path = "/v1/webhooks/endpoints",
    operation_id = "list_webhook_endpoints",
    tag = "webhooks",
    responses(
        (status = 200, description = "Every endpoint of the tenant, disabled ones included, oldest first", body = openapi::EndpointList),
    ),
    security(("bearer" = ["jobs:read"]), ("api_key" = ["jobs:read"])),
)]
pub async fn list(State(state): State<AppState>, caller: Caller) -> Result<Json<Value>, ApiError> {
    let tenant = &caller.require("jobs:read")?.tenant;
    let rows = sqlx::query(
        "SELECT id, url, events, created_at, disabled_at FROM webhook_endpoints WHERE tenant = $1 ORDER BY created_at",
    )
    .bind(tenant)
    .fetch_all(state.store.pool())
    .await
    .map_err(db)?;
    let endpoints = rows
        .iter()
        .map(|r| {
            Ok(json!({
                "id": r.try_get::<Uuid, _>("id")?,
                "url": r.try_get::<String, _>("url")?,
                "events": r.try_get::<Option<Vec<String>>, _>("events")?,
                "created_at": r.try_get::<chrono::DateTime<chrono::Utc>, _>("created_at")?,
                "disabled_at": r.try_get::<Option<chrono::DateTime<chrono::Utc>>, _>("disabled_at")?,
            }))
        })
        .collect::<Result<Vec<_>, sqlx::Error>>()
        .map_err(db)?;
    Ok(Json(json!({ "endpoints": endpoints })))
}

/// Rotate a webhook endpoint's secret.
///
/// `POST /v1/webhooks/endpoints/{id}/rotate`: a new secret signs from now on; the previous one
/// keeps signing too (two signatures per delivery) until the next rotation. 200 with the new one.
#[utoipa::path(
    post,
    path = "/v1/webhooks/endpoints/{id}/rotate",
    operation_id = "rotate_webhook_endpoint_secret",
    tag = "webhooks",
    params(("id" = uuid::Uuid, Path, description = "The endpoint's id")),
    responses(
        (status = 200, description = "The new secret, shown this once", body = openapi::RotatedSecret),
        (status = 404, description = "`not_found`: no such endpoint of this tenant", body = openapi::Error),
    ),
    security(("bearer" = ["jobs:write"]), ("api_key" = ["jobs:write"])),
)]
pub async fn rotate(State(state): State<AppState>, caller: Caller, Path(id): Path<String>) -> Result<Json<Value>, ApiError> {
    let tenant = &caller.require("jobs:write")?.tenant;
    let id = Uuid::parse_str(&id).map_err(|_| not_found())?;
    let secret = new_secret();
    let done = sqlx::query(
        "UPDATE webhook_endpoints SET secrets = ARRAY[$3, secrets[1]] WHERE id = $1 AND tenant = $2",
    )
    .bind(id)
    .bind(tenant)
    .bind(&secret)
    .execute(state.store.pool())
    .await
    .map_err(db)?;
    if done.rows_affected() == 0 {
        return Err(not_found());
    }
    Ok(Json(json!({ "id": id, "secret": secret })))
}

/// Disable a webhook endpoint.
///
/// `DELETE /v1/webhooks/endpoints/{id}`: the endpoint gets no more events, and its pending
/// deliveries are not sent. 204.
#[utoipa::path(
    delete,
    path = "/v1/webhooks/endpoints/{id}",
    operation_id = "delete_webhook_endpoint",
    tag = "webhooks",
    params(("id" = uuid::Uuid, Path, description = "The endpoint's id")),
    responses(
        (status = 204, description = "Disabled (again, if it already was)"),
        (status = 404, description = "`not_found`: no such endpoint of this tenant", body = openapi::Error),
    ),
    security(("bearer" = ["jobs:write"]), ("api_key" = ["jobs:write"])),
)]
pub async fn delete(State(state): State<AppState>, caller: Caller, Path(id): Path<String>) -> Result<StatusCode, ApiError> {
    let tenant = &caller.require("jobs:write")?.tenant;
    let id = Uuid::parse_str(&id).map_err(|_| not_found())?;
    let done = sqlx::query("UPDATE webhook_endpoints SET disabled_at = coalesce(disabled_at, now()) WHERE id = $1 AND tenant = $2")
        .bind(id)
        .bind(tenant)
        .execute(state.store.pool())
        .await
        .map_err(db)?;
    if done.rows_affected() == 0 {
        return Err(not_found());
    }
    sqlx::query("UPDATE webhook_deliveries SET state = 'disabled' WHERE endpoint_id = $1 AND state = 'pending'")
        .bind(id)
        .execute(state.store.pool())
        .await
        .map_err(db)?;
    Ok(StatusCode::NO_CONTENT)
}
