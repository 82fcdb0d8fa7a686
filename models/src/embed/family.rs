//! The sentence embedder as a [`Family`]: BERT-family encoders in Hugging Face folders
//! (`model.safetensors`, `config.json`, `tokenizer.json`), costed in padded tokens.

use std::any::Any;
use std::path::Path;
use std::time::Instant;

use anyhow::{ensure, Result};

use super::{Embedder, MAX_TOKENS_PER_TEXT, TOKENS_PER_FORWARD};
use crate::family::{downcast_all, file_len, is_out_of_memory, BatchRun, BudgetRule, Family, FamilyModel, LoadSettings, Setting, Work, WorkError};
use crate::precision::Precision;

/// Texts to embed, with the reply: one unit vector per text, in order.
pub struct EmbedWork {
    pub texts: Vec<String>,
    /// The vectors or why not, and the model that served them.
    pub reply: Box<dyn FnOnce(Result<Vec<Vec<f32>>, WorkError>, &str) + Send>,
}

pub struct EmbedderFamily;
pub static FAMILY: EmbedderFamily = EmbedderFamily;

/// Texts in the warmup batch, of about 64 tokens each.
const WARMUP_TEXTS: usize = 8;
/// Paraphrases must be closer than unrelated sentences by at least this cosine margin
/// (all-MiniLM-L6-v2: 0.755 against about 0.0).
const MIN_MARGIN: f32 = 0.2;

impl Family for EmbedderFamily {
    fn name(&self) -> &'static str {
        "embedder"
    }

    fn kinds(&self) -> &'static [&'static str] {
        &["embed"]
    }

    fn unit(&self) -> &'static str {
        "tokens"
    }

    fn model_setting(&self) -> Setting {
        Setting {
            flag: "embed-model",
            env: "TERN_EMBED_MODEL",
            default: Some("all-MiniLM-L6-v2"),
            help: "Sentence-embedding model for `embed` jobs: a Hugging Face folder (BERT family) under the models directory, or a hub id (`hf:sentence-transformers/all-MiniLM-L6-v2`)",
        }
    }

    fn budget_setting(&self) -> Setting {
        Setting {
            flag: "embed-batch-tokens",
            env: "TERN_EMBED_BATCH_TOKENS",
            default: None,
            help: "Most padded tokens in one batch of embedding jobs. Default: calibrated, at most 32,768 on the CPU and 1,048,576 on a GPU",
        }
    }

    fn hub_files(&self, _repo: &str, _file: Option<&str>) -> Result<Vec<(String, &'static str)>> {
        Ok(["config.json", "tokenizer.json", "model.safetensors"].into_iter().map(|f| (f.to_string(), f)).collect())
    }

    /// Safetensors load as stored.
    fn estimate_bytes(&self, dir: &Path, _settings: &LoadSettings) -> Result<u64> {
        file_len(dir, "model.safetensors")
    }

    /// Half precision on the CPU is for Whisper only: candle's CPU kernels are slow at it, and
    /// the embedder's fast path there is F32 (with BF16 products when chosen).
    fn load(&self, dir: &Path, settings: &LoadSettings) -> Result<Box<dyn FamilyModel>> {
        let precision = match settings.precision {
            Precision::F16 | Precision::Bf16 if settings.device.is_cpu() => Precision::Auto,
            p => p,
        };
        Ok(Box::new(Embedder::load_in(dir, &settings.device, precision)?))
    }

    /// Padded tokens of a pulled batch: 8,192 until the warmup has measured what fits; then what
    /// the memory free holds, at most 32,768 on the CPU and 1,048,576 on a GPU (where one forward
    /// pass takes the whole batch).
    fn budget(&self) -> BudgetRule {
        BudgetRule { initial: 8192, calibrated: true, cpu_ceiling: 32_768, device_ceiling: 1 << 20 }
    }

    fn refuse(&self, work: Work, error: WorkError, model: &str) {
        if let Ok(w) = work.downcast::<EmbedWork>() {
            (w.reply)(Err(error), model);
        }
    }
}

impl FamilyModel for Embedder {
    fn resident_bytes(&self) -> u64 {
        self.weights_bytes()
    }

    fn warm_up(&mut self, _settings: &LoadSettings) -> Result<u64> {
        let text = "tern warms this model up with a sentence of about sixty four tokens. ".repeat(4);
        let texts: Vec<&str> = (0..WARMUP_TEXTS).map(|_| text.as_str()).collect();
        let v = self.embed(&texts)?;
        ensure!(v.iter().flatten().all(|x| x.is_finite()), "non-finite embedding");
        Ok(self.count_tokens(&texts)?.iter().sum::<usize>() as u64)
    }

    fn check_health(&mut self) -> Result<()> {
        let v = self.embed(&["A man is eating food.", "A man is eating a piece of bread.", "A plane is taking off."])?;
        ensure!(v.iter().flatten().all(|x| x.is_finite()), "non-finite embedding");
        let cos = |a: &[f32], b: &[f32]| a.iter().zip(b).map(|(x, y)| x * y).sum::<f32>();
        let (near, far) = (cos(&v[0], &v[1]), cos(&v[0], &v[2]));
        ensure!(near - far >= MIN_MARGIN, "paraphrases scored {near:.3} and unrelated sentences {far:.3}: the margin is under {MIN_MARGIN}");
        Ok(())
    }

    fn as_any_mut(&mut self) -> &mut dyn Any {
        self
    }

    /// Every request's texts in one pass (sorted by length across requests). On a GPU one
    /// forward pass takes the whole pulled batch; the CPU gains nothing past
    /// [`TOKENS_PER_FORWARD`]. A pass that runs out of memory (or would: the free memory cannot
    /// hold its tokens) runs again with half the tokens per forward pass, which become the
    /// budget's cap.
    fn run(&mut self, work: Vec<Work>, batch: &mut dyn BatchRun) -> Vec<Work> {
        let jobs: Vec<EmbedWork> = downcast_all(work);
        let name = batch.model_name().to_string();
        let all: Vec<&str> = jobs.iter().flat_map(|w| w.texts.iter().map(String::as_str)).collect();
        let mut per_forward = if batch.on_device() { batch.units() } else { TOKENS_PER_FORWARD }.min(batch.cap());
        let result = loop {
            let result = batch.reserve(per_forward).and_then(|()| {
                let started = Instant::now();
                let vectors = self.embed_in(&all, per_forward);
                batch.busy(started);
                vectors
            });
            match result {
                // A text runs alone below its own length: smaller passes would not help.
                Err(e) if per_forward > MAX_TOKENS_PER_TEXT && is_out_of_memory(&e) => {
                    per_forward /= 2;
                    batch.split(per_forward, &format!("{e:#}"));
                }
                result => break result,
            }
        };
        match result {
            Ok(vectors) => {
                let mut vectors = vectors.into_iter();
                for w in jobs {
                    let mine: Vec<_> = vectors.by_ref().take(w.texts.len()).collect();
                    (w.reply)(Ok(mine), &name);
                }
            }
            Err(e) => {
                let e = WorkError::inference(format!("{e:#}"));
                jobs.into_iter().for_each(|w| (w.reply)(Err(e.clone()), &name));
            }
        }
        Vec::new()
    }
}
