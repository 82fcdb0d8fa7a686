//! Keeps a batch's leases alive while it runs: heartbeats every interval, and raises a job's
//! stop signal when its cancel was requested or its lease was lost.

use crate::stop::{StopReason, StopSignal};
use std::time::Duration;
use tern_jobs::queue::LeaseStatus;
use tern_jobs::{JobKind, Queue};
use uuid::Uuid;

pub struct HeldJob {
    pub id: Uuid,
    pub token: i64,
    pub stop: StopSignal,
}

/// Heartbeats until dropped (run it as a task and abort it when the batch is done).
pub async fn keep(queue: Queue, kind: JobKind, jobs: Vec<HeldJob>, interval: Duration) {
    let leases: Vec<(Uuid, i64)> = jobs.iter().map(|j| (j.id, j.token)).collect();
    let mut tick = tokio::time::interval(interval);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    tick.tick().await; // the first tick is immediate; the pull just set the deadline
    loop {
        tick.tick().await;
        match queue.heartbeat(kind, &leases).await {
            Ok(statuses) => {
                for (job, status) in jobs.iter().zip(statuses) {
                    match status {
                        LeaseStatus::Held | LeaseStatus::Unconfirmed => {}
                        LeaseStatus::CancelRequested => job.stop.raise(StopReason::Cancel),
                        LeaseStatus::Lost => {
                            tracing::warn!(job_id = %job.id, "lease lost; stopping the job");
                            job.stop.raise(StopReason::LeaseLost)
                        }
                    }
                }
            }
            // Keep trying: the lease outlives several missed heartbeats.
            Err(e) => tracing::warn!(error = %e, "heartbeat failed"),
        }
    }
}
