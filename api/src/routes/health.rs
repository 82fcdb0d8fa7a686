//! `/healthz` (the process is alive) and `/readyz` (Postgres, Redis and S3 answer).

use crate::openapi;
use crate::state::AppState;
use axum::extract::State;
use axum::http::StatusCode;
use axum::Json;
use serde_json::{json, Value};

/// Whether the process is alive.
///
/// Always 200 while the process serves requests; it asks nothing of Postgres, Redis or S3.
#[utoipa::path(
    get,
    path = "/healthz",
    operation_id = "healthz",
    tag = "health",
    responses((status = 200, description = "The process is alive: `{\"status\": \"ok\"}`", body = openapi::Health)),
)]
pub async fn healthz() -> Json<Value> {
    Json(json!({ "status": "ok" }))
}

/// Whether Postgres, Redis and S3 answer.
///
/// Asks all three at once; `checks` says `ok` or what went wrong for each.
#[utoipa::path(
    get,
    path = "/readyz",
    operation_id = "readyz",
    tag = "health",
    responses(
        (status = 200, description = "All three answer (`status`: `ready`)", body = openapi::Readiness),
        (status = 503, description = "One or more do not (`status`: `unavailable`)", body = openapi::Readiness),
    ),
)]
pub async fn readyz(State(state): State<AppState>) -> (StatusCode, Json<Value>) {
    let (db, redis, s3) = tokio::join!(state.store.ping(), state.queue.ping(), state.objects.ping());
    let show = |r: &tern_jobs::Result<()>| match r {
        Ok(()) => json!("ok"),
        Err(e) => json!(e.to_string()),
    };
    let ready = db.is_ok() && redis.is_ok() && s3.is_ok();
    let status = if ready { StatusCode::OK } else { StatusCode::SERVICE_UNAVAILABLE };
    let body = json!({
        "status": if ready { "ready" } else { "unavailable" },
        "checks": { "postgres": show(&db), "redis": show(&redis), "s3": show(&s3) },
    });
    (status, Json(body))
}
