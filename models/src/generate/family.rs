//! The language model as a [`Family`]: GGUF files (`model.gguf`), costed in tokens (prompt and
//! generated).

use std::any::Any;
use std::path::Path;

use anyhow::{bail, ensure, Result};

use super::{ChatMessage, GenerateOptions, Llm, Prompt};
use crate::family::{file_len, Family, FamilyModel, LoadSettings};

pub struct LlmFamily;
pub static FAMILY: LlmFamily = LlmFamily;

/// Tokens generated in the warmup after a short prompt.
const WARMUP_TOKENS: usize = 8;

impl Family for LlmFamily {
    fn name(&self) -> &'static str {
        "llm"
    }

    fn unit(&self) -> &'static str {
        "tokens"
    }

    /// One GGUF file of the repository, named in the hub id (`hf:OWNER/NAME/FILE.gguf`).
    fn hub_files(&self, repo: &str, file: Option<&str>) -> Result<Vec<(String, &'static str)>> {
        match file {
            Some(f) => Ok(vec![(f.to_string(), "model.gguf")]),
            None => bail!("name the GGUF file to load: hf:{repo}/FILE.gguf"),
        }
    }

    /// GGUF loads as stored on the CPU (a GPU dequantizes it at load: more, measured then).
    fn estimate_bytes(&self, dir: &Path, _settings: &LoadSettings) -> Result<u64> {
        file_len(dir, "model.gguf")
    }

    fn load(&self, dir: &Path, settings: &LoadSettings) -> Result<Box<dyn FamilyModel>> {
        let llm = Llm::load_gguf(dir, &settings.device)?;
        llm.set_precision(settings.precision);
        Ok(Box::new(llm))
    }
}

impl FamilyModel for Llm {
    fn resident_bytes(&self) -> u64 {
        self.weights_bytes()
    }

    fn warm_up(&mut self, _settings: &LoadSettings) -> Result<u64> {
        let prompt = Prompt::Text("tern warmup".into());
        let opts = GenerateOptions { max_tokens: WARMUP_TOKENS, temperature: 0.0, ..Default::default() };
        let g = self.generate(&prompt, &opts, &mut |_, _| true)?;
        Ok((g.prompt_tokens + g.completion_tokens) as u64)
    }

    fn check_health(&mut self) -> Result<()> {
        let prompt = Prompt::Chat(vec![ChatMessage { role: "user".into(), content: "What is the capital of France? Answer with one word.".into() }]);
        let opts = GenerateOptions { max_tokens: 16, temperature: 0.0, ..Default::default() };
        let g = self.generate(&prompt, &opts, &mut |_, _| true)?;
        ensure!(g.text.to_lowercase().contains("paris"), "asked for the capital of France, answered {:?}", g.text);
        Ok(())
    }

    fn as_any_mut(&mut self) -> &mut dyn Any {
        self
    }
}
