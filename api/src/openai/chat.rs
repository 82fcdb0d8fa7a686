//! `POST /v1/chat/completions` and `POST /v1/completions` as `generate` jobs, with `stream`
//! (`chat.completion.chunk` / `text_completion` server-sent events as the worker reports the
//! text, then `[DONE]`; a usage chunk first when `stream_options.include_usage`).

use super::{sse_data, OpenAiError, Waited};
use crate::auth::Caller;
use crate::state::AppState;
use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::State;
use axum::http::HeaderMap;
use axum::response::sse::{Event, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use axum::Json;
use futures::StreamExt;
use serde_json::{json, Map, Value};
use std::time::Duration;
use tern_jobs::Job;

/// How often a stream looks for new text.
const STREAM_POLL: Duration = Duration::from_millis(100);

/// Chat or plain completion.
#[derive(Clone, Copy, PartialEq, Eq)]
pub enum Flavour {
    Chat,
    Text,
}

impl Flavour {
    fn id(self, job: uuid::Uuid) -> String {
        match self {
            Flavour::Chat => format!("chatcmpl-{}", job.simple()),
            Flavour::Text => format!("cmpl-{}", job.simple()),
        }
    }

    /// The `object` of a whole answer.
    fn object(self) -> &'static str {
        match self {
            Flavour::Chat => "chat.completion",
            Flavour::Text => "text_completion",
        }
    }

    /// The `object` of a streamed chunk.
    fn chunk_object(self) -> &'static str {
        match self {
            Flavour::Chat => "chat.completion.chunk",
            Flavour::Text => "text_completion",
        }
    }
}

fn invalid(param: &'static str, message: impl Into<String>) -> OpenAiError {
    OpenAiError::invalid("invalid_request", message, param)
}

/// The generate input for a request: messages or prompt (with tools, for chat), and the
/// sampling options. Refuses what tern cannot honour (`n` > 1, the deprecated `functions`,
/// log-probabilities, penalties, JSON mode) rather than ignoring it.
fn generate_input(body: &Map<String, Value>, flavour: Flavour) -> Result<Value, OpenAiError> {
    let mut input = Map::new();
    match flavour {
        Flavour::Chat => {
            let messages = body.get("messages").and_then(Value::as_array).ok_or_else(|| invalid("messages", "\"messages\" must be an array"))?;
            let mut out = Vec::with_capacity(messages.len());
            for m in messages {
                let role = match m["role"].as_str() {
                    Some("system" | "developer") => "system",
                    Some("user") => "user",
                    Some("assistant") => "assistant",
                    Some("tool") => "tool",
                    other => return Err(OpenAiError::unsupported("messages", format!("message role {other:?}: tern takes system, developer, user, assistant and tool"))),
                };
                let mut message = json!({ "role": role, "content": content_text(&m["content"])? });
                // The calls an assistant's turn made, the call a tool's answer answers: passed
                // on (the job's schema checks them).
                if let Some(calls) = m.get("tool_calls").and_then(Value::as_array) {
                    message["tool_calls"] = calls.iter().map(call_of_history).collect();
                }
                for field in ["tool_call_id", "name"] {
                    if let Some(v) = m.get(field).filter(|v| !v.is_null() && role != "assistant") {
                        message[field] = v.clone();
                    }
                }
                out.push(message);
            }
            input.insert("messages".into(), json!(out));
            for field in ["tools", "tool_choice", "parallel_tool_calls"] {
                if let Some(v) = body.get(field).filter(|v| !v.is_null()) {
                    input.insert(field.into(), v.clone());
                }
            }
        }
        Flavour::Text => {
            let prompt = match body.get("prompt") {
                Some(Value::String(p)) => p.clone(),
                Some(Value::Array(items)) if items.len() == 1 && items[0].is_string() => items[0].as_str().unwrap_or_default().to_string(),
                Some(Value::Array(_)) => return Err(OpenAiError::unsupported("prompt", "one prompt per request: give a string")),
                _ => return Err(invalid("prompt", "\"prompt\" must be a string")),
            };
            input.insert("prompt".into(), json!(prompt));
        }
    }
    let max = body.get("max_completion_tokens").or_else(|| body.get("max_tokens")).filter(|v| !v.is_null());
    if let Some(max) = max {
        input.insert("max_tokens".into(), max.clone());
    }
    // top_k is no field of OpenAI's, but servers that speak its API (vLLM, llama.cpp) take it.
    for field in ["temperature", "top_p", "top_k", "seed"] {
        if let Some(v) = body.get(field).filter(|v| !v.is_null()) {
            input.insert(field.into(), v.clone());
        }
    }
    match body.get("stop") {
        None | Some(Value::Null) => {}
        Some(Value::String(s)) => {
            input.insert("stop".into(), json!([s]));
        }
        Some(stop) => {
            input.insert("stop".into(), stop.clone());
        }
    }
    if body.get("n").is_some_and(|n| !n.is_null() && n.as_f64() != Some(1.0)) {
        return Err(OpenAiError::unsupported("n", "one choice per request: n must be 1"));
    }
    // Chat offers tools; the deprecated `functions` never, nor do text completions.
    let refused_tools: &[&str] = match flavour {
        Flavour::Chat => &["functions", "function_call"],
        Flavour::Text => &["tools", "tool_choice", "functions", "function_call"],
    };
    for &field in refused_tools {
        if body.get(field).is_some_and(|v| !v.is_null()) {
            let message = match field {
                "functions" | "function_call" => "the deprecated functions are not taken: give tools",
                _ => "text completions call no tools: use chat completions",
            };
            return Err(OpenAiError::unsupported(field, message));
        }
    }
    if body.get("logprobs").is_some_and(|v| v.as_bool() == Some(true) || v.is_number()) {
        return Err(OpenAiError::unsupported("logprobs", "tern does not return log-probabilities"));
    }
    for field in ["presence_penalty", "frequency_penalty"] {
        if body.get(field).is_some_and(|v| v.as_f64().is_some_and(|p| p != 0.0)) {
            return Err(OpenAiError::unsupported(field, format!("tern does not apply {field}")));
        }
    }
    if body.get("response_format").is_some_and(|f| !f.is_null() && f["type"] != "text") {
        return Err(OpenAiError::unsupported("response_format", "tern generates text only: response_format must be {\"type\": \"text\"}"));
    }
    Ok(Value::Object(input))
}

/// A call in the conversation's history as the job takes it: `id`, `type` and `function`'s
/// `name` and `arguments` only (clients that rebuild calls from streamed deltas leave an
/// `index` in them), `arguments` given as an object written as JSON text. Anything else is
/// passed on for the job's schema to refuse.
fn call_of_history(call: &Value) -> Value {
    let function = &call["function"];
    let arguments = match &function["arguments"] {
        Value::String(text) => Value::String(text.clone()),
        Value::Null => json!("{}"),
        object @ Value::Object(_) => Value::String(object.to_string()),
        _ => return call.clone(),
    };
    match (call["id"].as_str(), function["name"].as_str()) {
        (Some(id), Some(name)) => json!({ "id": id, "type": "function", "function": { "name": name, "arguments": arguments } }),
        _ => call.clone(),
    }
}

/// A message's content: a string, or text parts (`[{"type": "text", "text": ...}]`).
fn content_text(content: &Value) -> Result<String, OpenAiError> {
    match content {
        Value::String(s) => Ok(s.clone()),
        Value::Null => Ok(String::new()),
        Value::Array(parts) => parts
            .iter()
            .map(|p| match (p["type"].as_str(), p["text"].as_str()) {
                (Some("text"), Some(t)) => Ok(t),
                _ => Err(OpenAiError::unsupported("messages", "tern's models read text parts only")),
            })
            .collect::<Result<Vec<_>, _>>()
            .map(|texts| texts.concat()),
        _ => Err(invalid("messages", "a message's content is a string or an array of text parts")),
    }
}

/// Chat completion.
pub async fn chat_completions(state: State<AppState>, caller: Caller, headers: HeaderMap, body: Result<Bytes, BytesRejection>) -> Result<Response, OpenAiError> {
    complete(state, caller, headers, body, Flavour::Chat).await
}

/// Text completion (legacy).
pub async fn completions(state: State<AppState>, caller: Caller, headers: HeaderMap, body: Result<Bytes, BytesRejection>) -> Result<Response, OpenAiError> {
    complete(state, caller, headers, body, Flavour::Text).await
}

/// A completion request, read from its JSON body.
pub struct Completion {
    flavour: Flavour,
    /// The `generate` job's input.
    input: Value,
    stream: bool,
    include_usage: bool,
    /// The model the request named.
    model: Value,
}

impl Completion {
    pub fn parse(value: &Value, flavour: Flavour) -> Result<Completion, OpenAiError> {
        let body = value.as_object().ok_or_else(|| invalid("body", "the body must be a JSON object"))?;
        Ok(Completion {
            flavour,
            input: generate_input(body, flavour)?,
            stream: body.get("stream").and_then(Value::as_bool).unwrap_or(false),
            include_usage: body.get("stream_options").and_then(|o| o.get("include_usage")).and_then(Value::as_bool).unwrap_or(false),
            model: body.get("model").cloned().unwrap_or(Value::Null),
        })
    }

    /// Whether it asks for a stream of chunks.
    pub fn stream(&self) -> bool {
        self.stream
    }

    /// The `generate` job it runs as (`POST /v1/jobs`'s body).
    pub fn job_request(&self) -> Value {
        json!({ "kind": "generate", "input": self.input })
    }

    /// OpenAI's whole answer from the finished job's output.
    pub fn response(&self, job: &Job, output: &Value) -> Value {
        let (id, created, model) = (self.flavour.id(job.id), job.created_at.timestamp(), output["model"].clone());
        let text = output["text"].clone();
        let finish_reason = output["finish_reason"].clone();
        let choice = match self.flavour {
            Flavour::Chat => {
                let mut message = json!({ "role": "assistant", "content": text, "refusal": null });
                if let Some(calls) = output.get("tool_calls").filter(|c| c.as_array().is_some_and(|c| !c.is_empty())) {
                    // OpenAI's content is null where the turn only calls tools.
                    if text.as_str().is_none_or(str::is_empty) {
                        message["content"] = Value::Null;
                    }
                    message["tool_calls"] = calls.clone();
                }
                json!({ "index": 0, "message": message, "finish_reason": finish_reason, "logprobs": null })
            }
            Flavour::Text => json!({ "index": 0, "text": text, "finish_reason": finish_reason, "logprobs": null }),
        };
        json!({
            "id": id, "object": self.flavour.object(), "created": created, "model": model,
            "choices": [choice], "usage": usage(output), "system_fingerprint": null,
        })
    }
}

async fn complete(
    State(state): State<AppState>,
    caller: Caller,
    headers: HeaderMap,
    body: Result<Bytes, BytesRejection>,
    flavour: Flavour,
) -> Result<Response, OpenAiError> {
    let principal = caller.require("jobs:write")?;
    let request = Completion::parse(&crate::extract::json_value(body)?, flavour)?;
    let mut waited = Waited::submit(&state, principal, request.job_request(), &headers).await?;
    let job_header = waited.header();
    if request.stream {
        let streamed = Streamed { waited, flavour, model: request.model, sent: 0, attempt: None, include_usage: request.include_usage, done: false };
        let events = futures::stream::unfold(streamed, |mut s| async move {
            if s.done {
                return None;
            }
            let events = s.next_events().await;
            Some((futures::stream::iter(events.into_iter().map(Ok::<_, std::convert::Infallible>)), s))
        })
        .flatten();
        return Ok(([job_header], Sse::new(events).keep_alive(KeepAlive::default())).into_response());
    }
    let job = waited.finished().await?;
    let output = waited.output(&job).await?;
    Ok(([job_header], Json(request.response(&job, &output))).into_response())
}

fn usage(output: &Value) -> Value {
    let (prompt, completion) = (output["usage"]["prompt_tokens"].as_u64().unwrap_or(0), output["usage"]["completion_tokens"].as_u64().unwrap_or(0));
    json!({ "prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion })
}

/// A streamed completion: the text the worker reports as it generates, as chunks.
struct Streamed {
    /// Dropped with the stream when the client leaves: the job is canceled.
    waited: Waited,
    flavour: Flavour,
    /// The model the request named, for chunks sent before the worker's output names its own.
    model: Value,
    /// Bytes of text sent so far.
    sent: usize,
    /// The attempt whose text was sent, once some was.
    attempt: Option<i32>,
    include_usage: bool,
    done: bool,
}

impl Streamed {
    fn chunk(&self, created: i64, model: &Value, delta: Option<&str>, finish_reason: Value, first: bool) -> Event {
        let choice = match self.flavour {
            Flavour::Chat => {
                let mut delta_obj = json!({});
                if first {
                    delta_obj["role"] = json!("assistant");
                }
                if let Some(d) = delta {
                    delta_obj["content"] = json!(d);
                }
                json!({ "index": 0, "delta": delta_obj, "finish_reason": finish_reason, "logprobs": null })
            }
            Flavour::Text => json!({ "index": 0, "text": delta.unwrap_or(""), "finish_reason": finish_reason, "logprobs": null }),
        };
        sse_data(&json!({
            "id": self.flavour.id(self.waited.id), "object": self.flavour.chunk_object(), "created": created, "model": model,
            "choices": [choice], "system_fingerprint": null,
        }))
    }

    /// A chat chunk whose delta holds the answer's tool calls, each with its `index`.
    fn tool_calls_chunk(&self, created: i64, model: &Value, calls: &[Value], first: bool) -> Event {
        let calls: Vec<Value> = calls
            .iter()
            .enumerate()
            .map(|(index, c)| json!({ "index": index, "id": c["id"], "type": "function", "function": c["function"] }))
            .collect();
        let mut delta = json!({ "tool_calls": calls });
        if first {
            delta["role"] = json!("assistant");
        }
        sse_data(&json!({
            "id": self.flavour.id(self.waited.id), "object": self.flavour.chunk_object(), "created": created, "model": model,
            "choices": [{ "index": 0, "delta": delta, "finish_reason": null, "logprobs": null }], "system_fingerprint": null,
        }))
    }

    /// The next events: new text as it comes, or the end of the stream.
    async fn next_events(&mut self) -> Vec<Event> {
        loop {
            // The text before the job: text of a later attempt is then seen with its attempt.
            let (job, progress) = match self.waited.poll(self.sent).await {
                Ok(read) => read,
                Err(e) => return self.fail(e),
            };
            if let Some(e) = super::retried_since(self.attempt, &job) {
                return self.fail(e);
            }
            let created = job.created_at.timestamp();
            if job.state.is_terminal() {
                let output = match self.waited.output(&job).await {
                    Ok(output) => output,
                    Err(e) => return self.fail(e),
                };
                let model = output["model"].clone();
                let text = output["text"].as_str().unwrap_or_default();
                let mut events = Vec::new();
                let first = self.sent == 0;
                // The final text may end before text already sent (a stop sequence trimmed
                // it): nothing more is sent then.
                if let Some(rest) = text.get(self.sent..).filter(|r| !r.is_empty()) {
                    events.push(self.chunk(created, &model, Some(rest), Value::Null, first));
                }
                // Calls come whole, in one chunk, once the answer is read.
                if let Some(calls) = output["tool_calls"].as_array().filter(|c| !c.is_empty() && self.flavour == Flavour::Chat) {
                    events.push(self.tool_calls_chunk(created, &model, calls, first && events.is_empty()));
                }
                events.push(self.chunk(created, &model, None, output["finish_reason"].clone(), first && events.is_empty()));
                if self.include_usage {
                    events.push(sse_data(&json!({
                        "id": self.flavour.id(job.id), "object": self.flavour.chunk_object(), "created": created, "model": model,
                        "choices": [], "usage": usage(&output),
                    })));
                }
                events.push(Event::default().data("[DONE]"));
                self.done = true;
                return events;
            }
            if let Some(text) = progress.and_then(|p| p.text) {
                // Only whole characters: the worker's text is UTF-8 and grows at its end.
                if let Some(delta) = text.get(self.sent..).filter(|d| !d.is_empty()) {
                    let first = self.sent == 0;
                    self.sent = text.len();
                    self.attempt = Some(super::attempt_in_progress(&job));
                    return vec![self.chunk(created, &self.model, Some(delta), Value::Null, first)];
                }
            }
            self.waited.pause(STREAM_POLL).await;
        }
    }

    fn fail(&mut self, e: OpenAiError) -> Vec<Event> {
        self.done = true;
        vec![sse_data(&json!({ "error": { "message": e.message, "type": "server_error", "param": null, "code": e.code } }))]
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn body(v: Value) -> Map<String, Value> {
        v.as_object().unwrap().clone()
    }

    #[test]
    fn chat_requests_become_generate_inputs() {
        let input = generate_input(
            &body(json!({
                "model": "anything", "max_completion_tokens": 12, "temperature": 0, "stop": "\n", "seed": 3,
                "messages": [{"role": "developer", "content": "Be brief."}, {"role": "user", "content": [{"type": "text", "text": "Hi"}]}],
            })),
            Flavour::Chat,
        )
        .unwrap();
        assert_eq!(
            input,
            json!({
                "messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}],
                "max_tokens": 12, "temperature": 0, "seed": 3, "stop": ["\n"],
            })
        );
    }

    #[test]
    fn what_tern_cannot_honour_is_refused_by_name() {
        let chat = |extra: Value| {
            let mut b = body(json!({"messages": [{"role": "user", "content": "Hi"}]}));
            b.extend(body(extra));
            generate_input(&b, Flavour::Chat).err().map(|e| (e.code, e.param))
        };
        assert_eq!(chat(json!({"n": 2})), Some(("unsupported_parameter".into(), Some("n"))));
        assert_eq!(chat(json!({"n": 1})), None);
        assert_eq!(chat(json!({"functions": [{"name": "f"}]})), Some(("unsupported_parameter".into(), Some("functions"))));
        assert_eq!(chat(json!({"logprobs": true})), Some(("unsupported_parameter".into(), Some("logprobs"))));
        assert_eq!(chat(json!({"presence_penalty": 0.5})), Some(("unsupported_parameter".into(), Some("presence_penalty"))));
        assert_eq!(chat(json!({"response_format": {"type": "json_object"}})), Some(("unsupported_parameter".into(), Some("response_format"))));
        let prompts = generate_input(&body(json!({"prompt": ["a", "b"]})), Flavour::Text).err().map(|e| e.param);
        assert_eq!(prompts, Some(Some("prompt")));
        let text_tools = generate_input(&body(json!({"prompt": "a", "tools": [{"type": "function"}]})), Flavour::Text).err().map(|e| e.param);
        assert_eq!(text_tools, Some(Some("tools")));
    }

    #[test]
    fn tools_calls_and_answers_pass_on_to_the_job() {
        let tool = json!({"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}});
        let call = json!({"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": "{\"city\":\"Paris\"}"}});
        let input = generate_input(
            &body(json!({
                "tools": [tool], "tool_choice": "required", "parallel_tool_calls": false,
                "messages": [
                    {"role": "user", "content": "Weather?"},
                    {"role": "assistant", "content": null, "tool_calls": [{"index": 0, "id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
                    {"role": "tool", "tool_call_id": "call_1", "content": [{"type": "text", "text": "sunny"}]},
                ],
            })),
            Flavour::Chat,
        )
        .unwrap();
        assert_eq!(
            input,
            json!({
                "messages": [
                    {"role": "user", "content": "Weather?"},
                    {"role": "assistant", "content": "", "tool_calls": [call]},
                    {"role": "tool", "content": "sunny", "tool_call_id": "call_1"},
                ],
                "tools": [tool], "tool_choice": "required", "parallel_tool_calls": false,
            })
        );
    }
}
