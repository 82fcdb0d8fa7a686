//! One executor per job kind.

pub mod echo;
pub mod subtitles;
pub mod transcribe;

use crate::file_fetch::FileFetcher;
use crate::speech_engine::SpeechEngine;
use crate::stop::StopSignal;
use bytes::Bytes;
use tern_jobs::{Failure, Job, Queue};

/// Another rendering of a job's result, stored beside the primary output.
pub struct ExtraOutput {
    /// Format name, also the file extension (`srt`, `vtt`).
    pub format: &'static str,
    pub body: Bytes,
    pub content_type: &'static str,
}

/// What an executor produced: an output to store, or why the attempt failed.
pub enum Execution {
    Output { body: Bytes, content_type: &'static str, extension: &'static str, extras: Vec<ExtraOutput> },
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
    /// The speech model's thread, when this worker runs transcriptions.
    pub speech: Option<&'a SpeechEngine>,
    /// Longest audio accepted, seconds.
    pub max_audio_seconds: f64,
}

pub async fn execute(job: &Job, ctx: &Context<'_>) -> Execution {
    match job.kind {
        tern_jobs::JobKind::Echo => echo::run(job, ctx).await,
        tern_jobs::JobKind::Transcribe => transcribe::run(job, ctx).await,
    }
}
