/// Errors of the job domain's infrastructure (Postgres, Redis, S3). Bad input is not an error
/// here: the API maps it to its own codes before anything reaches the store.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("postgres: {0}")]
    Database(#[from] sqlx::Error),
    #[error("redis: {0}")]
    Redis(#[from] redis::RedisError),
    #[error("redis pool: {0}")]
    RedisPool(#[from] deadpool_redis::PoolError),
    #[error("object storage: {0}")]
    ObjectStore(String),
    /// A job's idempotency key was used by its tenant for a different request; nothing of
    /// the insert was committed.
    #[error("idempotency key {0:?} was used for a different request")]
    IdempotencyConflict(String),
    #[error("{0}")]
    Other(String),
}

pub type Result<T, E = Error> = std::result::Result<T, E>;
