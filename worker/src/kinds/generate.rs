//! `generate`: text generation. See `schemas/generate.input.json`.
//!
//! Runs on the model thread one job at a time; the text generated so far is published as the
//! job's progress (at most every 200 ms) so GET shows it while it runs. A cancel or a release
//! stops generation at the next token.

use super::{engine_failure, json_output, permanent, Context, Execution};
use serde_json::{json, Value};
use std::sync::atomic::AtomicBool;
use std::sync::Arc;
use crate::engine::{Engine, EngineError, ProgressUntilReply, Served};
use tern_jobs::{Job, JobKind};
use tern_models::generate::family::GenerateWork;
use tern_models::generate::tools::{ToolChoice, ToolUse};
use tern_models::generate::{ChatMessage, GenerateOptions, Generation, Prompt};

/// Generates text on the engine's language model; (text so far, tokens so far) arrives on
/// `progress`; raising `stop` ends it early (the reply then holds what was generated).
pub async fn generate(
    engine: &Engine,
    prompt: Prompt,
    options: GenerateOptions,
    progress: tokio::sync::mpsc::UnboundedSender<(String, usize)>,
    stop: Arc<AtomicBool>,
) -> Result<Served<Generation>, EngineError> {
    let (reply, answer) = tokio::sync::oneshot::channel();
    let progress = ProgressUntilReply::new(progress);
    let report = progress.report_until(stop);
    let on_text = Box::new(move |text: &str, tokens: usize| report((text.to_string(), tokens)));
    engine.run(JobKind::Generate, Box::new(GenerateWork { prompt, options, on_text, reply: progress.reply(reply) }), answer).await
}

fn options(input: &Value) -> GenerateOptions {
    let defaults = GenerateOptions::default();
    GenerateOptions {
        max_tokens: input.get("max_tokens").and_then(Value::as_u64).map_or(defaults.max_tokens, |n| n as usize),
        temperature: input.get("temperature").and_then(Value::as_f64).unwrap_or(defaults.temperature),
        top_p: input.get("top_p").and_then(Value::as_f64).or(defaults.top_p),
        top_k: input.get("top_k").and_then(Value::as_u64).map(|k| k as usize).or(defaults.top_k),
        seed: input.get("seed").and_then(Value::as_u64).unwrap_or(defaults.seed),
        stop: input
            .get("stop")
            .and_then(|s| serde_json::from_value(s.clone()).ok())
            .unwrap_or(defaults.stop),
    }
}

/// The tools offered (`tools`, `tool_choice`, `parallel_tool_calls`), as the schema checked them.
fn tool_use(input: &Value) -> Option<ToolUse> {
    let tools = input.get("tools")?.as_array()?.clone();
    let choice = match input.get("tool_choice") {
        Some(Value::String(c)) if c == "none" => ToolChoice::None,
        Some(Value::String(c)) if c == "required" => ToolChoice::Required,
        Some(Value::Object(c)) => c.get("function").and_then(|f| f["name"].as_str()).map_or(ToolChoice::Auto, |name| ToolChoice::Function(name.to_string())),
        _ => ToolChoice::Auto,
    };
    Some(ToolUse { tools, choice, parallel: input.get("parallel_tool_calls").and_then(Value::as_bool).unwrap_or(true) })
}

pub async fn run(job: &Job, ctx: &Context<'_>) -> Execution {
    let Some(engine) = ctx.engine else {
        return permanent("model_unavailable", "this worker has no model engine");
    };
    let input = &job.input;
    let prompt = match (input.get("prompt").and_then(Value::as_str), input.get("messages")) {
        (Some(p), None) => Prompt::Text(p.to_string()),
        (None, Some(m)) => match (serde_json::from_value::<Vec<ChatMessage>>(m.clone()), tool_use(input)) {
            (Ok(m), None) => Prompt::Chat(m),
            (Ok(m), Some(tools)) => Prompt::ChatWithTools(m, tools),
            (Err(e), _) => return permanent("invalid_input", format!("input.messages: {e}")),
        },
        _ => return permanent("invalid_input", "give exactly one of input.prompt and input.messages"),
    };
    let stop = Arc::new(AtomicBool::new(false));
    let (progress_tx, progress_rx) = tokio::sync::mpsc::unbounded_channel::<(String, usize)>();
    let max_tokens = options(input).max_tokens;
    let report = super::record_progress(job, ctx, progress_rx, |last, _| last.elapsed() >= super::PROGRESS_EVERY, |(text, tokens)| async move {
        ctx.queue.set_progress_text(job.kind, job.id, tokens as u64, max_tokens as u64, &text).await
    });
    let work = async { tokio::join!(generate(engine, prompt, options(input), progress_tx, stop.clone()), report) };
    let Some((generation, ())) = super::until_stopped(ctx.stop, &stop, work).await else {
        return Execution::Stopped;
    };
    let generation = match generation {
        Ok(served) => served,
        Err(e) => return engine_failure(&e),
    };
    let (generation, model) = (generation.value, generation.model);
    metrics::counter!("tern_tokens_total", "kind" => "generate", "phase" => "prompt").increment(generation.prompt_tokens as u64);
    metrics::counter!("tern_tokens_total", "kind" => "generate", "phase" => "completion").increment(generation.completion_tokens as u64);
    let mut output = json!({
        "model": model,
        "text": generation.text,
        "finish_reason": generation.finish_reason,
        "usage": { "prompt_tokens": generation.prompt_tokens, "completion_tokens": generation.completion_tokens },
    });
    if !generation.tool_calls.is_empty() {
        output["tool_calls"] = json!(generation.tool_calls);
    }
    json_output(&output)
}
