//! Health checks a model version passes before it is switched in: a known input must give a
//! known-good output, so weights that load but compute garbage never serve a job.

use super::cache::Model;
use anyhow::{ensure, Context, Result};
use tern_models::generate::{ChatMessage, GenerateOptions, Prompt};
use tern_models::whisper::TranscribeOptions;

/// A LibriVox clip (public domain, from Debian's pocketsphinx-testdata), 16 kHz mono, 3 s.
const SPEECH: &[u8] = include_bytes!("../../assets/health-check-speech.wav");
const SPEECH_TEXT: &str = "he was not an ill disposed young man";
/// Most word error rate a Whisper version may show on [`SPEECH`] (tiny.en: 0).
const MAX_WER: f64 = 0.25;

/// Paraphrases must be closer than unrelated sentences by at least this cosine margin
/// (all-MiniLM-L6-v2: 0.755 against about 0.0).
const MIN_MARGIN: f32 = 0.2;

/// Runs `model`'s check; the error says what came out instead.
pub fn check(model: &mut Model) -> Result<()> {
    match model {
        Model::Whisper(m) => {
            let pcm = tern_models::audio::decode_mono_16k(SPEECH).context("decoding the check clip")?;
            let t = m.transcribe(&pcm, &TranscribeOptions::default(), &mut |_, _| {})?;
            let wer = tern_models::wer::word_error_rate(SPEECH_TEXT, &t.text);
            ensure!(wer <= MAX_WER, "transcribed {SPEECH_TEXT:?} as {:?} (word error rate {wer:.2})", t.text.trim());
        }
        Model::Embedder(m) => {
            let v = m.embed(&["A man is eating food.", "A man is eating a piece of bread.", "A plane is taking off."])?;
            ensure!(v.iter().flatten().all(|x| x.is_finite()), "non-finite embedding");
            let cos = |a: &[f32], b: &[f32]| a.iter().zip(b).map(|(x, y)| x * y).sum::<f32>();
            let (near, far) = (cos(&v[0], &v[1]), cos(&v[0], &v[2]));
            ensure!(
                near - far >= MIN_MARGIN,
                "paraphrases scored {near:.3} and unrelated sentences {far:.3}: the margin is under {MIN_MARGIN}"
            );
        }
        Model::Llm(m) => {
            let prompt = Prompt::Chat(vec![ChatMessage {
                role: "user".into(),
                content: "What is the capital of France? Answer with one word.".into(),
            }]);
            let opts = GenerateOptions { max_tokens: 16, temperature: 0.0, ..Default::default() };
            let g = m.generate(&prompt, &opts, &mut |_, _| true)?;
            ensure!(g.text.to_lowercase().contains("paris"), "asked for the capital of France, answered {:?}", g.text);
        }
    }
    Ok(())
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
        let mut models = vec![
            Model::Whisper(tern_models::whisper::Whisper::load_ct2(&dir.join("whisper-tiny.en"), &Device::Cpu).unwrap()),
            Model::Embedder(tern_models::embed::Embedder::load(&dir.join("all-MiniLM-L6-v2"), &Device::Cpu).unwrap()),
            Model::Llm(tern_models::generate::Llm::load_gguf(&dir.join("smollm2-135m-instruct"), &Device::Cpu).unwrap()),
        ];
        for model in &mut models {
            check(model).unwrap();
        }
    }

    #[test]
    fn a_whisper_model_of_another_size_passes_too() {
        let mut base =
            Model::Whisper(tern_models::whisper::Whisper::load_ct2(&models_dir().join("whisper-base"), &Device::Cpu).unwrap());
        check(&mut base).unwrap();
    }
}
