//! The sentence embedder as a [`Family`]: BERT-family encoders in Hugging Face folders
//! (`model.safetensors`, `config.json`, `tokenizer.json`), costed in padded tokens.

use std::any::Any;
use std::path::Path;

use anyhow::{ensure, Result};

use super::Embedder;
use crate::family::{file_len, Family, FamilyModel, LoadSettings};
use crate::precision::Precision;

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

    fn unit(&self) -> &'static str {
        "tokens"
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
}
