use std::time::Duration;

/// Exponential backoff with jitter between attempts.
///
/// After failed attempt `n` (1-based) the job waits `min(cap, base * 2^(n-1))`, of which the
/// second half is random ("equal jitter"), so retries of jobs that failed together spread out.
/// The wait is computed by Postgres (`tern_retry_at` in `migrations/`) inside the statement that
/// moves the job to `retrying`, so workers and the lease reaper apply one policy.
/// Defaults: 2 s base, 10 min cap.
#[derive(Debug, Clone, Copy)]
pub struct RetryPolicy {
    pub base: Duration,
    pub cap: Duration,
}

impl RetryPolicy {
    pub const BASE_DEFAULT: Duration = Duration::from_secs(2);
    pub const CAP_DEFAULT: Duration = Duration::from_secs(600);
}

impl Default for RetryPolicy {
    fn default() -> Self {
        RetryPolicy { base: Self::BASE_DEFAULT, cap: Self::CAP_DEFAULT }
    }
}
