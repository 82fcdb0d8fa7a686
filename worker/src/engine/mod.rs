//! Runs the models on one dedicated OS thread, never on the async runtime's workers. Requests
//! from the jobs in hand queue on a channel; the thread gathers the ones that can run together
//! (transcriptions with transcriptions, embeddings with embeddings) and runs each group as one
//! batch on a model from the [`cache::ModelCache`]. Transcription and generation batches take
//! in requests of their family that arrive while they run, and answer each as it finishes.

pub mod cache;
pub mod health;
mod hub;
pub mod memory;

use cache::{CacheReport, Family, Loaded, Model, ModelCache, Source};
use memory::MemoryProbe;
use std::collections::VecDeque;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicI64, AtomicU64, Ordering};
use std::sync::{mpsc, Arc, Mutex};
use std::time::{Duration, Instant};
use tern_models::generate::{GenerateError, GenerateOptions, Generation, GenerationRequest, Prompt};
use std::borrow::Cow;
use tern_models::whisper::{Pcm, TranscribeInput, TranscribeOptions, Transcript};
use tokio::sync::{mpsc as tokio_mpsc, oneshot};

/// Which model folder (under the models directory) serves each family.
#[derive(Debug, Clone)]
pub struct ModelNames {
    pub whisper: String,
    pub embedder: String,
    pub llm: String,
}

impl ModelNames {
    pub fn of(&self, family: Family) -> &str {
        match family {
            Family::Whisper => &self.whisper,
            Family::Embedder => &self.embedder,
            Family::Llm => &self.llm,
        }
    }

    /// Sets `family`'s model; returns the one it replaced.
    pub fn replace(&mut self, family: Family, name: String) -> String {
        let slot = match family {
            Family::Whisper => &mut self.whisper,
            Family::Embedder => &mut self.embedder,
            Family::Llm => &mut self.llm,
        };
        std::mem::replace(slot, name)
    }
}

/// A model the cache returned for a family, as that family's type.
fn downcast<T: 'static>(model: &mut Model) -> &mut T {
    model.as_any_mut().downcast_mut::<T>().expect("the cache returns the family asked for")
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
    /// Hypotheses a window decodes at the worker's default beam size
    /// (`TERN_WHISPER_BEAM_SIZE`, default 5): the Whisper warmup decodes that many rows a
    /// window, so the memory measured per window, and the budget from it, holds a beam search.
    pub whisper_beams: usize,
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
    Transcribe {
        /// Shared with the model while it runs, kept to run the recording again if its batch
        /// runs out of memory.
        pcm: Arc<Vec<f32>>,
        options: TranscribeOptions,
        progress: tokio_mpsc::UnboundedSender<TranscribeProgress>,
        /// Set when the job is canceled or released: its remaining windows are skipped.
        stop: Arc<AtomicBool>,
        reply: Reply<Transcript>,
    },
    Embed {
        texts: Vec<String>,
        reply: Reply<Vec<Vec<f32>>>,
    },
    Generate {
        prompt: Prompt,
        options: GenerateOptions,
        /// (text so far, tokens so far).
        progress: tokio_mpsc::UnboundedSender<(String, usize)>,
        /// Set when the job is canceled or released: generation stops at the next token.
        stop: Arc<AtomicBool>,
        reply: Reply<Generation>,
    },
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
            Request::Transcribe { .. } => Family::Whisper,
            Request::Embed { .. } => Family::Embedder,
            Request::Generate { .. } => Family::Llm,
            Request::Install { family, .. } => *family,
        }
    }
}

/// How long the thread waits for more requests of the same family after one arrives (reset by
/// each arrival), so the jobs of a pulled batch, which fetch and decode their inputs in
/// parallel, land in one model batch.
const LINGER: Duration = Duration::from_millis(15);
/// Longest a group is held open for late arrivals.
const LINGER_MAX: Duration = Duration::from_millis(150);
/// Windows per batch until the Whisper model's warmup has measured what fits.
const DEFAULT_WINDOWS: usize = 8;
/// Windows of the Whisper warmup: the probe batch whose memory is measured, and the largest
/// batch a CPU worker runs.
const WARMUP_WINDOWS: usize = 16;

/// Ceilings on calibrated batch sizes. On the CPU a batch is compute-bound past 16 windows (the
/// products are already at the kernel's peak) and 8,192 tokens per forward pass; on a GPU
/// memory is the bound.
#[derive(Debug, Clone, Copy)]
struct Ceilings {
    windows: usize,
    embed_tokens: usize,
}

const CPU_CEILINGS: Ceilings = Ceilings { windows: 16, embed_tokens: 32_768 };
const DEVICE_CEILINGS: Ceilings = Ceilings { windows: 1024, embed_tokens: 1 << 20 };

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
    /// The cost pulled per batch: windows, padded tokens, prompt + max tokens.
    pub budgets: serde_json::Value,
    /// Batches split because they ran out of memory.
    pub oom_splits: u64,
    /// Seconds the model thread spent in model calls.
    pub busy_seconds: f64,
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
    windows: Arc<AtomicI64>,
    embed_tokens: Arc<AtomicI64>,
    generate_tokens: i64,
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
        let windows = Arc::new(AtomicI64::new(limits.windows.unwrap_or(DEFAULT_WINDOWS) as i64));
        let embed_tokens = Arc::new(AtomicI64::new(limits.embed_tokens.unwrap_or(8192) as i64));
        let names = Arc::new(Mutex::new(names));
        let ceilings = if probe.is_device() { DEVICE_CEILINGS } else { CPU_CEILINGS };
        let warmup_windows = limits.windows.unwrap_or(WARMUP_WINDOWS).min(WARMUP_WINDOWS);
        let stats = Arc::new(EngineStats::default());
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
        let thread = Thread {
            cache,
            names: names.clone(),
            swap_loading: swap_loading.clone(),
            batches_during_load: batches_during_load.clone(),
            limits: limits.clone(),
            windows: windows.clone(),
            embed_tokens: embed_tokens.clone(),
            backlog: VecDeque::new(),
            probe: probe.clone(),
            stats: stats.clone(),
            ceilings,
            caps: Ceilings { windows: usize::MAX, embed_tokens: usize::MAX },
        };
        std::thread::Builder::new()
            .name("model-engine".into())
            .spawn(move || thread.serve(rx))
            .expect("spawn the model thread");
        Engine {
            requests: tx,
            names,
            source,
            swap_loading,
            batches_during_load,
            report,
            windows,
            embed_tokens,
            generate_tokens: limits.generate_tokens as i64,
            probe,
            stats,
        }
    }

    /// Whether batches are sized by a GPU's memory (up to [`DEVICE_CEILINGS`]) rather than the
    /// CPU's ceilings.
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

    /// The cost budget for one pulled batch of `family`'s jobs: windows for transcription,
    /// padded tokens for embeddings, prompt + max tokens for generation.
    pub fn batch_budget(&self, family: Family) -> i64 {
        match family {
            Family::Whisper => self.windows.load(Ordering::Relaxed),
            Family::Embedder => self.embed_tokens.load(Ordering::Relaxed),
            Family::Llm => self.generate_tokens,
        }
        .max(1)
    }

    fn send(&self, r: Request) -> Result<(), EngineError> {
        self.requests.send(r).map_err(|_| EngineError::Inference("the model thread stopped".into()))
    }

    async fn answer<T>(rx: oneshot::Receiver<Result<Served<T>, EngineError>>) -> Result<Served<T>, EngineError> {
        rx.await.map_err(|_| EngineError::Inference("the model thread stopped".into()))?
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
        self.send(Request::Transcribe { pcm: Arc::new(pcm), options, progress, stop, reply })?;
        Self::answer(answer).await
    }

    /// Embeds texts: one unit vector per text, in order.
    pub async fn embed(&self, texts: Vec<String>) -> Result<Served<Vec<Vec<f32>>>, EngineError> {
        let (reply, answer) = oneshot::channel();
        self.send(Request::Embed { texts, reply })?;
        Self::answer(answer).await
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
        self.send(Request::Generate { prompt, options, progress, stop, reply })?;
        Self::answer(answer).await
    }
}

struct Thread {
    cache: ModelCache,
    names: Arc<Mutex<ModelNames>>,
    swap_loading: Arc<AtomicBool>,
    batches_during_load: Arc<AtomicU64>,
    limits: BatchLimits,
    windows: Arc<AtomicI64>,
    embed_tokens: Arc<AtomicI64>,
    /// Requests that arrived while a group of another family was gathering.
    backlog: VecDeque<Request>,
    probe: MemoryProbe,
    stats: Arc<EngineStats>,
    /// Largest calibrated batches on this device.
    ceilings: Ceilings,
    /// Half of the last batch of each family that ran out of memory (unbounded until one does):
    /// calibrated and configured sizes stay under it.
    caps: Ceilings,
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
            match family {
                Family::Whisper => self.transcribe(group, &rx),
                Family::Embedder => self.embed(group),
                Family::Llm => self.generate(group, &rx),
            }
        }
    }

    fn install(&mut self, family: Family, name: String, loaded: Loaded, reply: oneshot::Sender<String>) {
        self.cache.install(&name, loaded);
        let old = self.names.lock().expect("not poisoned").replace(family, name.clone());
        tracing::info!(?family, model = %name, replaced = %old, "model swapped in between batches");
        let _ = reply.send(old);
    }

    fn name_of(&self, family: Family) -> String {
        current(&self.names, family)
    }

    /// Publishes the batch size the memory free allows: the budget's, less the resident models,
    /// and on a GPU also the device's; within `ceiling`.
    fn calibrate(&self, unit_bytes: u64, limit: Option<usize>, ceiling: usize, target: &AtomicI64) {
        if limit.is_some() {
            return;
        }
        let free = match self.probe.free_bytes() {
            Some(device) => device.min(self.cache.free_bytes()),
            None => self.cache.free_bytes(),
        };
        let fits = (free / unit_bytes.max(1)) as usize;
        target.store(fits.clamp(1, ceiling) as i64, Ordering::Relaxed);
    }

    /// Counts a batch that ran out of memory and lowers `cap` (and the published budget) to
    /// `half`, so later batches are pulled at that size.
    fn split(&self, family: Family, half: usize, target: &AtomicI64, error: &str) {
        self.stats.oom_splits.fetch_add(1, Ordering::Relaxed);
        metrics::counter!("tern_engine_oom_splits_total", "family" => format!("{family:?}").to_lowercase()).increment(1);
        target.fetch_min(half as i64, Ordering::Relaxed);
        tracing::warn!(?family, half, error, "batch ran out of memory: running it again at half size");
    }

    /// Adds the time since `started` to the model thread's busy time.
    fn busy_since(stats: &EngineStats, started: Instant) {
        stats.busy_ns.fetch_add(started.elapsed().as_nanos() as u64, Ordering::Relaxed);
    }

    /// Runs the transcription requests of `group` and lets more join while they decode
    /// (continuous batching, [`tern_models::whisper::Whisper::transcribe_continuous`]):
    /// transcription requests waiting on `rx` join whenever the batch runs short of windows,
    /// until a request of another family waits; each reply goes out as soon as its recording
    /// is transcribed. Recordings whose batch ran out of memory (or would have: the probe's
    /// free memory cannot hold its windows) run again at half the windows, which become the
    /// budget's cap; only at one window does running out of memory fail them.
    fn transcribe(&mut self, group: Vec<Request>, rx: &mpsc::Receiver<Request>) {
        let name = self.name_of(Family::Whisper);
        let mut window_batch = self.limits.windows.unwrap_or(self.windows.load(Ordering::Relaxed) as usize).min(self.caps.windows);
        let mut pending = group;
        let mut installs = Vec::new();
        let mut unit = 0;
        while !pending.is_empty() {
            let (model, unit_bytes) = match self.cache.get(Family::Whisper, &name) {
                Ok((m, unit)) => (downcast::<tern_models::whisper::Whisper>(m), unit),
                Err(e) => {
                    for r in pending {
                        if let Request::Transcribe { reply, .. } = r {
                            let _ = reply.send(Err(e.clone()));
                        }
                    }
                    return;
                }
            };
            unit = unit_bytes;
            // Recordings to run again at half the windows.
            let mut again: Vec<Request> = Vec::new();
            let mut out_of_memory = None;
            if let Err(e) = memory::reserve(&self.probe, window_batch, unit_bytes) {
                out_of_memory = Some(e.to_string());
                again = pending;
            } else {
                type Job = (Arc<Vec<f32>>, TranscribeOptions, tokio_mpsc::UnboundedSender<TranscribeProgress>, Arc<AtomicBool>, Reply<Transcript>);
                // Per request number, until it is answered.
                let jobs: std::cell::RefCell<Vec<Option<Job>>> = Default::default();
                let mut waiting: Vec<Request> = pending;
                let backlog = &mut self.backlog;
                let mut first_call = true;
                let mut joined_late = 0usize;
                let mut admit = || -> Vec<TranscribeInput<'static>> {
                    if !first_call {
                        // Newcomers, unless another family or a model swap is waiting for the
                        // model thread: then the batch drains and that goes next.
                        while backlog.is_empty() && installs.is_empty() {
                            match rx.try_recv() {
                                Ok(r @ Request::Transcribe { .. }) => {
                                    joined_late += 1;
                                    waiting.push(r);
                                }
                                Ok(Request::Install { family, name, loaded, reply }) => installs.push((family, name, loaded, reply)),
                                Ok(r) => backlog.push_back(r),
                                Err(_) => break,
                            }
                        }
                    }
                    first_call = false;
                    waiting
                        .drain(..)
                        .filter_map(|r| match r {
                            Request::Transcribe { pcm, options, progress, stop, reply } => {
                                let input = TranscribeInput { pcm: Pcm::Shared(pcm.clone()), options: Cow::Owned(options.clone()) };
                                jobs.borrow_mut().push(Some((pcm, options, progress, stop, reply)));
                                Some(input)
                            }
                            _ => None,
                        })
                        .collect()
                };
                let canceled = |i: usize| jobs.borrow()[i].as_ref().is_some_and(|(_, _, _, stop, _)| stop.load(Ordering::Relaxed));
                let mut progress = |i: usize, p: tern_models::whisper::Progress<'_>| {
                    if let Some((_, _, progress, ..)) = &jobs.borrow()[i] {
                        let _ = progress.send(TranscribeProgress { done: p.done, total: p.total, text: p.text.to_string() });
                    }
                };
                let mut served = 0usize;
                let mut done = |i: usize, result: anyhow::Result<Transcript>| {
                    let Some((pcm, options, progress, stop, reply)) = jobs.borrow_mut()[i].take() else { return };
                    match result {
                        Err(e) if window_batch > 1 && memory::is_out_of_memory(&e) => {
                            out_of_memory.get_or_insert_with(|| format!("{e:#}"));
                            again.push(Request::Transcribe { pcm, options, progress, stop, reply });
                        }
                        result => {
                            served += 1;
                            let served = result.map(|value| Served { value, model: name.clone() });
                            let _ = reply.send(served.map_err(|e| EngineError::Inference(format!("{e:#}"))));
                        }
                    }
                };
                let started = Instant::now();
                model.transcribe_continuous(window_batch, &mut admit, &canceled, &mut progress, &mut done);
                Self::busy_since(&self.stats, started);
                drop(admit);
                drop(done);
                let model_ms = started.elapsed().as_millis() as u64;
                let decode = model.last_decode_stats();
                tracing::info!(recordings = served, joined_late, window_batch, model_ms, steps = decode.steps, windows = decode.seated, joined_running = decode.joined_running, "transcription batch done");
            }
            if let Some(error) = out_of_memory {
                if window_batch == 1 {
                    // One window does not fit: nothing smaller to try; the jobs retry later.
                    for r in again.drain(..) {
                        if let Request::Transcribe { reply, .. } = r {
                            let _ = reply.send(Err(EngineError::Inference(format!("out of memory at one window: {error}"))));
                        }
                    }
                } else {
                    window_batch /= 2;
                    self.caps.windows = window_batch;
                    self.split(Family::Whisper, window_batch, &self.windows, &error);
                }
            }
            pending = again;
        }
        for (family, name, loaded, reply) in installs {
            self.install(family, name, *loaded, reply);
        }
        self.calibrate(unit, self.limits.windows, self.ceilings.windows.min(self.caps.windows), &self.windows);
    }

    /// Embeds the texts of every request in `group` in one pass. A pass that runs out of memory
    /// (or would: the probe's free memory cannot hold its tokens) runs again with half the
    /// tokens per forward pass, which become the budget's cap.
    fn embed(&mut self, group: Vec<Request>) {
        let mut jobs = Vec::new();
        for r in group {
            if let Request::Embed { texts, reply } = r {
                jobs.push((texts, reply));
            }
        }
        let name = self.name_of(Family::Embedder);
        // One pass over every job's texts: the embedder sorts them by length across jobs.
        let all: Vec<&str> = jobs.iter().flat_map(|(t, _)| t.iter().map(String::as_str)).collect();
        // On a GPU one forward pass takes the whole pulled batch; the CPU gains nothing past
        // the embedder's default.
        let mut per_forward = if self.probe.is_device() {
            self.embed_tokens.load(Ordering::Relaxed) as usize
        } else {
            tern_models::embed::TOKENS_PER_FORWARD
        }
        .min(self.caps.embed_tokens);
        let (result, unit) = loop {
            let (model, unit_bytes) = match self.cache.get(Family::Embedder, &name) {
                Ok((m, unit)) => (downcast::<tern_models::embed::Embedder>(m), unit),
                Err(e) => {
                    jobs.into_iter().for_each(|(_, reply)| drop(reply.send(Err(e.clone()))));
                    return;
                }
            };
            let result = match memory::reserve(&self.probe, per_forward, unit_bytes) {
                Err(e) => Err(anyhow::Error::new(e)),
                Ok(()) => {
                    let started = Instant::now();
                    let vectors = model.embed_in(&all, per_forward);
                    Self::busy_since(&self.stats, started);
                    vectors
                }
            };
            match result {
                // A text runs alone below its own length: smaller passes would not help.
                Err(e) if per_forward > tern_models::embed::MAX_TOKENS_PER_TEXT && memory::is_out_of_memory(&e) => {
                    per_forward /= 2;
                    self.caps.embed_tokens = per_forward;
                    self.split(Family::Embedder, per_forward, &self.embed_tokens, &format!("{e:#}"));
                }
                result => break (result, unit_bytes),
            }
        };
        match result {
            Ok(vectors) => {
                let mut vectors = vectors.into_iter();
                for (texts, reply) in jobs {
                    let mine: Vec<_> = vectors.by_ref().take(texts.len()).collect();
                    let _ = reply.send(Ok(Served { value: mine, model: name.clone() }));
                }
            }
            Err(e) => {
                let e = EngineError::Inference(format!("{e:#}"));
                jobs.into_iter().for_each(|(_, reply)| drop(reply.send(Err(e.clone()))));
            }
        }
        self.calibrate(unit, self.limits.embed_tokens, self.ceilings.embed_tokens.min(self.caps.embed_tokens), &self.embed_tokens);
    }

    /// Runs the generation requests of `group` and lets more join while they decode
    /// (continuous batching): between steps, generation requests waiting on `rx` join as long
    /// as the tokens in flight (prompt + max_tokens of each running request) stay within the
    /// batch budget. Once a request of another family waits, none join, so the batch drains and
    /// that request runs next. Each reply goes out as soon as its request finishes.
    fn generate(&mut self, group: Vec<Request>, rx: &mpsc::Receiver<Request>) {
        let name = self.name_of(Family::Llm);
        let model = match self.cache.get(Family::Llm, &name) {
            Ok((m, _)) => downcast::<tern_models::generate::Llm>(m),
            Err(e) => {
                for r in group {
                    if let Request::Generate { reply, .. } = r {
                        let _ = reply.send(Err(e.clone()));
                    }
                }
                return;
            }
        };
        struct Job {
            prompt: Prompt,
            options: GenerateOptions,
            on_text: Box<dyn FnMut(&str, usize) -> bool + Send>,
        }
        // Jobs live until the batch ends; the requests borrow them while newcomers are added.
        let jobs: typed_arena::Arena<Job> = typed_arena::Arena::new();
        // Per request number: its reply and its cost (prompt tokens are not known before its
        // prompt is rendered, so the cost counts max_tokens plus the prompt's characters / 4).
        // The progress sender sits behind a lock so that `done` can drop it: the job's
        // progress loop ends only when it is gone, and its closure lives until the batch ends.
        type Progress = Arc<Mutex<Option<tokio_mpsc::UnboundedSender<(String, usize)>>>>;
        let replies: std::cell::RefCell<Vec<Option<(Reply<Generation>, usize, Progress)>>> = Default::default();
        let in_flight = std::cell::Cell::new(0usize);
        let budget = self.limits.generate_tokens.max(1);
        let mut waiting: VecDeque<Request> = group.into();
        let mut installs = Vec::new();
        let backlog = &mut self.backlog;
        let started = Instant::now();
        let (mut served, mut joined_late) = (0usize, 0usize);
        let mut first_call = true;
        let mut admit = |_running: usize| -> Vec<GenerationRequest<'_>> {
            if !first_call {
                // Newcomers, unless another family or a model swap is waiting for the model
                // thread: then the batch drains and that goes next.
                while backlog.is_empty() && installs.is_empty() {
                    match rx.try_recv() {
                        Ok(r @ Request::Generate { .. }) => waiting.push_back(r),
                        Ok(Request::Install { family, name, loaded, reply }) => installs.push((family, name, loaded, reply)),
                        Ok(r) => backlog.push_back(r),
                        Err(_) => break,
                    }
                }
            }
            let mut out = Vec::new();
            while let Some(Request::Generate { .. }) = waiting.front() {
                let Some(Request::Generate { prompt, options, progress, stop, reply }) = waiting.pop_front() else { unreachable!() };
                let cost = options.max_tokens + prompt.approximate_tokens();
                // The first request always runs, however costly.
                if in_flight.get() > 0 && in_flight.get() + cost > budget {
                    waiting.push_front(Request::Generate { prompt, options, progress, stop, reply });
                    break;
                }
                in_flight.set(in_flight.get() + cost);
                let progress: Progress = Arc::new(Mutex::new(Some(progress)));
                replies.borrow_mut().push(Some((reply, cost, progress.clone())));
                if !first_call {
                    joined_late += 1;
                }
                let on_text = Box::new(move |text: &str, tokens: usize| {
                    if let Some(p) = progress.lock().expect("not poisoned").as_ref() {
                        let _ = p.send((text.to_string(), tokens));
                    }
                    !stop.load(Ordering::Relaxed)
                });
                let job = jobs.alloc(Job { prompt, options, on_text });
                out.push(GenerationRequest { prompt: &job.prompt, options: &job.options, on_text: job.on_text.as_mut() });
            }
            first_call = false;
            out
        };
        let mut done = |number: usize, result: anyhow::Result<Generation>| {
            let Some((reply, cost, progress)) = replies.borrow_mut().get_mut(number).and_then(Option::take) else { return };
            progress.lock().expect("not poisoned").take();
            in_flight.set(in_flight.get().saturating_sub(cost));
            served += 1;
            let result = result.map_err(|e| match e.downcast_ref::<GenerateError>() {
                // A stop is seen by the job itself; the rest are the input's fault.
                Some(g) if *g != GenerateError::Canceled => EngineError::Rejected { code: g.code(), message: g.to_string() },
                _ => EngineError::Inference(format!("{e:#}")),
            });
            let _ = reply.send(result.map(|value| Served { value, model: name.clone() }));
        };
        model.generate_continuous(&mut admit, &mut done);
        Self::busy_since(&self.stats, started);
        drop(admit);
        drop(done);
        tracing::info!(requests = served, joined_late, model_ms = started.elapsed().as_millis() as u64, "generation batch done");
        // Requests that did not fit run in the next batch; installs wait for the batch to end.
        for r in waiting.into_iter().rev() {
            self.backlog.push_front(r);
        }
        for (family, name, loaded, reply) in installs {
            self.install(family, name, *loaded, reply);
        }
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
        let names = ModelNames { whisper: "whisper-tiny.en".into(), embedder: "all-MiniLM-L6-v2".into(), llm: "smollm2-135m-instruct".into() };
        let limits = BatchLimits { windows: Some(4), embed_tokens: None, generate_tokens: 4096, whisper_beams: 1 };
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

    /// A batch that runs out of memory (here the probe's free memory cannot hold its windows,
    /// as a GPU's allocator would refuse them) is run again at half size until it fits: every
    /// recording is transcribed as it is alone, none fails, and the budget shrinks to what ran.
    /// The same for an embedding pass, whose tokens per forward pass halve.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_batch_that_runs_out_of_memory_is_split_and_no_job_fails() {
        let dir = models_dir();
        let names = ModelNames { whisper: "whisper-tiny.en".into(), embedder: "all-MiniLM-L6-v2".into(), llm: "smollm2-135m-instruct".into() };
        let limits = BatchLimits { windows: None, embed_tokens: None, generate_tokens: 4096, whisper_beams: 1 };
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
