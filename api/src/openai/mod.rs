//! OpenAI-compatible routes, so that code written against OpenAI's API (its SDKs, LangChain,
//! LiteLLM) runs on tern unchanged: `POST /v1/audio/transcriptions`, `/v1/audio/translations`,
//! `/v1/embeddings`, `/v1/audio/embeddings` (tern's own: a recording as a vector),
//! `/v1/chat/completions`, `/v1/completions`, `/v1/images/generations`, `GET /v1/models`, and
//! the Batch API over them (`/v1/files`, `/v1/batches`, see [`batch`]).
//!
//! Each request is a job like any other: the same API keys (`Authorization: Bearer`), checks,
//! tenant limits, queue, priority (`X-Tern-Priority`, default `normal`), metrics and timeline.
//! The request waits for its job; a client that hangs up before it finishes cancels it. The
//! `X-Tern-Job-Id` response header names the job. Errors take OpenAI's shape,
//! `{"error": {"message", "type", "param", "code"}}`, with tern's stable codes as `code`.
//!
//! These routes follow OpenAI's own API reference, so `/openapi.json` leaves them out.

pub mod audio;
pub mod batch;
pub mod chat;
pub mod embeddings;
pub mod files;
pub mod images;
pub mod models;
pub mod route;

use crate::error::ApiError;
use crate::routes::jobs::{self, Created};
use crate::state::AppState;
use axum::body::Body;
use axum::extract::{DefaultBodyLimit, Request};
use axum::http::{header, HeaderMap, HeaderValue, StatusCode};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use serde_json::{json, Value};
use std::time::Duration;
use tern_jobs::api_keys::Principal;
use tern_jobs::{Job, JobState};
use uuid::Uuid;

/// The routes. `max_audio_upload` bounds the multipart body of the audio routes,
/// `max_batch_file` that of `POST /v1/files`.
pub fn router(max_audio_upload: usize, max_batch_file: usize) -> Router<AppState> {
    Router::new()
        .route(
            "/v1/audio/transcriptions",
            post(audio::transcriptions).layer(DefaultBodyLimit::max(max_audio_upload)),
        )
        .route("/v1/audio/translations", post(audio::translations).layer(DefaultBodyLimit::max(max_audio_upload)))
        .route("/v1/audio/embeddings", post(audio::embeddings).layer(DefaultBodyLimit::max(max_audio_upload)))
        .route("/v1/embeddings", post(embeddings::create))
        .route("/v1/chat/completions", post(chat::chat_completions))
        .route("/v1/completions", post(chat::completions))
        .route("/v1/images/generations", post(images::generations))
        .route("/v1/files", post(files::upload).layer(DefaultBodyLimit::max(max_batch_file)).get(files::list))
        .route("/v1/files/{id}", get(files::get).delete(files::delete))
        .route("/v1/files/{id}/content", get(files::content))
        .route("/v1/batches", post(batch::routes::create).get(batch::routes::list))
        .route("/v1/batches/{id}", get(batch::routes::get))
        .route("/v1/batches/{id}/cancel", post(batch::routes::cancel))
        .route("/v1/models", get(models::list))
        .route("/v1/models/{id}", get(models::get))
        .layer(axum::middleware::from_fn(openai_errors))
}

/// An error in OpenAI's shape.
#[derive(Debug)]
pub struct OpenAiError {
    pub status: StatusCode,
    pub code: String,
    pub message: String,
    /// The request field at fault, when one is.
    pub param: Option<&'static str>,
}

impl OpenAiError {
    pub fn invalid(code: &str, message: impl Into<String>, param: &'static str) -> Self {
        OpenAiError { status: StatusCode::BAD_REQUEST, code: code.into(), message: message.into(), param: Some(param) }
    }

    /// 400 `unsupported_parameter`: what tern cannot honour is refused by name, not ignored.
    pub fn unsupported(param: &'static str, message: impl Into<String>) -> Self {
        Self::invalid("unsupported_parameter", message, param)
    }
}

impl From<ApiError> for OpenAiError {
    fn from(e: ApiError) -> Self {
        OpenAiError { status: e.status, code: e.code.into(), message: e.message, param: None }
    }
}

/// OpenAI's `type` for a status.
fn error_type(status: StatusCode) -> &'static str {
    match status.as_u16() {
        401 => "authentication_error",
        403 => "permission_error",
        429 => "rate_limit_error",
        s if s >= 500 => "server_error",
        _ => "invalid_request_error",
    }
}

impl IntoResponse for OpenAiError {
    fn into_response(self) -> Response {
        let body = json!({ "error": {
            "message": self.message,
            "type": error_type(self.status),
            "param": self.param,
            "code": self.code,
        }});
        (self.status, Json(body)).into_response()
    }
}

/// Rewrites tern's error bodies (`{"error": {"code", "message", "request_id"}}`, from the key
/// check, the rate limit, body limits and the job checks) into OpenAI's shape.
async fn openai_errors(request: Request, next: Next) -> Response {
    let response = next.run(request).await;
    if response.status().is_success() {
        return response;
    }
    let (mut parts, body) = response.into_parts();
    let Ok(bytes) = axum::body::to_bytes(body, 256 * 1024).await else {
        return Response::from_parts(parts, Body::empty());
    };
    let tern_shape = serde_json::from_slice::<Value>(&bytes)
        .ok()
        .filter(|v| v["error"]["code"].is_string() && v["error"].get("type").is_none());
    let Some(v) = tern_shape else {
        return Response::from_parts(parts, Body::from(bytes));
    };
    let body = json!({ "error": {
        "message": v["error"]["message"],
        "type": error_type(parts.status),
        "param": Value::Null,
        "code": v["error"]["code"],
    }});
    parts.headers.remove(header::CONTENT_LENGTH);
    Response::from_parts(parts, Body::from(body.to_string()))
}

/// The priority a request asks for with `X-Tern-Priority` (OpenAI's API has none).
pub(crate) fn priority(headers: &HeaderMap) -> Result<Option<String>, OpenAiError> {
    let Some(value) = headers.get("x-tern-priority") else { return Ok(None) };
    let value = value.to_str().unwrap_or_default();
    value.parse::<tern_jobs::Priority>().map_err(|()| {
        OpenAiError::invalid("invalid_priority", format!("X-Tern-Priority {value:?}: use urgent, high, normal or low"), "X-Tern-Priority")
    })?;
    Ok(Some(value.to_string()))
}

/// A job submitted for a request that waits for it: dropped before it finished (the client
/// hung up), it cancels the job.
pub struct Waited {
    state: AppState,
    pub id: Uuid,
    kind: tern_jobs::JobKind,
    /// Only a job this request made is canceled with it, not one an idempotency key replayed.
    owned: bool,
    finished: bool,
    /// Wakes [`Self::finished`] and [`Self::pause`] when the job changes.
    watch: crate::job_watch::JobWatch,
    /// The job as [`Self::poll`] last read it, whether it was running, and whether it may have
    /// changed since.
    last: Option<Job>,
    running: bool,
    stale: bool,
}

impl Waited {
    /// Submits the job request `value` (`POST /v1/jobs`'s body) for `tenant`, with the
    /// priority `headers` ask for and their `Idempotency-Key`.
    /// The wait counts against the caller's and the server's open streams and waits
    /// (`crate::job_watch`): over them, 429 `too_many_streams` before the job is made.
    pub async fn submit(state: &AppState, caller: &Principal, value: Value, headers: &HeaderMap) -> Result<Waited, OpenAiError> {
        Self::submit_as(state, caller, value, headers, None).await
    }

    /// [`Self::submit`], an `Idempotency-Key` telling replays from other requests by
    /// `canonical` rather than by `value` (where `value` names something each try makes anew,
    /// such as an upload's key).
    pub async fn submit_as(state: &AppState, caller: &Principal, mut value: Value, headers: &HeaderMap, canonical: Option<&Value>) -> Result<Waited, OpenAiError> {
        let slot = state.watches.reserve(caller.key_id)?;
        let tenant = caller.tenant.as_str();
        let priority = priority(headers)?;
        if let Some(p) = &priority {
            value["priority"] = json!(p);
        }
        let canonical = canonical.map(|c| {
            let mut c = c.clone();
            if let Some(p) = &priority {
                c["priority"] = json!(p);
            }
            crate::submission::fingerprint(&c)
        });
        let key = headers.get("idempotency-key").and_then(|v| v.to_str().ok());
        let created = jobs::create_as(state, tenant, &value, key, canonical).await?;
        let owned = matches!(created, Created::New(_));
        let job = created.job();
        Ok(Waited { state: state.clone(), id: job.id, kind: job.kind, owned, finished: false, watch: slot.attach(job.id), last: None, running: false, stale: true })
    }

    /// Whether this request made the job (not an `Idempotency-Key` replay of an earlier one).
    pub fn owned(&self) -> bool {
        self.owned
    }

    /// The job now. Once it is seen final, dropping `self` no longer cancels it.
    pub async fn job(&mut self) -> Result<Job, OpenAiError> {
        let job = self.state.store.get(self.id).await.map_err(ApiError::from)?.ok_or_else(ApiError::not_found)?;
        self.finished |= job.state.is_terminal();
        Ok(job)
    }

    /// Waits for the job's final state, reading it again each time its timeline grows
    /// (`crate::job_watch`).
    pub async fn finished(&mut self) -> Result<Job, OpenAiError> {
        loop {
            let job = self.job().await?;
            if job.state.is_terminal() {
                return Ok(job);
            }
            self.watch.changed(crate::job_watch::SAFETY_RECHECK).await;
        }
    }

    /// For a live stream: the job and its progress. The progress (Redis) is read each call
    /// while the job runs; the job (Postgres) only when it may have changed ([`Self::pause`]
    /// said so), or when the progress has text past `sent`, so that text is always seen with
    /// the attempt it belongs to (progress first, then the job).
    pub async fn poll(&mut self, sent: usize) -> Result<(Job, Option<tern_jobs::queue::Progress>), OpenAiError> {
        let progress = match self.running {
            true => self.state.queue.progress(self.kind, self.id).await.ok().flatten(),
            false => None,
        };
        let fresh = progress.as_ref().and_then(|p| p.text.as_deref()).is_some_and(|t| t.len() > sent);
        let job = match self.last.take() {
            Some(job) if !self.stale && !fresh => job,
            _ => self.job().await?,
        };
        self.stale = false;
        self.running = job.state == JobState::Running;
        self.last = Some(job.clone());
        Ok((job, progress))
    }

    /// Waits before the next [`Self::poll`]: `every` while the job runs (its progress is
    /// polled), else until the job changes.
    pub async fn pause(&mut self, every: Duration) {
        if self.watch.pause(self.running, every, crate::job_watch::SAFETY_RECHECK).await {
            self.stale = true;
        }
    }

    /// The finished job's output JSON (inline, or read from object storage); a failed or
    /// canceled job's error.
    pub async fn output(&self, job: &Job) -> Result<Value, OpenAiError> {
        job_output(&self.state, job).await
    }

    /// The job's id as the `X-Tern-Job-Id` header.
    pub fn header(&self) -> (header::HeaderName, HeaderValue) {
        (header::HeaderName::from_static("x-tern-job-id"), HeaderValue::from_str(&self.id.to_string()).expect("a uuid"))
    }
}

/// The attempt a job's progress text belongs to: its recorded attempts while it runs or once
/// it ended; one more while it waits (a worker may run it with its start not yet recorded,
/// `TERN_RECORD_START_AFTER_MS`, and records that start as this attempt).
pub fn attempt_in_progress(job: &tern_jobs::Job) -> i32 {
    match job.state == tern_jobs::JobState::Running || job.state.is_terminal() {
        true => job.attempts,
        false => job.attempts + 1,
    }
}

/// A stream that sent text of attempt `sent_attempt` (where it sent any) ends with this error
/// once `job` is on another attempt: OpenAI's streams only grow, so the new attempt's text,
/// generated anew, cannot follow what the client already holds (it would splice the two).
pub fn retried_since(sent_attempt: Option<i32>, job: &tern_jobs::Job) -> Option<OpenAiError> {
    sent_attempt.filter(|&a| a != attempt_in_progress(job)).map(|_| OpenAiError {
        status: StatusCode::SERVICE_UNAVAILABLE,
        code: "job_retried".into(),
        message: "the job was retried after part of its text was sent; its new attempt's text starts over: ask again".into(),
        param: None,
    })
}

impl Drop for Waited {
    fn drop(&mut self) {
        if self.finished || !self.owned {
            return;
        }
        let (state, id) = (self.state.clone(), self.id);
        tokio::spawn(async move {
            match jobs::cancel_job(&state, id).await {
                Ok(_) => tracing::info!(job = %id, "the client hung up: its job is canceled"),
                Err(e) => tracing::debug!(job = %id, code = e.code, "the client hung up as its job finished"),
            }
        });
    }
}

/// A finished job's output JSON (inline, or read from object storage); a failed or canceled
/// job's error, as OpenAI's routes answer it.
pub async fn job_output(state: &AppState, job: &Job) -> Result<Value, OpenAiError> {
    match job.state {
        JobState::Succeeded => {}
        JobState::Failed => {
            let (code, message) =
                job.error.as_ref().map_or(("failed", "the job failed"), |f| (f.code.as_str(), f.message.as_str()));
            let status = if CLIENT_FAULTS.contains(&code) { StatusCode::BAD_REQUEST } else { StatusCode::INTERNAL_SERVER_ERROR };
            return Err(OpenAiError { status, code: code.into(), message: format!("job {}: {message}", job.id), param: None });
        }
        _ => {
            return Err(OpenAiError {
                status: StatusCode::CONFLICT,
                code: "job_canceled".into(),
                message: format!("job {} was canceled", job.id),
                param: None,
            })
        }
    }
    let internal = |message: String| ApiError::new(StatusCode::INTERNAL_SERVER_ERROR, "internal", message);
    let output = job.output.as_ref().ok_or_else(|| internal("a succeeded job without output".into()))?;
    if let Some(inline) = &output.inline {
        return Ok(inline.clone());
    }
    let bytes = match &output.key {
        Some(key) => state.objects.get(key, output.size.max(0) as u64).await.map_err(ApiError::from)?.to_vec(),
        None => state.store.output_body(job.id).await.map_err(ApiError::from)?.ok_or_else(|| internal("the job's output is not in Postgres".into()))?.1,
    };
    Ok(serde_json::from_slice(&bytes).map_err(|e| internal(format!("the job's output is not JSON: {e}")))?)
}

/// Job failures that are the request's fault: 400, not 500.
pub(crate) const CLIENT_FAULTS: &[&str] = &[
    "audio_unreadable",
    "audio_empty",
    "audio_too_long",
    "invalid_input",
    "file_unreachable",
    "file_unreadable",
    "file_too_large",
    "url_forbidden",
    // generate
    "context_length_exceeded",
    "invalid_options",
    "invalid_messages",
    "prompt_empty",
    "tools_unsupported",
];

/// A server-sent event carrying JSON, as OpenAI's streams send them (`data: {...}`).
pub fn sse_data(value: &Value) -> axum::response::sse::Event {
    axum::response::sse::Event::default().data(value.to_string())
}
