//! Returns jobs whose lease expired (their worker died or stalled) to the queue.
//!
//! Each expired lease counts as a used attempt: the job becomes `retrying` with backoff, or
//! `failed` (`lease_expired`) after its last attempt. A job that merely ran long but whose worker
//! is alive keeps its lease through heartbeats, so it is never reaped; a worker that stalls past
//! its lease may see its job run twice, but only the newest lease can record the outcome. A job
//! whose lease expired before Postgres marked it running is put back as it was, uncharged.

use crate::queue::{Enqueue, SettleAction};
use crate::store::{Outcome, Settlement};
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
                    outcome: Outcome::Retry(Failure::new(
                        "lease_expired",
                        "the worker running this job stopped heartbeating (it died or stalled)",
                    )),
                })
            })
            .collect();
        let settled = self.store.settle(&settlements, self.retry).await?;
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
        if !settled.is_empty() {
            tracing::warn!(kind = %kind, jobs = settled.len(), "returned jobs whose lease expired");
        }
        // A lease whose job Postgres never marked running (its worker died between pull and
        // start, or the start failed) settles nothing above, and the job is now in no Redis
        // set: it goes back at once rather than waiting for the reconciler's sweep.
        let settled_ids: HashSet<Uuid> = settled.iter().map(|s| s.id).collect();
        let unsettled: Vec<Uuid> = expired
            .iter()
            .map(|(id, _)| *id)
            .filter(|id| !settled_ids.contains(id))
            .collect();
        let mut restored = 0;
        if !unsettled.is_empty() {
            let waiting: Vec<_> = self
                .store
                .waiting_among(&unsettled)
                .await?
                .into_iter()
                .map(|job| (Enqueue::from(&job), None))
                .collect();
            if !waiting.is_empty() {
                restored = self.queue.restore(kind, &waiting).await?;
                tracing::warn!(kind = %kind, jobs = restored, "put back jobs whose lease expired before they started");
            }
        }
        Ok(settled.len() + restored as usize)
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
