//! What the API sends and accepts, as OpenAPI schemas. Handlers mostly build their bodies with
//! `json!`; these types mirror those bodies field for field (names, which fields may be null,
//! which may be absent) and exist only to be described: nothing constructs them. Objects are
//! left open (no `additionalProperties: false`) so that a field added later does not break
//! clients that validate against this document.
#![allow(dead_code)]

use chrono::{DateTime, Utc};
use serde::Serialize;
use serde_json::Value;
use std::collections::BTreeMap;
use utoipa::ToSchema;
use uuid::Uuid;

// ---------------------------------------------------------------------------------------------
// Errors

/// Every 4xx and 5xx answer of the API (but `/readyz`'s 503, which reports its checks).
#[derive(Serialize, ToSchema)]
pub struct Error {
    pub error: ErrorDetail,
}

#[derive(Serialize, ToSchema)]
pub struct ErrorDetail {
    /// Stable, machine-readable: `not_found`, `invalid_input`, `rate_limited`, ... (README lists
    /// them all). Clients branch on it.
    pub code: String,
    /// For people; its wording may change.
    pub message: String,
    /// The request's id, the same as its `x-request-id` response header.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub request_id: Option<String>,
}

// ---------------------------------------------------------------------------------------------
// Enumerations (each is checked against its tern-jobs counterpart by a test in `openapi.rs`)

/// What a job does; each kind has its own queue and input and output schemas.
#[derive(Serialize, ToSchema)]
#[serde(rename_all = "lowercase")]
pub enum JobKind {
    Echo,
    Transcribe,
    Embed,
    Generate,
    #[serde(rename = "audio_embed")]
    AudioEmbed,
    Image,
}

/// Where a job is in its life. `succeeded`, `failed` and `canceled` are final.
#[derive(Serialize, ToSchema)]
#[serde(rename_all = "lowercase")]
pub enum JobState {
    Queued,
    Scheduled,
    Running,
    Retrying,
    Succeeded,
    Failed,
    Canceled,
}

/// How soon a job runs relative to others of its kind; waiting raises it, so low jobs are
/// never starved.
#[derive(Serialize, ToSchema)]
#[serde(rename_all = "lowercase")]
pub enum Priority {
    Urgent,
    High,
    Normal,
    Low,
}

/// An event a job's webhook can ask for. `job.progress` (at most one a second) is sent only
/// when asked for by name.
#[derive(Serialize, ToSchema)]
pub enum WebhookEvent {
    #[serde(rename = "job.started")]
    Started,
    #[serde(rename = "job.progress")]
    Progress,
    #[serde(rename = "job.succeeded")]
    Succeeded,
    #[serde(rename = "job.failed")]
    Failed,
    #[serde(rename = "job.canceled")]
    Canceled,
}

/// An event a webhook endpoint can subscribe to (every event but `job.progress`).
#[derive(Serialize, ToSchema)]
pub enum EndpointEvent {
    #[serde(rename = "job.started")]
    Started,
    #[serde(rename = "job.succeeded")]
    Succeeded,
    #[serde(rename = "job.failed")]
    Failed,
    #[serde(rename = "job.canceled")]
    Canceled,
}

/// What an API key may do.
#[derive(Serialize, ToSchema)]
pub enum Scope {
    #[serde(rename = "jobs:write")]
    JobsWrite,
    #[serde(rename = "jobs:read")]
    JobsRead,
    #[serde(rename = "admin")]
    Admin,
}

// ---------------------------------------------------------------------------------------------
// Submitting jobs

/// A job to run: its kind, the kind's input, and options. Unknown fields are refused (400
/// `invalid_request`), and so is a NUL (`\u0000`) in any string or key (400 `invalid_character`:
/// Postgres cannot store it).
// `openapi::document` turns this into one variant per kind, each naming its kind's input schema.
#[derive(Serialize, ToSchema)]
pub struct JobRequest {
    pub kind: JobKind,
    /// The kind's input (EchoInput, TranscribeInput, EmbedInput, GenerateInput, Audio_embedInput
    /// or ImageInput).
    pub input: Value,
    /// Default `normal`.
    pub priority: Option<Priority>,
    /// When to run (RFC 3339); the job waits as `scheduled` until then. Not with `delay_ms`.
    pub run_at: Option<DateTime<Utc>>,
    /// Milliseconds to wait before running: 0 to 31,622,400,000 (a year). Not with `run_at`.
    #[schema(minimum = 0, maximum = 31_622_400_000_i64)]
    pub delay_ms: Option<i64>,
    /// Attempts in all, 1 to 100. Default 5.
    #[schema(minimum = 1, maximum = 100)]
    pub max_attempts: Option<i32>,
    /// How long one attempt may run, 1 to 86,400,000 ms (24 h). Default 600,000 (10 minutes).
    #[schema(minimum = 1, maximum = 86_400_000)]
    pub timeout_ms: Option<i64>,
    /// The client's own JSON object, at most 16 KiB serialised; returned with the job.
    pub metadata: Option<BTreeMap<String, Value>>,
    /// As the `Idempotency-Key` header (which it may not contradict), 1 to 255 characters.
    #[schema(min_length = 1, max_length = 255)]
    pub idempotency_key: Option<String>,
    /// Where to POST the job's events (Standard Webhooks signatures). Needs a server with
    /// `TERN_WEBHOOK_SECRETS` (else 422 `webhooks_not_configured`).
    pub webhook: Option<Webhook>,
}

/// `POST /v1/jobs/batch`: checked together, inserted in one transaction; any bad job refuses
/// the whole batch, naming its index.
#[derive(Serialize, ToSchema)]
pub struct BatchRequest {
    /// 1 to 1,000 jobs.
    #[schema(min_items = 1, max_items = 1000)]
    pub jobs: Vec<JobRequest>,
}

/// A job's webhook: its events are POSTed to `url`, signed per the Standard Webhooks spec.
#[derive(Serialize, ToSchema)]
pub struct Webhook {
    /// An http(s) URL of at most 2,048 printable ASCII characters (international names as
    /// punycode) that does not point at an internal address (422 `url_forbidden`).
    #[schema(max_length = 2048, format = "uri", pattern = r"^[hH][tT][tT][pP][sS]?://[!-~]+$")]
    pub url: String,
    /// Events wanted, at least one. Absent: every event but `job.progress`.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    #[schema(min_items = 1)]
    pub events: Vec<WebhookEvent>,
}

// ---------------------------------------------------------------------------------------------
// Jobs

/// A job as the API shows it: its record, its place in the queue while it waits, its progress
/// while it runs, and presigned URLs to its output once it succeeded.
#[derive(Serialize, ToSchema)]
pub struct Job {
    pub id: Uuid,
    /// The tenant of the API key that submitted it.
    pub tenant: String,
    pub kind: JobKind,
    pub priority: Priority,
    pub state: JobState,
    /// The input as stored: base64 files appear as the `upload_key` they were moved to.
    pub input: Value,
    /// What the job weighs in a batch: 1 for echo, 30 s windows for transcribe, (estimated)
    /// tokens for embed and generate, (estimated) UNet rows for image.
    pub cost: i32,
    /// Attempts started so far.
    pub attempts: i32,
    pub max_attempts: i32,
    /// When it is due to run while it waits: its `run_at` or `delay_ms`, or its retry's backoff.
    pub run_at: Option<DateTime<Utc>>,
    /// How long one attempt may run.
    pub timeout_ms: i64,
    /// The client's `metadata`, as given (an empty object when none was).
    pub metadata: Value,
    pub idempotency_key: Option<String>,
    pub created_at: DateTime<Utc>,
    /// When its latest attempt started.
    pub started_at: Option<DateTime<Utc>>,
    /// When it reached its final state.
    pub finished_at: Option<DateTime<Utc>>,
    /// The worker running it, or that ran its latest attempt.
    pub worker_id: Option<String>,
    /// A cancel came while it ran; its worker stops it within about a second.
    pub cancel_requested: bool,
    /// Why its latest attempt failed.
    pub error: Option<Failure>,
    /// Its output, once it succeeded.
    pub output: Option<JobOutput>,
    /// Where its events go; absent when it names no webhook.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub webhook: Option<Webhook>,
    /// Ready jobs of its kind that run before it (0: it is next). Only from `GET
    /// /v1/jobs/{id}` (and the admin's), while it is `queued`; null otherwise.
    pub queue_position: Option<u64>,
    /// How far it got, while it runs and once its worker reported (transcribe, generate,
    /// image).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub progress: Option<Progress>,
}

/// Why an attempt failed: a stable `code` (`model_unavailable`, `audio_unreadable`, ...) and a
/// message for people.
#[derive(Serialize, ToSchema)]
pub struct Failure {
    pub code: String,
    pub message: String,
}

/// A succeeded job's output: where to download it, its size and digest.
#[derive(Serialize, ToSchema)]
pub struct JobOutput {
    /// S3 object key, relative to the server's storage prefix; absent when the output (at most
    /// 16 KiB by default, `TERN_OUTPUT_IN_POSTGRES_MAX_BYTES`) is kept in Postgres.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub key: Option<String>,
    /// Bytes.
    pub size: i64,
    /// Hex SHA-256 of the bytes.
    pub sha256: String,
    pub content_type: String,
    /// GET URL of the output that needs no key (JSON: EchoOutput, TranscribeOutput, EmbedOutput,
    /// GenerateOutput, Audio_embedOutput or ImageOutput): presigned S3, or a signed
    /// `/outputs/{id}` link for an output kept in Postgres; it expires (`TERN_PRESIGN_TTL_SECS`,
    /// 1 h by default).
    pub url: String,
    /// Other renderings of the same result by format name (`srt`, `vtt` for transcriptions), and
    /// the files it made (`0.png`, `1.png`, ... for images); absent when there are none.
    #[serde(skip_serializing_if = "BTreeMap::is_empty")]
    pub formats: BTreeMap<String, OutputFormat>,
    /// The output itself, for kinds that inline it (embed, generate, audio_embed, image) when it
    /// is under 64 KiB; an image job's `images` each get a presigned `url` here.
    #[serde(skip_serializing_if = "Value::is_null")]
    pub inline: Value,
}

/// One more rendering of a job's output.
#[derive(Serialize, ToSchema)]
pub struct OutputFormat {
    pub key: String,
    pub size: i64,
    pub sha256: String,
    pub content_type: String,
    /// Presigned GET URL; it expires.
    pub url: String,
}

/// How far a running job got.
#[derive(Serialize, ToSchema)]
pub struct Progress {
    /// Units done: 30 s windows (transcribe), tokens generated (generate) or denoising steps
    /// (image).
    pub done: u64,
    /// Units in all (for generate, `max_tokens`: an upper bound).
    pub total: u64,
    /// The text generated so far (generate only).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub text: Option<String>,
}

/// One page of jobs, newest first.
#[derive(Serialize, ToSchema)]
pub struct JobList {
    pub jobs: Vec<Job>,
    /// Pass as `cursor` for the next page; null on the last page.
    pub next_cursor: Option<Uuid>,
}

/// The jobs of a batch, in request order; a replayed request shows its earlier job.
#[derive(Serialize, ToSchema)]
pub struct JobBatch {
    pub jobs: Vec<Job>,
}

/// A job's timeline, oldest first.
#[derive(Serialize, ToSchema)]
pub struct JobEvents {
    pub events: Vec<JobEvent>,
}

/// A state a job entered.
#[derive(Serialize, ToSchema)]
pub struct JobEvent {
    pub at: DateTime<Utc>,
    pub state: JobState,
    /// The attempt it belongs to (0 before the first).
    pub attempt: i32,
    pub worker_id: Option<String>,
    /// What went with it (an error, a lost lease, ...), or null.
    pub detail: Value,
}

/// A job of any tenant with its whole timeline (admin).
#[derive(Serialize, ToSchema)]
pub struct AdminJob {
    #[serde(flatten)]
    pub job: Job,
    pub events: Vec<JobEvent>,
    pub deliveries: Vec<Delivery>,
}

// ---------------------------------------------------------------------------------------------
// Webhooks

/// A job's webhook deliveries, oldest first.
#[derive(Serialize, ToSchema)]
pub struct DeliveryList {
    pub deliveries: Vec<Delivery>,
}

/// One event on its way to one URL, with every attempt at it.
#[derive(Serialize, ToSchema)]
pub struct Delivery {
    /// The `webhook-id` header: `msg_` and 32 hex digits, the same on every retry.
    pub id: String,
    /// The id to replay it with.
    pub delivery_id: Uuid,
    /// `job.started`, `job.progress`, `job.succeeded`, `job.failed` or `job.canceled`.
    pub event: String,
    pub url: String,
    pub state: DeliveryState,
    /// Attempts since it was created or last replayed.
    pub attempts: i32,
    pub created_at: DateTime<Utc>,
    pub delivered_at: Option<DateTime<Utc>>,
    /// When the next attempt is due, while it is `pending`.
    pub next_attempt_at: Option<DateTime<Utc>>,
    /// The receiver's latest HTTP status.
    pub last_status: Option<i32>,
    pub last_error: Option<String>,
    /// Every attempt, oldest first.
    pub history: Vec<DeliveryAttempt>,
}

#[derive(Serialize, ToSchema)]
#[serde(rename_all = "lowercase")]
pub enum DeliveryState {
    Pending,
    Delivered,
    Failed,
    Disabled,
}

#[derive(Serialize, ToSchema)]
pub struct DeliveryAttempt {
    pub at: DateTime<Utc>,
    /// The receiver's HTTP status; null when no answer came.
    pub status: Option<i32>,
    pub latency_ms: i32,
    pub error: Option<String>,
}

/// What a webhook receives: one of a job's events, with the job as `GET /v1/jobs/{id}` shows it
/// (output URLs included).
#[derive(Serialize, ToSchema)]
pub struct WebhookMessage {
    #[serde(rename = "type")]
    pub event: WebhookEvent,
    /// When the event happened, RFC 3339 with milliseconds.
    pub timestamp: DateTime<Utc>,
    pub data: Job,
}

/// One server-sent event of `GET /v1/jobs/{id}/stream`.
#[derive(Serialize, ToSchema)]
pub struct JobStreamEvent {
    /// `state` (a timeline entry), `progress` (`{done, total}`), `text` (`{delta, offset}`),
    /// `job` (the finished job, the last event), or `error` (`{code, message}`).
    #[schema(pattern = "^(state|progress|text|job|error)$")]
    pub event: String,
    /// Resume after this event with `Last-Event-ID`: `{timeline id}` or `{timeline id}.{text bytes}`.
    #[schema(pattern = "^[0-9]+(\\.[0-9]+)?$")]
    pub id: String,
    /// The event's JSON.
    pub data: String,
}

/// A delivery queued again.
#[derive(Serialize, ToSchema)]
pub struct Replayed {
    pub delivery_id: Uuid,
    /// Always `pending`.
    pub state: String,
}

/// `POST /v1/webhooks/endpoints`.
#[derive(Serialize, ToSchema)]
pub struct NewEndpoint {
    /// An http(s) URL of at most 2,048 printable ASCII characters (international names as
    /// punycode) that does not point at an internal address (422 `url_forbidden`).
    #[schema(max_length = 2048, format = "uri", pattern = r"^[hH][tT][tT][pP][sS]?://[!-~]+$")]
    pub url: String,
    /// Events to receive, at least one. Absent or null: all four.
    #[schema(min_items = 1)]
    pub events: Option<Vec<EndpointEvent>>,
}

/// A new endpoint, with its signing secret: shown this once.
#[derive(Serialize, ToSchema)]
pub struct CreatedEndpoint {
    pub id: Uuid,
    pub url: String,
    /// Null: all four events.
    pub events: Option<Vec<String>>,
    /// `whsec_` and 32 random bytes in base64.
    pub secret: String,
}

/// A tenant's endpoints, oldest first, without secrets.
#[derive(Serialize, ToSchema)]
pub struct EndpointList {
    pub endpoints: Vec<Endpoint>,
}

#[derive(Serialize, ToSchema)]
pub struct Endpoint {
    pub id: Uuid,
    pub url: String,
    /// Null: all four events.
    pub events: Option<Vec<String>>,
    pub created_at: DateTime<Utc>,
    /// Set by its owner's DELETE or by a 410 from the receiver; it gets no more events.
    pub disabled_at: Option<DateTime<Utc>>,
}

/// An endpoint's new secret; the previous one keeps signing until the next rotation.
#[derive(Serialize, ToSchema)]
pub struct RotatedSecret {
    pub id: Uuid,
    pub secret: String,
}

// ---------------------------------------------------------------------------------------------
// Uploads

/// Where to PUT a file's bytes; then name it as `{"upload_key": ...}` in a job's input.
#[derive(Serialize, ToSchema)]
pub struct Upload {
    /// Under the tenant's own prefix: another tenant cannot use it.
    #[schema(pattern = "^uploads/")]
    pub upload_key: String,
    /// Presigned URL to PUT the bytes to.
    pub url: String,
    /// Always `PUT`.
    pub method: String,
    /// When `url` stops working.
    pub expires_at: DateTime<Utc>,
}

// ---------------------------------------------------------------------------------------------
// Admin: keys

/// `POST /v1/admin/keys`.
#[derive(Serialize, ToSchema)]
pub struct NewKey {
    /// 1 to 64 letters, digits, `-`, `_` and `.`.
    #[schema(pattern = "^[A-Za-z0-9._-]{1,64}$")]
    pub tenant: String,
    /// At least one.
    #[schema(min_items = 1)]
    pub scopes: Vec<Scope>,
    /// A note to tell keys apart.
    pub name: Option<String>,
}

/// An API key as lists show it: never its secret.
#[derive(Serialize, ToSchema)]
pub struct ApiKey {
    pub id: Uuid,
    /// `tern_` and 8 characters: the visible part of the key, also accepted to revoke it.
    pub prefix: String,
    pub tenant: String,
    pub scopes: Vec<String>,
    pub name: Option<String>,
    pub created_at: DateTime<Utc>,
    pub revoked_at: Option<DateTime<Utc>>,
    /// To the minute.
    pub last_used_at: Option<DateTime<Utc>>,
}

/// A new key with its secret, shown this once (only its SHA-256 is stored).
#[derive(Serialize, ToSchema)]
pub struct CreatedKey {
    #[serde(flatten)]
    pub info: ApiKey,
    /// `tern_<prefix>_<secret>`: send it as `Authorization: Bearer ...`.
    pub key: String,
}

#[derive(Serialize, ToSchema)]
pub struct KeyList {
    pub keys: Vec<ApiKey>,
}

/// `PUT /v1/admin/tenants/{tenant}`.
#[derive(Serialize, ToSchema)]
pub struct TenantShareRequest {
    /// Its share relative to other tenants' within a priority, on job cost. Default 1.
    #[schema(minimum = 1, maximum = 1000)]
    pub weight: Option<i64>,
    /// Most jobs of one kind it may have running at once. Default (and null): no cap.
    #[schema(minimum = 1, maximum = 1000000)]
    pub max_running: Option<i64>,
}

/// A tenant's share of the workers.
#[derive(Serialize, ToSchema)]
pub struct TenantShare {
    pub tenant: String,
    #[schema(minimum = 1, maximum = 1000)]
    pub weight: i64,
    /// Null: no cap.
    pub max_running: Option<i64>,
}

/// A tenant as `GET /v1/admin/tenants` lists it.
#[derive(Serialize, ToSchema)]
pub struct Tenant {
    pub tenant: String,
    pub weight: i64,
    pub max_running: Option<i64>,
    /// When an admin last set its share; null: never (defaults).
    pub updated_at: Option<DateTime<Utc>>,
    /// Its jobs queued, scheduled or retrying, as Postgres counts them.
    pub waiting: i64,
    pub running: i64,
}

#[derive(Serialize, ToSchema)]
pub struct TenantList {
    pub tenants: Vec<Tenant>,
}

#[derive(Serialize, ToSchema)]
pub struct RevokedKey {
    /// The id or prefix given.
    pub revoked: String,
}

// ---------------------------------------------------------------------------------------------
// Admin: queues

#[derive(Serialize, ToSchema)]
pub struct QueueList {
    /// One per kind.
    pub queues: Vec<QueueStats>,
}

/// One kind's queue.
#[derive(Serialize, ToSchema)]
pub struct QueueStats {
    pub kind: JobKind,
    /// Workers pull nothing of this kind while it is paused; submissions are still accepted.
    pub paused: bool,
    /// Per priority (`urgent`, `high`, `normal`, `low`); every priority is present.
    pub priorities: BTreeMap<String, StateCounts>,
    /// Summed over priorities.
    pub total: StateCounts,
    /// Seconds since the oldest queued job was submitted; null with nothing queued.
    pub oldest_queued_seconds: Option<f64>,
    pub succeeded: Throughput,
    pub failed: Throughput,
    /// Jobs in Redis (ready and delayed), next to Postgres's counts.
    pub redis_depth: u64,
}

/// Jobs in each state an operator watches.
#[derive(Serialize, ToSchema)]
pub struct StateCounts {
    pub queued: i64,
    pub scheduled: i64,
    pub running: i64,
    pub retrying: i64,
    /// Failed for good: the dead letters.
    pub failed: i64,
}

/// Jobs finished in the last 1, 5 and 15 minutes.
#[derive(Serialize, ToSchema)]
pub struct Throughput {
    pub last_1m: i64,
    pub last_5m: i64,
    pub last_15m: i64,
}

#[derive(Serialize, ToSchema)]
pub struct QueuePaused {
    pub kind: JobKind,
    pub paused: bool,
}

#[derive(Serialize, ToSchema)]
pub struct Purged {
    pub kind: JobKind,
    /// Waiting jobs canceled by this call, at most 1,000.
    pub canceled: u64,
    /// The limit was reached: call again for the rest.
    pub more: bool,
}

// ---------------------------------------------------------------------------------------------
// Admin: jobs

/// `POST /v1/admin/jobs/retry`: failed jobs by id, or every failed job of a kind; at least one
/// of the two (400 `nothing_to_retry`).
#[derive(Serialize, ToSchema)]
pub struct RetryRequest {
    /// At most 1,000.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    #[schema(max_items = 1000)]
    pub ids: Vec<Uuid>,
    pub kind: Option<JobKind>,
}

#[derive(Serialize, ToSchema)]
pub struct Retried {
    /// The jobs that were failed and are queued again (at most 1,000).
    pub retried: Vec<Uuid>,
}

// ---------------------------------------------------------------------------------------------
// Admin: workers and system

#[derive(Serialize, ToSchema)]
pub struct WorkerList {
    /// Every worker that reported in the last day, newest first.
    pub workers: Vec<Worker>,
    /// A worker silent this long shows as `lost` (the lease period).
    pub lost_after_seconds: f64,
}

/// A worker as its latest report left it. The fields after `state` are what the worker
/// reports about itself; a worker that has not reported them yet lacks them.
#[derive(Serialize, ToSchema)]
pub struct Worker {
    pub id: String,
    pub host: String,
    /// Job kinds it pulls.
    pub kinds: Vec<String>,
    /// `cpu`, `cuda:N` or `metal:N`.
    pub device: String,
    pub started_at: DateTime<Utc>,
    pub last_heartbeat: DateTime<Utc>,
    /// Set when it shut down cleanly.
    pub stopped_at: Option<DateTime<Utc>>,
    /// An admin asked it to finish its batch and pull no more.
    pub draining: bool,
    pub seconds_since_heartbeat: f64,
    pub state: WorkerState,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub memory: Option<WorkerMemory>,
    /// Models it holds, as it reports them.
    #[serde(skip_serializing_if = "Value::is_null")]
    pub models: Value,
    /// Model cache counters: hits, misses, evictions, load failures.
    #[serde(skip_serializing_if = "Value::is_null")]
    pub cache: Value,
    /// What it does to run faster or leaner.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub optimisations: Vec<String>,
    /// Jobs in the batches it runs now.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub batch_in_hand: Option<u64>,
    /// Jobs it settled since it started.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub jobs_done: Option<u64>,
}

/// `active`, `draining`, `stopped` (shut down cleanly) or `lost` (no report for a lease
/// period: it died or lost its network, and its jobs were returned to the queue).
#[derive(Serialize, ToSchema)]
#[serde(rename_all = "lowercase")]
pub enum WorkerState {
    Active,
    Draining,
    Stopped,
    Lost,
}

/// A worker's memory, bytes; null before its model engine reported.
#[derive(Serialize, ToSchema)]
pub struct WorkerMemory {
    /// What resident models and their batches may use.
    pub budget_bytes: Option<u64>,
    /// What resident models use.
    pub models_bytes: Option<u64>,
    /// The process's resident set.
    pub rss_bytes: Option<u64>,
}

#[derive(Serialize, ToSchema)]
pub struct Drained {
    pub id: String,
    pub draining: bool,
}

/// `GET /v1/admin/history`.
#[derive(Serialize, ToSchema)]
pub struct History {
    /// The minutes of the series, oldest first (each the start of its minute).
    pub minutes: Vec<DateTime<Utc>>,
    /// Per kind: `waiting`, `running` (at each minute's end), `succeeded`, `failed` (within
    /// it), one number a minute.
    #[schema(value_type = Object)]
    pub kinds: serde_json::Value,
    /// Per kind with jobs that succeeded in the span: their count and the p50/p90/p99 of their
    /// run and wait (submit to start) seconds.
    #[schema(value_type = Vec<Object>)]
    pub timings: serde_json::Value,
}

/// The service at a glance.
#[derive(Serialize, ToSchema)]
pub struct SystemView {
    /// Live (active or draining) workers.
    pub workers: Vec<LiveWorker>,
    /// Totals over every kind.
    pub queue: QueueTotals,
    pub redis: RedisView,
}

/// Where the queue lives.
#[derive(Serialize, ToSchema)]
pub struct RedisView {
    /// On a Redis Cluster (`TERN_REDIS_CLUSTER`).
    pub cluster: bool,
    /// Shards each kind's queue is spread over (`TERN_QUEUE_SHARDS`, default 1).
    pub shards: u16,
}

/// A live worker's memory pressure, models and optimisations. Fields the worker has not
/// reported are null.
#[derive(Serialize, ToSchema)]
pub struct LiveWorker {
    pub id: String,
    pub device: String,
    pub state: WorkerState,
    pub memory: LiveMemory,
    pub models: Value,
    pub cache: Value,
    pub optimisations: Value,
    pub batch_in_hand: Value,
    /// How the worker sizes batches: `probe` (`cuda`: the driver's free memory; `host`: peak
    /// resident set), `free_bytes` (the device's, less 1 GiB of headroom; null on the CPU),
    /// `budgets` (`transcribe_windows`, `embed_tokens`, `generate_tokens`, `image_rows` pulled
    /// per batch),
    /// `oom_splits` (batches run again at half size for want of memory) and `busy_seconds`
    /// (time its model thread spent in model calls). Null for workers without models.
    pub batching: Value,
}

#[derive(Serialize, ToSchema)]
pub struct LiveMemory {
    /// Resident models against the budget: under 50% `low`, under 75% `moderate`, under 90%
    /// `high`, else `critical`.
    pub state: MemoryState,
    pub budget_bytes: Option<u64>,
    pub models_bytes: Option<u64>,
    pub rss_bytes: Option<u64>,
}

#[derive(Serialize, ToSchema)]
#[serde(rename_all = "lowercase")]
pub enum MemoryState {
    Low,
    Moderate,
    High,
    Critical,
}

#[derive(Serialize, ToSchema)]
pub struct QueueTotals {
    pub queued: i64,
    pub scheduled: i64,
    pub running: i64,
    pub retrying: i64,
    pub failed: i64,
    pub succeeded_last_1m: i64,
}

// ---------------------------------------------------------------------------------------------
// Health

#[derive(Serialize, ToSchema)]
pub struct Health {
    /// Always `ok`.
    pub status: String,
}

/// Whether Postgres, Redis and S3 answer.
#[derive(Serialize, ToSchema)]
pub struct Readiness {
    pub status: ReadyStatus,
    pub checks: ReadinessChecks,
}

#[derive(Serialize, ToSchema)]
#[serde(rename_all = "lowercase")]
pub enum ReadyStatus {
    Ready,
    Unavailable,
}

/// Each `ok`, or what went wrong.
#[derive(Serialize, ToSchema)]
pub struct ReadinessChecks {
    pub postgres: String,
    pub redis: String,
    pub s3: String,
}

// ---------------------------------------------------------------------------------------------
// Admin: model versions (hot swaps)

/// The kinds that run a model (echo runs none).
#[derive(Serialize, ToSchema)]
#[serde(rename_all = "lowercase")]
pub enum ModelKind {
    Transcribe,
    Embed,
    Generate,
    Image,
}

/// `POST /v1/admin/models`.
#[derive(Serialize, ToSchema)]
pub struct NewModelVersion {
    pub kind: ModelKind,
    /// A folder under the workers' models directory (no `.` or `..` parts, not absolute) or
    /// `hf:OWNER/NAME`; 1 to 200 letters, digits and `-_./:@`.
    #[schema(pattern = "^[A-Za-z0-9_:@-][A-Za-z0-9_./:@-]{0,199}$")]
    pub model: String,
}

/// A version's place in its kind's rollout.
#[derive(Serialize, ToSchema)]
#[serde(rename_all = "snake_case")]
pub enum ModelVersionState {
    Candidate,
    Active,
    Previous,
    Retired,
    Failed,
}

/// Where one worker's swap to a version stands.
#[derive(Serialize, ToSchema)]
#[serde(rename_all = "snake_case")]
pub enum WorkerSwapState {
    Loading,
    HealthCheck,
    Ready,
    Active,
    Deprecated,
    Failed,
}

#[derive(Serialize, ToSchema)]
pub struct WorkerSwap {
    pub worker_id: String,
    pub state: WorkerSwapState,
    pub error: Option<String>,
    /// Batches the worker ran on the model in use while this version loaded.
    pub batches_during_load: i64,
    pub load_ms: Option<i64>,
    pub updated_at: DateTime<Utc>,
}

#[derive(Serialize, ToSchema)]
pub struct ModelVersion {
    pub id: Uuid,
    pub kind: String,
    pub model: String,
    pub state: ModelVersionState,
    /// Why it failed.
    pub error: Option<String>,
    pub created_at: DateTime<Utc>,
    pub activated_at: Option<DateTime<Utc>>,
    /// Each worker that has worked on it.
    pub workers: Vec<WorkerSwap>,
}

#[derive(Serialize, ToSchema)]
pub struct ModelVersionList {
    /// Newest first.
    pub versions: Vec<ModelVersion>,
}

#[derive(Serialize, ToSchema)]
pub struct Rollback {
    pub kind: String,
    /// The version active now; null: the models the workers were started with.
    pub active: Option<Uuid>,
}
