//! The models resident in a worker: loaded on first use, kept within a memory budget, least
//! recently used evicted first, each warmed up (and its working memory measured) on load.

use super::memory::MemoryProbe;
use super::EngineError;
use candle_core::Device;
use serde::Serialize;
use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::Instant;
use tern_models::family::{FamilyModel, LoadSettings};
use tern_models::precision::Precision;

/// A model family the worker runs ([`tern_models::family::FAMILIES`]); a batch never mixes
/// families (or models). Compared, hashed, logged and serialised by its name.
#[derive(Clone, Copy)]
pub struct Family(&'static dyn tern_models::family::Family);

impl Family {
    /// Every registered family, in the order the admin API lists them.
    pub fn all() -> impl Iterator<Item = Family> {
        tern_models::family::FAMILIES.iter().map(|f| Family(*f))
    }

    /// The family a job kind runs; `None` for kinds without a model (echo).
    pub fn of_kind(kind: tern_jobs::JobKind) -> Option<Family> {
        Family::all().find(|f| f.0.kinds().contains(&kind.as_str()))
    }

    /// The registered family called `name` (`whisper`, `diffusion`).
    pub fn named(name: &str) -> Option<Family> {
        Family::all().find(|f| f.name() == name)
    }

    pub fn name(self) -> &'static str {
        self.0.name()
    }

    /// The family's plug-in: how its models load, warm up and check their health.
    pub fn plugin(self) -> &'static dyn tern_models::family::Family {
        self.0
    }
}

impl PartialEq for Family {
    fn eq(&self, other: &Family) -> bool {
        self.name() == other.name()
    }
}

impl Eq for Family {}

impl std::hash::Hash for Family {
    fn hash<H: std::hash::Hasher>(&self, state: &mut H) {
        self.name().hash(state)
    }
}

impl std::fmt::Debug for Family {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

impl Serialize for Family {
    fn serialize<S: serde::Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        serializer.serialize_str(self.name())
    }
}

/// A loaded model of any family.
pub type Model = Box<dyn FamilyModel>;

struct Entry {
    model: Model,
    family: Family,
    bytes: u64,
    /// Working memory per cost unit (window, token) measured at warmup.
    unit_bytes: u64,
    last_used: u64,
    hits: u64,
    load_ms: u64,
}

/// A snapshot of the cache for logs and the admin API.
#[derive(Debug, Clone, Default, Serialize)]
pub struct CacheReport {
    /// Bytes resident models (and their batches' working memory) may use.
    pub budget_bytes: u64,
    /// Bytes of weights resident now.
    pub resident_bytes: u64,
    pub hits: u64,
    pub misses: u64,
    pub evictions: u64,
    pub load_failures: u64,
    pub models: Vec<ModelReport>,
}

#[derive(Debug, Clone, Serialize)]
pub struct ModelReport {
    pub name: String,
    pub family: Family,
    pub bytes: u64,
    /// Working memory per cost unit measured at warmup (bytes per window or per token).
    pub unit_bytes: u64,
    pub hits: u64,
    pub load_ms: u64,
}

pub struct ModelCache {
    source: Source,
    budget: u64,
    entries: HashMap<String, Entry>,
    clock: u64,
    report: Arc<Mutex<CacheReport>>,
}

impl ModelCache {
    /// `dir`: the models directory (each model is a folder in it); `budget`: bytes;
    /// `warmup_windows`: the largest Whisper batch, which each Whisper model runs on load,
    /// `warmup_beams` hypotheses a window; `probe`: what measures the working memory of that
    /// warmup.
    pub fn new(
        dir: PathBuf,
        runtime: tokio::runtime::Handle,
        device: Device,
        precision: Precision,
        budget: u64,
        warmup_windows: usize,
        warmup_beams: usize,
        probe: MemoryProbe,
        report: Arc<Mutex<CacheReport>>,
    ) -> ModelCache {
        report.lock().expect("not poisoned").budget_bytes = budget;
        let settings = LoadSettings { device, precision, warmup_windows, warmup_beams };
        let source = Source { dir, runtime, settings, probe };
        ModelCache { source, budget, entries: HashMap::new(), clock: 0, report }
    }

    /// Bytes of the budget not held by resident weights: what batches may use.
    pub fn free_bytes(&self) -> u64 {
        self.budget.saturating_sub(self.resident())
    }

    fn resident(&self) -> u64 {
        self.entries.values().map(|e| e.bytes).sum()
    }

    /// The model `name` (a folder under the models directory, or a hub id `hf:OWNER/NAME`),
    /// loading it first if needed, and its working memory per cost unit measured at warmup.
    pub fn get(&mut self, family: Family, name: &str) -> Result<(&mut Model, u64), EngineError> {
        self.clock += 1;
        let clock = self.clock;
        if self.entries.contains_key(name) {
            let e = self.entries.get_mut(name).expect("checked");
            e.last_used = clock;
            e.hits += 1;
            self.report.lock().expect("not poisoned").hits += 1;
            self.publish();
            let e = self.entries.get_mut(name).expect("checked");
            return Ok((&mut e.model, e.unit_bytes));
        }
        self.report.lock().expect("not poisoned").misses += 1;
        let loaded = self.source.locate(family, name, self.budget).and_then(|(dir, estimate)| {
            while self.resident() + estimate > self.budget {
                self.evict_lru_except(None);
            }
            self.source.load(family, name, &dir)
        });
        match loaded {
            Ok(loaded) => {
                let unit_bytes = loaded.unit_bytes;
                Ok((self.install(name, loaded), unit_bytes))
            }
            Err(e) => {
                self.report.lock().expect("not poisoned").load_failures += 1;
                Err(e)
            }
        }
    }

    /// Puts a loaded model in the cache as the most recently used, then evicts others (never
    /// it) while over the budget: the estimate may have been low, or it was loaded in the
    /// background beside the resident models.
    pub fn install(&mut self, name: &str, loaded: Loaded) -> &mut Model {
        self.clock += 1;
        let Loaded { model, family, bytes, unit_bytes, load_ms } = loaded;
        self.entries.insert(name.to_string(), Entry { model, family, bytes, unit_bytes, last_used: self.clock, hits: 0, load_ms });
        while self.resident() > self.budget && self.entries.len() > 1 {
            self.evict_lru_except(Some(name));
        }
        self.publish();
        &mut self.entries.get_mut(name).expect("inserted").model
    }

    /// Where this cache loads models from, for loads in the background.
    pub fn source(&self) -> Source {
        self.source.clone()
    }

    /// Evicts the least recently used model other than `keep`.
    fn evict_lru_except(&mut self, keep: Option<&str>) {
        let victim = self
            .entries
            .iter()
            .filter(|(n, _)| Some(n.as_str()) != keep)
            .min_by_key(|(_, e)| e.last_used)
            .map(|(n, _)| n.clone());
        if let Some(name) = victim {
            let e = self.entries.remove(&name).expect("present");
            tracing::info!(model = %name, bytes = e.bytes, "model evicted (least recently used) to stay within the memory budget");
            self.report.lock().expect("not poisoned").evictions += 1;
        }
    }

    fn publish(&self) {
        let mut r = self.report.lock().expect("not poisoned");
        r.resident_bytes = self.resident();
        r.models = self
            .entries
            .iter()
            .map(|(name, e)| ModelReport {
                name: name.clone(),
                family: e.family,
                bytes: e.bytes,
                unit_bytes: e.unit_bytes,
                hits: e.hits,
                load_ms: e.load_ms,
            })
            .collect();
        r.models.sort_by(|a, b| a.name.cmp(&b.name));
    }
}

/// A model loaded and warmed up, not yet in a cache.
pub struct Loaded {
    pub model: Model,
    family: Family,
    bytes: u64,
    unit_bytes: u64,
    pub load_ms: u64,
}

/// Where models come from: the models directory, the hub, and the device they run on.
#[derive(Clone)]
pub struct Source {
    dir: PathBuf,
    /// Runs hub downloads (async HTTP) from threads outside the runtime.
    runtime: tokio::runtime::Handle,
    /// The device, precision and warmup sizes models load with.
    settings: LoadSettings,
    /// Measures each warmup's working memory.
    probe: MemoryProbe,
}

impl Source {
    /// The model's folder (downloaded first for a hub id) and its estimated size, refused when
    /// the size is over `budget`.
    pub fn locate(&self, family: Family, name: &str, budget: u64) -> Result<(PathBuf, u64), EngineError> {
        let unavailable = |reason: String| EngineError::ModelUnavailable { model: name.to_string(), reason };
        let dir = if name.starts_with(super::hub::PREFIX) {
            super::hub::fetch(&self.dir, name, family, &self.runtime).map_err(|e| unavailable(format!("{e:#}")))?
        } else {
            self.dir.join(name)
        };
        let estimate = family.plugin().estimate_bytes(&dir, &self.settings).map_err(|e| unavailable(format!("{e:#}")))?;
        if estimate > budget {
            return Err(unavailable(format!(
                "it needs about {estimate} bytes; the worker's memory budget is {budget} bytes (TERN_MEMORY_BUDGET)"
            )));
        }
        Ok((dir, estimate))
    }

    /// Loads and warms up the model in `dir`, measuring its working memory per cost unit.
    pub fn load(&self, family: Family, name: &str, dir: &Path) -> Result<Loaded, EngineError> {
        let started = Instant::now();
        let loaded = family.plugin().load(dir, &self.settings).and_then(|mut model| {
            // The working memory per cost unit, as the probe measures it: the fall of the
            // device's free memory on a GPU, the growth of the peak resident set on the CPU.
            let unit_bytes = self.probe.measure(&mut || model.warm_up(&self.settings)).map_err(|e| e.context("warmup failed"))?;
            Ok((model, unit_bytes))
        });
        let (model, unit_bytes) = loaded.map_err(|e| {
            tracing::error!(model = %name, error = format!("{e:#}"), "model refused");
            EngineError::ModelUnavailable { model: name.to_string(), reason: format!("{e:#}") }
        })?;
        let bytes = model.resident_bytes();
        let load_ms = started.elapsed().as_millis() as u64;
        metrics::histogram!("tern_model_load_seconds", "model" => name.to_string()).record(started.elapsed().as_secs_f64());
        tracing::info!(model = %name, ?family, bytes, unit_bytes, load_ms, "model loaded and warmed up");
        Ok(Loaded { model, family, bytes, unit_bytes, load_ms })
    }
}
