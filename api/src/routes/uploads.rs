//! `POST /v1/uploads`: a presigned PUT URL for a file too large to send as base64.

use crate::auth::Caller;
use crate::error::ApiError;
use crate::openapi;
use crate::state::AppState;
use axum::extract::State;
use axum::http::StatusCode;
use axum::Json;
use serde_json::{json, Value};
use tern_jobs::file_ref::UPLOAD_PREFIX;
use uuid::Uuid;

/// Get a presigned URL to upload a file.
///
/// Returns `{upload_key, url, method, expires_at}`: PUT the file's bytes to `url`, then pass
/// `{"upload_key": ...}` as the job's file. Keys live under the tenant's own prefix, so one
/// tenant cannot name another's upload.
#[utoipa::path(
    post,
    path = "/v1/uploads",
    operation_id = "create_upload",
    tag = "uploads",
    responses(
        (status = 201, description = "Where to PUT the file, and the key to name it by", body = openapi::Upload),
    ),
    security(("bearer" = ["jobs:write"]), ("api_key" = ["jobs:write"])),
)]
pub async fn create(State(state): State<AppState>, caller: Caller) -> Result<(StatusCode, Json<Value>), ApiError> {
    let tenant = &caller.require("jobs:write")?.tenant;
    let key = format!("{UPLOAD_PREFIX}{}/{}", tenant_segment(tenant), Uuid::now_v7());
    let url = state.objects.presign_put(&key).await?;
    let expires_at = chrono::Utc::now() + chrono::Duration::from_std(state.objects.presign_ttl()).unwrap_or_default();
    Ok((StatusCode::CREATED, Json(json!({ "upload_key": key, "url": url, "method": "PUT", "expires_at": expires_at }))))
}

/// The tenant as one key segment.
pub fn tenant_segment(tenant: &str) -> String {
    tenant.chars().map(|c| if c.is_ascii_alphanumeric() || c == '-' || c == '_' { c } else { '~' }).collect()
}
