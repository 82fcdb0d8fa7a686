use std::sync::Arc;
use tern_jobs::api_keys::ApiKeys;
use tern_jobs::{ObjectStore, Queue, Store};

/// What every request handler shares.
#[derive(Clone)]
pub struct AppState(pub Arc<Inner>);

pub struct Inner {
    pub store: Store,
    pub queue: Queue,
    pub objects: ObjectStore,
    pub keys: ApiKeys,
    /// Signs `output.url` for outputs kept in Postgres.
    pub output_links: crate::output_links::OutputLinks,
    pub limits: Limits,
    /// Whether webhook secrets are configured: jobs may name a webhook only then.
    pub webhooks_enabled: bool,
    /// Whether file URLs and webhook targets may be internal addresses.
    pub allow_private_urls: bool,
    /// What wakes waits and streams: Postgres's notifications of job changes.
    pub watches: crate::job_watch::JobWatches,
    /// Longest a job's event stream stays open before the client resumes it with
    /// `Last-Event-ID`.
    pub stream_lifetime: std::time::Duration,
}

/// Admission limits.
#[derive(Debug, Clone, Copy)]
pub struct Limits {
    /// Jobs of one kind that may wait before submissions get 503 `queue_full`.
    pub max_queued: u64,
    /// Largest request body, bytes.
    pub max_body_bytes: usize,
    /// Largest multipart audio upload of `/v1/audio/*`, bytes.
    pub max_audio_upload_bytes: usize,
    /// Largest batch input file (`POST /v1/files`), bytes.
    pub max_batch_file_bytes: usize,
    /// Longest audio a job may bring, seconds.
    pub max_audio_seconds: f64,
    /// Per-key request rate; `None`: unlimited.
    pub rate: Option<crate::auth::RateLimit>,
    /// Jobs one tenant may have waiting (queued, scheduled, retrying); `None`: unlimited.
    pub max_queued_per_tenant: Option<i64>,
}

impl std::ops::Deref for AppState {
    type Target = Inner;
    fn deref(&self) -> &Inner {
        &self.0
    }
}
