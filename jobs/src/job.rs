use crate::{JobKind, JobState, Priority};
use chrono::{DateTime, Utc};
use serde::{Deserialize, Serialize};
use serde_json::Value;
use std::collections::BTreeMap;
use uuid::Uuid;

/// Largest `metadata` object a job may carry, serialised: 16 KiB.
pub const METADATA_MAX_BYTES: usize = 16 * 1024;
/// Attempts a job gets unless it asks otherwise: 5.
pub const MAX_ATTEMPTS_DEFAULT: i32 = 5;
/// Upper bound on `max_attempts`: 100.
pub const MAX_ATTEMPTS_LIMIT: i32 = 100;
/// How long one attempt may run unless the job asks otherwise: 10 minutes.
pub const TIMEOUT_MS_DEFAULT: i64 = 10 * 60 * 1000;
/// Upper bound on `timeout_ms`: 24 hours.
pub const TIMEOUT_MS_LIMIT: i64 = 24 * 60 * 60 * 1000;

/// A job as Postgres records it.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Job {
    pub id: Uuid,
    /// The tenant of the API key that submitted the job.
    pub tenant: String,
    pub kind: JobKind,
    pub priority: Priority,
    pub state: JobState,
    pub input: Value,
    /// What the job weighs in a batch (see [`crate::queue::Queue::pull`]); 1 for `echo`.
    pub cost: i32,
    pub attempts: i32,
    pub max_attempts: i32,
    pub run_at: Option<DateTime<Utc>>,
    pub timeout_ms: i64,
    pub metadata: Value,
    pub idempotency_key: Option<String>,
    pub created_at: DateTime<Utc>,
    pub started_at: Option<DateTime<Utc>>,
    pub finished_at: Option<DateTime<Utc>>,
    pub worker_id: Option<String>,
    pub cancel_requested: bool,
    pub error: Option<Failure>,
    pub output: Option<JobOutput>,
    /// Where this job's events are delivered, if anywhere.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub webhook: Option<Webhook>,
    /// Fencing token of the lease that may settle the job; internal, never shown by the API.
    #[serde(skip)]
    pub lease_token: Option<i64>,
    #[serde(skip)]
    pub request_sha256: Option<String>,
}

/// A job's webhook: its events are POSTed to `url`, signed per the Standard Webhooks spec.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Webhook {
    pub url: String,
    /// Events wanted (see [`WEBHOOK_EVENTS`]); absent: all of them.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub events: Option<Vec<String>>,
}

/// The events a webhook can ask for. `job.progress` (at most one a second per job) is sent only
/// when asked for by name; the others are the default.
pub const WEBHOOK_EVENTS: &[&str] = &["job.started", "job.progress", "job.succeeded", "job.failed", "job.canceled"];

impl Webhook {
    /// Whether the job's progress is to be sent.
    pub fn wants_progress(&self) -> bool {
        self.events.as_ref().is_some_and(|e| e.iter().any(|e| e == "job.progress"))
    }
}

/// Why an attempt failed: a stable machine-readable `code` and a message for people.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Failure {
    pub code: String,
    pub message: String,
}

impl Failure {
    /// A NUL in the message (a decoder's or model's text can hold one) becomes U+FFFD:
    /// Postgres cannot store NUL in text or JSON, and the settle of the whole batch would fail.
    pub fn new(code: impl Into<String>, message: impl Into<String>) -> Self {
        let message: String = message.into();
        let message = if message.contains('\0') { message.replace('\0', "\u{FFFD}") } else { message };
        Failure { code: code.into(), message }
    }
}

/// A succeeded job's output: where it lies, its size and digest.
///
/// An output of at most [`OUTPUT_IN_POSTGRES_MAX_BYTES_DEFAULT`] bytes (the worker's
/// `TERN_OUTPUT_IN_POSTGRES_MAX_BYTES`) without other renderings lives in Postgres, in the job's
/// row, and has no `key`; a larger one is an S3 object under `key`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct JobOutput {
    /// The S3 object's key (under the deployment's prefix); `None` when the output lives in
    /// Postgres.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub key: Option<String>,
    pub size: i64,
    /// Hex SHA-256 of the object's bytes.
    pub sha256: String,
    pub content_type: String,
    /// Other renderings of the same result, by format name (`srt`, `vtt` for transcriptions).
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub formats: BTreeMap<String, JobOutput>,
    /// The output itself, when it is JSON smaller than [`INLINE_OUTPUT_MAX_BYTES`] and its kind
    /// inlines results (embeddings, generation): clients then need no second request.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub inline: Option<Value>,
    /// The output's bytes, when they are to live in Postgres (`key` is `None`): set by the
    /// worker for [`crate::Store::settle`], never serialised; read them back with
    /// [`crate::Store::output_body`].
    #[serde(skip)]
    pub body: Option<bytes::Bytes>,
}

impl JobOutput {
    /// An output that lives in Postgres: its bytes, described.
    pub fn in_postgres(body: bytes::Bytes, content_type: &str) -> JobOutput {
        use sha2::{Digest, Sha256};
        JobOutput {
            key: None,
            size: body.len() as i64,
            sha256: hex::encode(Sha256::digest(&body)),
            content_type: content_type.to_string(),
            formats: BTreeMap::new(),
            inline: None,
            body: Some(body),
        }
    }
}

/// Default largest output kept in Postgres instead of S3: 16 KiB. Below this an S3 PUT (a round
/// trip and an object's metadata on the store) costs far more than the bytes in the job's row;
/// see docs/design.md, "Where outputs live".
pub const OUTPUT_IN_POSTGRES_MAX_BYTES_DEFAULT: usize = 16 * 1024;

/// Largest output (bytes of JSON) copied into the job record as [`JobOutput::inline`]: 64 KiB.
pub const INLINE_OUTPUT_MAX_BYTES: usize = 64 * 1024;

/// A job about to be inserted. Build it with [`NewJob::new`] and adjust the public fields.
#[derive(Debug, Clone)]
pub struct NewJob {
    pub id: Uuid,
    /// Default `default`.
    pub tenant: String,
    pub kind: JobKind,
    pub priority: Priority,
    pub input: Value,
    pub cost: i32,
    pub max_attempts: i32,
    pub run_at: Option<DateTime<Utc>>,
    pub timeout_ms: i64,
    pub metadata: Value,
    pub idempotency_key: Option<String>,
    /// Fingerprint of the request, compared when the idempotency key is used again.
    pub request_sha256: Option<String>,
    pub webhook: Option<Webhook>,
}

impl NewJob {
    pub fn new(kind: JobKind, input: Value) -> Self {
        NewJob {
            id: Uuid::now_v7(),
            tenant: "default".into(),
            kind,
            priority: Priority::default(),
            input,
            cost: 1,
            max_attempts: MAX_ATTEMPTS_DEFAULT,
            run_at: None,
            timeout_ms: TIMEOUT_MS_DEFAULT,
            webhook: None,
            metadata: Value::Object(Default::default()),
            idempotency_key: None,
            request_sha256: None,
        }
    }

    /// The state the job starts in: `scheduled` when `run_at` lies ahead, else `queued`.
    pub fn initial_state(&self, now: DateTime<Utc>) -> JobState {
        match self.run_at {
            Some(at) if at > now => JobState::Scheduled,
            _ => JobState::Queued,
        }
    }
}

/// One entry of a job's timeline.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct JobEvent {
    pub at: DateTime<Utc>,
    pub state: JobState,
    pub attempt: i32,
    pub worker_id: Option<String>,
    pub detail: Option<Value>,
}

#[cfg(test)]
mod failure_tests {
    #[test]
    fn a_nul_in_a_failure_message_becomes_a_replacement_character() {
        let f = super::Failure::new("inference_failed", "bad \0 text");
        assert_eq!(f.message, "bad \u{FFFD} text");
    }
}
