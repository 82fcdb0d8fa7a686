//! The worker's row in Postgres `workers`: who it is and what it holds (memory, models, batch in
//! hand, jobs done), written every couple of seconds. The same write reads back whether an admin
//! asked it to drain. A worker whose row stops changing shows as lost in the admin API.

use crate::engine::Engine;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;
use tern_jobs::{JobKind, Store};
use tokio::sync::watch;

pub struct Registry {
    pub store: Store,
    pub worker_id: String,
    pub host: String,
    pub kinds: Vec<JobKind>,
    pub device: String,
    /// Set from the row: pull nothing more.
    pub draining: AtomicBool,
    /// Jobs in the batches being run now.
    pub in_hand: AtomicUsize,
    /// Jobs this worker settled since it started.
    pub done: AtomicU64,
    /// What this worker does to run faster or leaner, for the admin's system view.
    pub optimisations: Vec<String>,
}

impl Registry {
    fn status(&self, engine: Option<&Engine>) -> serde_json::Value {
        let report = engine.map(|e| e.report.lock().expect("not poisoned").clone());
        serde_json::json!({
            "memory": {
                "budget_bytes": report.as_ref().map(|r| r.budget_bytes),
                "models_bytes": report.as_ref().map(|r| r.resident_bytes),
                "rss_bytes": crate::resources::process_status_bytes("VmRSS:"),
            },
            "models": report.as_ref().map(|r| &r.models),
            "cache": report.as_ref().map(|r| serde_json::json!({
                "hits": r.hits, "misses": r.misses, "evictions": r.evictions, "load_failures": r.load_failures,
            })),
            "batching": engine.map(Engine::batching),
            "optimisations": self.optimisations,
            "batch_in_hand": self.in_hand.load(Ordering::Relaxed),
            "jobs_done": self.done.load(Ordering::Relaxed),
        })
    }

    async fn report(&self, engine: Option<&Engine>) -> Result<bool, sqlx::Error> {
        let kinds: Vec<&str> = self.kinds.iter().map(|k| k.as_str()).collect();
        sqlx::query_scalar(
            "INSERT INTO workers (id, host, kinds, device, status) VALUES ($1, $2, $3, $4, $5)
             ON CONFLICT (id) DO UPDATE SET host = $2, kinds = $3, device = $4, status = $5,
                 last_heartbeat = now(), stopped_at = NULL
             RETURNING draining",
        )
        .bind(&self.worker_id)
        .bind(&self.host)
        .bind(&kinds)
        .bind(&self.device)
        .bind(self.status(engine))
        .fetch_one(self.store.pool())
        .await
    }

    /// Reports every `interval` until `shutdown`, then marks the row stopped. A failed write is
    /// logged and retried at the next tick: the registry never stops the worker.
    pub async fn run(self: Arc<Self>, engine: Option<Arc<Engine>>, interval: Duration, mut shutdown: watch::Receiver<bool>) {
        loop {
            match self.report(engine.as_deref()).await {
                Ok(draining) => {
                    if draining != self.draining.swap(draining, Ordering::Relaxed) {
                        tracing::info!(draining, "drain state changed by an admin");
                    }
                }
                Err(e) => tracing::warn!(error = %e, "could not report to the workers table"),
            }
            tokio::select! {
                _ = tokio::time::sleep(interval) => {}
                _ = shutdown.changed() => break,
            }
        }
        let _ = sqlx::query("UPDATE workers SET stopped_at = now(), last_heartbeat = now(), status = $2 WHERE id = $1")
            .bind(&self.worker_id)
            .bind(self.status(engine.as_deref()))
            .execute(self.store.pool())
            .await;
    }
}
