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
use tern_models::diffusion::family::ImageWork;
use tern_models::diffusion::{ImageOutput, ImageRequest};
use tern_models::embed::family::EmbedWork;
use tern_models::family::{BatchRun, Work, WorkError};
use tern_models::generate::family::GenerateWork;
use tern_models::generate::{GenerateOptions, Generation, Prompt};
use tern_models::whisper::family::TranscribeWork;
use tern_models::whisper::{TranscribeOptions, Transcript};
use tokio::sync::{mpsc as tokio_mpsc, oneshot};

/// Which model folder (under the models directory) serves each family.
#[derive(Debug, Clone)]
pub struct ModelNames {
    pub whisper: String,
    pub embedder: String,
    pub llm: String,
    pub diffusion: String,
}

impl ModelNames {
    pub fn of(&self, family: Family) -> &str {
        match family {
            Family::Whisper => &self.whisper,
            Family::Embedder => &self.embedder,
            Family::Llm => &self.llm,
            Family::Diffusion => &self.diffusion,
        }
    }

    /// Sets `family`'s model; returns the one it replaced.
    pub fn replace(&mut self, family: Family, name: String) -> String {
        let slot = match family {
            Family::Whisper => &mut self.whisper,
            Family::Embedder => &mut self.embedder,
            Family::Llm => &mut self.llm,
            Family::Diffusion => &mut self.diffusion,
        };
        std::mem::replace(slot, name)
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
    /// Most Whisper windows encoded and decoded together. `None`: calibrated after each batch
    /// from the memory free (the device's, on a GPU; the budget's) and the memory per window
    /// measured at warmup, at most 16 on the CPU (where more rows stop paying) and 1,024 on a
    /// GPU; halved when a batch runs out of memory.
    pub windows: Option<usize>,
    /// Most padded tokens of embedding texts pulled in one batch. `None`: calibrated, at most
    /// 32,768 on the CPU and 1,048,576 on a GPU (where one forward pass takes the whole batch).
    pub embed_tokens: Option<usize>,
    /// Most tokens (prompt + max_tokens) of generation jobs pulled in one batch, and in flight
    /// in a running generation batch (requests pulled later join it between decoding steps
    /// while they fit); they decode together, one pass through the weights per step for all of
    /// them, on the CPU and on a GPU. Default 4096.
    pub generate_tokens: usize,
    /// Most UNet rows in one batch of image jobs (an image is one row, two under guidance,
    /// times its pixels' share of the model's native size). `None`: calibrated from the memory
    /// free and the memory per row measured at warmup, at most 8 on the CPU and 64 on a GPU;
    /// halved when a batch runs out of memory.
    pub image_rows: Option<usize>,
    /// Hypotheses a window decodes at the worker's default beam size
    /// (`TERN_WHISPER_BEAM_SIZE`, default 5): the Whisper warmup decodes that many rows a
    /// window, so the memory measured per window, and the budget from it, holds a beam search.
    pub whisper_beams: usize,
}

impl BatchLimits {
    /// `family`'s configured budget; `None`: calibrated.
    fn configured(&self, family: Family) -> Option<usize> {
        match family {
            Family::Whisper => self.windows,
            Family::Embedder => self.embed_tokens,
            Family::Llm => Some(self.generate_tokens),
            Family::Diffusion => self.image_rows,
        }
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

type Reply<T> = oneshot::Sender<Result<Served<T>, EngineError>>;

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
fn answer_with<T: Send + 'static>(reply: Reply<T>) -> Box<dyn FnOnce(Result<T, WorkError>, &str) + Send> {
    Box::new(move |result, model| {
        let _ = reply.send(result.map(|value| Served { value, model: model.to_string() }).map_err(|e| EngineError::of_work(e, model)));
    })
}

/// A transcription's progress as the model thread reports it, once per window done.
#[derive(Debug, Clone)]
pub struct TranscribeProgress {
    /// Windows done.
    pub done: usize,
    /// Windows in all.
    pub total: usize,
    /// The transcript of the windows done from the first on, with none missing: it grows at
    /// its end.
    pub text: String,
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
        let warmup_windows = limits.windows.unwrap_or(WARMUP_WINDOWS).min(WARMUP_WINDOWS);
        let stats = Arc::new(EngineStats::default());
        let budgets: HashMap<Family, Budget> = Family::ALL
            .iter()
            .map(|&family| {
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
            budgets: serde_json::json!({
                "transcribe_windows": self.batch_budget(Family::Whisper),
                "embed_tokens": self.batch_budget(Family::Embedder),
                "generate_tokens": self.batch_budget(Family::Llm),
                "image_rows": self.batch_budget(Family::Diffusion),
            }),
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

    /// Sends `work` (a request of `family`'s type) and waits for its answer.
    async fn run<T>(&self, family: Family, work: Work, answer: oneshot::Receiver<Result<Served<T>, EngineError>>) -> Result<Served<T>, EngineError> {
        self.send(Request::Work { family, work })?;
        answer.await.map_err(|_| EngineError::Inference("the model thread stopped".into()))?
    }

    /// Transcribes 16 kHz mono PCM; progress (windows done, total, the text of the leading
    /// windows done) arrives on `progress`;
    /// raising `stop` skips the windows not yet started (the reply is then an error).
    pub async fn transcribe(
        &self,
        pcm: Vec<f32>,
        options: TranscribeOptions,
        progress: tokio_mpsc::UnboundedSender<TranscribeProgress>,
        stop: Arc<AtomicBool>,
    ) -> Result<Served<Transcript>, EngineError> {
        let (reply, answer) = oneshot::channel();
        let work = TranscribeWork {
            pcm: Arc::new(pcm),
            options,
            progress: Box::new(move |done, total, text| drop(progress.send(TranscribeProgress { done, total, text: text.to_string() }))),
            stop,
            reply: answer_with(reply),
        };
        self.run(Family::Whisper, Box::new(work), answer).await
    }

    /// Embeds texts: one unit vector per text, in order.
    pub async fn embed(&self, texts: Vec<String>) -> Result<Served<Vec<Vec<f32>>>, EngineError> {
        let (reply, answer) = oneshot::channel();
        self.run(Family::Embedder, Box::new(EmbedWork { texts, reply: answer_with(reply) }), answer).await
    }

    /// Generates text; (text so far, tokens so far) arrives on `progress`; raising `stop` ends
    /// it early (the reply then holds what was generated).
    pub async fn generate(
        &self,
        prompt: Prompt,
        options: GenerateOptions,
        progress: tokio_mpsc::UnboundedSender<(String, usize)>,
        stop: Arc<AtomicBool>,
    ) -> Result<Served<Generation>, EngineError> {
        let (reply, answer) = oneshot::channel();
        // The reply drops the progress sender: the job's progress loop ends only when it is
        // gone, and `on_text` lives until the batch ends.
        let progress = Arc::new(Mutex::new(Some(progress)));
        let on_text = {
            let progress = progress.clone();
            Box::new(move |text: &str, tokens: usize| {
                if let Some(p) = progress.lock().expect("not poisoned").as_ref() {
                    let _ = p.send((text.to_string(), tokens));
                }
                !stop.load(Ordering::Relaxed)
            })
        };
        let answer_reply = answer_with(reply);
        let reply = Box::new(move |result, model: &str| {
            progress.lock().expect("not poisoned").take();
            answer_reply(result, model)
        });
        self.run(Family::Llm, Box::new(GenerateWork { prompt, options, on_text, reply }), answer).await
    }

    /// Generates `request.n` images (default 1) of one prompt; (steps done, steps in all)
    /// arrives on `progress` after each denoising step of the batch it runs in; raising `stop`
    /// ends it at the next step (the reply is then an error, code `canceled`). Unset fields of
    /// `request` take the pipeline's defaults (the model's native size, 50 steps, guidance 7.5,
    /// a random seed), which the output states.
    pub async fn image(
        &self,
        request: ImageRequest,
        progress: tokio_mpsc::UnboundedSender<(usize, usize)>,
        stop: Arc<AtomicBool>,
    ) -> Result<Served<ImageOutput>, EngineError> {
        let (reply, answer) = oneshot::channel();
        // As for `generate`: the reply drops the progress sender, which ends the job's progress
        // loop; `on_step` lives until the batch ends.
        let progress = Arc::new(Mutex::new(Some(progress)));
        let on_step = {
            let progress = progress.clone();
            Box::new(move |done: usize, total: usize| {
                if let Some(p) = progress.lock().expect("not poisoned").as_ref() {
                    let _ = p.send((done, total));
                }
                !stop.load(Ordering::Relaxed)
            })
        };
        let answer_reply = answer_with(reply);
        let reply = Box::new(move |result, model: &str| {
            progress.lock().expect("not poisoned").take();
            answer_reply(result, model)
        });
        self.run(Family::Diffusion, Box::new(ImageWork { request, on_step, reply }), answer).await
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
mod tests {
    use super::health::tests::models_dir;
    use super::*;
    use std::sync::atomic::AtomicUsize;

    /// Six clips always in flight (each answered one is sent again) keep a continuous
    /// transcription batch running for as long as the loop goes on. A model swap must still
    /// apply once its batch drains, not wait for the load to stop.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_swap_applies_while_a_closed_loop_keeps_a_transcription_batch_running() {
        let dir = models_dir();
        let names = ModelNames { whisper: "whisper-tiny.en".into(), embedder: "all-MiniLM-L6-v2".into(), llm: "smollm2-135m-instruct".into(), diffusion: "sd-turbo".into() };
        let limits = BatchLimits { windows: Some(4), embed_tokens: None, generate_tokens: 4096, image_rows: None, whisper_beams: 1 };
        let engine = Arc::new(Engine::start(dir.clone(), candle_core::Device::Cpu, Default::default(), names, 4 << 30, limits, MemoryProbe::Host));
        let clip = std::fs::read(dir.join("testdata/librivox/sense_and_sensibility_01_austen_64kb-0880.wav")).expect("test speech: run scripts/models.sh");
        let pcm = tern_models::audio::decode_mono_16k(&clip).unwrap();
        let source = engine.source().clone();
        let whisper = dir.join("whisper-tiny.en");
        let loaded = tokio::task::spawn_blocking(move || source.load(Family::Whisper, "tiny-v2", &whisper)).await.unwrap().unwrap();

        let (running, served) = (Arc::new(AtomicBool::new(true)), Arc::new(AtomicUsize::new(0)));
        let models = Arc::new(Mutex::new(Vec::new()));
        let loops: Vec<_> = (0..6)
            .map(|_| {
                let (engine, pcm, running, served, models) = (engine.clone(), pcm.clone(), running.clone(), served.clone(), models.clone());
                tokio::spawn(async move {
                    while running.load(Ordering::Relaxed) {
                        let (progress, _) = tokio_mpsc::unbounded_channel();
                        let out = engine.transcribe(pcm.clone(), TranscribeOptions::default(), progress, Arc::default()).await;
                        let text = out.as_ref().map(|o| o.value.text.to_lowercase()).unwrap_or_default();
                        if !text.contains("young man") {
                            running.store(false, Ordering::Relaxed);
                            panic!("{out:?}");
                        }
                        models.lock().unwrap().push(out.unwrap().model);
                        served.fetch_add(1, Ordering::Relaxed);
                    }
                })
            })
            .collect();
        // Until `n` clips are answered; a loop that fails ends the wait (its panic shows below).
        let wait_served = |n: usize| {
            let (served, loops_alive) = (served.clone(), running.clone());
            async move {
                let deadline = Instant::now() + Duration::from_secs(60);
                while served.load(Ordering::Relaxed) < n && loops_alive.load(Ordering::Relaxed) {
                    assert!(Instant::now() < deadline, "{n} clips not answered within 60 s");
                    tokio::time::sleep(Duration::from_millis(20)).await;
                }
            }
        };
        wait_served(12).await;
        let installed = tokio::time::timeout(Duration::from_secs(30), engine.install(Family::Whisper, "tiny-v2".into(), loaded)).await;
        let at_install = served.load(Ordering::Relaxed);
        wait_served(at_install + 6).await;
        running.store(false, Ordering::Relaxed);
        for l in loops {
            l.await.unwrap();
        }
        assert_eq!(installed.expect("the swap waited for the load to stop").unwrap(), "whisper-tiny.en");
        let models = models.lock().unwrap();
        assert_eq!(models.last().map(String::as_str), Some("tiny-v2"), "clips after the swap run the new model");
        assert!(models[..12].iter().all(|m| m == "whisper-tiny.en"));
    }

    /// An image request on the diffusion family's tiny fixture (random weights) reports each
    /// denoising step, ending at steps/steps; with its stop raised it ends after its first step,
    /// `canceled`.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn an_image_request_reports_each_step_and_stops_when_asked() {
        let fixtures = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../models/tests/fixtures/diffusion");
        let names = ModelNames { whisper: "whisper-tiny.en".into(), embedder: "all-MiniLM-L6-v2".into(), llm: "smollm2-135m-instruct".into(), diffusion: "sd-tiny".into() };
        let limits = BatchLimits { windows: None, embed_tokens: None, generate_tokens: 4096, image_rows: None, whisper_beams: 1 };
        let engine = Engine::start(fixtures, candle_core::Device::Cpu, Default::default(), names, 4 << 30, limits, MemoryProbe::Host);
        let request = ImageRequest {
            prompt: "a lighthouse at dusk".into(),
            width: Some(64),
            height: Some(64),
            steps: Some(3),
            seed: Some(5),
            n: Some(2),
            scheduler: Some(tern_models::diffusion::SchedulerKind::Euler),
            ..Default::default()
        };
        // A request of several images may hear a step once per image.
        let steps_seen = |mut rx: tokio_mpsc::UnboundedReceiver<(usize, usize)>| {
            let mut seen = Vec::new();
            while let Ok(step) = rx.try_recv() {
                seen.push(step);
            }
            seen.dedup();
            seen
        };

        let (progress, rx) = tokio_mpsc::unbounded_channel();
        let served = engine.image(request.clone(), progress, Arc::default()).await.unwrap();
        assert_eq!(served.model, "sd-tiny");
        let out = served.value;
        assert_eq!(out.steps, 3);
        assert_eq!(out.images.iter().map(|i| (i.width, i.height, i.seed, i.rgb.len())).collect::<Vec<_>>(), [(64, 64, 5, 64 * 64 * 3), (64, 64, 6, 64 * 64 * 3)]);
        assert_eq!(steps_seen(rx), [(1, 3), (2, 3), (3, 3)]);

        let (progress, rx) = tokio_mpsc::unbounded_channel();
        let stopped = engine.image(request, progress, Arc::new(AtomicBool::new(true))).await.unwrap_err();
        assert_eq!(stopped.code(), "canceled", "{stopped}");
        assert_eq!(steps_seen(rx), [(1, 3)]);
    }

    /// With the memory free too small for a whole VAE decode (a test's figure: the CPU's probe
    /// cannot tell), images decode in tiles, and with room enough whole; both finish.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn images_decode_in_tiles_when_a_whole_decode_would_not_fit() {
        let fixtures = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../models/tests/fixtures/diffusion");
        let names = ModelNames { whisper: "whisper-tiny.en".into(), embedder: "all-MiniLM-L6-v2".into(), llm: "smollm2-135m-instruct".into(), diffusion: "sd-tiny".into() };
        let limits = BatchLimits { windows: None, embed_tokens: None, generate_tokens: 4096, image_rows: None, whisper_beams: 1 };
        // 1 KiB a UNet row, so the rows always fit; a 128x128 whole decode of sd-tiny's VAE
        // needs about 5 MiB.
        let (probe, figures) = MemoryProbe::fixed(1 << 20, 1 << 10);
        let engine = Engine::start(fixtures, candle_core::Device::Cpu, Default::default(), names, 4 << 30, limits, probe);
        let request = ImageRequest {
            prompt: "a lighthouse at dusk".into(),
            width: Some(128),
            height: Some(128),
            steps: Some(2),
            seed: Some(5),
            scheduler: Some(tern_models::diffusion::SchedulerKind::Euler),
            ..Default::default()
        };
        let (progress, _rx) = tokio_mpsc::unbounded_channel();
        let tight = engine.image(request.clone(), progress, Arc::default()).await.unwrap().value;
        assert!(tight.tiled_decode, "1 MiB free: tiles");
        figures.free_bytes.store(1 << 30, Ordering::Relaxed);
        let (progress, _rx) = tokio_mpsc::unbounded_channel();
        let roomy = engine.image(request, progress, Arc::default()).await.unwrap().value;
        assert!(!roomy.tiled_decode, "1 GiB free: whole");
        assert_eq!(tight.images[0].rgb.len(), roomy.images[0].rgb.len());
        assert_ne!(tight.images[0].rgb, roomy.images[0].rgb, "tiles blend at their seams");
    }

    /// Memory states: with the memory free too small for a batch's UNet rows (a test's figure:
    /// the CPU's probe cannot tell), the text encoders and the VAE wait in host memory and move
    /// to the device for their step, their bytes making the room the batch needs; with room
    /// for both they are resident again. The images are the same in both states.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn image_encoders_and_vae_wait_in_host_memory_when_the_unet_rows_need_their_room() {
        use tern_models::diffusion::MemoryState;
        let fixtures = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../models/tests/fixtures/diffusion");
        let names = ModelNames { whisper: "whisper-tiny.en".into(), embedder: "all-MiniLM-L6-v2".into(), llm: "smollm2-135m-instruct".into(), diffusion: "sd-tiny".into() };
        let limits = BatchLimits { windows: None, embed_tokens: None, generate_tokens: 4096, image_rows: None, whisper_beams: 1 };
        // A UNet row takes 512 KiB (the warmup measures what the probe says); sd-tiny's text
        // encoder and VAE decoder weigh 0.93 MiB in F32, a whole 64x64 decode takes 1.3 MiB.
        // 64 MiB free hold everything.
        let (probe, figures) = MemoryProbe::fixed(64 << 20, 512 << 10);
        let engine = Engine::start(fixtures, candle_core::Device::Cpu, Default::default(), names, 4 << 30, limits, probe);
        let request = ImageRequest { prompt: "a lighthouse at dusk".into(), steps: Some(2), seed: Some(3), n: Some(2), scheduler: Some(tern_models::diffusion::SchedulerKind::Euler), ..Default::default() };
        let run = |request: ImageRequest| {
            let (progress, _rx) = tokio_mpsc::unbounded_channel();
            engine.image(request, progress, Arc::default())
        };
        let roomy = run(request.clone()).await.unwrap().value;
        assert_eq!(roomy.memory_state, MemoryState::Resident);
        // Two guided images are four rows, 2 MiB: 1.5 MiB free do not hold them, but do with
        // the encoder's and the VAE's bytes moved out (and a whole decode still fits).
        figures.free_bytes.store(3 << 19, Ordering::Relaxed);
        let tight = run(request.clone()).await.unwrap().value;
        assert_eq!(tight.memory_state, MemoryState::Offloaded, "1.5 MiB free: offloaded");
        assert!(!tight.tiled_decode && !roomy.tiled_decode);
        assert_eq!(tight.images.len(), 2);
        for (a, b) in tight.images.iter().zip(&roomy.images) {
            assert_eq!(a.rgb, b.rgb, "the same images in either state");
        }
        // Still short of the batch and the components together: they stay in host memory.
        let still = run(request.clone()).await.unwrap().value;
        assert_eq!(still.memory_state, MemoryState::Offloaded);
        figures.free_bytes.store(64 << 20, Ordering::Relaxed);
        let back = run(request).await.unwrap().value;
        assert_eq!(back.memory_state, MemoryState::Resident, "room again: resident");
        assert_eq!(back.images[0].rgb, roomy.images[0].rgb);
    }

    /// A batch that runs out of memory (here the probe's free memory cannot hold its windows,
    /// as a GPU's allocator would refuse them) is run again at half size until it fits: every
    /// recording is transcribed as it is alone, none fails, and the budget shrinks to what ran.
    /// The same for an embedding pass, whose tokens per forward pass halve.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_batch_that_runs_out_of_memory_is_split_and_no_job_fails() {
        let dir = models_dir();
        let names = ModelNames { whisper: "whisper-tiny.en".into(), embedder: "all-MiniLM-L6-v2".into(), llm: "smollm2-135m-instruct".into(), diffusion: "sd-turbo".into() };
        let limits = BatchLimits { windows: None, embed_tokens: None, generate_tokens: 4096, image_rows: None, whisper_beams: 1 };
        // The warmup measures 100 MiB per window; 4 GiB are free until the test says otherwise.
        let (probe, figures) = MemoryProbe::fixed(4 << 30, 100 << 20);
        let engine = Engine::start(dir.clone(), candle_core::Device::Cpu, Default::default(), names.clone(), 8 << 30, limits.clone(), probe);
        let clips: Vec<Vec<f32>> = ["sense_and_sensibility_01_austen_64kb-0880.wav", "sense_and_sensibility_01_austen_64kb-0870.wav"]
            .iter()
            .map(|f| tern_models::audio::decode_mono_16k(&std::fs::read(dir.join("testdata/librivox").join(f)).expect("test speech: run scripts/models.sh")).unwrap())
            .collect();
        let transcribe = |pcm: Vec<f32>| {
            let (progress, _) = tokio_mpsc::unbounded_channel();
            engine.transcribe(pcm, TranscribeOptions::default(), progress, Arc::default())
        };
        let alone: Vec<String> = futures::future::join_all(clips.iter().map(|c| transcribe(c.clone()))).await.into_iter().map(|t| t.unwrap().value.text).collect();
        // The budget is set once the batch ends, which can be just after its last reply.
        let deadline = Instant::now() + Duration::from_secs(5);
        while engine.batch_budget(Family::Whisper) != 16 && Instant::now() < deadline {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        assert_eq!(engine.batch_budget(Family::Whisper), 16, "4 GiB free hold 40 windows of 100 MiB: the CPU's ceiling");

        // 250 MiB free: 16 windows do not fit, nor 8 or 4; 2 do.
        figures.free_bytes.store(250 << 20, Ordering::Relaxed);
        let batch: Vec<Vec<f32>> = (0..6).map(|i| clips[i % 2].clone()).collect();
        let texts = futures::future::join_all(batch.into_iter().map(transcribe)).await;
        for (i, t) in texts.into_iter().enumerate() {
            assert_eq!(t.expect("no recording fails for want of memory").value.text, alone[i % 2]);
        }
        assert_eq!(engine.stats.oom_splits.load(Ordering::Relaxed), 3, "16 -> 8 -> 4 -> 2 windows");
        assert_eq!(engine.batch_budget(Family::Whisper), 2, "later pulls take what fitted");
        assert_eq!(engine.batching().budgets["transcribe_windows"], 2);

        // Embeddings: 1 MiB per token; 3,000 MiB free hold 2,048 of the CPU's 8,192 tokens per pass.
        let (probe, figures) = MemoryProbe::fixed(4 << 30, 1 << 20);
        let engine = Engine::start(dir, candle_core::Device::Cpu, Default::default(), names, 8 << 30, limits, probe);
        let texts: Vec<String> = (0..300).map(|i| format!("sentence number {i} about the weather in a town by the sea")).collect();
        let before = engine.embed(texts.clone()).await.unwrap().value;
        figures.free_bytes.store(3000 << 20, Ordering::Relaxed);
        let after = engine.embed(texts).await.expect("no embedding fails for want of memory").value;
        assert_eq!(engine.stats.oom_splits.load(Ordering::Relaxed), 2, "8,192 -> 4,096 -> 2,048 tokens per pass");
        assert_eq!(engine.batch_budget(Family::Embedder), 2048);
        for (a, b) in before.iter().zip(&after) {
            let cosine: f32 = a.iter().zip(b).map(|(x, y)| x * y).sum();
            assert!(cosine > 0.9999, "smaller passes give the same vectors: {cosine}");
        }
    }
}
