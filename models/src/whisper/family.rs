//! Whisper as a [`Family`]: CTranslate2 (faster-whisper) folders, costed in 30 s windows.

use std::any::Any;
use std::path::Path;

use anyhow::{ensure, Context, Result};

use super::{TranscribeOptions, Whisper};
use crate::family::{file_len, Family, FamilyModel, LoadSettings};

pub struct WhisperFamily;
pub static FAMILY: WhisperFamily = WhisperFamily;

/// A LibriVox clip (public domain, from Debian's pocketsphinx-testdata), 16 kHz mono, 3 s.
const SPEECH: &[u8] = include_bytes!("../../assets/health-check-speech.wav");
const SPEECH_TEXT: &str = "he was not an ill disposed young man";
/// Most word error rate a Whisper version may show on [`SPEECH`] (tiny.en: 0).
const MAX_WER: f64 = 0.25;

impl Family for WhisperFamily {
    fn name(&self) -> &'static str {
        "whisper"
    }

    fn unit(&self) -> &'static str {
        "windows"
    }

    fn hub_files(&self, _repo: &str, _file: Option<&str>) -> Result<Vec<(String, &'static str)>> {
        Ok(["model.bin", "config.json", "tokenizer.json"].into_iter().map(|f| (f.to_string(), f)).collect())
    }

    /// CTranslate2 files hold F16 weights: twice the file in F32, as stored in F16.
    fn estimate_bytes(&self, dir: &Path, settings: &LoadSettings) -> Result<u64> {
        Ok(file_len(dir, "model.bin")? * settings.precision.dtype(&settings.device).size_in_bytes() as u64 / 2)
    }

    fn load(&self, dir: &Path, settings: &LoadSettings) -> Result<Box<dyn FamilyModel>> {
        Ok(Box::new(Whisper::load_ct2_in(dir, &settings.device, settings.precision)?))
    }
}

impl FamilyModel for Whisper {
    fn resident_bytes(&self) -> u64 {
        self.weights_bytes()
    }

    /// The largest batch the worker starts with (`warmup_windows` full 30 s windows, about
    /// 2.5 s for tiny.en on 2 AVX-512 cores), so a model that cannot hold it is refused at load
    /// and its working memory is already mapped when the first real batch comes.
    fn warm_up(&mut self, settings: &LoadSettings) -> Result<u64> {
        self.warmup(settings.warmup_windows, settings.warmup_beams)?;
        Ok(settings.warmup_windows as u64)
    }

    fn check_health(&mut self) -> Result<()> {
        let pcm = crate::audio::decode_mono_16k(SPEECH).context("decoding the check clip")?;
        let t = self.transcribe(&pcm, &TranscribeOptions::default(), &mut |_, _| {})?;
        let wer = crate::wer::word_error_rate(SPEECH_TEXT, &t.text);
        ensure!(wer <= MAX_WER, "transcribed {SPEECH_TEXT:?} as {:?} (word error rate {wer:.2})", t.text.trim());
        Ok(())
    }

    fn as_any_mut(&mut self) -> &mut dyn Any {
        self
    }
}
