//! Every `/v1` request carries an API key (`Authorization: Bearer tern_...`, or `x-api-key`).
//! The key names a tenant and scopes; each key draws from its own token bucket (in Redis, so
//! the limit holds across API replicas).

use crate::error::ApiError;
use crate::state::AppState;
use axum::extract::FromRequestParts;
use axum::http::request::Parts;
use axum::http::StatusCode;
use tern_jobs::api_keys::{KeyRejection, Principal};

/// The caller of a request.
pub struct Caller(pub Principal);

/// Per-key request rate.
#[derive(Debug, Clone, Copy)]
pub struct RateLimit {
    /// Requests per second, sustained.
    pub per_second: f64,
    /// Requests that may come at once after a quiet spell.
    pub burst: f64,
}

fn unauthorized(code: &'static str, message: &str) -> ApiError {
    ApiError::new(StatusCode::UNAUTHORIZED, code, message)
}

impl Caller {
    /// Refuses the request (403 `insufficient_scope`) unless the key has `scope`.
    pub fn require(&self, scope: &str) -> Result<&Principal, ApiError> {
        if self.0.has(scope) {
            Ok(&self.0)
        } else {
            Err(ApiError::new(
                StatusCode::FORBIDDEN,
                "insufficient_scope",
                format!("this API key ({}) lacks the {scope} scope", self.0.prefix),
            ))
        }
    }
}

impl FromRequestParts<AppState> for Caller {
    type Rejection = ApiError;

    async fn from_request_parts(parts: &mut Parts, state: &AppState) -> Result<Self, ApiError> {
        let header = |name: &str| parts.headers.get(name).and_then(|v| v.to_str().ok());
        let key = header("authorization")
            .and_then(|v| v.strip_prefix("Bearer ").or_else(|| v.strip_prefix("bearer ")))
            .or_else(|| header("x-api-key"))
            .map(str::trim)
            .ok_or_else(|| unauthorized("unauthenticated", "send an API key: Authorization: Bearer tern_..."))?;
        let principal = match state.keys.authenticate(key).await? {
            Ok(p) => p,
            Err(KeyRejection::Revoked) => return Err(unauthorized("api_key_revoked", "this API key was revoked")),
            Err(KeyRejection::Malformed | KeyRejection::Unknown) => {
                return Err(unauthorized("invalid_api_key", "the API key is not valid"))
            }
        };
        if let Some(limit) = state.limits.rate {
            if let Some(wait) = state.queue.take_token(&principal.prefix, limit.per_second, limit.burst).await? {
                return Err(ApiError::new(
                    StatusCode::TOO_MANY_REQUESTS,
                    "rate_limited",
                    format!("over {} requests per second for this API key", limit.per_second),
                )
                .retry_after(wait.as_secs_f64().ceil().max(1.0) as u64));
            }
        }
        Ok(Caller(principal))
    }
}
