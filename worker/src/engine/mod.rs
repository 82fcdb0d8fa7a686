//! Runs the models on one dedicated OS thread, never on the async runtime's workers. Requests
//! from the jobs in hand queue on a channel; the thread gathers the ones that can run together
//! (transcriptions with transcriptions, embeddings with embeddings) and runs each group as one
//! batch on a model from the [`cache::ModelCache`]. Transcription and generation batches take
//! in requests of their family that arrive while they run, and answer each as it finishes.

pub mod cache;
pub mod health;
mod hub;

use cache::{CacheReport, Family, Loaded, Model, ModelCache, Source};
use std::collections::VecDeque;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicI64, AtomicU64, Ordering};
use std::sync::{mpsc, Arc, Mutex};
use std::time::{Duration, Instant};
use tern_models::generate::{GenerateError, GenerateOptions, Generation, GenerationRequest, Prompt};
use std::borrow::Cow;
use tern_models::whisper::{TranscribeInput, TranscribeOptions, Transcript};
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
    /// Most Whisper windows encoded and decoded together. `None`: calibrated at load from the
    /// memory left in the budget and the memory per window measured at warmup, at most 16.
    pub windows: Option<usize>,
    /// Most padded tokens of embedding texts pulled in one batch. `None`: calibrated, at most
    /// 32768.
    pub embed_tokens: Option<usize>,
    /// Most tokens (prompt + max_tokens) of generation jobs pulled in one batch, and in flight
    /// in a running generation batch (requests pulled later join it between decoding steps
    /// while they fit); on the CPU they decode together (one pass through the weights per step
    /// for all of them), elsewhere one after another. Default 4096.
    pub generate_tokens: usize,
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

enum Request {
    Transcribe {
        pcm: Vec<f32>,
        options: TranscribeOptions,
        progress: tokio_mpsc::UnboundedSender<(usize, usize)>,
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
/// Ceilings on calibrated batch sizes.
const MAX_WINDOWS: usize = 16;
const MAX_EMBED_TOKENS: usize = 32_768;

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
}

impl Engine {
    /// Starts the thread; models load on first use. `budget`: bytes the resident models and
    /// their batches may use. Call from within the tokio runtime (hub downloads run on it).
    pub fn start(
        models_dir: PathBuf,
        device: candle_core::Device,
        precision: tern_models::precision::Precision,
        names: ModelNames,
        budget: u64,
        limits: BatchLimits,
    ) -> Engine {
        let (tx, rx) = mpsc::channel::<Request>();
        let report = Arc::new(Mutex::new(CacheReport::default()));
        let windows = Arc::new(AtomicI64::new(limits.windows.unwrap_or(DEFAULT_WINDOWS) as i64));
        let embed_tokens = Arc::new(AtomicI64::new(limits.embed_tokens.unwrap_or(8192) as i64));
        let names = Arc::new(Mutex::new(names));
        let warmup_windows = limits.windows.unwrap_or(MAX_WINDOWS);
        let cache = ModelCache::new(
            models_dir,
            tokio::runtime::Handle::current(),
            device,
            precision,
            budget,
            warmup_windows,
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

    /// Transcribes 16 kHz mono PCM; progress (windows done, total) arrives on `progress`;
    /// raising `stop` skips the windows not yet started (the reply is then an error).
    pub async fn transcribe(
        &self,
        pcm: Vec<f32>,
        options: TranscribeOptions,
        progress: tokio_mpsc::UnboundedSender<(usize, usize)>,
        stop: Arc<AtomicBool>,
    ) -> Result<Served<Transcript>, EngineError> {
        let (reply, answer) = oneshot::channel();
        self.send(Request::Transcribe { pcm, options, progress, stop, reply })?;
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

    /// Publishes the batch size the memory left in the budget allows.
    fn calibrate(&self, name: &str, limit: Option<usize>, ceiling: usize, target: &AtomicI64) {
        if limit.is_some() {
            return;
        }
        if let Some(unit) = self.cache.unit_bytes(name) {
            let fits = (self.cache.free_bytes() / unit.max(1)) as usize;
            target.store(fits.clamp(1, ceiling) as i64, Ordering::Relaxed);
        }
    }

    /// Runs the transcription requests of `group` and lets more join while they decode
    /// (continuous batching, [`tern_models::whisper::Whisper::transcribe_continuous`]):
    /// transcription requests waiting on `rx` join whenever the batch runs short of windows,
    /// until a request of another family waits; each reply goes out as soon as its recording
    /// is transcribed.
    fn transcribe(&mut self, group: Vec<Request>, rx: &mpsc::Receiver<Request>) {
        let name = self.name_of(Family::Whisper);
        let model = match self.cache.get(Family::Whisper, &name) {
            Ok(Model::Whisper(m)) => m,
            Ok(_) => unreachable!("the cache returns the family asked for"),
            Err(e) => {
                for r in group {
                    if let Request::Transcribe { reply, .. } = r {
                        let _ = reply.send(Err(e.clone()));
                    }
                }
                return;
            }
        };
        let window_batch = self.limits.windows.unwrap_or(self.windows.load(Ordering::Relaxed) as usize);
        type Job = (tokio_mpsc::UnboundedSender<(usize, usize)>, Arc<AtomicBool>, Reply<Transcript>);
        // Per request number, until it is answered.
        let jobs: std::cell::RefCell<Vec<Option<Job>>> = Default::default();
        let mut waiting: Vec<Request> = group;
        let mut installs = Vec::new();
        let backlog = &mut self.backlog;
        let mut first_call = true;
        let mut joined_late = 0usize;
        let mut admit = || -> Vec<TranscribeInput<'static>> {
            if !first_call {
                // Newcomers, unless another family or a model swap is waiting for the model
                // thread: then the batch drains and that goes next.
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
                        jobs.borrow_mut().push(Some((progress, stop, reply)));
                        Some(TranscribeInput { pcm: Cow::Owned(pcm), options: Cow::Owned(options) })
                    }
                    _ => None,
                })
                .collect()
        };
        let canceled = |i: usize| jobs.borrow()[i].as_ref().is_some_and(|(_, stop, _)| stop.load(Ordering::Relaxed));
        let mut progress = |i: usize, done: usize, total: usize| {
            if let Some((progress, ..)) = &jobs.borrow()[i] {
                let _ = progress.send((done, total));
            }
        };
        let mut served = 0usize;
        let mut done = |i: usize, result: anyhow::Result<Transcript>| {
            let Some((.., reply)) = jobs.borrow_mut()[i].take() else { return };
            served += 1;
            let served = result.map(|value| Served { value, model: name.clone() });
            let _ = reply.send(served.map_err(|e| EngineError::Inference(format!("{e:#}"))));
        };
        let started = Instant::now();
        model.transcribe_continuous(window_batch, &mut admit, &canceled, &mut progress, &mut done);
        drop(admit);
        drop(done);
        let model_ms = started.elapsed().as_millis() as u64;
        let decode = model.last_decode_stats();
        tracing::info!(recordings = served, joined_late, window_batch, model_ms, steps = decode.steps, windows = decode.seated, joined_running = decode.joined_running, "transcription batch done");
        for (family, name, loaded, reply) in installs {
            self.install(family, name, *loaded, reply);
        }
        self.calibrate(&name, self.limits.windows, MAX_WINDOWS, &self.windows);
    }

    fn embed(&mut self, group: Vec<Request>) {
        let mut jobs = Vec::new();
        for r in group {
            if let Request::Embed { texts, reply } = r {
                jobs.push((texts, reply));
            }
        }
        let name = self.name_of(Family::Embedder);
        let model = match self.cache.get(Family::Embedder, &name) {
            Ok(Model::Embedder(m)) => m,
            Ok(_) => unreachable!("the cache returns the family asked for"),
            Err(e) => {
                jobs.into_iter().for_each(|(_, reply)| drop(reply.send(Err(e.clone()))));
                return;
            }
        };
        // One pass over every job's texts: the embedder sorts them by length across jobs.
        let all: Vec<&str> = jobs.iter().flat_map(|(t, _)| t.iter().map(String::as_str)).collect();
        match model.embed(&all) {
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
        self.calibrate(&name, self.limits.embed_tokens, MAX_EMBED_TOKENS, &self.embed_tokens);
    }

    /// Runs the generation requests of `group` and lets more join while they decode
    /// (continuous batching): between steps, generation requests waiting on `rx` join as long
    /// as the tokens in flight (prompt + max_tokens of each running request) stay within the
    /// batch budget. Once a request of another family waits, none join, so the batch drains and
    /// that request runs next. Each reply goes out as soon as its request finishes.
    fn generate(&mut self, group: Vec<Request>, rx: &mpsc::Receiver<Request>) {
        let name = self.name_of(Family::Llm);
        let model = match self.cache.get(Family::Llm, &name) {
            Ok(Model::Llm(m)) => m,
            Ok(_) => unreachable!("the cache returns the family asked for"),
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
        let limits = BatchLimits { windows: Some(4), embed_tokens: None, generate_tokens: 4096 };
        let engine = Arc::new(Engine::start(dir.clone(), candle_core::Device::Cpu, Default::default(), names, 4 << 30, limits));
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
}
