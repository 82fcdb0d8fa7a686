//! `/v1/batches`: create, get, list, cancel.

use super::{status, Batch};
use crate::error::ApiError;
use crate::auth::Caller;
use crate::extract::ApiQuery;
use crate::openai::files::FileRecord;
use crate::openai::route::Route;
use crate::openai::OpenAiError;
use crate::state::AppState;
use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::{Path, State};
use axum::http::{HeaderMap, StatusCode};
use axum::Json;
use serde::Deserialize;
use serde_json::{json, Value};
use uuid::Uuid;

/// Longest completion window, hours.
pub const WINDOW_MAX_HOURS: i64 = 168;
/// Default and largest page of `GET /v1/batches`.
pub const LIST_LIMIT_DEFAULT: i64 = 20;
pub const LIST_LIMIT_MAX: i64 = 100;
/// OpenAI's metadata: at most 16 pairs, keys up to 64 characters, values up to 512.
const METADATA_PAIRS: usize = 16;

fn invalid(code: &str, message: impl Into<String>, param: &'static str) -> OpenAiError {
    OpenAiError::invalid(code, message, param)
}

/// Hours of a window `"{n}h"`, 1 to 168.
fn window_hours(window: &str) -> Option<i64> {
    window.strip_suffix('h')?.parse::<i64>().ok().filter(|h| (1..=WINDOW_MAX_HOURS).contains(h))
}

fn check_metadata(metadata: Option<&Value>) -> Result<Option<Value>, OpenAiError> {
    let Some(value) = metadata.filter(|v| !v.is_null()) else { return Ok(None) };
    let pairs = value.as_object().ok_or_else(|| invalid("invalid_metadata", "metadata must be an object", "metadata"))?;
    if pairs.len() > METADATA_PAIRS
        || pairs.iter().any(|(k, v)| k.chars().count() > 64 || v.as_str().is_none_or(|v| v.chars().count() > 512))
    {
        return Err(invalid(
            "invalid_metadata",
            "metadata holds at most 16 pairs of strings, keys up to 64 characters and values up to 512",
            "metadata",
        ));
    }
    Ok(Some(value.clone()))
}

/// Create a batch from an uploaded file: 200 with it `validating`; the runner checks the file,
/// then makes its lines jobs. `X-Tern-Priority` sets the jobs' priority (default `low`).
pub async fn create(
    State(state): State<AppState>,
    caller: Caller,
    headers: HeaderMap,
    body: Result<Bytes, BytesRejection>,
) -> Result<Json<Value>, OpenAiError> {
    let tenant = caller.require("jobs:write")?.tenant.clone();
    let body = crate::extract::json_value(body)?;
    let input_file_id = body["input_file_id"]
        .as_str()
        .ok_or_else(|| invalid("missing_required_parameter", "input_file_id is required", "input_file_id"))?;
    let endpoint = body["endpoint"].as_str().unwrap_or_default();
    if Route::parse(endpoint).is_none() {
        return Err(invalid("invalid_endpoint", format!("endpoint {endpoint:?}: use one of {}", Route::listed()), "endpoint"));
    }
    let window = body["completion_window"].as_str().unwrap_or_default();
    let hours = window_hours(window).ok_or_else(|| {
        invalid("invalid_completion_window", format!("completion_window {window:?}: \"24h\", or any of \"1h\" to \"{WINDOW_MAX_HOURS}h\""), "completion_window")
    })?;
    let metadata = check_metadata(body.get("metadata"))?;
    let priority = super::super::priority(&headers)?.unwrap_or_else(|| "low".into());
    let file = FileRecord::get(&state, &tenant, input_file_id).await.map_err(|mut e| {
        e.param = Some("input_file_id");
        e
    })?;
    if file.purpose != "batch" {
        return Err(invalid("invalid_input_file", format!("{input_file_id} has purpose {:?}, not \"batch\"", file.purpose), "input_file_id"));
    }
    let id = format!("batch_{}", Uuid::now_v7().simple());
    let row = sqlx::query(
        "INSERT INTO batches (id, tenant, endpoint, input_file_id, completion_window, priority, metadata, status, expires_at)
         VALUES ($1, $2, $3, $4, $5, $6, $7, 'validating', now() + make_interval(hours => $8))
         RETURNING *",
    )
    .bind(&id)
    .bind(&tenant)
    .bind(endpoint)
    .bind(input_file_id)
    .bind(window)
    .bind(&priority)
    .bind(&metadata)
    .bind(hours as i32)
    .fetch_one(state.store.pool())
    .await
    .map_err(ApiError::from)?;
    let batch = Batch::from_row(&row).map_err(ApiError::from)?;
    metrics::counter!("tern_batches_created_total").increment(1);
    Ok(Json(batch.view(&state).await?))
}

/// `tenant`'s batch `id`: another tenant's is 404, like a missing one.
async fn own(state: &AppState, tenant: &str, id: &str) -> Result<Batch, OpenAiError> {
    Batch::load(state, id).await?.filter(|b| b.tenant == tenant).ok_or_else(|| OpenAiError {
        status: StatusCode::NOT_FOUND,
        code: "batch_not_found".into(),
        message: format!("no batch {id}"),
        param: Some("batch_id"),
    })
}

/// A batch, its `request_counts` live.
pub async fn get(State(state): State<AppState>, caller: Caller, Path(id): Path<String>) -> Result<Json<Value>, OpenAiError> {
    let tenant = &caller.require("jobs:read")?.tenant;
    Ok(Json(own(&state, tenant, &id).await?.view(&state).await?))
}

#[derive(Debug, Deserialize)]
pub struct ListQuery {
    limit: Option<String>,
    after: Option<String>,
}

/// The tenant's batches, newest first: `limit` 1 to 100 (default 20), `after` the last id of
/// the previous page.
pub async fn list(State(state): State<AppState>, caller: Caller, ApiQuery(q): ApiQuery<ListQuery>) -> Result<Json<Value>, OpenAiError> {
    let tenant = caller.require("jobs:read")?.tenant.clone();
    let limit = match q.limit.as_deref() {
        None => LIST_LIMIT_DEFAULT,
        Some(l) => l
            .parse::<i64>()
            .ok()
            .filter(|n| (1..=LIST_LIMIT_MAX).contains(n))
            .ok_or_else(|| invalid("invalid_limit", format!("limit must be an integer from 1 to {LIST_LIMIT_MAX}"), "limit"))?,
    };
    let rows = sqlx::query(
        "SELECT * FROM batches WHERE tenant = $1
           AND ($2::text IS NULL OR (created_at, id) < (SELECT created_at, id FROM batches WHERE id = $2 AND tenant = $1))
         ORDER BY created_at DESC, id DESC LIMIT $3",
    )
    .bind(&tenant)
    .bind(q.after.as_deref())
    .bind(limit + 1)
    .fetch_all(state.store.pool())
    .await
    .map_err(ApiError::from)?;
    let mut batches: Vec<Batch> = rows.iter().map(Batch::from_row).collect::<Result<_, _>>().map_err(ApiError::from)?;
    let has_more = batches.len() as i64 > limit;
    batches.truncate(limit as usize);
    let mut data = Vec::with_capacity(batches.len());
    for b in &batches {
        data.push(b.view(&state).await?);
    }
    Ok(Json(json!({
        "object": "list", "data": data, "has_more": has_more,
        "first_id": batches.first().map(|b| &b.id), "last_id": batches.last().map(|b| &b.id),
    })))
}

/// Cancel a batch: `cancelling` at once; its waiting jobs are canceled, its running ones
/// stopped, and once none runs it is `cancelled`, with what finished in its output file.
/// Canceling a batch already cancelling is no error; one that ended is 409 `batch_finished`.
pub async fn cancel(State(state): State<AppState>, caller: Caller, Path(id): Path<String>) -> Result<Json<Value>, OpenAiError> {
    let tenant = caller.require("jobs:write")?.tenant.clone();
    let batch = own(&state, &tenant, &id).await?;
    let row = sqlx::query(
        "UPDATE batches SET status = 'cancelling', cancelling_at = now(), next_check_at = now()
         WHERE id = $1 AND status IN ('validating', 'in_progress') RETURNING *",
    )
    .bind(&id)
    .fetch_optional(state.store.pool())
    .await
    .map_err(ApiError::from)?;
    let batch = match row {
        Some(row) => Batch::from_row(&row).map_err(ApiError::from)?,
        None if batch.status == status::CANCELLING => batch,
        None => {
            return Err(OpenAiError {
                status: StatusCode::CONFLICT,
                code: "batch_finished".into(),
                message: format!("batch {id} is {}: only a batch validating or in progress can be canceled", batch.status),
                param: None,
            })
        }
    };
    Ok(Json(batch.view(&state).await?))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn windows_are_whole_hours_up_to_a_week() {
        assert_eq!(window_hours("24h"), Some(24));
        assert_eq!(window_hours("1h"), Some(1));
        assert_eq!(window_hours("168h"), Some(168));
        for bad in ["0h", "169h", "24", "1d", "h", "-1h"] {
            assert_eq!(window_hours(bad), None, "{bad}");
        }
    }

    #[test]
    fn metadata_is_openais() {
        assert!(check_metadata(Some(&json!({"a": "b"}))).is_ok());
        assert!(check_metadata(Some(&json!({"a": 1}))).is_err());
        let many: serde_json::Map<String, Value> = (0..17).map(|i| (i.to_string(), json!("v"))).collect();
        assert!(check_metadata(Some(&Value::Object(many))).is_err());
    }
}
