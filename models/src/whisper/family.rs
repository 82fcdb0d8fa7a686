//! Whisper as a [`Family`]: CTranslate2 (faster-whisper) folders, costed in 30 s windows.

use std::any::Any;
use std::borrow::Cow;
use std::cell::RefCell;
use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Instant;

use anyhow::{ensure, Context, Result};

use super::{Pcm, TranscribeInput, TranscribeOptions, Transcript, Whisper};
use crate::family::{downcast_all, file_len, is_out_of_memory, BatchRun, BudgetRule, Family, FamilyModel, LoadSettings, Setting, Work, WorkError};

/// A recording to transcribe, with its reply.
pub struct TranscribeWork {
    /// 16 kHz mono; shared with the model while it runs, kept to run the recording again if
    /// its batch runs out of memory.
    pub pcm: Arc<Vec<f32>>,
    pub options: TranscribeOptions,
    /// After each window: windows done, windows in all, the transcript of the windows done
    /// from the first on (it grows at its end).
    pub progress: Box<dyn FnMut(usize, usize, &str) + Send>,
    /// Set when the job is canceled or released: its remaining windows are skipped.
    pub stop: Arc<AtomicBool>,
    /// The transcript or why not, and the model that served it.
    pub reply: Box<dyn FnOnce(Result<Transcript, WorkError>, &str) + Send>,
}

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

    fn kinds(&self) -> &'static [&'static str] {
        &["transcribe", "audio_embed"]
    }

    fn unit(&self) -> &'static str {
        "windows"
    }

    fn model_setting(&self) -> Setting {
        Setting {
            flag: "whisper-model",
            env: "TERN_WHISPER_MODEL",
            default: Some("whisper-tiny.en"),
            help: "Whisper model for `transcribe` and `audio_embed` jobs: a CTranslate2 (faster-whisper) folder under the models directory, or a hub id such as `hf:Systran/faster-whisper-base` (downloaded once into the models directory; HF_ENDPOINT and HF_TOKEN are honoured)",
        }
    }

    fn budget_setting(&self) -> Setting {
        Setting {
            flag: "transcribe-batch-windows",
            env: "TERN_TRANSCRIBE_BATCH_WINDOWS",
            default: None,
            help: "Most Whisper windows (30 s each) in one batch. Default: calibrated from the memory free (on a GPU the device's, read from the CUDA driver) and the memory per window measured at warmup, at most 16 on the CPU and 1,024 on a GPU; halved when a batch runs out of memory",
        }
    }

    /// CTranslate2's files (`Systran/faster-whisper-base`); a repository without `model.bin`
    /// gets Hugging Face's instead ([`Family::hub_other_files`]).
    fn hub_files(&self, _repo: &str, _file: Option<&str>) -> Result<Vec<(String, &'static str)>> {
        Ok(["model.bin", "config.json", "tokenizer.json"].into_iter().map(|f| (f.to_string(), f)).collect())
    }

    /// A Hugging Face repository (`openai/whisper-large-v3`, `distil-whisper/distil-large-v3`).
    fn hub_other_files(&self, _repo: &str) -> Vec<(String, &'static str)> {
        ["model.safetensors", "config.json", "generation_config.json", "tokenizer.json"].into_iter().map(|f| (f.to_string(), f)).collect()
    }

    /// CTranslate2 files hold F16 weights: twice the file in F32, as stored in F16. A Hugging
    /// Face folder: its tensors' elements in the precision's dtype.
    fn estimate_bytes(&self, dir: &Path, settings: &LoadSettings) -> Result<u64> {
        let size = settings.precision.dtype(&settings.device).size_in_bytes() as u64;
        if dir.join("model.bin").is_file() {
            return Ok(file_len(dir, "model.bin")? * size / 2);
        }
        Ok(super::hf::elements(dir)? * size)
    }

    /// Either format ([`Whisper::load_in`]).
    fn load(&self, dir: &Path, settings: &LoadSettings) -> Result<Box<dyn FamilyModel>> {
        Ok(Box::new(Whisper::load_in(dir, &settings.device, settings.precision)?))
    }

    /// 8 windows until the warmup has measured what fits; then what the memory free holds, at
    /// most 16 on the CPU (past that the products are at the kernel's peak) and 1,024 on a GPU.
    fn budget(&self) -> BudgetRule {
        BudgetRule { initial: 8, calibrated: true, cpu_ceiling: 16, device_ceiling: 1024 }
    }

    fn refuse(&self, work: Work, error: WorkError, model: &str) {
        if let Ok(w) = work.downcast::<TranscribeWork>() {
            (w.reply)(Err(error), model);
        }
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

    /// Continuous batching ([`Whisper::transcribe_continuous`]): recordings that arrive join
    /// whenever the batch runs short of windows; each reply goes out as soon as its recording
    /// is transcribed. Recordings whose batch ran out of memory (or would have: the free memory
    /// cannot hold its windows) run again at half the windows, which become the budget's cap;
    /// only at one window does running out of memory fail them.
    fn run(&mut self, work: Vec<Work>, batch: &mut dyn BatchRun) -> Vec<Work> {
        let name = batch.model_name().to_string();
        let mut window_batch = batch.units();
        let mut pending: Vec<TranscribeWork> = downcast_all(work);
        while !pending.is_empty() {
            // Recordings to run again at half the windows.
            let mut again: Vec<TranscribeWork> = Vec::new();
            let mut out_of_memory = None;
            if let Err(e) = batch.reserve(window_batch) {
                out_of_memory = Some(format!("{e:#}"));
                again = pending;
            } else {
                // Per request number, until it is answered.
                let jobs: RefCell<Vec<Option<TranscribeWork>>> = Default::default();
                let mut waiting = pending;
                let mut first_call = true;
                let mut joined_late = 0usize;
                let mut admit = || -> Vec<TranscribeInput<'static>> {
                    if !first_call {
                        let late: Vec<TranscribeWork> = downcast_all(batch.arrivals());
                        joined_late += late.len();
                        waiting.extend(late);
                    }
                    first_call = false;
                    waiting
                        .drain(..)
                        .map(|w| {
                            let input = TranscribeInput { pcm: Pcm::Shared(w.pcm.clone()), options: Cow::Owned(w.options.clone()) };
                            jobs.borrow_mut().push(Some(w));
                            input
                        })
                        .collect()
                };
                let canceled = |i: usize| jobs.borrow()[i].as_ref().is_some_and(|w| w.stop.load(Ordering::Relaxed));
                let mut progress = |i: usize, p: super::Progress<'_>| {
                    if let Some(w) = jobs.borrow_mut()[i].as_mut() {
                        (w.progress)(p.done, p.total, p.text);
                    }
                };
                let mut served = 0usize;
                let mut done = |i: usize, result: Result<Transcript>| {
                    let Some(w) = jobs.borrow_mut()[i].take() else { return };
                    match result {
                        Err(e) if window_batch > 1 && is_out_of_memory(&e) => {
                            out_of_memory.get_or_insert_with(|| format!("{e:#}"));
                            again.push(w);
                        }
                        result => {
                            served += 1;
                            (w.reply)(result.map_err(|e| WorkError::inference(format!("{e:#}"))), &name);
                        }
                    }
                };
                let started = Instant::now();
                self.transcribe_continuous(window_batch, &mut admit, &canceled, &mut progress, &mut done);
                drop(admit);
                drop(done);
                batch.busy(started);
                let stats = self.last_decode_stats();
                tracing::info!(recordings = served, joined_late, window_batch, model_ms = started.elapsed().as_millis() as u64, steps = stats.steps, windows = stats.seated, joined_running = stats.joined_running, "transcription batch done");
            }
            if let Some(error) = out_of_memory {
                if window_batch == 1 {
                    // One window does not fit: nothing smaller to try; the jobs retry later.
                    for w in again.drain(..) {
                        (w.reply)(Err(WorkError::inference(format!("out of memory at one window: {error}"))), &name);
                    }
                } else {
                    window_batch /= 2;
                    batch.split(window_batch, &error);
                }
            }
            pending = again;
        }
        Vec::new()
    }
}
