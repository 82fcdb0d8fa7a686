//! Runs Whisper on a dedicated OS thread, never on the async runtime's workers: the model is
//! loaded on first use (a missing or broken model fails the jobs that need it, not the worker)
//! and kept for later jobs. Requests queue on a channel and run one at a time.

use std::path::PathBuf;
use std::sync::mpsc;
use tern_models::whisper::{TranscribeOptions, Transcript, Whisper};
use tokio::sync::{mpsc as tokio_mpsc, oneshot};

struct Request {
    pcm: Vec<f32>,
    options: TranscribeOptions,
    progress: tokio_mpsc::UnboundedSender<(usize, usize)>,
    reply: oneshot::Sender<Result<Transcript, EngineError>>,
}

/// Why a transcription could not run.
#[derive(Debug, Clone, thiserror::Error)]
pub enum EngineError {
    /// The model could not be loaded (missing files, bad format): code `model_unavailable`.
    #[error("model {model} could not be loaded: {reason}")]
    ModelUnavailable { model: String, reason: String },
    /// Inference failed: code `inference_failed`.
    #[error("inference failed: {0}")]
    Inference(String),
}

impl EngineError {
    pub fn code(&self) -> &'static str {
        match self {
            EngineError::ModelUnavailable { .. } => "model_unavailable",
            EngineError::Inference(_) => "inference_failed",
        }
    }
}

/// Handle to the speech thread. Cheap to share behind an `Arc`.
pub struct SpeechEngine {
    requests: mpsc::Sender<Request>,
    /// The model's folder name under the models directory, e.g. `whisper-tiny.en`.
    pub model_name: String,
}

impl SpeechEngine {
    /// Starts the thread; the model in `models_dir/model_name` loads on the first request.
    pub fn start(models_dir: PathBuf, model_name: String) -> SpeechEngine {
        let (tx, rx) = mpsc::channel::<Request>();
        let name = model_name.clone();
        std::thread::Builder::new()
            .name("speech-engine".into())
            .spawn(move || serve(rx, models_dir.join(&name), name))
            .expect("spawn the speech thread");
        SpeechEngine { requests: tx, model_name }
    }

    /// Transcribes 16 kHz mono PCM; progress (windows done, total) arrives on `progress`.
    pub async fn transcribe(
        &self,
        pcm: Vec<f32>,
        options: TranscribeOptions,
        progress: tokio_mpsc::UnboundedSender<(usize, usize)>,
    ) -> Result<Transcript, EngineError> {
        let (reply, answer) = oneshot::channel();
        self.requests
            .send(Request { pcm, options, progress, reply })
            .map_err(|_| EngineError::Inference("the speech thread stopped".into()))?;
        answer.await.map_err(|_| EngineError::Inference("the speech thread stopped".into()))?
    }
}

fn serve(requests: mpsc::Receiver<Request>, dir: PathBuf, name: String) {
    let device = candle_core::Device::Cpu;
    let mut model: Option<Whisper> = None;
    for req in requests {
        if model.is_none() {
            let started = std::time::Instant::now();
            match Whisper::load_ct2(&dir, &device) {
                Ok(m) => {
                    tracing::info!(model = %name, load_ms = started.elapsed().as_millis() as u64, "model loaded");
                    model = Some(m);
                }
                Err(e) => {
                    let err = EngineError::ModelUnavailable { model: name.clone(), reason: format!("{e:#}") };
                    tracing::error!(error = %err, "model load failed");
                    let _ = req.reply.send(Err(err));
                    continue;
                }
            }
        }
        let m = model.as_mut().expect("loaded above");
        let progress = req.progress;
        let result = m
            .transcribe(&req.pcm, &req.options, &mut |done, total| {
                let _ = progress.send((done, total));
            })
            .map_err(|e| EngineError::Inference(format!("{e:#}")));
        let _ = req.reply.send(result);
    }
}
