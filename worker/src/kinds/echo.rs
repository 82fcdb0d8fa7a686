//! `echo`: returns its input after an optional sleep; can fail on request. See
//! `schemas/echo.input.json`.

use super::{Context, Execution};
use serde_json::{json, Value};
use sha2::{Digest, Sha256};
use std::time::Duration;
use tern_jobs::file_ref::FileRef;
use tern_jobs::{Failure, Job};

pub async fn run(job: &Job, ctx: &Context<'_>) -> Execution {
    let input = &job.input;
    if let Some(ms) = input.get("sleep_ms").and_then(Value::as_u64).filter(|ms| *ms > 0) {
        tokio::select! {
            _ = tokio::time::sleep(Duration::from_millis(ms)) => {}
            _ = ctx.stop.raised() => return Execution::Stopped,
        }
    }
    if input.get("fail_permanently").and_then(Value::as_bool) == Some(true) {
        return Execution::Failed {
            failure: Failure::new("echo_failure", "failed on request (fail_permanently)"),
            permanent: true,
        };
    }
    let fail_attempts = input.get("fail_attempts").and_then(Value::as_i64).unwrap_or(0);
    if i64::from(job.attempts) <= fail_attempts {
        return Execution::Failed {
            failure: Failure::new("echo_failure", format!("failed on request (attempt {} of fail_attempts {fail_attempts})", job.attempts)),
            permanent: false,
        };
    }
    let mut output = json!({ "input": input, "attempt": job.attempts, "worker_id": ctx.worker_id });
    if let Some(file) = input.get("file") {
        let file = match FileRef::parse(file) {
            Ok(f) => f,
            Err(e) => return Execution::Failed { failure: Failure::new(e.code(), e.to_string()), permanent: true },
        };
        match ctx.files.fetch(&file).await {
            Ok(bytes) => {
                output["file"] = json!({ "size": bytes.len(), "sha256": hex::encode(Sha256::digest(&bytes)) });
            }
            Err((failure, permanent)) => return Execution::Failed { failure, permanent },
        }
    }
    if ctx.stop.reason().is_some() {
        return Execution::Stopped;
    }
    Execution::Output {
        body: serde_json::to_vec(&output).expect("JSON values serialise").into(),
        content_type: "application/json",
        extension: "json",
        extras: Vec::new(),
        inline: false,
    }
}
