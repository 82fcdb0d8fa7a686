//! `audio_embed`: a recording as a vector from Whisper's encoder. See
//! `schemas/audio_embed.input.json`.
//!
//! The audio is fetched and decoded as for `transcribe`; its windows go to the speech thread
//! with the transcriptions' windows, through the encoder only.

use super::{engine_failure, json_output, Context, Execution};
use super::transcribe::{transcribe, TranscribeProgress};
use serde_json::{json, Value};
use tern_jobs::Job;
use tern_models::whisper::TranscribeOptions;

pub async fn run(job: &Job, ctx: &Context<'_>) -> Execution {
    let Some(engine) = ctx.engine else {
        return super::permanent("model_unavailable", "this worker has no model engine");
    };
    let pcm = match super::transcribe::audio_of(job, ctx).await {
        Ok(pcm) => pcm,
        Err(stopped_or_failed) => return stopped_or_failed,
    };
    let windows = job.input.get("windows").and_then(Value::as_bool).unwrap_or(false);
    let options = TranscribeOptions { padding: ctx.whisper_padding, feature_padding: ctx.whisper_feature_padding, embed: true, ..TranscribeOptions::default() };
    // Windows of an embedding finish without text: nothing to report as they go.
    let (progress, _) = tokio::sync::mpsc::unbounded_channel::<TranscribeProgress>();
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let Some(served) = super::until_stopped(ctx.stop, &stop, transcribe(engine, pcm, options, progress, stop.clone())).await else {
        return Execution::Stopped;
    };
    let served = match served {
        Ok(served) => served,
        Err(e) => return engine_failure(&e),
    };
    let (transcript, model) = (served.value, served.model);
    let Some(embedding) = transcript.embedding else {
        return Execution::Failed {
            failure: tern_jobs::Failure::new("inference_failed", "the model returned no embedding"),
            permanent: false,
        };
    };
    metrics::counter!("tern_audio_seconds_total").increment(transcript.duration.round() as u64);
    let mut body = json!({
        "model": model,
        "dimensions": embedding.vector.len(),
        "duration": transcript.duration,
        "embedding": embedding.vector,
    });
    if windows {
        body["windows"] =
            embedding.windows.iter().map(|w| json!({"start": w.start, "end": w.end, "embedding": w.vector})).collect();
    }
    json_output(&body)
}
