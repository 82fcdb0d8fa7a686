//! Keeps Redis in step with Postgres, the source of truth.
//!
//! Every round walks the unfinished jobs in Postgres and restores any that Redis does not hold:
//! after Redis lost its data (restart without persistence, `FLUSHALL`, failover) or after a
//! process died between a Postgres commit and the matching Redis call. Waiting jobs go back to
//! their ready or delayed sets (after a data loss, due a lease from now: a live worker may run
//! one with its start not yet recorded, and it records that start, settles the job or is told
//! its lease is lost within a lease); running jobs get their lease back, so a live worker
//! carries on and a dead one's job is reaped. Each tenant's running count is counted again
//! from the leases. Jobs Redis already holds are left alone, so nothing is
//! queued twice, and Postgres refuses any second start of a job, so nothing runs twice.
//!
//! Marker keys tell a data loss apart: `{prefix}:epoch`, and one `restored` key in each queue
//! shard's slot (so a cluster node that loses its data loses its shards' markers with it).
//! While they are all present, jobs whose state changed within the last `grace` are skipped
//! (the API may be about to enqueue them); when one is missing, every unfinished job is checked
//! at once and the markers are set afterwards.
//! A routine round checks at most [`ROUTINE_PAGES_PER_ROUND`] pages and the next round goes
//! on from there, so its cost does not grow with the backlog; a job Redis lost without a data
//! loss (a process died between its commit and its Redis call) is found within a pass.
//! With several API replicas, a Redis lock lets one of them sweep per round.
//!
//! Each round also sets the Redis pause flags to the paused kinds Postgres records, the cancel
//! flags to the running jobs whose cancel Postgres records, and the tenants' weights and caps
//! to the `tenants` table.

use crate::queue::Enqueue;
use crate::{JobKind, JobState, Queue, Result, Store};
use chrono::Utc;
use std::collections::HashMap;
use std::time::Duration;
use uuid::Uuid;

/// How often the reconciler sweeps. Default 5 s.
pub const RECONCILE_INTERVAL_DEFAULT: Duration = Duration::from_secs(5);
/// How long a job's state must have stood before a routine sweep restores it. Default 30 s.
pub const RECONCILE_GRACE_DEFAULT: Duration = Duration::from_secs(30);
const PAGE: i64 = 1000;
/// Most pages a routine round walks (5,000 jobs): the walk goes on from there next round, so a
/// backlog of a million jobs costs each round the same as one of a thousand. A round after a
/// data loss walks everything at once.
pub const ROUTINE_PAGES_PER_ROUND: usize = 5;

#[derive(Clone)]
pub struct Reconciler {
    pub store: Store,
    pub queue: Queue,
    pub grace: Duration,
    /// Identifies this process in the sweep lock.
    pub owner: String,
    /// Where the routine walk goes on (the last job id it checked); `None`: from the start.
    pub cursor: std::sync::Arc<std::sync::Mutex<Option<Uuid>>>,
}

impl Reconciler {
    /// One sweep; returns how many jobs were restored.
    pub async fn run_once(&self) -> Result<u64> {
        for (kind, paused) in self.store.restore_pause_flags(&self.queue).await? {
            tracing::info!(%kind, paused, "pause flag restored from Postgres");
        }
        self.restore_cancel_flags().await?;
        self.store.restore_tenant_shares(&self.queue).await?;
        let epoch = self.queue.epoch().await?;
        let lost_shards = self.queue.lost_shards().await?;
        let data_lost = epoch.is_none() || !lost_shards.is_empty();
        if !lost_shards.is_empty() && epoch.is_some() {
            let shards: Vec<String> = lost_shards.iter().map(|(kind, shard)| format!("{kind}:{shard}")).collect();
            tracing::warn!(shards = %shards.join(","), "queue shards lost their data; restoring them from Postgres");
        }
        let settled_before =
            (!data_lost).then(|| Utc::now() - chrono::Duration::from_std(self.grace).unwrap_or_default());
        // After a data loss every unfinished job is checked now; a routine round goes on where
        // the last one stopped, a bounded number of pages.
        let (mut after, max_pages) = match data_lost {
            true => (None, usize::MAX),
            false => (*self.cursor.lock().expect("never poisoned"), ROUTINE_PAGES_PER_ROUND),
        };
        let mut restored = 0;
        let mut pages = 0;
        loop {
            if pages == max_pages {
                break;
            }
            pages += 1;
            let page = self.store.active_page(after, settled_before, PAGE).await?;
            let Some(last) = page.last() else {
                after = None;
                break;
            };
            after = Some(last.id);
            let mut by_kind: HashMap<JobKind, Vec<(Enqueue, Option<i64>)>> = HashMap::new();
            for job in &page {
                let token = if job.state == JobState::Running { job.lease_token } else { None };
                by_kind.entry(job.kind).or_default().push((
                    Enqueue::from(job),
                    token,
                ));
            }
            for (kind, jobs) in by_kind {
                restored += self.queue.restore(kind, &jobs, data_lost).await?;
            }
            if (page.len() as i64) < PAGE {
                after = None;
                break;
            }
        }
        *self.cursor.lock().expect("never poisoned") = after;
        if epoch.is_none() {
            self.queue.set_epoch(&Uuid::now_v7().to_string()).await?;
        }
        self.queue.mark_restored().await?;
        if restored > 0 {
            tracing::warn!(restored, redis_data_lost = data_lost, "restored jobs Redis did not hold");
        }
        Ok(restored)
    }

    /// Sets each kind's cancel flags (what workers read at heartbeats) to the running jobs
    /// Postgres holds as cancel-requested: a flag Redis lost is set again, and a flag left for
    /// a job that has ended is dropped.
    async fn restore_cancel_flags(&self) -> Result<()> {
        // Redis first: a flag set there after the Postgres read below belongs to a cancel that
        // committed in Postgres first, so it is in that read and is kept.
        let mut flagged = HashMap::new();
        for &kind in JobKind::ALL {
            flagged.insert(kind, self.queue.canceled(kind).await?);
        }
        let mut wanted: HashMap<JobKind, Vec<Uuid>> = HashMap::new();
        for (id, kind) in self.store.cancel_requested().await? {
            wanted.entry(kind).or_default().push(id);
        }
        for &kind in JobKind::ALL {
            let have = &flagged[&kind];
            let want = wanted.get(&kind).map(Vec::as_slice).unwrap_or_default();
            let add: Vec<Uuid> = want
                .iter()
                .filter(|id| !have.contains(id))
                .copied()
                .collect();
            let remove: Vec<Uuid> = have
                .iter()
                .filter(|id| !want.contains(id))
                .copied()
                .collect();
            if !add.is_empty() {
                tracing::warn!(%kind, jobs = add.len(), "cancel flags restored from Postgres");
            }
            self.queue.set_canceled(kind, &add, &remove).await?;
        }
        Ok(())
    }

    /// Sweeps every `interval` (when this process holds the sweep lock) until `stop` changes.
    pub async fn run(self, interval: Duration, mut stop: tokio::sync::watch::Receiver<bool>) {
        loop {
            match self.queue.try_lock("reconciler", &self.owner, interval * 2).await {
                Ok(true) => {
                    if let Err(e) = self.run_once().await {
                        tracing::error!(error = %e, "reconciler sweep failed");
                    }
                }
                Ok(false) => {}
                Err(e) => tracing::error!(error = %e, "reconciler could not take its lock"),
            }
            tokio::select! {
                _ = tokio::time::sleep(interval) => {}
                _ = stop.changed() => return,
            }
        }
    }
}
