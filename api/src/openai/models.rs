//! `GET /v1/models` and `GET /v1/models/{id}`: the models live workers serve. Each kind a live
//! worker pulls is listed by its kind (`transcribe`, `embed`, `generate`, `image`), and each
//! model a worker holds in memory by its name. Requests may name any model: the kind's model
//! runs.

use super::OpenAiError;
use crate::auth::Caller;
use crate::error::ApiError;
use crate::state::AppState;
use axum::extract::{Path, State};
use axum::http::StatusCode;
use axum::Json;
use serde_json::{json, Value};

/// (id, created, kind) of every model live workers serve, sorted by id.
async fn served(state: &AppState) -> Result<Vec<(String, i64, String)>, OpenAiError> {
    let lease_ms = state.queue.settings.lease.as_millis() as f64;
    let rows: Vec<(Vec<String>, Value, chrono::DateTime<chrono::Utc>)> = sqlx::query_as(
        "SELECT kinds, status, started_at FROM workers
         WHERE stopped_at IS NULL AND last_heartbeat > now() - make_interval(secs => $1 / 1000.0)",
    )
    .bind(lease_ms)
    .fetch_all(state.store.pool())
    .await
    .map_err(|e| ApiError::from(tern_jobs::Error::from(e)))?;
    let mut models: Vec<(String, i64, String)> = Vec::new();
    for (kinds, status, started) in rows {
        for kind in kinds.iter().filter(|k| k.as_str() != "echo") {
            models.push((kind.clone(), started.timestamp(), kind.clone()));
        }
        for model in status["models"].as_array().map_or(&[][..], Vec::as_slice) {
            let Some(name) = model["name"].as_str() else { continue };
            let kind = match model["family"].as_str().unwrap_or_default() {
                "whisper" => "transcribe",
                "embedder" => "embed",
                "diffusion" => "image",
                _ => "generate",
            };
            models.push((name.to_string(), started.timestamp(), kind.to_string()));
        }
    }
    models.sort();
    models.dedup_by(|a, b| a.0 == b.0);
    Ok(models)
}

fn object((id, created, kind): &(String, i64, String)) -> Value {
    json!({ "id": id, "object": "model", "created": created, "owned_by": "tern", "tern_kind": kind })
}

/// List models.
pub async fn list(State(state): State<AppState>, caller: Caller) -> Result<Json<Value>, OpenAiError> {
    caller.require("jobs:read")?;
    let data: Vec<Value> = served(&state).await?.iter().map(object).collect();
    Ok(Json(json!({ "object": "list", "data": data })))
}

/// One model.
pub async fn get(State(state): State<AppState>, caller: Caller, Path(id): Path<String>) -> Result<Json<Value>, OpenAiError> {
    caller.require("jobs:read")?;
    let models = served(&state).await?;
    let model = models.iter().find(|m| m.0 == id).ok_or_else(|| OpenAiError {
        status: StatusCode::NOT_FOUND,
        code: "model_not_found".into(),
        message: format!("no live worker serves {id:?}"),
        param: Some("model"),
    })?;
    Ok(Json(object(model)))
}
