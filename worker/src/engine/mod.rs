//! Runs the models on one dedicated OS thread, never on the async runtime's workers. Requests
//! from the jobs in hand queue on a channel; the thread gathers the ones of one family
//! (transcriptions with transcriptions, embeddings with embeddings) and runs each group as one
//! batch on a model from the [`cache::ModelCache`], through the family's plug-in
//! ([`tern_models::family::FamilyModel::run`]): this thread knows no family's requests, only
//! their budgets, the memory free, and which requests may join a running batch.

pub mod cache;
pub mod health;
mod hub;
pub mod memory;

use cache::{CacheReport, Family, Loaded, ModelCache, Source};
use memory::MemoryProbe;
use std::collections::{HashMap, VecDeque};
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicI64, AtomicU64, Ordering};
use std::sync::{mpsc, Arc, Mutex};
use std::time::{Duration, Instant};
use tern_models::family::{BatchRun, Work, WorkError};
use tokio::sync::{mpsc as tokio_mpsc, oneshot};

/// Which model (a folder under the models directory, or a hub id) serves each family.
#[derive(Debug, Clone)]
pub struct ModelNames(HashMap<Family, String>);

impl ModelNames {
    /// Each family's default model (the default of its model setting).
    pub fn defaults() -> ModelNames {
        ModelNames(Family::all().map(|f| (f, f.plugin().model_setting().default.unwrap_or_default().to_string())).collect())
    }

    /// With the family called `family` served by `name`.
    ///
    /// # Panics
    /// Where no family is called `family` (a setting the worker itself names).
    #[cfg(test)]
    pub fn with(mut self, family: &str, name: &str) -> ModelNames {
        let family = Family::named(family).unwrap_or_else(|| panic!("no model family is called {family:?}"));
        self.0.insert(family, name.to_string());
        self
    }

    pub fn of(&self, family: Family) -> &str {
        self.0.get(&family).map_or("", String::as_str)
    }

    /// Sets `family`'s model; returns the one it replaced.
    pub fn replace(&mut self, family: Family, name: String) -> String {
        self.0.insert(family, name).unwrap_or_default()
    }
}

/// The model serving `family` now.
fn current(names: &Mutex<ModelNames>, family: Family) -> String {
    names.lock().expect("not poisoned").of(family).to_string()
}

/// A result and the model that produced it.
#[derive(Debug)]
pub struct Served<T> {
    pub value: T,
    pub model: String,
}

/// Limits of the batches the engine runs.
#[derive(Debug, Clone)]
pub struct BatchLimits {
    /// Each family's batch budget where its setting fixes one ([`tern_models::family::Family::budget_setting`]),
    /// in its unit; a family absent here follows its [`tern_models::family::BudgetRule`]
    /// (calibrated from the memory free, within its ceilings, halved when a batch runs out of
    /// memory).
    pub configured: HashMap<Family, usize>,
    /// Hypotheses a window decodes at the worker's default beam size
    /// (`TERN_WHISPER_BEAM_SIZE`, default 5): the Whisper warmup decodes that many rows a
    /// window, so the memory measured per window, and the budget from it, holds a beam search.
    pub whisper_beams: usize,
}

impl BatchLimits {
    /// Each family's budget setting's default (the language model's 4,096 tokens; the others
    /// calibrated), `whisper_beams` hypotheses a Whisper window.
    #[cfg(test)]
    pub fn defaults(whisper_beams: usize) -> BatchLimits {
        let configured = Family::all().filter_map(|f| Some((f, f.plugin().budget_setting().default?.parse().ok()?))).collect();
        BatchLimits { configured, whisper_beams }
    }

    /// With the family called `family` held to `budget` units a batch.
    ///
    /// # Panics
    /// Where no family is called `family`.
    #[cfg(test)]
    pub fn with(mut self, family: &str, budget: usize) -> BatchLimits {
        let family = Family::named(family).unwrap_or_else(|| panic!("no model family is called {family:?}"));
        self.configured.insert(family, budget.max(1));
        self
    }

    /// `family`'s configured budget; `None`: calibrated.
    fn configured(&self, family: Family) -> Option<usize> {
        self.configured.get(&family).copied()
    }
}

/// Why a request could not run.
#[derive(Debug, Clone, thiserror::Error)]
pub enum EngineError {
    /// The model could not be loaded (missing files, bad format, failed warmup, over the memory
    /// budget): code `model_unavailable`.
    #[error("model {model} could not be loaded: {reason}")]
    ModelUnavailable { model: String, reason: String },
    /// The model refused the input (say, `context_length_exceeded`: a prompt plus max_tokens
    /// longer than the context); retrying cannot help.
    #[error("{message}")]
    Rejected { code: &'static str, message: String },
    /// Inference failed: code `inference_failed`.
    #[error("inference failed: {0}")]
    Inference(String),
}

impl EngineError {
    pub fn code(&self) -> &'static str {
        match self {
            EngineError::ModelUnavailable { .. } => "model_unavailable",
            EngineError::Rejected { code, .. } => code,
            EngineError::Inference(_) => "inference_failed",
        }
    }

    /// Whether retrying the job can help.
    pub fn is_permanent(&self) -> bool {
        matches!(self, EngineError::Rejected { .. })
    }
}

/// Where a request's answer goes.
pub type Reply<T> = oneshot::Sender<Result<Served<T>, EngineError>>;

impl EngineError {
    /// A family's error for a request `model` was to serve.
    fn of_work(e: WorkError, model: &str) -> EngineError {
        match e {
            WorkError::Rejected { code, message } => EngineError::Rejected { code, message },
            WorkError::Failed { code: "model_unavailable", message } => EngineError::ModelUnavailable { model: model.to_string(), reason: message },
            WorkError::Failed { message, .. } => EngineError::Inference(message),
        }
    }

    /// The error a family answers its requests with.
    fn to_work(&self) -> WorkError {
        match self {
            EngineError::ModelUnavailable { reason, .. } => WorkError::Failed { code: "model_unavailable", message: reason.clone() },
            EngineError::Rejected { code, message } => WorkError::Rejected { code, message: message.clone() },
            EngineError::Inference(message) => WorkError::inference(message.clone()),
        }
    }
}

/// A reply closure for a family's request: answers `reply` with the result and the model.
pub fn answer_with<T: Send + 'static>(reply: Reply<T>) -> Box<dyn FnOnce(Result<T, WorkError>, &str) + Send> {
    Box::new(move |result, model| {
        let _ = reply.send(result.map(|value| Served { value, model: model.to_string() }).map_err(|e| EngineError::of_work(e, model)));
    })
}

enum Request {
    /// A family's request (its own type, with its reply).
    Work { family: Family, work: Work },
    /// Switch `family` to a model loaded (and health-checked) in the background. Handled as
    /// soon as the thread is between batches.
    Install {
        family: Family,
        name: String,
        loaded: Box<Loaded>,
        /// The name it replaced.
        reply: oneshot::Sender<String>,
    },
}

impl Request {
    fn family(&self) -> Family {
        match self {
            Request::Work { family, .. } | Request::Install { family, .. } => *family,
        }
    }
}

/// How long the thread waits for more requests of the same family after one arrives (reset by
/// each arrival), so the jobs of a pulled batch, which fetch and decode their inputs in
/// parallel, land in one model batch.
const LINGER: Duration = Duration::from_millis(15);
/// Longest a group is held open for late arrivals.
const LINGER_MAX: Duration = Duration::from_millis(150);
/// Windows of the Whisper warmup: the probe batch whose memory is measured, and the largest
/// batch a CPU worker runs.
const WARMUP_WINDOWS: usize = 16;

/// What the model thread did, for metrics and the admin's system view.
#[derive(Debug, Default)]
pub struct EngineStats {
    /// Nanoseconds spent in model calls (encoding, decoding, embedding, generating): over the
    /// wall clock, how busy the device was.
    pub busy_ns: AtomicU64,
    /// Batches that ran out of memory and were split.
    pub oom_splits: AtomicU64,
}

/// How the engine sizes batches, as the worker reports it.
#[derive(Debug, Clone, serde::Serialize)]
pub struct BatchingReport {
    /// What measures memory: `cuda` (the driver's free memory), `host` (peak resident set),
    /// `fixed` (tests).
    pub probe: &'static str,
    /// Memory batches may still take now, where the probe can tell (a GPU).
    pub free_bytes: Option<u64>,
    /// The cost pulled per batch: windows, padded tokens, prompt + max tokens, UNet rows.
    pub budgets: serde_json::Value,
    /// Batches split because they ran out of memory.
    pub oom_splits: u64,
    /// Seconds the model thread spent in model calls.
    pub busy_seconds: f64,
}

/// One family's batch size: configured, or published after each batch from the memory free.
struct Budget {
    /// Set by the worker's settings: never calibrated.
    configured: Option<usize>,
    /// What pulls take now (shared with the [`Engine`] handle).
    published: Arc<AtomicI64>,
    /// Half of the last batch that ran out of memory (unbounded until one does): calibrated
    /// and configured sizes stay under it.
    cap: usize,
    /// Largest calibrated budget on this device; `None`: not calibrated.
    ceiling: Option<usize>,
}

/// Handle to the model thread. Cheap to share behind an `Arc`.
pub struct Engine {
    requests: mpsc::Sender<Request>,
    /// The models serving each family now; swaps change them.
    names: Arc<Mutex<ModelNames>>,
    source: Source,
    /// Set while a swap loads a model in the background.
    pub swap_loading: Arc<AtomicBool>,
    /// Batches run while `swap_loading` was set: batches that did not wait for the load.
    pub batches_during_load: Arc<AtomicU64>,
    /// The model cache's state, refreshed by the thread.
    pub report: Arc<Mutex<CacheReport>>,
    /// Each family's published batch budget.
    budgets: HashMap<Family, Arc<AtomicI64>>,
    probe: MemoryProbe,
    pub stats: Arc<EngineStats>,
}

impl Engine {
    /// Starts the thread; models load on first use. `budget`: bytes the resident models and
    /// their batches may use; `probe`: what measures the memory batches take and have left
    /// ([`MemoryProbe::for_device`] but in tests). Call from within the tokio runtime (hub
    /// downloads run on it).
    pub fn start(
        models_dir: PathBuf,
        device: candle_core::Device,
        precision: tern_models::precision::Precision,
        names: ModelNames,
        budget: u64,
        limits: BatchLimits,
        probe: MemoryProbe,
    ) -> Engine {
        let (tx, rx) = mpsc::channel::<Request>();
        let report = Arc::new(Mutex::new(CacheReport::default()));
        let names = Arc::new(Mutex::new(names));
        let warmup_windows = Family::named("whisper").and_then(|f| limits.configured(f)).unwrap_or(WARMUP_WINDOWS).min(WARMUP_WINDOWS);
        let stats = Arc::new(EngineStats::default());
        let budgets: HashMap<Family, Budget> = Family::all()
            .map(|family| {
                let rule = family.plugin().budget();
                let configured = limits.configured(family);
                let ceiling = rule.calibrated.then_some(if probe.is_device() { rule.device_ceiling } else { rule.cpu_ceiling });
                let published = Arc::new(AtomicI64::new(configured.unwrap_or(rule.initial) as i64));
                (family, Budget { configured, published, cap: usize::MAX, ceiling })
            })
            .collect();
        let cache = ModelCache::new(
            models_dir,
            tokio::runtime::Handle::current(),
            device,
            precision,
            budget,
            warmup_windows,
            limits.whisper_beams,
            probe.clone(),
            report.clone(),
        );
        let source = cache.source();
        let swap_loading = Arc::new(AtomicBool::new(false));
        let batches_during_load = Arc::new(AtomicU64::new(0));
        let published = budgets.iter().map(|(f, b)| (*f, b.published.clone())).collect();
        let thread = Thread {
            cache,
            names: names.clone(),
            swap_loading: swap_loading.clone(),
            batches_during_load: batches_during_load.clone(),
            budgets,
            backlog: VecDeque::new(),
            probe: probe.clone(),
            stats: stats.clone(),
        };
        std::thread::Builder::new()
            .name("model-engine".into())
            .spawn(move || thread.serve(rx))
            .expect("spawn the model thread");
        Engine { requests: tx, names, source, swap_loading, batches_during_load, report, budgets: published, probe, stats }
    }

    /// Whether batches are sized by a GPU's memory (up to each family's device ceiling) rather
    /// than the CPU's ceilings.
    pub fn sizes_by_device_memory(&self) -> bool {
        self.probe.is_device()
    }

    /// How batches are sized now.
    pub fn batching(&self) -> BatchingReport {
        BatchingReport {
            probe: self.probe.name(),
            free_bytes: self.probe.free_bytes(),
            // `transcribe_windows`, `embed_tokens`, `generate_tokens`, `image_rows`.
            budgets: Family::all()
                .map(|f| (format!("{}_{}", f.plugin().kinds()[0], f.plugin().unit()), serde_json::json!(self.batch_budget(f))))
                .collect::<serde_json::Map<_, _>>()
                .into(),
            oom_splits: self.stats.oom_splits.load(Ordering::Relaxed),
            busy_seconds: self.stats.busy_ns.load(Ordering::Relaxed) as f64 / 1e9,
        }
    }

    /// The model serving `family` now.
    pub fn model_of(&self, family: Family) -> String {
        current(&self.names, family)
    }

    /// The memory budget of the resident models, bytes.
    pub fn budget_bytes(&self) -> u64 {
        self.report.lock().expect("not poisoned").budget_bytes
    }

    /// Where the models come from, for loading one in the background.
    pub fn source(&self) -> &Source {
        &self.source
    }

    /// Switches `family` to `loaded` (called `name`) between batches; returns the name it
    /// replaced, which stays resident (least recently used first out) for a rollback.
    pub async fn install(&self, family: Family, name: String, loaded: Loaded) -> Result<String, EngineError> {
        let (reply, answer) = oneshot::channel();
        self.send(Request::Install { family, name, loaded: Box::new(loaded), reply })?;
        answer.await.map_err(|_| EngineError::Inference("the model thread stopped".into()))
    }

    /// Switches `family` to the resident or loadable model `name` without a background load
    /// (a rollback to a model still in memory); returns the name it replaced.
    pub fn switch(&self, family: Family, name: String) -> String {
        self.names.lock().expect("not poisoned").replace(family, name)
    }

    /// The cost budget for one pulled batch of `family`'s jobs, in its unit: windows for
    /// transcription, padded tokens for embeddings, prompt + max tokens for generation, UNet
    /// rows for images.
    pub fn batch_budget(&self, family: Family) -> i64 {
        self.budgets.get(&family).map_or(1, |b| b.load(Ordering::Relaxed)).max(1)
    }

    fn send(&self, r: Request) -> Result<(), EngineError> {
        self.requests.send(r).map_err(|_| EngineError::Inference("the model thread stopped".into()))
    }

    /// Sends `work` (a request of the type of the family that runs `kind`, with its reply) and
    /// waits for `answer`. The kinds' files build their family's requests
    /// (`kinds::transcribe::transcribe`, `kinds::image::generate_images`).
    pub async fn run<T>(&self, kind: tern_jobs::JobKind, work: Work, answer: oneshot::Receiver<Result<Served<T>, EngineError>>) -> Result<Served<T>, EngineError> {
        let family = Family::of_kind(kind).ok_or_else(|| EngineError::Rejected { code: "model_unavailable", message: format!("no model family runs {kind} jobs") })?;
        self.send(Request::Work { family, work })?;
        answer.await.map_err(|_| EngineError::Inference("the model thread stopped".into()))?
    }
}

/// A request's progress channel, kept open until its reply: the job's progress loop ends only
/// when the sender is gone, while a family's step callback lives until the batch ends.
pub struct ProgressUntilReply<P>(Arc<Mutex<Option<tokio_mpsc::UnboundedSender<P>>>>);

impl<P: Send + 'static> ProgressUntilReply<P> {
    pub fn new(sender: tokio_mpsc::UnboundedSender<P>) -> ProgressUntilReply<P> {
        ProgressUntilReply(Arc::new(Mutex::new(Some(sender))))
    }

    /// Sends `progress` unless the reply has gone.
    fn send(&self, progress: P) {
        if let Some(p) = self.0.lock().expect("not poisoned").as_ref() {
            let _ = p.send(progress);
        }
    }

    /// A family's step callback: sends the state it is given and answers whether to go on
    /// (until `stop` is raised).
    pub fn report_until(&self, stop: Arc<AtomicBool>) -> impl Fn(P) -> bool + Send + 'static {
        let progress = self.clone();
        move |state| {
            progress.send(state);
            !stop.load(Ordering::Relaxed)
        }
    }

    /// The reply closure for `reply`, which closes the channel first.
    pub fn reply<T: Send + 'static>(&self, reply: Reply<T>) -> Box<dyn FnOnce(Result<T, WorkError>, &str) + Send> {
        let (channel, answer) = (self.0.clone(), answer_with(reply));
        Box::new(move |result, model: &str| {
            channel.lock().expect("not poisoned").take();
            answer(result, model)
        })
    }
}

impl<P> Clone for ProgressUntilReply<P> {
    fn clone(&self) -> Self {
        ProgressUntilReply(self.0.clone())
    }
}

struct Thread {
    cache: ModelCache,
    names: Arc<Mutex<ModelNames>>,
    swap_loading: Arc<AtomicBool>,
    batches_during_load: Arc<AtomicU64>,
    budgets: HashMap<Family, Budget>,
    /// Requests that arrived while a group of another family was gathering.
    backlog: VecDeque<Request>,
    probe: MemoryProbe,
    stats: Arc<EngineStats>,
}

impl Thread {
    fn serve(mut self, rx: mpsc::Receiver<Request>) {
        loop {
            let first = match self.backlog.pop_front() {
                Some(r) => r,
                None => match rx.recv() {
                    Ok(Request::Install { family, name, loaded, reply }) => {
                        self.install(family, name, *loaded, reply);
                        continue;
                    }
                    Ok(r) => r,
                    Err(_) => return,
                },
            };
            let family = first.family();
            let mut group = vec![first];
            {
                // Same-family requests already waiting join; then linger for late ones.
                let (same, other): (VecDeque<_>, VecDeque<_>) =
                    std::mem::take(&mut self.backlog).into_iter().partition(|r| r.family() == family);
                group.extend(same);
                self.backlog = other;
                let opened = Instant::now();
                loop {
                    let wait = LINGER.min(LINGER_MAX.saturating_sub(opened.elapsed()));
                    match rx.recv_timeout(wait) {
                        // The group has not started: it runs on the new model.
                        Ok(Request::Install { family, name, loaded, reply }) => self.install(family, name, *loaded, reply),
                        Ok(r) if r.family() == family => group.push(r),
                        Ok(r) => self.backlog.push_back(r),
                        Err(_) => break,
                    }
                }
            }
            if self.swap_loading.load(Ordering::Relaxed) {
                self.batches_during_load.fetch_add(1, Ordering::Relaxed);
            }
            let work: Vec<Work> = group
                .into_iter()
                .filter_map(|r| match r {
                    Request::Work { work, .. } => Some(work),
                    Request::Install { .. } => None,
                })
                .collect();
            self.run(family, work, &rx);
        }
    }

    /// Runs `work` as one batch of `family` on its current model ([`FamilyModel::run`]), then
    /// publishes the batch size the memory free allows.
    fn run(&mut self, family: Family, work: Vec<Work>, rx: &mpsc::Receiver<Request>) {
        let name = current(&self.names, family);
        let plugin = family.plugin();
        let (model, unit_bytes) = match self.cache.get(family, &name) {
            Ok(got) => got,
            Err(e) => {
                let error = e.to_work();
                for w in work {
                    plugin.refuse(w, error.clone(), &name);
                }
                return;
            }
        };
        let budget = self.budgets.get_mut(&family).expect("every family has a budget");
        let mut batch = ThreadBatch {
            family,
            name: &name,
            budget,
            unit_bytes,
            rx,
            backlog: &mut self.backlog,
            installs: Vec::new(),
            probe: &self.probe,
            stats: &self.stats,
        };
        let left = model.run(work, &mut batch);
        let installs = std::mem::take(&mut batch.installs);
        // Requests that did not fit run in the next batch, first; installs waited for the
        // batch to end.
        for w in left.into_iter().rev() {
            self.backlog.push_front(Request::Work { family, work: w });
        }
        for (family, name, loaded, reply) in installs {
            self.install(family, name, *loaded, reply);
        }
        self.calibrate(family, unit_bytes);
    }

    fn install(&mut self, family: Family, name: String, loaded: Loaded, reply: oneshot::Sender<String>) {
        self.cache.install(&name, loaded);
        let old = self.names.lock().expect("not poisoned").replace(family, name.clone());
        tracing::info!(?family, model = %name, replaced = %old, "model swapped in between batches");
        let _ = reply.send(old);
    }

    /// Publishes `family`'s batch size the memory free allows: the budget's, less the resident
    /// models, and on a GPU also the device's; within the ceiling and any cap.
    fn calibrate(&self, family: Family, unit_bytes: u64) {
        let budget = &self.budgets[&family];
        let Some(ceiling) = budget.ceiling.filter(|_| budget.configured.is_none()) else { return };
        let free = match self.probe.free_bytes() {
            Some(device) => device.min(self.cache.free_bytes()),
            None => self.cache.free_bytes(),
        };
        let fits = (free / unit_bytes.max(1)) as usize;
        budget.published.store(fits.clamp(1, ceiling.min(budget.cap)) as i64, Ordering::Relaxed);
    }
}

/// What the model thread offers a running batch ([`BatchRun`]).
struct ThreadBatch<'a> {
    family: Family,
    name: &'a str,
    budget: &'a mut Budget,
    unit_bytes: u64,
    rx: &'a mpsc::Receiver<Request>,
    backlog: &'a mut VecDeque<Request>,
    /// Model swaps that arrived while the batch ran: applied once it ends.
    installs: Vec<(Family, String, Box<Loaded>, oneshot::Sender<String>)>,
    probe: &'a MemoryProbe,
    stats: &'a EngineStats,
}

impl BatchRun for ThreadBatch<'_> {
    fn model_name(&self) -> &str {
        self.name
    }

    /// Newcomers of this family, unless another family or a model swap is waiting for the
    /// model thread: then the batch drains and that goes next.
    fn arrivals(&mut self) -> Vec<Work> {
        let mut out = Vec::new();
        while self.backlog.is_empty() && self.installs.is_empty() {
            match self.rx.try_recv() {
                Ok(Request::Work { family, work }) if family == self.family => out.push(work),
                Ok(Request::Install { family, name, loaded, reply }) => self.installs.push((family, name, loaded, reply)),
                Ok(r) => self.backlog.push_back(r),
                Err(_) => break,
            }
        }
        out
    }

    fn units(&self) -> usize {
        self.budget.configured.unwrap_or(self.budget.published.load(Ordering::Relaxed).max(1) as usize).min(self.budget.cap)
    }

    fn cap(&self) -> usize {
        self.budget.cap
    }

    fn on_device(&self) -> bool {
        self.probe.is_device()
    }

    fn reserve(&self, units: usize) -> anyhow::Result<()> {
        memory::reserve(self.probe, units, self.unit_bytes, 0).map_err(anyhow::Error::new)
    }

    fn reserve_freed(&self, units: usize, freed: u64) -> anyhow::Result<()> {
        memory::reserve(self.probe, units, self.unit_bytes, freed).map_err(anyhow::Error::new)
    }

    fn unit_bytes(&self) -> u64 {
        self.unit_bytes
    }

    fn free_bytes(&self) -> Option<u64> {
        self.probe.free_bytes()
    }

    fn split(&mut self, half: usize, error: &str) {
        self.budget.cap = half;
        self.stats.oom_splits.fetch_add(1, Ordering::Relaxed);
        metrics::counter!("tern_engine_oom_splits_total", "family" => self.family.plugin().name()).increment(1);
        self.budget.published.fetch_min(half as i64, Ordering::Relaxed);
        tracing::warn!(family = ?self.family, half, error, "batch ran out of memory: running it again at half size");
    }

    fn busy(&self, started: Instant) {
        self.stats.busy_ns.fetch_add(started.elapsed().as_nanos() as u64, Ordering::Relaxed);
    }
}

#[cfg(test)]
mod tests;
