//! `GET /outputs/{id}`: the output of a job that lives in Postgres, behind a signed link (see
//! [`crate::output_links`]); what a job's `output.url` names when the output is not in S3.

use crate::error::ApiError;
use crate::extract::ApiQuery;
use crate::openapi;
use crate::output_links::LinkRefused;
use crate::state::AppState;
use axum::extract::{Path, State};
use axum::http::{header, StatusCode};
use axum::response::{IntoResponse, Response};
use serde::Deserialize;

#[derive(Debug, Deserialize, utoipa::IntoParams)]
#[into_params(parameter_in = Query)]
pub struct LinkQuery {
    /// When the link stops working, Unix seconds.
    expires: i64,
    /// Hex HMAC-SHA256 of the job id and `expires`.
    signature: String,
}

/// Download an output kept in Postgres.
///
/// The link comes from a job's `output.url` and needs no API key, like a presigned S3 URL; it
/// works until `expires` (`TERN_PRESIGN_TTL_SECS` after the job was read, 1 h by default). The
/// body is the output's exact bytes: its SHA-256 is the job's `output.sha256`.
#[utoipa::path(
    get,
    path = "/outputs/{id}",
    operation_id = "download_output",
    tag = "jobs",
    params(("id" = uuid::Uuid, Path, description = "The job's id"), LinkQuery),
    responses(
        (status = 200, description = "The output's bytes, with its content type", content_type = "application/octet-stream", body = Vec<u8>),
        (status = 400, description = "`invalid_query`: `expires` or `signature` missing or malformed", body = openapi::Error),
        (status = 403, description = "`invalid_signature`: the link was not signed by this deployment for this job; `link_expired`: read the job again for a fresh link", body = openapi::Error),
        (status = 404, description = "`not_found`: the job has no output kept in Postgres", body = openapi::Error),
    ),
)]
pub async fn download(
    State(state): State<AppState>,
    Path(id): Path<String>,
    ApiQuery(q): ApiQuery<LinkQuery>,
) -> Result<Response, ApiError> {
    let id = super::jobs::parse_id(&id)?;
    match state.output_links.check(id, q.expires, &q.signature) {
        Ok(()) => {}
        Err(LinkRefused::BadSignature) => {
            return Err(ApiError::new(StatusCode::FORBIDDEN, "invalid_signature", "the link's signature does not match this job"))
        }
        Err(LinkRefused::Expired) => {
            return Err(ApiError::new(StatusCode::FORBIDDEN, "link_expired", "the link has expired; read the job again for a fresh one"))
        }
    }
    let (content_type, body) = state.store.output_body(id).await?.ok_or_else(ApiError::not_found)?;
    Ok(([(header::CONTENT_TYPE, content_type)], body).into_response())
}
