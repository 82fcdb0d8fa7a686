//! `/v1/admin/models` (admin scope): hot model swaps. Registering a version makes it the kind's
//! candidate; workers load and health-check it in the background and switch between batches.
//! Rollback makes the previous version active again.

use crate::auth::Caller;
use crate::error::ApiError;
use crate::extract::ApiJson;
use crate::openapi;
use crate::state::AppState;
use axum::extract::{Path, State};
use axum::http::StatusCode;
use axum::Json;
use serde::Deserialize;
use serde_json::{json, Value};
use tern_jobs::model_versions::has_model;
use tern_jobs::JobKind;

#[derive(Deserialize)]
pub struct NewVersion {
    kind: String,
    /// A folder under the workers' models directory, or `hf:OWNER/NAME`.
    model: String,
}

/// Longest model name accepted.
const MODEL_NAME_MAX: usize = 200;

/// A kind that runs a model, or 422 `invalid_kind`.
fn model_kind(kind: &str) -> Result<JobKind, ApiError> {
    match kind.parse::<JobKind>() {
        Ok(k) if has_model(k) => Ok(k),
        Ok(k) => Err(ApiError::new(StatusCode::UNPROCESSABLE_ENTITY, "invalid_kind", format!("{k} jobs run no model"))),
        Err(()) => Err(ApiError::new(StatusCode::UNPROCESSABLE_ENTITY, "invalid_kind", format!("unknown job kind {kind:?}"))),
    }
}

/// A folder name inside the models directory (no way out of it) or a hub id.
fn check_model_name(model: &str) -> Result<(), ApiError> {
    let invalid = |why: &str| ApiError::new(StatusCode::UNPROCESSABLE_ENTITY, "invalid_model", why.to_string());
    if model.is_empty() || model.len() > MODEL_NAME_MAX {
        return Err(invalid("a model is 1 to 200 characters: a folder under the models directory or hf:OWNER/NAME"));
    }
    if model.starts_with('/') || model.split('/').any(|part| part == ".." || part == ".") {
        return Err(invalid("a model folder is named relative to the models directory, without . or .."));
    }
    if !model.chars().all(|c| c.is_ascii_alphanumeric() || "-_./:@".contains(c)) {
        return Err(invalid("a model name is letters, digits and - _ . / : @"));
    }
    Ok(())
}

/// Register a model version.
///
/// `POST /v1/admin/models` `{kind, model}`: 201 with the new candidate version.
#[utoipa::path(
    post,
    path = "/v1/admin/models",
    operation_id = "admin_register_model_version",
    tag = "admin",
    request_body(content = openapi::NewModelVersion, description = "The kind and the model folder or hub id."),
    responses(
        (status = 201, description = "The kind's new candidate; workers load and health-check it in the background", body = openapi::ModelVersion),
        (status = 400, description = "`invalid_json` (the body is not JSON), `invalid_body`, `invalid_character` (a NUL, `\\u0000`, anywhere in the body)", body = openapi::Error),
        (status = 413, description = "`body_too_large`: the body is larger than `TERN_MAX_BODY_BYTES`", body = openapi::Error),
        (status = 415, description = "`unsupported_media_type`: the body was not sent as `Content-Type: application/json`", body = openapi::Error),
        (status = 422, description = "`invalid_kind` or `invalid_model`; `invalid_request`: a body of the wrong shape", body = openapi::Error),
    ),
    security(("bearer" = ["admin"]), ("api_key" = ["admin"])),
)]
pub async fn register(
    State(state): State<AppState>,
    caller: Caller,
    ApiJson(req): ApiJson<NewVersion>,
) -> Result<(StatusCode, Json<Value>), ApiError> {
    caller.require("admin")?;
    let kind = model_kind(&req.kind)?;
    check_model_name(&req.model)?;
    let version = state.store.register_model_version(kind, &req.model).await?;
    tracing::info!(%kind, model = %req.model, version = %version.id, "model version registered");
    Ok((StatusCode::CREATED, Json(serde_json::to_value(version).expect("versions serialise"))))
}

/// List model versions.
///
/// `GET /v1/admin/models`: every version, newest first, with each worker's swap state
/// (loading, health_check, ready, active, deprecated, failed).
#[utoipa::path(
    get,
    path = "/v1/admin/models",
    operation_id = "admin_list_model_versions",
    tag = "admin",
    responses((status = 200, description = "Every version, newest first", body = openapi::ModelVersionList)),
    security(("bearer" = ["admin"]), ("api_key" = ["admin"])),
)]
pub async fn list(State(state): State<AppState>, caller: Caller) -> Result<Json<Value>, ApiError> {
    caller.require("admin")?;
    Ok(Json(json!({ "versions": state.store.model_versions().await? })))
}

/// Roll a kind back to its previous model version.
///
/// `POST /v1/admin/models/{kind}/rollback`: the previous version becomes active again (with
/// none, the models the workers were started with); 409 `nothing_to_roll_back` without an
/// active version.
#[utoipa::path(
    post,
    path = "/v1/admin/models/{kind}/rollback",
    operation_id = "admin_rollback_model",
    tag = "admin",
    params(("kind" = openapi::ModelKind, Path, description = "The kind to roll back")),
    responses(
        (status = 200, description = "Rolled back", body = openapi::Rollback),
        (status = 409, description = "`nothing_to_roll_back`: the kind has no active version", body = openapi::Error),
        (status = 422, description = "`invalid_kind`", body = openapi::Error),
    ),
    security(("bearer" = ["admin"]), ("api_key" = ["admin"])),
)]
pub async fn rollback(State(state): State<AppState>, caller: Caller, Path(kind): Path<String>) -> Result<Json<Value>, ApiError> {
    caller.require("admin")?;
    let kind = model_kind(&kind)?;
    match state.store.rollback_model(kind).await? {
        Ok(active) => {
            tracing::info!(%kind, active = ?active, "model version rolled back");
            Ok(Json(json!({ "kind": kind, "active": active })))
        }
        Err(()) => Err(ApiError::new(
            StatusCode::CONFLICT,
            "nothing_to_roll_back",
            format!("{kind} has no active model version to roll back from"),
        )),
    }
}
