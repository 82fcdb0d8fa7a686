//! Returns jobs whose lease expired (their worker died or stalled) to the queue.
//!
//! Each expired lease counts as a used attempt: the job becomes `retrying` with backoff, or
//! `failed` (`lease_expired`) after its last attempt. A job that merely ran long but whose worker
//! is alive keeps its lease through heartbeats, so it is never reaped; a worker that stalls past
//! its lease may see its job run twice, but only the newest lease can record the outcome. A job
//! whose lease expired before Postgres recorded its start is charged the same way: workers
//! record a short batch's starts with its outcomes, so the lease is all that shows it ran.

use crate::queue::SettleAction;
use crate::store::{Outcome, Settlement, UnrecordedStart};
use crate::{Failure, JobKind, JobState, Queue, Result, RetryPolicy, Store};
use std::collections::{HashMap, HashSet};
use std::time::Duration;
use uuid::Uuid;

/// How often the reaper looks for expired leases. Default 1 s.
pub const REAPER_INTERVAL_DEFAULT: Duration = Duration::from_secs(1);
/// Most leases taken per kind per round.
const REAP_BATCH: usize = 1000;

#[derive(Clone)]
pub struct Reaper {
    pub store: Store,
    pub queue: Queue,
    pub retry: RetryPolicy,
}

impl Reaper {
    /// Reaps until there is nothing expired; returns how many jobs were returned or failed.
    pub async fn run_once(&self) -> Result<usize> {
        let mut total = 0;
        for kind in JobKind::ALL {
            loop {
                let expired = self.queue.reap(*kind, REAP_BATCH).await?;
                if expired.is_empty() {
                    break;
                }
                total += self.settle_expired(*kind, &expired).await?;
                if expired.len() < REAP_BATCH {
                    break;
                }
            }
        }
        Ok(total)
    }

    async fn settle_expired(&self, kind: JobKind, expired: &[(Uuid, Option<i64>)]) -> Result<usize> {
        let settlements: Vec<Settlement> = expired
            .iter()
            .filter_map(|(id, token)| {
                token.map(|token| Settlement {
                    id: *id,
                    token,
                    outcome: lease_expired(),
                    unrecorded: None,
                })
            })
            .collect();
        let settled = self.record(kind, &settlements).await?;
        if !settled.is_empty() {
            tracing::warn!(kind = %kind, jobs = settled.len(), "returned jobs whose lease expired");
        }
        // A lease whose job Postgres never marked running: its worker died or stalled before it
        // recorded the start (a batch records it with the outcome when it ends soon enough, or
        // never ran it). The lease is an attempt all the same, charged now, so a job that kills
        // its workers fails after its attempts instead of coming back for ever.
        let unsettled: Vec<Uuid> = expired
            .iter()
            .map(|(id, _)| *id)
            .filter(|id| !settled.contains(id))
            .collect();
        let mut charged = 0;
        if !unsettled.is_empty() {
            let expired_tokens: HashMap<Uuid, i64> =
                expired.iter().filter_map(|(id, token)| token.map(|t| (*id, t))).collect();
            let waiting = self.store.waiting_among(&unsettled).await?;
            let settlements: Vec<Settlement> = waiting
                .iter()
                .map(|job| Settlement {
                    id: job.id,
                    // A lease with no token left (Redis lost it) is charged under none.
                    token: expired_tokens.get(&job.id).copied().unwrap_or_default(),
                    outcome: lease_expired(),
                    unrecorded: Some(UnrecordedStart {
                        at: None,
                        attempts: job.attempts,
                        lease_token: job.lease_token,
                        worker_id: None,
                    }),
                })
                .collect();
            charged = self.record(kind, &settlements).await?.len();
            if charged > 0 {
                tracing::warn!(kind = %kind, jobs = charged, "charged an attempt to jobs whose lease expired before their start was recorded");
            }
        }
        Ok(settled.len() + charged)
    }

    /// Records expired leases' settlements in Postgres, then clears those leases in Redis and
    /// requeues the retries; returns the jobs Postgres took.
    async fn record(&self, kind: JobKind, settlements: &[Settlement]) -> Result<HashSet<Uuid>> {
        let settled = self.store.settle(settlements, self.retry).await?;
        let tokens: HashMap<Uuid, i64> = settlements.iter().map(|s| (s.id, s.token)).collect();
        let actions: Vec<_> = settled
            .iter()
            .map(|s| {
                let action = match (s.state, s.run_at) {
                    (JobState::Retrying, Some(at)) => SettleAction::At(at),
                    _ => SettleAction::Done,
                };
                (s.id, tokens[&s.id], action)
            })
            .collect();
        self.queue.settle(kind, &actions).await?;
        Ok(settled.iter().map(|s| s.id).collect())
    }

    /// Runs every `interval` until `stop` resolves.
    pub async fn run(self, interval: Duration, mut stop: tokio::sync::watch::Receiver<bool>) {
        loop {
            if let Err(e) = self.run_once().await {
                tracing::error!(error = %e, "lease reaper round failed");
            }
            tokio::select! {
                _ = tokio::time::sleep(interval) => {}
                _ = stop.changed() => return,
            }
        }
    }
}

fn lease_expired() -> Outcome {
    Outcome::Retry(Failure::new(
        "lease_expired",
        "the worker running this job stopped heartbeating (it died or stalled)",
    ))
}
