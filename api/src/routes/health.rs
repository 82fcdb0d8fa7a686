//! `/healthz` (the process is alive) and `/readyz` (Postgres, Redis and S3 answer).

use crate::state::AppState;
use axum::extract::State;
use axum::http::StatusCode;
use axum::Json;
use serde_json::{json, Value};

pub async fn healthz() -> Json<Value> {
    Json(json!({ "status": "ok" }))
}

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
