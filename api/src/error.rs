//! API errors: `{"error": {"code", "message"}}` with a fitting status. Codes are stable; clients
//! branch on them, people read the message.

use axum::http::{header, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde_json::json;

#[derive(Debug)]
pub struct ApiError {
    pub status: StatusCode,
    pub code: &'static str,
    pub message: String,
    /// Seconds, sent as `Retry-After`.
    pub retry_after: Option<u64>,
}

impl ApiError {
    pub fn new(status: StatusCode, code: &'static str, message: impl Into<String>) -> Self {
        ApiError { status, code, message: message.into(), retry_after: None }
    }

    pub fn bad_request(code: &'static str, message: impl Into<String>) -> Self {
        Self::new(StatusCode::BAD_REQUEST, code, message)
    }

    /// 429 `too_many_streams`: the caller or the server has as many streams and waits open as
    /// allowed (`crate::job_watch`).
    pub fn too_many_streams(message: impl Into<String>) -> Self {
        Self::new(StatusCode::TOO_MANY_REQUESTS, "too_many_streams", message).retry_after(1)
    }

    pub fn not_found() -> Self {
        Self::new(StatusCode::NOT_FOUND, "not_found", "no such job")
    }

    pub fn retry_after(mut self, secs: u64) -> Self {
        self.retry_after = Some(secs);
        self
    }
}

/// A query the API runs itself (beside the `Store`'s) failed: as a `Store` failure.
impl From<sqlx::Error> for ApiError {
    fn from(e: sqlx::Error) -> Self {
        tern_jobs::Error::from(e).into()
    }
}

impl From<tern_jobs::Error> for ApiError {
    fn from(e: tern_jobs::Error) -> Self {
        if let tern_jobs::Error::IdempotencyConflict(_) = &e {
            return ApiError::new(StatusCode::CONFLICT, "idempotency_conflict", e.to_string());
        }
        // Postgres refusing a value (SQLSTATE class 22, data exception: a NUL it cannot store,
        // a number out of range) is the request's fault, not an outage: retrying cannot help.
        if let tern_jobs::Error::Database(sqlx::Error::Database(db)) = &e {
            if let Some(code) = db.code().filter(|c| c.starts_with("22")) {
                tracing::info!(sqlstate = %code, error = %db.message(), "the database refused a value of a request");
                let api_code = if code == "22P05" || code == "22021" { "invalid_character" } else { "invalid_request" };
                return ApiError::bad_request(api_code, format!("the database refused a value of this request: {}", db.message()));
            }
        }
        tracing::error!(error = %e, "request failed on a backing service");
        let (code, message) = match &e {
            tern_jobs::Error::Database(_) => {
                ("database_unavailable", "the job database is unavailable")
            }
            tern_jobs::Error::Redis(_) | tern_jobs::Error::RedisPool(_) => {
                ("queue_unavailable", "the queue is unavailable")
            }
            tern_jobs::Error::ObjectStore(_) => {
                ("storage_unavailable", "object storage is unavailable")
            }
            tern_jobs::Error::Other(_) | tern_jobs::Error::IdempotencyConflict(_) => {
                ("internal", "internal error")
            }
        };
        ApiError::new(StatusCode::SERVICE_UNAVAILABLE, code, message).retry_after(5)
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let mut error = json!({ "code": self.code, "message": self.message });
        if let Ok(id) = crate::middleware::REQUEST_ID.try_with(String::clone) {
            error["request_id"] = json!(id);
        }
        let body = Json(json!({ "error": error }));
        let mut resp = (self.status, body).into_response();
        if let Some(secs) = self.retry_after {
            resp.headers_mut().insert(header::RETRY_AFTER, HeaderValue::from(secs));
        }
        resp
    }
}
