//! A model family as a plug-in: what the worker's engine, model cache, hub downloads and hot
//! swap need of a family, so that they work on this interface alone.
//!
//! A family is a folder under `models/src/` holding the model and its `family.rs`, which
//! implements [`Family`] (how a model folder loads, what it weighs) and [`FamilyModel`] on the
//! loaded model (its warmup, whose working memory the worker measures to size batches, and its
//! health check), and one line in [`FAMILIES`]. The worker maps job kinds to families
//! (`worker/src/kinds/`).

use std::any::Any;
use std::path::Path;

use anyhow::{Context, Result};
use candle_core::Device;

use crate::precision::Precision;

/// Every family a worker can serve: registering a family is one line here.
pub static FAMILIES: &[&dyn Family] = &[&crate::whisper::family::FAMILY, &crate::embed::family::FAMILY, &crate::generate::family::FAMILY];

/// The family called `name` (see [`Family::name`]).
pub fn by_name(name: &str) -> Option<&'static dyn Family> {
    FAMILIES.iter().copied().find(|f| f.name() == name)
}

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

/// A family of models: how a model folder loads.
pub trait Family: Send + Sync + 'static {
    /// Lowercase name: metrics labels, logs, the admin API (`whisper`, `embedder`, `llm`).
    fn name(&self) -> &'static str;
    /// The unit a job's cost is counted in, a batch budget too (`windows`, `tokens`).
    fn unit(&self) -> &'static str;
    /// What a hub model `hf:REPO[/FILE]` downloads: (file in the repository, name in the local
    /// folder). An error where the family needs a file named and none is.
    fn hub_files(&self, repo: &str, file: Option<&str>) -> Result<Vec<(String, &'static str)>>;
    /// Bytes the model in `dir` will hold resident, from its files, before loading it.
    fn estimate_bytes(&self, dir: &Path, settings: &LoadSettings) -> Result<u64>;
    /// Loads the model in `dir` onto `settings.device`.
    fn load(&self, dir: &Path, settings: &LoadSettings) -> Result<Box<dyn FamilyModel>>;
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
    /// The model itself, for the code that runs its batches.
    fn as_any_mut(&mut self) -> &mut dyn Any;
}

/// The size of `dir/file`, with the path in the error.
pub(crate) fn file_len(dir: &Path, file: &str) -> Result<u64> {
    let path = dir.join(file);
    Ok(std::fs::metadata(&path).with_context(|| format!("reading {}", path.display()))?.len())
}
