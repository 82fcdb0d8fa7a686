//! One executor per job kind.

pub mod echo;

use crate::file_fetch::FileFetcher;
use crate::stop::StopSignal;
use bytes::Bytes;
use tern_jobs::{Failure, Job};

/// What an executor produced: an output to store, or why the attempt failed.
pub enum Execution {
    Output { body: Bytes, content_type: &'static str, extension: &'static str },
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
}

pub async fn execute(job: &Job, ctx: &Context<'_>) -> Execution {
    match job.kind {
        tern_jobs::JobKind::Echo => echo::run(job, ctx).await,
    }
}
