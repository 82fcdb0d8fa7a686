//! `/v1/admin/tenants` (admin scope): how tenants share the workers. Within a priority each
//! kind's jobs are served to tenants in proportion to their weight, on job cost; a cap bounds a
//! tenant's running jobs of each kind.

use super::admin::check_tenant;
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
use tern_jobs::tenants::{TenantShare, MAX_RUNNING_MAX, WEIGHT_DEFAULT, WEIGHT_MAX};

#[derive(Deserialize)]
pub struct ShareRequest {
    // Numbers, not integers: JSON's 3.0 is the integer 3 (a JSON Schema integer), 3.5 is refused.
    weight: Option<f64>,
    max_running: Option<f64>,
}

/// `n` if it is a whole number within `range`.
fn whole_in(n: f64, range: std::ops::RangeInclusive<i32>) -> Option<i32> {
    (n.fract() == 0.0 && n >= *range.start() as f64 && n <= *range.end() as f64).then_some(n as i32)
}

/// Checks a share request; the message says what is allowed.
fn check_share(req: &ShareRequest) -> Result<(i32, Option<i32>), ApiError> {
    let weight = whole_in(req.weight.unwrap_or(WEIGHT_DEFAULT as f64), 1..=WEIGHT_MAX)
        .ok_or_else(|| ApiError::bad_request("invalid_weight", format!("weight is a whole number from 1 to {WEIGHT_MAX}")))?;
    let max_running = match req.max_running {
        None => None,
        Some(m) => Some(whole_in(m, 1..=MAX_RUNNING_MAX).ok_or_else(|| {
            ApiError::bad_request(
                "invalid_max_running",
                format!("max_running is a whole number from 1 to {MAX_RUNNING_MAX}, or null for no cap"),
            )
        })?),
    };
    Ok((weight, max_running))
}

fn path_tenant(tenant: &str) -> Result<(), ApiError> {
    check_tenant(tenant).map_err(|m| ApiError::bad_request("invalid_tenant", m))
}

/// List tenants.
///
/// `GET /v1/admin/tenants`: every tenant with a share set or jobs unfinished, by name, with its
/// weight, cap and Postgres's counts of its waiting and running jobs.
#[utoipa::path(
    get,
    path = "/v1/admin/tenants",
    operation_id = "admin_list_tenants",
    tag = "admin",
    responses((status = 200, description = "Tenants by name", body = openapi::TenantList)),
    security(("bearer" = ["admin"]), ("api_key" = ["admin"])),
)]
pub async fn list(State(state): State<AppState>, caller: Caller) -> Result<Json<Value>, ApiError> {
    caller.require("admin")?;
    Ok(Json(json!({ "tenants": state.store.tenants().await? })))
}

/// Set a tenant's share.
///
/// `PUT /v1/admin/tenants/{tenant}` `{weight?, max_running?}`: from the next pull on, the
/// tenant's jobs get `weight` times the share of a weight-1 tenant's within a priority (default
/// 1, at most 1,000), and at most `max_running` of its jobs of each kind run at once (default:
/// no cap). Fields left out take their defaults.
#[utoipa::path(
    put,
    path = "/v1/admin/tenants/{tenant}",
    operation_id = "admin_set_tenant",
    tag = "admin",
    params(("tenant" = String, Path, description = "The tenant's name: 1 to 64 letters, digits, `-`, `_` and `.`", pattern = "^[A-Za-z0-9._-]{1,64}$")),
    request_body(content = openapi::TenantShareRequest, description = "Its weight and cap."),
    responses(
        (status = 200, description = "The share now in force", body = openapi::TenantShare),
        (status = 400, description = "`invalid_tenant`, `invalid_weight` (not 1 to 1,000), `invalid_max_running` (not 1 to 1,000,000 or null), `invalid_json`, `invalid_body`", body = openapi::Error),
        (status = 415, description = "`unsupported_media_type`", body = openapi::Error),
        (status = 422, description = "`invalid_request`: a body of the wrong shape", body = openapi::Error),
    ),
    security(("bearer" = ["admin"]), ("api_key" = ["admin"])),
)]
pub async fn set(
    State(state): State<AppState>,
    caller: Caller,
    Path(tenant): Path<String>,
    ApiJson(req): ApiJson<ShareRequest>,
) -> Result<Json<TenantShare>, ApiError> {
    caller.require("admin")?;
    path_tenant(&tenant)?;
    let (weight, max_running) = check_share(&req)?;
    state.store.set_tenant_share(&state.queue, &tenant, Some((weight, max_running))).await?;
    tracing::info!(tenant, weight, max_running, "tenant share set");
    Ok(Json(TenantShare { tenant, weight, max_running }))
}

/// Reset a tenant's share.
///
/// `DELETE /v1/admin/tenants/{tenant}`: back to weight 1 and no cap.
#[utoipa::path(
    delete,
    path = "/v1/admin/tenants/{tenant}",
    operation_id = "admin_reset_tenant",
    tag = "admin",
    params(("tenant" = String, Path, description = "The tenant's name: 1 to 64 letters, digits, `-`, `_` and `.`", pattern = "^[A-Za-z0-9._-]{1,64}$")),
    responses(
        (status = 204, description = "Back to the defaults (or it had them)"),
        (status = 400, description = "`invalid_tenant`", body = openapi::Error),
    ),
    security(("bearer" = ["admin"]), ("api_key" = ["admin"])),
)]
pub async fn reset(State(state): State<AppState>, caller: Caller, Path(tenant): Path<String>) -> Result<StatusCode, ApiError> {
    caller.require("admin")?;
    path_tenant(&tenant)?;
    state.store.set_tenant_share(&state.queue, &tenant, None).await?;
    tracing::info!(tenant, "tenant share reset");
    Ok(StatusCode::NO_CONTENT)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn code(req: ShareRequest) -> Option<String> {
        check_share(&req).err().map(|e| e.code.to_string())
    }

    #[test]
    fn shares_out_of_range_are_refused_with_their_codes() {
        assert_eq!(check_share(&ShareRequest { weight: None, max_running: None }).unwrap(), (1, None));
        assert_eq!(check_share(&ShareRequest { weight: Some(1000.0), max_running: Some(5.0) }).unwrap(), (1000, Some(5)));
        assert_eq!(code(ShareRequest { weight: Some(0.0), max_running: None }).as_deref(), Some("invalid_weight"));
        assert_eq!(code(ShareRequest { weight: Some(1001.0), max_running: None }).as_deref(), Some("invalid_weight"));
        assert_eq!(code(ShareRequest { weight: Some(2.5), max_running: None }).as_deref(), Some("invalid_weight"));
        assert_eq!(code(ShareRequest { weight: None, max_running: Some(0.0) }).as_deref(), Some("invalid_max_running"));
        assert_eq!(code(ShareRequest { weight: None, max_running: Some(-3.0) }).as_deref(), Some("invalid_max_running"));
        assert_eq!(code(ShareRequest { weight: None, max_running: Some(1e300) }).as_deref(), Some("invalid_max_running"));
    }
}
