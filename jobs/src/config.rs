//! Settings shared by the binaries. Every one is a flag and an environment variable (`TERN_*`).

use crate::object_store::ObjectStoreSettings;
use crate::queue::QueueSettings;
use crate::RetryPolicy;
use std::time::Duration;

/// Postgres connection.
#[derive(clap::Args, Debug, Clone)]
pub struct DatabaseArgs {
    /// Postgres URL.
    #[arg(long, env = "TERN_DATABASE_URL", default_value = "postgres://postgres@127.0.0.1:5432/tern")]
    pub database_url: String,
    /// Most pooled Postgres connections.
    #[arg(long, env = "TERN_DATABASE_MAX_CONNECTIONS", default_value_t = 16)]
    pub database_max_connections: u32,
}

/// Redis connection and queue tuning.
#[derive(clap::Args, Debug, Clone)]
pub struct QueueArgs {
    /// Redis URL; with `--redis-cluster`, one or more of the cluster's nodes, comma-separated.
    #[arg(long, env = "TERN_REDIS_URL", default_value = "redis://127.0.0.1:6379")]
    pub redis_url: String,
    /// The Redis is a Redis Cluster: follow its redirects and failovers. Off by default.
    #[arg(long, env = "TERN_REDIS_CLUSTER", default_value_t = false, action = clap::ArgAction::Set)]
    pub redis_cluster: bool,
    /// Shards each kind's queue is spread over (1-64), so a hot kind is not bound to one
    /// cluster node. Every process of a deployment must use the same number. Priority, aging
    /// and tenants' shares then hold within each shard; a tenant's cap is split over them.
    #[arg(long, env = "TERN_QUEUE_SHARDS", default_value_t = crate::queue::SHARDS_DEFAULT,
        value_parser = clap::value_parser!(u16).range(1..=i64::from(crate::queue::SHARDS_MAX)))]
    pub queue_shards: u16,
    /// Prefix of every Redis key, so several tern deployments (or tests) can share a server.
    #[arg(long, env = "TERN_REDIS_PREFIX", default_value = "tern")]
    pub redis_prefix: String,
    /// Most pooled Redis connections (one server; a cluster multiplexes one connection a node).
    #[arg(long, env = "TERN_REDIS_POOL_SIZE", default_value_t = 16)]
    pub redis_pool_size: usize,
    /// How long (ms) a pulled job stays leased without a heartbeat before it is run elsewhere.
    /// Workers heartbeat every second; a job whose worker died reruns after about this long.
    #[arg(long, env = "TERN_LEASE_MS", default_value_t = 30_000)]
    pub lease_ms: u64,
    /// How much waiting (ms) raises a job one priority level. Default: a low job that waited
    /// 10 minutes outranks newly arrived normal jobs.
    #[arg(long, env = "TERN_AGING_STEP_MS", default_value_t = 600_000)]
    pub aging_step_ms: u64,
    /// First retry backoff (ms); doubles with each attempt, with jitter.
    #[arg(long, env = "TERN_RETRY_BASE_MS", default_value_t = 2_000)]
    pub retry_base_ms: u64,
    /// Longest retry backoff (ms).
    #[arg(long, env = "TERN_RETRY_CAP_MS", default_value_t = 600_000)]
    pub retry_cap_ms: u64,
}

impl QueueArgs {
    pub fn settings(&self) -> QueueSettings {
        QueueSettings {
            lease: Duration::from_millis(self.lease_ms.max(1)),
            aging_step: Duration::from_millis(self.aging_step_ms),
            shards: self.queue_shards,
        }
    }

    pub fn retry_policy(&self) -> RetryPolicy {
        RetryPolicy { base: Duration::from_millis(self.retry_base_ms), cap: Duration::from_millis(self.retry_cap_ms) }
    }

    pub fn connect(&self) -> crate::Result<crate::Queue> {
        if self.redis_cluster {
            crate::Queue::connect_cluster(&self.redis_url, &self.redis_prefix, self.settings())
        } else {
            crate::Queue::connect(&self.redis_url, &self.redis_prefix, self.redis_pool_size, self.settings())
        }
    }
}

/// S3-compatible storage.
#[derive(clap::Args, Clone)]
pub struct S3Args {
    /// S3 endpoint URL; leave unset for AWS S3 itself.
    #[arg(long, env = "TERN_S3_ENDPOINT")]
    pub s3_endpoint: Option<String>,
    #[arg(long, env = "TERN_S3_REGION", default_value = "us-east-1")]
    pub s3_region: String,
    /// Bucket for uploads and outputs; created if missing.
    #[arg(long, env = "TERN_S3_BUCKET", default_value = "tern")]
    pub s3_bucket: String,
    /// Prefix of every object key (e.g. `staging/`), to share a bucket between deployments.
    #[arg(long, env = "TERN_S3_PREFIX", default_value = "")]
    pub s3_prefix: String,
    #[arg(long, env = "TERN_S3_ACCESS_KEY", default_value = "tern-dev", hide_env_values = true)]
    pub s3_access_key: String,
    #[arg(long, env = "TERN_S3_SECRET_KEY", default_value = "tern-dev-secret", hide_env_values = true, hide_default_value = true)]
    pub s3_secret_key: String,
    /// Path-style addressing (endpoint/bucket/key), as self-hosted servers need.
    #[arg(long, env = "TERN_S3_PATH_STYLE", default_value_t = true, action = clap::ArgAction::Set)]
    pub s3_path_style: bool,
    /// Lifetime (seconds) of presigned download and upload URLs.
    #[arg(long, env = "TERN_PRESIGN_TTL_SECS", default_value_t = 3600)]
    pub presign_ttl_secs: u64,
}

// Written by hand so the secret key never reaches a log line.
impl std::fmt::Debug for S3Args {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("S3Args")
            .field("s3_endpoint", &self.s3_endpoint)
            .field("s3_region", &self.s3_region)
            .field("s3_bucket", &self.s3_bucket)
            .field("s3_prefix", &self.s3_prefix)
            .field("s3_access_key", &self.s3_access_key)
            .field("s3_secret_key", &"<redacted>")
            .field("s3_path_style", &self.s3_path_style)
            .finish()
    }
}

impl S3Args {
    pub fn settings(&self) -> ObjectStoreSettings {
        ObjectStoreSettings {
            endpoint: self.s3_endpoint.clone(),
            region: self.s3_region.clone(),
            bucket: self.s3_bucket.clone(),
            key_prefix: self.s3_prefix.clone(),
            access_key: self.s3_access_key.clone(),
            secret_key: self.s3_secret_key.clone(),
            path_style: self.s3_path_style,
            presign_ttl: Duration::from_secs(self.presign_ttl_secs),
        }
    }
}

/// Logging.
#[derive(clap::Args, Debug, Clone)]
pub struct LogArgs {
    /// Log format: `text` for people, `json` for log pipelines.
    #[arg(long, env = "TERN_LOG_FORMAT", default_value = "text", value_parser = ["text", "json"])]
    pub log_format: String,
    /// Log filter in `tracing` syntax, e.g. `info,tern_jobs=debug`.
    #[arg(long, env = "TERN_LOG", default_value = "info")]
    pub log: String,
}

/// The connections every tern binary needs, and its logging.
#[derive(clap::Args, Debug, Clone)]
pub struct ServiceArgs {
    #[command(flatten)]
    pub database: DatabaseArgs,
    #[command(flatten)]
    pub queue: QueueArgs,
    #[command(flatten)]
    pub s3: S3Args,
    #[command(flatten)]
    pub log: LogArgs,
    /// Longest audio (seconds) a transcription job may bring; longer fails with `audio_too_long`.
    #[arg(long, env = "TERN_MAX_AUDIO_SECONDS", default_value_t = 7200.0)]
    pub max_audio_seconds: f64,
    /// Let audio URLs and webhook targets reach loopback, private, link-local and other internal
    /// addresses. Off by default (such URLs get `url_forbidden`); for local development and tests.
    #[arg(long, env = "TERN_ALLOW_PRIVATE_URLS", default_value_t = false, action = clap::ArgAction::Set)]
    pub allow_private_urls: bool,
}
