//! One executor per job kind.

pub mod audio_embed;
pub mod echo;
pub mod embed;
pub mod generate;
pub mod image;
pub mod subtitles;
pub mod transcribe;

use crate::file_fetch::FileFetcher;
use crate::engine::Engine;
use crate::stop::StopSignal;
use bytes::Bytes;
use tern_jobs::{Failure, Job, Queue};

/// Another rendering of a job's result, or a file it made, stored beside the primary output
/// (at [`output_key`] of its format) and listed in the job's `output.formats`.
pub struct ExtraOutput {
    /// Format name, also the end of its key: the file extension (`srt`, `vtt`), or a file's
    /// name (`0.png`, an image job's first image).
    pub format: String,
    pub body: Bytes,
    pub content_type: &'static str,
}

/// What an executor produced: an output to store, or why the attempt failed.
pub enum Execution {
    Output {
        body: Bytes,
        content_type: &'static str,
        extension: &'static str,
        extras: Vec<ExtraOutput>,
        /// Copy the (JSON) body into the job record too when it is small enough.
        inline: bool,
    },
    /// `permanent`: bad input; retrying cannot help.
    Failed { failure: Failure, permanent: bool },
    /// Stopped by its [`StopSignal`] before it finished.
    Stopped,
}

/// What executors may use.
pub struct Context<'a> {
    pub worker_id: &'a str,
    pub files: &'a FileFetcher,
    pub stop: &'a StopSignal,
    pub queue: &'a Queue,
    /// For `job.progress` webhook events.
    pub store: &'a tern_jobs::Store,
    /// The model thread, when this worker runs model kinds.
    pub engine: Option<&'a Engine>,
    /// Longest audio accepted, seconds.
    pub max_audio_seconds: f64,
    /// How much of a short Whisper window's padding the encoder runs.
    pub whisper_padding: tern_models::whisper::Padding,
    /// What a Whisper window's features hold past its audio (`TERN_WHISPER_FEATURE_PADDING`).
    pub whisper_feature_padding: tern_models::whisper::FeaturePadding,
    /// Beam size of transcriptions whose input names none (`TERN_WHISPER_BEAM_SIZE`).
    pub whisper_beam_size: usize,
}

/// Where an attempt's output in `format` is stored: `outputs/{job id}.{lease token}.{format}`.
/// The key carries the lease token: a stale attempt can never overwrite the objects a newer
/// attempt recorded.
pub fn output_key(job: &Job, format: &str) -> String {
    format!("outputs/{}.{}.{format}", job.id, job.lease_token.unwrap_or_default())
}

/// A failure retrying cannot help (bad input).
pub fn permanent(code: &str, message: impl Into<String>) -> Execution {
    Execution::Failed { failure: Failure::new(code, message), permanent: true }
}

/// An engine error as the job's failure.
pub fn engine_failure(e: &crate::engine::EngineError) -> Execution {
    Execution::Failed { failure: Failure::new(e.code(), e.to_string()), permanent: e.is_permanent() }
}

/// A JSON output, inlined in the job record when small.
pub fn json_output(body: &serde_json::Value) -> Execution {
    Execution::Output {
        body: serde_json::to_vec(body).expect("JSON values serialise").into(),
        content_type: "application/json",
        extension: "json",
        extras: Vec::new(),
        inline: true,
    }
}

/// Sends a `job.progress` webhook event if the job asked for them (throttled to one a second in
/// Postgres). A failure only costs the event: progress is advisory.
pub async fn progress_event(job: &Job, ctx: &Context<'_>) {
    if job.webhook.as_ref().is_some_and(tern_jobs::Webhook::wants_progress) {
        if let Err(e) = ctx.store.progress_event(job.id).await {
            tracing::warn!(error = %e, "could not queue a progress webhook");
        }
    }
}

/// Shortest interval between two progress writes to Redis.
pub const PROGRESS_EVERY: std::time::Duration = std::time::Duration::from_millis(200);

/// Records the progress a model call reports on `reports` as the job's: only the newest state
/// waiting, written with `write` when `due(last write, state)` says so (at first always), each
/// write followed by a [`progress_event`]. Ends when the call drops its sender.
pub async fn record_progress<P, W, E>(
    job: &Job,
    ctx: &Context<'_>,
    mut reports: tokio::sync::mpsc::UnboundedReceiver<P>,
    due: impl Fn(std::time::Instant, &P) -> bool,
    mut write: impl FnMut(P) -> W,
) where
    W: std::future::Future<Output = Result<(), E>>,
    E: std::fmt::Display,
{
    let mut last = std::time::Instant::now() - PROGRESS_EVERY;
    while let Some(mut state) = reports.recv().await {
        // Only the newest state matters.
        while let Ok(newer) = reports.try_recv() {
            state = newer;
        }
        if !due(last, &state) {
            continue;
        }
        last = std::time::Instant::now();
        if let Err(e) = write(state).await {
            tracing::warn!(error = %e, "could not record progress");
        }
        progress_event(job, ctx).await;
    }
}

/// Runs `work` (a model call reading `flag`), raising `flag` as soon as the job's stop signal
/// is raised so the model thread stops early. `None` when the job was stopped: its result must
/// not be reported.
pub async fn until_stopped<T>(
    stop: &StopSignal,
    flag: &std::sync::atomic::AtomicBool,
    work: impl std::future::Future<Output = T>,
) -> Option<T> {
    let forward = async {
        stop.raised().await;
        flag.store(true, std::sync::atomic::Ordering::Relaxed);
        std::future::pending::<()>().await
    };
    let out = tokio::select! {
        out = work => out,
        () = forward => unreachable!("never resolves"),
    };
    stop.reason().is_none().then_some(out)
}

pub async fn execute(job: &Job, ctx: &Context<'_>) -> Execution {
    match job.kind {
        tern_jobs::JobKind::Echo => echo::run(job, ctx).await,
        tern_jobs::JobKind::Transcribe => transcribe::run(job, ctx).await,
        tern_jobs::JobKind::Embed => embed::run(job, ctx).await,
        tern_jobs::JobKind::Generate => generate::run(job, ctx).await,
        tern_jobs::JobKind::AudioEmbed => audio_embed::run(job, ctx).await,
        tern_jobs::JobKind::Image => image::run(job, ctx).await,
    }
}
