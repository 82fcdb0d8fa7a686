//! The worker's loop: pull a batch, read its jobs, execute them, store outputs, settle them.
//! Postgres sees two statements per batch (a read, and a settle that records each job's start
//! with its outcome), three for a batch that runs past `record_start_after` (its starts are
//! recorded then); Redis two scripts (pull, settle) plus a heartbeat per second while it runs.

use crate::file_fetch::FileFetcher;
use crate::kinds::{self, Context, Execution};
use crate::lease_keeper::{self, HeldJob};
use crate::engine::cache::Family;
use crate::engine::Engine;
use crate::stop::{StopReason, StopSignal};
use chrono::Utc;
use std::sync::Arc;
use std::time::Duration;
use tern_jobs::queue::{Lease, SettleAction};
use std::collections::{HashMap, HashSet};
use tern_jobs::store::{Outcome, Settled, Settlement, UnrecordedStart};
use uuid::Uuid;
use tern_jobs::{Failure, Job, JobKind, JobOutput, JobState, ObjectStore, Queue, RetryPolicy, Store};
use tokio::sync::{watch, Notify, Semaphore};

/// First wait before recording a batch's outcomes again after Postgres failed; it doubles up
/// to 2 s.
const SETTLE_RETRY_FIRST: Duration = Duration::from_millis(100);
/// How long a batch's outcomes are retried before the batch is given up (its leases then
/// expire and the reaper returns its jobs). Within a default lease of 30 s, the heartbeats keep
/// the leases meanwhile.
const SETTLE_RETRY_FOR: Duration = Duration::from_secs(60);

/// Jobs per batch of echo jobs, and the fewest per batch of model jobs, unless configured.
pub const DEFAULT_BATCH_SIZE: usize = 64;
/// Most jobs per batch of model jobs unless configured: a GPU's budget can be thousands of
/// tokens, each a job at worst.
pub const MAX_MODEL_BATCH_JOBS: usize = 1024;

/// How the worker pulls and runs batches.
#[derive(Debug, Clone)]
pub struct RunnerSettings {
    pub worker_id: String,
    pub kinds: Vec<JobKind>,
    /// Most jobs per batch; `None`: [`DEFAULT_BATCH_SIZE`], but for model kinds on a GPU the
    /// cost budget (within [`DEFAULT_BATCH_SIZE`]..=[`MAX_MODEL_BATCH_JOBS`]).
    pub batch_size: Option<usize>,
    /// Cost budget per batch of kinds without a model (echo). Model kinds take theirs from the
    /// engine: windows, padded tokens, or prompt + max tokens.
    pub batch_budget: i64,
    pub heartbeat: Duration,
    /// Longest sleep between pulls while the queue is empty.
    pub idle_poll_max: Duration,
    pub retry: RetryPolicy,
    /// Longest audio accepted, seconds.
    pub max_audio_seconds: f64,
    /// How much of a short Whisper window's padding the encoder runs.
    pub whisper_padding: tern_models::whisper::Padding,
    /// What a Whisper window's features hold past its audio.
    pub whisper_feature_padding: tern_models::whisper::FeaturePadding,
    /// Beam size of transcriptions whose input names none.
    pub whisper_beam_size: usize,
    /// Largest output kept in Postgres instead of S3 (0: none).
    pub output_in_postgres_max_bytes: usize,
    /// How long a batch runs before its starts are recorded; a batch that ends sooner records
    /// them with its outcomes. Zero: before it runs. Default [`RECORD_START_AFTER_DEFAULT`].
    pub record_start_after: Duration,
}

/// How long a batch runs before its jobs are recorded `running`: long enough that a batch of
/// quick jobs (echo, most embeddings) records each job once, with its outcome, short enough
/// that a client polling a long job soon sees it running.
pub const RECORD_START_AFTER_DEFAULT: Duration = Duration::from_millis(250);

pub struct Runner {
    pub settings: RunnerSettings,
    pub store: Store,
    pub queue: Queue,
    pub objects: ObjectStore,
    pub files: FileFetcher,
    /// Bounds concurrent output uploads across the worker's loops.
    pub uploads: Semaphore,
    /// Raised when Redis hints that jobs are ready ([`crate::wakeup`]): idle loops pull at once.
    pub wake: Arc<Notify>,
    /// The model thread, when this worker runs model kinds.
    pub engine: Option<Arc<Engine>>,
    /// This worker's row in `workers`: drain flag and counts.
    pub registry: Arc<crate::registry::Registry>,
}

impl Runner {
    /// Pulls and runs batches until `shutdown` is set. When `abort` is set (the grace period
    /// ran out), the batch in hand is handed back to the queue.
    pub async fn run_loop(self: Arc<Self>, mut shutdown: watch::Receiver<bool>, abort: watch::Receiver<bool>) {
        let mut idle = Duration::from_millis(1);
        let mut next_kind = 0;
        while !*shutdown.borrow() {
            if self.registry.draining.load(std::sync::atomic::Ordering::Relaxed) {
                // Drained by an admin: the batch in hand finished, nothing more is pulled.
                tokio::select! {
                    _ = tokio::time::sleep(self.settings.idle_poll_max.max(Duration::from_millis(500))) => {}
                    _ = shutdown.changed() => {}
                }
                continue;
            }
            let kind = self.settings.kinds[next_kind % self.settings.kinds.len()];
            next_kind += 1;
            // Registered before the pull, so a hint that arrives during it is not missed.
            let woken = self.wake.notified();
            tokio::pin!(woken);
            woken.as_mut().enable();
            let budget = self.batch_budget(kind);
            match self.queue.pull(kind, self.max_jobs(kind, budget), budget).await {
                Ok(leases) if !leases.is_empty() => {
                    idle = Duration::from_millis(1);
                    if let Err(e) = self.run_batch(kind, leases, abort.clone()).await {
                        // The leases expire and the reaper returns the jobs; nothing is lost.
                        tracing::error!(error = %e, kind = %kind, "batch failed on a backing service");
                        tokio::time::sleep(Duration::from_secs(1)).await;
                    }
                }
                Ok(_) => {
                    if next_kind % self.settings.kinds.len() == 0 {
                        tokio::select! {
                            _ = tokio::time::sleep(idle) => idle = (idle * 2).min(self.settings.idle_poll_max),
                            _ = &mut woken => idle = Duration::from_millis(1),
                            _ = shutdown.changed() => {}
                        }
                    }
                }
                Err(e) => {
                    tracing::error!(error = %e, "pull failed");
                    tokio::select! {
                        _ = tokio::time::sleep(Duration::from_secs(1)) => {}
                        _ = shutdown.changed() => {}
                    }
                }
            }
        }
    }

    fn max_jobs(&self, kind: JobKind, budget: i64) -> usize {
        let on_device = self.engine.as_ref().is_some_and(|e| e.sizes_by_device_memory());
        match (self.settings.batch_size, Family::of_kind(kind)) {
            (Some(n), _) => n,
            (None, Some(_)) if on_device => (budget.max(0) as usize).clamp(DEFAULT_BATCH_SIZE, MAX_MODEL_BATCH_JOBS),
            _ => DEFAULT_BATCH_SIZE,
        }
    }

    fn batch_budget(&self, kind: JobKind) -> i64 {
        match (Family::of_kind(kind), &self.engine) {
            (Some(f), Some(engine)) => engine.batch_budget(f),
            _ => self.settings.batch_budget,
        }
    }

    async fn run_batch(&self, kind: JobKind, leases: Vec<Lease>, mut abort: watch::Receiver<bool>) -> tern_jobs::Result<()> {
        let pairs: Vec<(Uuid, i64)> = leases.iter().map(|l| (l.id, l.token)).collect();
        // Each job's start is recorded before it runs, or (the default) with its outcome when
        // the batch ends within `record_start_after`, else once that has passed. `unrecorded`
        // holds what such a settle needs, per job, until the start is recorded.
        let defer = !self.settings.record_start_after.is_zero();
        let (jobs, mut unrecorded, began) = if defer {
            let (began, mut jobs) = self.store.waiting_jobs(&pairs.iter().map(|p| p.0).collect::<Vec<_>>()).await?;
            let tokens: HashMap<Uuid, i64> = pairs.iter().copied().collect();
            let mut unrecorded = HashMap::with_capacity(jobs.len());
            for job in &mut jobs {
                unrecorded.insert(
                    job.id,
                    UnrecordedStart {
                        at: Some(began),
                        attempts: job.attempts,
                        lease_token: job.lease_token,
                        worker_id: Some(self.settings.worker_id.clone()),
                    },
                );
                // The job as it runs: this lease's attempt.
                job.lease_token = tokens.get(&job.id).copied();
                job.attempts += 1;
                job.state = JobState::Running;
                job.started_at = Some(began);
                job.worker_id = Some(self.settings.worker_id.clone());
            }
            (jobs, unrecorded, Some(began))
        } else {
            (self.store.start(&self.settings.worker_id, &pairs).await?, HashMap::new(), None)
        };
        // Leases Postgres refused: the job was canceled, finished or is held elsewhere.
        let started: HashSet<Uuid> = jobs.iter().map(|j| j.id).collect();
        let refused: Vec<_> = leases
            .iter()
            .filter(|l| !started.contains(&l.id))
            .map(|l| (l.id, l.token, SettleAction::Drop))
            .collect();
        if !refused.is_empty() {
            self.queue.settle(kind, &refused).await?;
        }
        if jobs.is_empty() {
            return Ok(());
        }
        let k = kind.as_str();
        self.registry.in_hand.fetch_add(jobs.len(), std::sync::atomic::Ordering::Relaxed);
        let _in_hand = InHand(&self.registry.in_hand, jobs.len());
        metrics::histogram!("tern_batch_jobs", "kind" => k).record(jobs.len() as f64);
        metrics::histogram!("tern_batch_cost", "kind" => k).record(jobs.iter().map(|j| f64::from(j.cost)).sum::<f64>());
        for j in &jobs {
            let waited = (j.started_at.unwrap_or_else(Utc::now) - j.created_at).num_milliseconds().max(0);
            metrics::histogram!("tern_job_wait_seconds", "kind" => k).record(waited as f64 / 1000.0);
        }
        let signals: Vec<StopSignal> = jobs.iter().map(|_| StopSignal::new()).collect();
        let held = jobs
            .iter()
            .zip(&signals)
            .map(|(j, s)| HeldJob { id: j.id, token: j.lease_token.unwrap_or_default(), stop: s.clone() })
            .collect();
        let keeper = tokio::spawn(lease_keeper::keep(self.queue.clone(), kind, held, self.settings.heartbeat));
        let release_on_abort = {
            let signals = signals.clone();
            async move {
                if abort.wait_for(|a| *a).await.is_ok() {
                    for s in &signals {
                        s.raise(StopReason::Release);
                    }
                }
                std::future::pending::<()>().await
            }
        };
        let work = futures::future::join_all(jobs.iter().zip(&signals).map(|(job, stop)| async move {
            let started = std::time::Instant::now();
            let outcome = self.attempt(job, stop).await;
            metrics::histogram!("tern_job_run_seconds", "kind" => job.kind.as_str()).record(started.elapsed().as_secs_f64());
            outcome
        }));
        tokio::pin!(work, release_on_abort);
        let record_start = tokio::time::sleep(self.settings.record_start_after);
        tokio::pin!(record_start);
        // Jobs whose recorded start Postgres refused (canceled or taken meanwhile): stopped, and
        // their outcomes dropped.
        let mut lost = HashSet::new();
        let mut record_due = defer;
        let outcomes = loop {
            tokio::select! {
                outcomes = &mut work => break outcomes,
                _ = &mut release_on_abort => unreachable!("never resolves"),
                _ = &mut record_start, if record_due => {
                    record_due = false;
                    let pairs: Vec<(Uuid, i64)> = jobs.iter().map(|j| (j.id, j.lease_token.unwrap_or_default())).collect();
                    match self.store.start_at(&self.settings.worker_id, &pairs, began).await {
                        Ok(recorded) => {
                            let recorded: HashSet<Uuid> = recorded.iter().map(|j| j.id).collect();
                            for (job, stop) in jobs.iter().zip(&signals) {
                                if !recorded.contains(&job.id) {
                                    stop.raise(StopReason::LeaseLost);
                                    lost.insert(job.id);
                                }
                            }
                            unrecorded.clear();
                        }
                        // Recorded with the outcomes instead, as for a short batch.
                        Err(e) => {
                            tracing::warn!(error = %e, jobs = pairs.len(), "could not record the batch's starts; they are recorded with its outcomes");
                        }
                    }
                }
            }
        };

        // A job whose lease the keeper found lost reports nothing, even if it finished before
        // it saw the signal: another worker may hold it. Postgres refuses a recorded start's
        // outcome by its token anyway; an unrecorded one's it would take, and after Redis lost
        // its data the job may be handed out again (a lease later), so it would run twice.
        let settlements: Vec<Settlement> = jobs
            .iter()
            .zip(outcomes)
            .zip(&signals)
            .filter(|((job, _), stop)| !lost.contains(&job.id) && stop.reason() != Some(StopReason::LeaseLost))
            .map(|(pair, _)| pair)
            .filter_map(|(job, outcome)| {
                outcome.map(|outcome| Settlement {
                    id: job.id,
                    token: job.lease_token.unwrap_or_default(),
                    outcome,
                    unrecorded: unrecorded.remove(&job.id),
                })
            })
            .collect();
        // The leases stay held (the keeper heartbeats on) while Postgres is retried: a blip at
        // settle must not throw the batch's results away and charge every job an attempt.
        let settled = self.settle_while_held(&settlements).await;
        keeper.abort();
        let settled: HashMap<Uuid, Settled> = settled?.into_iter().map(|s| (s.id, s)).collect();
        self.registry.done.fetch_add(settled.len() as u64, std::sync::atomic::Ordering::Relaxed);
        for s in settled.values() {
            metrics::counter!("tern_jobs_settled_total", "kind" => k, "state" => s.state.as_str()).increment(1);
        }
        let now = Utc::now();
        // Leases whose recorded start Postgres refused are released at once (a tenant's cap
        // counts them until then).
        let released = jobs
            .iter()
            .filter(|j| lost.contains(&j.id))
            .map(|j| (j.id, j.lease_token.unwrap_or_default(), SettleAction::Drop));
        let actions: Vec<_> = settlements
            .iter()
            .map(|s| {
                let action = match settled.get(&s.id) {
                    // Handed back before Postgres saw it start: it is waiting there as it was.
                    None if s.unrecorded.is_some() && matches!(s.outcome, Outcome::Released) => SettleAction::At(now),
                    None => SettleAction::Drop,
                    Some(x) => match x.state {
                        JobState::Retrying => SettleAction::At(x.run_at.unwrap_or(now)),
                        JobState::Queued => SettleAction::At(now),
                        _ => SettleAction::Done,
                    },
                };
                (s.id, s.token, action)
            })
            .chain(released)
            .collect();
        self.queue.settle(kind, &actions).await?;
        if settled.len() < settlements.len() {
            tracing::warn!(refused = settlements.len() - settled.len(), "outcomes refused: their leases had expired");
        }
        Ok(())
    }

    /// Records the outcomes in Postgres, retrying with backoff (from [`SETTLE_RETRY_FIRST`],
    /// doubling) for up to [`SETTLE_RETRY_FOR`] while Postgres is unreachable; outcomes whose
    /// lease expired meanwhile are refused by their tokens, as ever.
    async fn settle_while_held(&self, settlements: &[Settlement]) -> tern_jobs::Result<Vec<Settled>> {
        let (started, mut delay) = (std::time::Instant::now(), SETTLE_RETRY_FIRST);
        loop {
            match self.store.settle(settlements, self.settings.retry).await {
                Ok(settled) => return Ok(settled),
                Err(e) if started.elapsed() + delay < SETTLE_RETRY_FOR => {
                    tracing::warn!(error = %e, jobs = settlements.len(), retry_in_ms = delay.as_millis() as u64, "could not record the batch's outcomes; retrying while the leases are held");
                    tokio::time::sleep(delay).await;
                    delay = (delay * 2).min(Duration::from_secs(2));
                }
                Err(e) => return Err(e),
            }
        }
    }

    /// Runs one job to an outcome; `None` when its lease was lost (nothing may be reported).
    async fn attempt(&self, job: &Job, stop: &StopSignal) -> Option<Outcome> {
        let ctx = Context {
            worker_id: &self.settings.worker_id,
            files: &self.files,
            stop,
            queue: &self.queue,
            store: &self.store,
            engine: self.engine.as_deref(),
            max_audio_seconds: self.settings.max_audio_seconds,
            whisper_padding: self.settings.whisper_padding,
            whisper_feature_padding: self.settings.whisper_feature_padding,
            whisper_beam_size: self.settings.whisper_beam_size,
        };
        let timeout = Duration::from_millis(job.timeout_ms.max(1) as u64);
        let execution = match tokio::time::timeout(timeout, kinds::execute(job, &ctx)).await {
            Ok(execution) => execution,
            Err(_) => {
                return Some(Outcome::Retry(Failure::new(
                    "timeout",
                    format!("the attempt ran longer than its timeout of {} ms", job.timeout_ms),
                )))
            }
        };
        match execution {
            Execution::Output { body, content_type, extension, extras, inline } => {
                // Output holding a NUL (a generated text can) stays in S3 only: Postgres cannot
                // store NUL in JSON, and the whole batch's settle would fail on it.
                let inline = (inline && body.len() < tern_jobs::job::INLINE_OUTPUT_MAX_BYTES && !body.windows(6).any(|w| w == b"\\u0000"))
                    .then(|| serde_json::from_slice(&body).ok())
                    .flatten();
                // A small output stays in the job's row: an S3 PUT per job would cost more than
                // everything else the job does.
                if extras.is_empty() && body.len() <= self.settings.output_in_postgres_max_bytes {
                    let mut output = JobOutput::in_postgres(body, content_type);
                    output.inline = inline;
                    return Some(Outcome::Succeeded(output));
                }
                let _permit = self.uploads.acquire().await.expect("never closed");
                let stored = async {
                    let mut output = self.objects.put(&kinds::output_key(job, extension), body, content_type).await?;
                    output.inline = inline;
                    for extra in extras {
                        let file = self.objects.put(&kinds::output_key(job, &extra.format), extra.body, extra.content_type).await?;
                        output.formats.insert(extra.format, file);
                    }
                    tern_jobs::Result::Ok(output)
                };
                match stored.await {
                    Ok(output) => Some(Outcome::Succeeded(output)),
                    Err(e) => {
                        let e: tern_jobs::Error = e;
                        Some(Outcome::Retry(Failure::new("output_upload_failed", e.to_string())))
                    }
                }
            }
            Execution::Failed { failure, permanent: true } => Some(Outcome::Failed(failure)),
            Execution::Failed { failure, permanent: false } => Some(Outcome::Retry(failure)),
            Execution::Stopped => match stop.reason() {
                Some(StopReason::Cancel) => Some(Outcome::Canceled),
                Some(StopReason::Release) => Some(Outcome::Released),
                Some(StopReason::LeaseLost) | None => None,
            },
        }
    }
}

/// Takes a batch's jobs off the in-hand count however the batch ends.
struct InHand<'a>(&'a std::sync::atomic::AtomicUsize, usize);

impl Drop for InHand<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(self.1, std::sync::atomic::Ordering::Relaxed);
    }
}
