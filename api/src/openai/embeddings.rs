//! `POST /v1/embeddings` as an `embed` job: `input` a string or an array of strings,
//! `encoding_format` `float` or `base64` (little-endian f32, as OpenAI sends it).

use super::{OpenAiError, Waited};
use crate::auth::Caller;
use crate::state::AppState;
use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::State;
use axum::http::HeaderMap;
use axum::response::{IntoResponse, Response};
use axum::Json;
use base64::Engine;
use serde_json::{json, Value};
use tern_jobs::Job;

/// The texts of `input`; token arrays are refused (tern's API holds no tokenizer to read them).
fn texts(input: Option<&Value>) -> Result<Vec<Value>, OpenAiError> {
    match input {
        Some(Value::String(s)) => Ok(vec![json!(s)]),
        Some(Value::Array(items)) if items.iter().all(Value::is_string) && !items.is_empty() => Ok(items.clone()),
        Some(Value::Array(items)) if items.iter().any(|i| i.is_number() || i.is_array()) => {
            Err(OpenAiError::unsupported("input", "token arrays are not supported: send text"))
        }
        _ => Err(OpenAiError::invalid("invalid_request", "\"input\" must be a string or a non-empty array of strings", "input")),
    }
}

/// An embeddings request, read from its JSON body.
pub struct Embeddings {
    texts: Vec<Value>,
    base64: bool,
    dimensions: Option<u64>,
}

impl Embeddings {
    pub fn parse(body: &Value) -> Result<Embeddings, OpenAiError> {
        let texts = texts(body.get("input"))?;
        let base64 = match body["encoding_format"].as_str() {
            None | Some("float") => false,
            Some("base64") => true,
            Some(other) => return Err(OpenAiError::invalid("invalid_encoding_format", format!("{other:?}: use float or base64"), "encoding_format")),
        };
        let dimensions = match body.get("dimensions").filter(|d| !d.is_null()) {
            None => None,
            Some(d) => Some(d.as_u64().filter(|d| *d > 0).ok_or_else(|| OpenAiError::invalid("invalid_dimensions", "dimensions must be a positive integer", "dimensions"))?),
        };
        Ok(Embeddings { texts, base64, dimensions })
    }

    /// The `embed` job it runs as (`POST /v1/jobs`'s body).
    pub fn job_request(&self) -> Value {
        json!({ "kind": "embed", "input": { "texts": self.texts } })
    }

    /// OpenAI's answer from the finished job's output.
    pub fn response(&self, job: &Job, output: &Value) -> Result<Value, OpenAiError> {
        let model_dimensions = output["dimensions"].as_u64().unwrap_or(0);
        if let Some(asked) = self.dimensions.filter(|d| *d != model_dimensions) {
            // The vectors are unit-length in the model's own space; cutting them would not give
            // what a Matryoshka-trained model gives, so none is cut.
            return Err(OpenAiError::invalid(
                "dimensions_unsupported",
                format!("{} gives {model_dimensions}-dimensional embeddings and cannot shorten them to {asked}", output["model"].as_str().unwrap_or("the model")),
                "dimensions",
            ));
        }
        let data: Vec<Value> = output["embeddings"]
            .as_array()
            .map_or(&[][..], Vec::as_slice)
            .iter()
            .enumerate()
            .map(|(index, vector)| {
                let embedding = if self.base64 {
                    let floats = vector.as_array().map_or(&[][..], Vec::as_slice);
                    let bytes: Vec<u8> = floats.iter().flat_map(|f| (f.as_f64().unwrap_or(0.0) as f32).to_le_bytes()).collect();
                    json!(base64::engine::general_purpose::STANDARD.encode(bytes))
                } else {
                    vector.clone()
                };
                json!({ "object": "embedding", "index": index, "embedding": embedding })
            })
            .collect();
        // tern counts what a job costs, the tokens of its padded batch as the API estimates them
        // (about 4 characters a token); the model's own count is not reported.
        let tokens = job.cost.max(0);
        Ok(json!({
            "object": "list", "data": data, "model": output["model"],
            "usage": { "prompt_tokens": tokens, "total_tokens": tokens },
        }))
    }
}

/// Create embeddings.
pub async fn create(State(state): State<AppState>, caller: Caller, headers: HeaderMap, body: Result<Bytes, BytesRejection>) -> Result<Response, OpenAiError> {
    let principal = caller.require("jobs:write")?;
    let request = Embeddings::parse(&crate::extract::json_value(body)?)?;
    let mut waited = Waited::submit(&state, principal, request.job_request(), &headers).await?;
    let job_header = waited.header();
    let job = waited.finished().await?;
    let output = waited.output(&job).await?;
    Ok(([job_header], Json(request.response(&job, &output)?)).into_response())
}
