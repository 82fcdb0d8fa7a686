//! `/v1/admin/keys`: API key management (admin scope). The first admin key comes from the
//! command line: `tern-api keys create --tenant T --scope admin`.

use crate::auth::Caller;
use crate::error::ApiError;
use crate::state::AppState;
use axum::extract::{Path, State};
use axum::http::StatusCode;
use axum::Json;
use serde::Deserialize;
use serde_json::{json, Value};
use tern_jobs::api_keys::SCOPES;

#[derive(Deserialize)]
pub struct NewKey {
    tenant: String,
    scopes: Vec<String>,
    name: Option<String>,
}

/// Checks a tenant name and scopes; the message says what is allowed.
pub fn check_key_request(tenant: &str, scopes: &[String]) -> Result<(), String> {
    if tenant.is_empty() || tenant.len() > 64 || !tenant.chars().all(|c| c.is_ascii_alphanumeric() || "-_.".contains(c)) {
        return Err("a tenant is 1 to 64 characters of letters, digits, '-', '_' and '.'".into());
    }
    if scopes.is_empty() {
        return Err(format!("give at least one scope of {}", SCOPES.join(", ")));
    }
    if let Some(s) = scopes.iter().find(|s| !SCOPES.contains(&s.as_str())) {
        return Err(format!("unknown scope {s:?}; scopes are {}", SCOPES.join(", ")));
    }
    Ok(())
}

/// `POST /v1/admin/keys` `{tenant, scopes, name?}`: 201 with the key, shown this once.
pub async fn create_key(
    State(state): State<AppState>,
    caller: Caller,
    Json(req): Json<NewKey>,
) -> Result<(StatusCode, Json<Value>), ApiError> {
    caller.require("admin")?;
    check_key_request(&req.tenant, &req.scopes)
        .map_err(|m| ApiError::new(StatusCode::UNPROCESSABLE_ENTITY, "invalid_key_request", m))?;
    let (info, key) = state.keys.create(&req.tenant, &req.scopes, req.name.as_deref()).await?;
    let mut v = serde_json::to_value(info).expect("keys serialise");
    v["key"] = json!(key);
    Ok((StatusCode::CREATED, Json(v)))
}

/// `GET /v1/admin/keys`: every key, without secrets.
pub async fn list_keys(State(state): State<AppState>, caller: Caller) -> Result<Json<Value>, ApiError> {
    caller.require("admin")?;
    Ok(Json(json!({ "keys": state.keys.list().await? })))
}

/// `POST /v1/admin/keys/{id or prefix}/revoke`: the key stops working at once.
pub async fn revoke_key(State(state): State<AppState>, caller: Caller, Path(id): Path<String>) -> Result<Json<Value>, ApiError> {
    caller.require("admin")?;
    if !state.keys.revoke(&id).await? {
        return Err(ApiError::new(StatusCode::NOT_FOUND, "not_found", format!("no API key {id}")));
    }
    Ok(Json(json!({ "revoked": id })))
}
