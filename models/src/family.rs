//! A model family as a plug-in: what the worker's engine, model cache, hub downloads and hot
//! swap need of a family, so that they work on this interface alone.
//!
//! A family is a folder under `models/src/` holding the model and its `family.rs`, which
//! implements [`Family`] (how a model folder loads, what it weighs, how its batches are sized)
//! and [`FamilyModel`] on the loaded model (its warmup, whose working memory the worker measures
//! to size batches, its health check, and running a batch of its requests through [`BatchRun`],
//! what the worker's model thread offers a batch). [`FAMILIES`] registers it: the worker
//! serves every family listed there, routes the job kinds each names ([`Family::kinds`]) to it,
//! and takes its settings (the model to serve, the batch budget) from the flags and
//! environment variables it declares.

use std::any::Any;
use std::path::Path;
use std::time::Instant;

use anyhow::{Context, Result};
use candle_core::Device;

use crate::precision::Precision;

/// How a worker loads and warms up its models.
#[derive(Debug, Clone)]
pub struct LoadSettings {
    pub device: Device,
    /// `TERN_PRECISION` (each family reads it as [`Precision`] documents).
    pub precision: Precision,
    /// Whisper: windows of the warmup batch, the largest batch the worker starts with.
    pub warmup_windows: usize,
    /// Whisper: hypotheses a window decodes in that warmup (the worker's default beam size).
    pub warmup_beams: usize,
}

/// Every model family tern serves: one line registers one.
pub static FAMILIES: [&dyn Family; 4] =
    [&crate::whisper::family::FAMILY, &crate::embed::family::FAMILY, &crate::generate::family::FAMILY, &crate::diffusion::family::FAMILY];

/// A worker setting a family declares: a command-line flag, its environment variable, its
/// default (none: unset) and its `--help` text.
#[derive(Debug, Clone, Copy)]
pub struct Setting {
    pub flag: &'static str,
    pub env: &'static str,
    pub default: Option<&'static str>,
    pub help: &'static str,
}

/// A family of models: how a model folder loads.
pub trait Family: Send + Sync + 'static {
    /// Lowercase name: metrics labels, logs, the admin API (`whisper`, `embedder`, `llm`).
    fn name(&self) -> &'static str;
    /// The job kinds its models run (`transcribe`, `audio_embed`), the first the one whose name
    /// the batch budget's report takes (`transcribe_windows`).
    fn kinds(&self) -> &'static [&'static str];
    /// The unit a job's cost is counted in, a batch budget too (`windows`, `tokens`).
    fn unit(&self) -> &'static str;
    /// The worker setting naming the model that serves it: a folder under the models
    /// directory or a hub id (`--whisper-model`, `TERN_WHISPER_MODEL`).
    fn model_setting(&self) -> Setting;
    /// The worker setting fixing its batch budget, in its unit (`TERN_TRANSCRIBE_BATCH_WINDOWS`);
    /// unset, the budget follows [`Family::budget`].
    fn budget_setting(&self) -> Setting;
    /// Further settings its models read from the environment when they load
    /// (`TERN_IMAGE_MEMORY`): the worker lists each in `--help` as a flag, and a flag given sets
    /// its variable before the worker starts its threads. None by default.
    fn load_settings(&self) -> &'static [Setting] {
        &[]
    }
    /// What a hub model `hf:REPO[/FILE]` downloads: (file in the repository, name in the local
    /// folder). An error where the family needs a file named and none is.
    fn hub_files(&self, repo: &str, file: Option<&str>) -> Result<Vec<(String, &'static str)>>;
    /// The files of the repository's other layout, downloaded instead where the first file of
    /// [`Family::hub_files`] is not there (Whisper: Hugging Face's after CTranslate2's). None by
    /// default.
    fn hub_other_files(&self, _repo: &str) -> Vec<(String, &'static str)> {
        Vec::new()
    }
    /// Bytes the model in `dir` will hold resident, from its files, before loading it.
    fn estimate_bytes(&self, dir: &Path, settings: &LoadSettings) -> Result<u64>;
    /// Loads the model in `dir` onto `settings.device`.
    fn load(&self, dir: &Path, settings: &LoadSettings) -> Result<Box<dyn FamilyModel>>;
    /// How the worker sizes this family's batches.
    fn budget(&self) -> BudgetRule;
    /// Answers `work` (this family's request) with `error` without running it: the model could
    /// not be loaded.
    fn refuse(&self, work: Work, error: WorkError, model: &str);
}

/// How a family's batches are sized, in its cost units.
#[derive(Debug, Clone, Copy)]
pub struct BudgetRule {
    /// The budget until a warmup has measured what fits (or for good, if not `calibrated`).
    pub initial: usize,
    /// Whether the budget follows the memory free after each batch, within the ceilings.
    pub calibrated: bool,
    /// Largest calibrated budget on the CPU, where more stops paying.
    pub cpu_ceiling: usize,
    /// Largest calibrated budget on a GPU, where memory is the bound.
    pub device_ceiling: usize,
}

/// A request for a family's model: that family's own type (say
/// [`crate::whisper::family::TranscribeWork`]), boxed. Each carries its own reply.
pub type Work = Box<dyn Any + Send>;

/// Why a request was not served.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum WorkError {
    /// The model refused the input (code such as `context_length_exceeded`): retrying cannot
    /// help.
    Rejected { code: &'static str, message: String },
    /// Inference failed, or the model could not be loaded (`code`, as the worker reports it).
    Failed { code: &'static str, message: String },
}

impl WorkError {
    /// Inference failed: code `inference_failed`.
    pub fn inference(message: impl Into<String>) -> WorkError {
        WorkError::Failed { code: "inference_failed", message: message.into() }
    }
}

/// What the worker's model thread offers a running batch of one family.
pub trait BatchRun {
    /// The name of the model serving the batch (replies say which model served them).
    fn model_name(&self) -> &str;
    /// Requests of this family that arrived since the last call; none once a request of another
    /// family or a model swap waits for the model thread (the batch should then drain).
    fn arrivals(&mut self) -> Vec<Work>;
    /// The cost units a batch may take now: the configured or calibrated budget, under the cap.
    fn units(&self) -> usize;
    /// Half of the last batch that ran out of memory (unbounded until one does).
    fn cap(&self) -> usize;
    /// Whether batches are sized by a GPU's memory.
    fn on_device(&self) -> bool;
    /// Whether a batch of `units` fits the memory free now, as the device's allocator would
    /// tell; the error is an out-of-memory error.
    fn reserve(&self, units: usize) -> Result<()>;
    /// As [`BatchRun::reserve`], with `freed` bytes the family released since it last read
    /// [`BatchRun::free_bytes`] (weights it moved to host memory) counted as free.
    fn reserve_freed(&self, units: usize, freed: u64) -> Result<()> {
        let _ = freed;
        self.reserve(units)
    }
    /// Working memory a cost unit took in the warmup, bytes (0 until measured).
    fn unit_bytes(&self) -> u64 {
        0
    }
    /// Bytes batches may still take now, where the worker's memory probe can tell (a GPU's free
    /// memory, or a test's figure); `None` on the CPU. Families choose memory-saving paths by it
    /// (the diffusion family's tiled decode).
    fn free_bytes(&self) -> Option<u64> {
        None
    }
    /// A batch ran out of memory and runs again at `half` units: counted, and the budget (and
    /// the cap) lowered to `half`.
    fn split(&mut self, half: usize, error: &str);
    /// Adds the model time since `started` to the model thread's busy time.
    fn busy(&self, started: Instant);
}

/// Whether `error` says the device (or the host) ran out of memory: the driver's, cuBLAS's
/// (its workspace) and the CPU allocator's words for it.
pub fn is_out_of_memory(error: &anyhow::Error) -> bool {
    error.chain().any(|cause| {
        let text = cause.to_string();
        text.contains("OUT_OF_MEMORY") || text.contains("ALLOC_FAILED") || text.to_ascii_lowercase().contains("out of memory")
    })
}

/// A loaded model of some family.
pub trait FamilyModel: Send + 'static {
    /// Bytes of weights resident.
    fn resident_bytes(&self) -> u64;
    /// Runs a warmup batch (the worker measures the working memory it takes) and returns its
    /// size in the family's cost units ([`Family::unit`]).
    fn warm_up(&mut self, settings: &LoadSettings) -> Result<u64>;
    /// A known input must give a known answer (run before a hot swap switches a version in);
    /// the error says what came out instead.
    fn check_health(&mut self) -> Result<()>;
    /// The model itself.
    fn as_any_mut(&mut self) -> &mut dyn Any;
    /// Runs `work` (this family's requests) as one batch, letting [`BatchRun::arrivals`] join
    /// where the family can, splitting a batch that runs out of memory; answers each request
    /// through its own reply as it finishes. Returns the requests it did not take (they run
    /// next, first).
    fn run(&mut self, work: Vec<Work>, batch: &mut dyn BatchRun) -> Vec<Work>;
}

/// `work` as the family's request type `T`; a request of another type (never sent to a family
/// that does not own it) is dropped, which drops its reply.
pub fn downcast_all<T: 'static>(work: Vec<Work>) -> Vec<T> {
    work.into_iter().filter_map(|w| w.downcast::<T>().ok().map(|b| *b)).collect()
}

/// The size of `dir/file`, with the path in the error.
pub(crate) fn file_len(dir: &Path, file: &str) -> Result<u64> {
    let path = dir.join(file);
    Ok(std::fs::metadata(&path).with_context(|| format!("reading {}", path.display()))?.len())
}
