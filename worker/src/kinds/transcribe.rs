//! `transcribe`: speech to text with Whisper. See `schemas/transcribe.input.json`.
//!
//! The audio is fetched, decoded and resampled off the async runtime, checked against the
//! duration limit, then transcribed on the speech thread. Outputs: JSON (the primary output),
//! SRT and VTT.

use super::{engine_failure, permanent, Context, Execution, ExtraOutput};
use crate::engine::{answer_with, Engine, EngineError, Served};
use serde_json::{json, Value};
use std::sync::atomic::AtomicBool;
use std::sync::Arc;
use tern_jobs::file_ref::FileRef;
use tern_jobs::{Failure, Job, JobKind};
use tern_models::audio;
use tern_models::whisper::family::TranscribeWork;
use tern_models::whisper::{Task, TranscribeOptions, Transcript};
use tokio::sync::{mpsc, oneshot};

/// A transcription's progress as the model thread reports it, once per window done.
#[derive(Debug, Clone)]
pub struct TranscribeProgress {
    /// Windows done.
    pub done: usize,
    /// Windows in all.
    pub total: usize,
    /// The transcript of the windows done from the first on, with none missing: it grows at
    /// its end.
    pub text: String,
}

/// Transcribes 16 kHz mono PCM on the engine's Whisper; progress (windows done, total, the
/// text of the leading windows done) arrives on `progress`; raising `stop` skips the windows
/// not yet started (the reply is then an error).
pub async fn transcribe(
    engine: &Engine,
    pcm: Vec<f32>,
    options: TranscribeOptions,
    progress: mpsc::UnboundedSender<TranscribeProgress>,
    stop: Arc<AtomicBool>,
) -> Result<Served<Transcript>, EngineError> {
    let (reply, answer) = oneshot::channel();
    let work = TranscribeWork {
        pcm: Arc::new(pcm),
        options,
        progress: Box::new(move |done, total, text| drop(progress.send(TranscribeProgress { done, total, text: text.to_string() }))),
        stop,
        reply: answer_with(reply),
    };
    engine.run(JobKind::Transcribe, Box::new(work), answer).await
}

pub async fn run(job: &Job, ctx: &Context<'_>) -> Execution {
    let input = &job.input;
    let Some(engine) = ctx.engine else {
        return permanent("model_unavailable", "this worker has no model engine");
    };
    let pcm = match audio_of(job, ctx).await {
        Ok(pcm) => pcm,
        Err(stopped_or_failed) => return stopped_or_failed,
    };
    let options = TranscribeOptions {
        language: input.get("language").and_then(Value::as_str).map(str::to_string),
        task: if input.get("task").and_then(Value::as_str) == Some("translate") { Task::Translate } else { Task::Transcribe },
        timestamps: input.get("timestamps").and_then(Value::as_bool).unwrap_or(true),
        padding: ctx.whisper_padding,
        feature_padding: ctx.whisper_feature_padding,
        prompt: input.get("prompt").and_then(Value::as_str).map(str::to_string),
        temperature: input.get("temperature").and_then(Value::as_f64).unwrap_or(0.0),
        beam_size: input.get("beam_size").and_then(Value::as_u64).map_or(ctx.whisper_beam_size, |b| b as usize),
        fallback: input.get("temperature_fallback").and_then(Value::as_bool).unwrap_or(true),
        embed: false,
        word_timestamps: input.get("word_timestamps").and_then(Value::as_bool).unwrap_or(false),
    };
    let (progress_tx, mut progress_rx) = tokio::sync::mpsc::unbounded_channel::<TranscribeProgress>();
    let report = async {
        while let Some(mut p) = progress_rx.recv().await {
            // Only the newest state matters.
            while let Ok(newer) = progress_rx.try_recv() {
                p = newer;
            }
            // The transcript so far goes with the count, so streams show text as windows end.
            let written = if p.text.is_empty() {
                ctx.queue.set_progress(job.kind, job.id, p.done as u64, p.total as u64).await
            } else {
                ctx.queue.set_progress_text(job.kind, job.id, p.done as u64, p.total as u64, &p.text).await
            };
            if let Err(e) = written {
                tracing::warn!(error = %e, "could not record progress");
            }
            super::progress_event(job, ctx).await;
        }
    };
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let work = async { tokio::join!(transcribe(engine, pcm, options, progress_tx, stop.clone()), report) };
    let Some((transcript, ())) = super::until_stopped(ctx.stop, &stop, work).await else {
        return Execution::Stopped;
    };
    let transcript = match transcript {
        Ok(served) => served,
        Err(e) => return engine_failure(&e),
    };
    let (transcript, model) = (transcript.value, transcript.model);
    metrics::counter!("tern_audio_seconds_total").increment(transcript.duration.round() as u64);
    let body = json!({
        "text": transcript.text,
        "language": transcript.language,
        "duration": transcript.duration,
        "model": model,
        "segments": transcript.segments,
    });
    Execution::Output {
        body: serde_json::to_vec(&body).expect("JSON values serialise").into(),
        content_type: "application/json",
        extension: "json",
        extras: vec![
            ExtraOutput {
                format: "srt".into(),
                body: super::subtitles::srt(&transcript.segments).into(),
                content_type: "application/x-subrip",
            },
            ExtraOutput { format: "vtt".into(), body: super::subtitles::vtt(&transcript.segments).into(), content_type: "text/vtt" },
        ],
        inline: false,
    }
}

/// The job's `audio`, fetched, decoded to 16 kHz mono off the async runtime and checked against
/// the duration limit; its cost in 30 s windows recorded where it was not known at submit
/// (audio given by URL). `Err`: the execution to report (a failure, or stopped).
pub(super) async fn audio_of(job: &Job, ctx: &Context<'_>) -> Result<Vec<f32>, Execution> {
    let file = match job.input.get("audio").map(FileRef::parse) {
        Some(Ok(f)) => f,
        Some(Err(e)) => return Err(permanent(e.code(), e.to_string())),
        None => return Err(permanent("invalid_input", "input.audio is required")),
    };
    let bytes = match ctx.files.fetch(&file).await {
        Ok(b) => b,
        Err((failure, permanent)) => return Err(Execution::Failed { failure, permanent }),
    };
    // Decoding stops at the limit (at once where the headers state a longer duration): a long
    // recording never costs more memory than the limit's worth of samples.
    let limit = ctx.max_audio_seconds;
    let pcm = match tokio::task::spawn_blocking(move || audio::decode_mono_16k_within(&bytes, limit)).await {
        Ok(Ok(pcm)) => pcm,
        Ok(Err(e)) => return Err(permanent(e.code(), e.to_string())),
        Err(e) => return Err(Execution::Failed { failure: Failure::new("inference_failed", e.to_string()), permanent: false }),
    };
    let duration = pcm.len() as f64 / f64::from(audio::SAMPLE_RATE);
    // Audio given by URL was priced at one window before its duration was known.
    let windows = audio::windows_for(duration) as i32;
    if windows != job.cost {
        if let Err(e) = ctx.store.set_cost(job.id, windows).await {
            tracing::warn!(error = %e, job = %job.id, "could not record the audio's cost");
        }
    }
    if ctx.stop.reason().is_some() {
        return Err(Execution::Stopped);
    }
    Ok(pcm)
}
