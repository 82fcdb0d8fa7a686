//! `embed`: sentence embeddings. See `schemas/embed.input.json`.
//!
//! The texts go to the model thread, which runs them together with the texts of the other
//! embed jobs that arrive with them. The output (one unit vector per text) is stored in S3 and
//! inlined in the job when under 64 KiB.

use super::{engine_failure, json_output, permanent, Context, Execution};
use crate::engine::{answer_with, Engine, EngineError, Served};
use serde_json::json;
use tern_jobs::{Job, JobKind};
use tern_models::embed::family::EmbedWork;

/// Embeds texts on the engine's embedder: one unit vector per text, in order.
pub async fn embed(engine: &Engine, texts: Vec<String>) -> Result<Served<Vec<Vec<f32>>>, EngineError> {
    let (reply, answer) = tokio::sync::oneshot::channel();
    engine.run(JobKind::Embed, Box::new(EmbedWork { texts, reply: answer_with(reply) }), answer).await
}

pub async fn run(job: &Job, ctx: &Context<'_>) -> Execution {
    let Some(engine) = ctx.engine else {
        return permanent("model_unavailable", "this worker has no model engine");
    };
    let texts: Vec<String> = match job.input.get("texts").and_then(|t| serde_json::from_value(t.clone()).ok()) {
        Some(t) => t,
        None => return permanent("invalid_input", "input.texts must be an array of strings"),
    };
    if ctx.stop.reason().is_some() {
        return Execution::Stopped;
    }
    let vectors = match embed(engine, texts).await {
        Ok(served) => served,
        Err(e) => return engine_failure(&e),
    };
    let (vectors, model) = (vectors.value, vectors.model);
    if ctx.stop.reason().is_some() {
        return Execution::Stopped;
    }
    // The job's cost is its padded tokens (set at submit).
    metrics::counter!("tern_tokens_total", "kind" => "embed", "phase" => "prompt").increment(job.cost.max(0) as u64);
    json_output(&json!({
        "model": model,
        "dimensions": vectors.first().map_or(0, Vec::len),
        "embeddings": vectors,
    }))
}
