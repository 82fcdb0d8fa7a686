//! Hot model swaps. Every couple of seconds the worker asks Postgres which version each of its
//! kinds should run (the candidate while one rolls out, else the active one, else the model it
//! was started with). A model not in memory is loaded, warmed up and health-checked on a
//! blocking thread while the model thread keeps running batches on the old one; it is then
//! switched in between two batches. The replaced model stays resident (least recently used,
//! first out when memory is short), so a rollback to it is instant.

use crate::engine::cache::Family;
use crate::engine::{health, Engine, ModelNames};
use std::collections::{HashMap, HashSet};
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};
use tern_jobs::model_versions::{SwapState, Target};
use tern_jobs::{JobKind, Store};
use tokio::sync::watch;
use uuid::Uuid;

pub struct Swapper {
    pub store: Store,
    pub engine: Arc<Engine>,
    pub worker_id: String,
    pub kinds: Vec<JobKind>,
    /// The models the worker was started with: what a kind runs with no active version.
    pub defaults: ModelNames,
    /// The version each kind runs now (`None`: its default).
    pub current: HashMap<JobKind, Option<Uuid>>,
    /// Versions that failed here: not tried again.
    pub failed: HashSet<Uuid>,
}

/// The active version of each kind at start, so a worker starting after a swap runs the
/// swapped-in model from its first job.
pub async fn active_at_start(store: &Store, kinds: &[JobKind]) -> HashMap<JobKind, Target> {
    let mut active = HashMap::new();
    for kind in swapped_kinds(kinds) {
        match store.active_model(kind).await {
            Ok(Some(t)) => {
                active.insert(kind, t);
            }
            Ok(None) => {}
            Err(e) => tracing::warn!(error = %e, %kind, "could not read the active model version; using the configured model"),
        }
    }
    active
}

/// The kinds whose model versions a worker serving `kinds` follows: those that run a model,
/// each once under the kind that owns its versions (`audio_embed` follows `transcribe`).
pub fn swapped_kinds(kinds: &[JobKind]) -> Vec<JobKind> {
    let mut out: Vec<JobKind> = kinds.iter().map(|k| k.model_kind()).filter(|k| Family::of_kind(*k).is_some()).collect();
    out.sort();
    out.dedup();
    out
}

impl Swapper {
    /// Checks every `interval` until `shutdown`. Failures are logged and retried: a swap never
    /// stops the worker.
    pub async fn run(mut self, interval: Duration, mut shutdown: watch::Receiver<bool>) {
        for (kind, version) in self.current.clone() {
            if let Some(v) = version {
                self.report(kind, v, SwapState::Active, None, None, None).await;
            }
        }
        loop {
            for kind in self.kinds.clone() {
                if let Err(e) = self.step(kind).await {
                    tracing::warn!(error = %e, %kind, "model version check failed");
                }
            }
            tokio::select! {
                _ = tokio::time::sleep(interval) => {}
                _ = shutdown.changed() => return,
            }
        }
    }

    async fn report(
        &self,
        kind: JobKind,
        version: Uuid,
        state: SwapState,
        error: Option<&str>,
        batches: Option<u64>,
        load_ms: Option<u64>,
    ) {
        if let Err(e) = self.store.report_swap(&self.worker_id, version, state, error, batches, load_ms).await {
            tracing::warn!(error = %e, %kind, %version, state = state.as_str(), "could not report a swap state");
        }
    }

    async fn step(&mut self, kind: JobKind) -> tern_jobs::Result<()> {
        let Some(family) = Family::of_kind(kind) else { return Ok(()) };
        let target = self.store.model_target(kind).await?;
        let (version, name, candidate) = match target {
            Some(t) => (Some(t.version), t.model, t.candidate),
            None => (None, self.defaults.of(family).to_string(), false),
        };
        let current = self.current.get(&kind).copied().flatten();
        if version == current && self.engine.model_of(family) == name {
            return Ok(());
        }
        if version.is_some_and(|v| self.failed.contains(&v)) {
            return Ok(());
        }
        let resident = self.engine.report.lock().expect("not poisoned").models.iter().any(|m| m.name == name);
        let replaced = if resident || self.engine.model_of(family) == name {
            // In memory already (a rollback, or the same model under a new version): at once.
            let replaced = self.engine.switch(family, name.clone());
            tracing::info!(%kind, model = %name, %replaced, "switched to a resident model");
            replaced
        } else {
            match self.load_in_background(kind, family, version, &name).await {
                Some(replaced) => replaced,
                None => {
                    if let Some(v) = version {
                        self.failed.insert(v);
                    }
                    return Ok(());
                }
            }
        };
        if let Some(v) = version {
            self.report(kind, v, SwapState::Active, None, None, None).await;
            if candidate {
                self.store.promote_model_version(v).await?;
            }
        }
        if let Some(old) = current.filter(|old| Some(*old) != version) {
            self.report(kind, old, SwapState::Deprecated, None, None, None).await;
        }
        tracing::info!(%kind, model = %name, %replaced, version = ?version, "model version in use");
        self.current.insert(kind, version);
        Ok(())
    }

    /// Loads, warms up and health-checks `name` while batches go on, then switches it in.
    /// Returns the model it replaced; `None` when it failed (reported, and a candidate marked
    /// failed so other workers skip it).
    async fn load_in_background(&self, kind: JobKind, family: Family, version: Option<Uuid>, name: &str) -> Option<String> {
        let started = Instant::now();
        if let Some(v) = version {
            self.report(kind, v, SwapState::Loading, None, None, None).await;
        }
        tracing::info!(%kind, model = %name, "loading a model version in the background");
        let before = self.engine.batches_during_load.load(Ordering::Relaxed);
        self.engine.swap_loading.store(true, Ordering::Relaxed);
        let batches = || self.engine.batches_during_load.load(Ordering::Relaxed) - before;
        let source = self.engine.source().clone();
        let budget = self.engine.budget_bytes();
        let owned = name.to_string();
        let loaded = tokio::task::spawn_blocking(move || {
            let (dir, _) = source.locate(family, &owned, budget)?;
            source.load(family, &owned, &dir)
        })
        .await;
        let outcome = match loaded {
            Ok(Ok(mut loaded)) => {
                if let Some(v) = version {
                    self.report(kind, v, SwapState::HealthCheck, None, Some(batches()), Some(loaded.load_ms)).await;
                }
                tokio::task::spawn_blocking(move || health::check(&mut loaded.model).map(|()| loaded))
                    .await
                    .map_err(|e| format!("the health check panicked: {e}"))
                    .and_then(|r| r.map_err(|e| format!("health check failed: {e:#}")))
            }
            Ok(Err(e)) => Err(e.to_string()),
            Err(e) => Err(format!("loading panicked: {e}")),
        };
        self.engine.swap_loading.store(false, Ordering::Relaxed);
        let batches = batches();
        let load_ms = started.elapsed().as_millis() as u64;
        match outcome {
            Ok(loaded) => {
                if let Some(v) = version {
                    self.report(kind, v, SwapState::Ready, None, Some(batches), Some(load_ms)).await;
                }
                metrics::counter!("tern_model_swaps_total", "kind" => kind.as_str(), "outcome" => "switched").increment(1);
                match self.engine.install(family, name.to_string(), loaded).await {
                    Ok(replaced) => {
                        tracing::info!(%kind, model = %name, load_ms, batches_during_load = batches, "model loaded beside the running one");
                        Some(replaced)
                    }
                    Err(e) => {
                        tracing::error!(error = %e, "could not hand the model to the model thread");
                        None
                    }
                }
            }
            Err(error) => {
                tracing::error!(%kind, model = %name, %error, "model version refused; the current one stays");
                metrics::counter!("tern_model_swaps_total", "kind" => kind.as_str(), "outcome" => "failed").increment(1);
                if let Some(v) = version {
                    self.report(kind, v, SwapState::Failed, Some(&error), Some(batches), Some(load_ms)).await;
                    if let Err(e) = self.store.fail_model_version(v, &error).await {
                        tracing::warn!(error = %e, "could not mark the version failed");
                    }
                }
                None
            }
        }
    }
}
