//! Health checks a model version passes before it is switched in: a known input must give a
//! known-good output, so weights that load but compute garbage never serve a job. Each family
//! states its own check ([`tern_models::family::FamilyModel::check_health`]).

use super::cache::Model;
use anyhow::Result;

/// Runs `model`'s check; the error says what came out instead.
pub fn check(model: &mut Model) -> Result<()> {
    model.check_health()
}

#[cfg(test)]
pub(super) mod tests {
    //! The checks against the real default models (`TERN_MODELS_DIR`, filled by
    //! scripts/models.sh): each must pass, or no swap to them could ever succeed.
    use super::*;
    use candle_core::Device;
    use std::path::PathBuf;

    /// `TERN_MODELS_DIR`, else `~/.cache/tern/models`: the engine's tests load from here too.
    pub(crate) fn models_dir() -> PathBuf {
        std::env::var_os("TERN_MODELS_DIR")
            .map(PathBuf::from)
            .unwrap_or_else(|| PathBuf::from(std::env::var("HOME").unwrap()).join(".cache/tern/models"))
    }

    #[test]
    fn the_default_models_pass_their_checks() {
        let dir = models_dir();
        let mut models: Vec<Model> = vec![
            Box::new(tern_models::whisper::Whisper::load_ct2(&dir.join("whisper-tiny.en"), &Device::Cpu).unwrap()),
            Box::new(tern_models::embed::Embedder::load(&dir.join("all-MiniLM-L6-v2"), &Device::Cpu).unwrap()),
            Box::new(tern_models::generate::Llm::load_gguf(&dir.join("smollm2-135m-instruct"), &Device::Cpu).unwrap()),
        ];
        for model in &mut models {
            check(model).unwrap();
        }
    }

    #[test]
    fn a_whisper_model_of_another_size_passes_too() {
        let mut base: Model = Box::new(tern_models::whisper::Whisper::load_ct2(&models_dir().join("whisper-base"), &Device::Cpu).unwrap());
        check(&mut base).unwrap();
    }
}
