//! Turning a submitted JSON object into a [`NewJob`], with a stable error code for every way it
//! can be wrong. Nothing here touches Postgres or Redis, so bad input never enqueues anything.

use crate::error::ApiError;
use chrono::{DateTime, Utc};
use serde_json::{Map, Value};
use sha2::{Digest, Sha256};
use axum::http::StatusCode;
use tern_jobs::file_ref::{FileRef, FileRefError};
use tern_jobs::job::{MAX_ATTEMPTS_LIMIT, METADATA_MAX_BYTES, TIMEOUT_MS_LIMIT};
use tern_jobs::{schemas, JobKind, NewJob, ObjectStore, Priority};
use tern_audio as audio;
use uuid::Uuid;

/// Longest accepted idempotency key, characters.
pub const IDEMPOTENCY_KEY_MAX_LEN: usize = 255;

const FIELDS: &[&str] =
    &["kind", "input", "priority", "run_at", "delay_ms", "max_attempts", "timeout_ms", "metadata", "idempotency_key", "webhook"];

/// A job request that passed every check but its files (see [`store_inline_files`]).
pub struct Submission {
    pub job: NewJob,
}

fn invalid(message: impl Into<String>) -> ApiError {
    ApiError::bad_request("invalid_request", message)
}

/// Checks one job request. `header_key` is the `Idempotency-Key` header, which a body field of
/// the same name may not contradict.
pub fn parse(value: &Value, header_key: Option<&str>) -> Result<Submission, ApiError> {
    let obj = value.as_object().ok_or_else(|| invalid("a job request must be a JSON object"))?;
    if let Some(unknown) = obj.keys().find(|k| !FIELDS.contains(&k.as_str())) {
        return Err(invalid(format!("unknown field {unknown:?}; known fields: {}", FIELDS.join(", "))));
    }

    let kind = match obj.get("kind") {
        None | Some(Value::Null) => return Err(invalid("\"kind\" is required")),
        Some(Value::String(s)) => s.parse::<JobKind>().map_err(|()| unknown_kind(s))?,
        Some(other) => return Err(unknown_kind(&other.to_string())),
    };
    let priority = match obj.get("priority") {
        None | Some(Value::Null) => Priority::default(),
        Some(Value::String(s)) => s.parse().map_err(|()| invalid_priority(s))?,
        Some(other) => return Err(invalid_priority(&other.to_string())),
    };
    let mut input = obj.get("input").cloned().unwrap_or(Value::Null);
    if input.is_null() {
        return Err(ApiError::new(
            StatusCode::UNPROCESSABLE_ENTITY,
            "invalid_input",
            "\"input\" is required",
        ));
    }
    // Files first: a bad URL scheme deserves its own code, not a schema message.
    for field in kind.file_fields() {
        if let Some(file) = input.get(*field) {
            FileRef::parse(file).map_err(|e| file_error(field, e))?;
        }
    }
    schemas::validate_input(kind, &input).map_err(|msg| {
        ApiError::new(StatusCode::UNPROCESSABLE_ENTITY, "invalid_input", format!("input of {kind}: {msg}"))
    })?;

    integers_as_integers(&mut input);
    let cost = estimated_cost(kind, &input);
    let mut job = NewJob::new(kind, input);
    job.cost = cost;
    job.priority = priority;
    job.run_at = parse_run_at(obj)?;
    if let Some(v) = obj.get("max_attempts").filter(|v| !v.is_null()) {
        job.max_attempts = integer(v)
            .filter(|n| (1..=MAX_ATTEMPTS_LIMIT as i64).contains(n))
            .ok_or_else(|| invalid(format!("\"max_attempts\" must be an integer from 1 to {MAX_ATTEMPTS_LIMIT}")))?
            as i32;
    }
    if let Some(v) = obj.get("timeout_ms").filter(|v| !v.is_null()) {
        job.timeout_ms = integer(v)
            .filter(|n| (1..=TIMEOUT_MS_LIMIT).contains(n))
            .ok_or_else(|| invalid(format!("\"timeout_ms\" must be an integer from 1 to {TIMEOUT_MS_LIMIT}")))?;
    }
    if let Some(v) = obj.get("metadata").filter(|v| !v.is_null()) {
        if !v.is_object() {
            return Err(invalid("\"metadata\" must be a JSON object"));
        }
        if v.to_string().len() > METADATA_MAX_BYTES {
            return Err(ApiError::bad_request(
                "metadata_too_large",
                format!("\"metadata\" is larger than {METADATA_MAX_BYTES} bytes"),
            ));
        }
        job.metadata = v.clone();
    }
    if let Some(v) = obj.get("webhook").filter(|v| !v.is_null()) {
        job.webhook = Some(parse_webhook(v)?);
    }
    let body_key = match obj.get("idempotency_key") {
        None | Some(Value::Null) => None,
        Some(Value::String(s)) => Some(s.as_str()),
        Some(_) => return Err(invalid("\"idempotency_key\" must be a string")),
    };
    let key = match (header_key, body_key) {
        (Some(h), Some(b)) if h != b => {
            return Err(invalid("the Idempotency-Key header and the \"idempotency_key\" field differ"))
        }
        (h, b) => h.or(b),
    };
    if let Some(key) = key {
        if key.is_empty() || key.chars().count() > IDEMPOTENCY_KEY_MAX_LEN {
            return Err(invalid(format!("idempotency keys are 1 to {IDEMPOTENCY_KEY_MAX_LEN} characters")));
        }
        job.idempotency_key = Some(key.to_string());
        job.request_sha256 = Some(fingerprint(value));
    }
    Ok(Submission { job })
}

/// Refuses upload keys outside the tenant's prefix as unknown (404 `upload_not_found`, as for a
/// missing upload), so one tenant cannot use, or learn of, another's upload.
pub fn check_upload_tenant(job: &NewJob, tenant: &str) -> Result<(), ApiError> {
    let own = format!("{}{}/", tern_jobs::file_ref::UPLOAD_PREFIX, crate::routes::uploads::tenant_segment(tenant));
    for field in job.kind.file_fields() {
        if let Some(Ok(FileRef::UploadKey(key))) = job.input.get(*field).map(FileRef::parse) {
            if !key.starts_with(&own) {
                return Err(ApiError::new(StatusCode::NOT_FOUND, "upload_not_found", format!("no upload {key}")));
            }
        }
    }
    Ok(())
}

/// Refuses file URLs and webhook targets that are not http(s) or that point at internal
/// addresses (literal, or by what their host resolves to now): 422 `url_forbidden`. The worker
/// and the dispatcher check again when they connect.
pub async fn check_urls(job: &NewJob, allow_private: bool) -> Result<(), ApiError> {
    let forbidden = |what: String, e: tern_jobs::egress::Forbidden| {
        ApiError::new(StatusCode::UNPROCESSABLE_ENTITY, "url_forbidden", format!("{what}: {}", e.0))
    };
    for field in job.kind.file_fields() {
        if let Some(Ok(FileRef::Url(url))) = job.input.get(*field).map(FileRef::parse) {
            tern_jobs::egress::check_url_resolving(&url, allow_private).await.map_err(|e| forbidden(format!("input.{field}"), e))?;
        }
    }
    if let Some(hook) = &job.webhook {
        tern_jobs::egress::check_url_resolving(&hook.url, allow_private).await.map_err(|e| forbidden("webhook.url".into(), e))?;
    }
    Ok(())
}

/// Longest webhook URL accepted.
const WEBHOOK_URL_MAX: usize = 2048;

/// `{"url": "https://...", "events"?: ["job.succeeded", ...]}`.
fn parse_webhook(v: &Value) -> Result<tern_jobs::Webhook, ApiError> {
    let bad = |m: String| ApiError::new(StatusCode::UNPROCESSABLE_ENTITY, "invalid_webhook", m);
    let hook: tern_jobs::Webhook = serde_json::from_value(v.clone())
        .map_err(|e| bad(format!("\"webhook\" must be {{\"url\", \"events\"?}}: {e}")))?;
    let scheme_ok = hook
        .url
        .get(..8)
        .is_some_and(|p| p.eq_ignore_ascii_case("https://"))
        || hook
            .url
            .get(..7)
            .is_some_and(|p| p.eq_ignore_ascii_case("http://"));
    if !scheme_ok && reqwest::Url::parse(&hook.url).is_ok() {
        return Err(ApiError::new(
            StatusCode::UNPROCESSABLE_ENTITY,
            "url_forbidden",
            "webhook.url: only http and https URLs are called".to_string(),
        ));
    }
    if !scheme_ok || hook.url.len() > WEBHOOK_URL_MAX || !tern_jobs::egress::well_formed(&hook.url) {
        return Err(bad(format!(
            "the webhook url must be an http(s) URL of at most {WEBHOOK_URL_MAX} printable ASCII characters"
        )));
    }
    if let Some(events) = &hook.events {
        let known = tern_jobs::job::WEBHOOK_EVENTS;
        if events.is_empty() {
            return Err(bad("\"events\", when given, names at least one event".into()));
        }
        if let Some(e) = events.iter().find(|e| !known.contains(&e.as_str())) {
            return Err(bad(format!("unknown webhook event {e:?}; known: {}", known.join(", "))));
        }
    }
    Ok(hook)
}

/// Characters per token assumed when estimating costs without a tokenizer (English text with
/// BERT WordPiece or a GPT-style BPE averages about 4).
const CHARS_PER_TOKEN: usize = 4;
/// Tokens an embedding text is truncated at.
const EMBED_MAX_TOKENS: usize = 256;
/// `max_tokens` of a generate job that gives none.
const GENERATE_DEFAULT_MAX_TOKENS: usize = 256;
/// Pixels of an image as image costs are estimated: 512 x 512, the native size of SD 1.5 and
/// SD-Turbo (the workers' default model); the API does not know the model's own.
const IMAGE_REFERENCE_PIXELS: u64 = 512 * 512;
/// Guidance of an image job that gives none (diffusers' default): above 1, so guided.
const IMAGE_DEFAULT_GUIDANCE: f64 = 7.5;

/// The cost the queue packs batches by, for kinds whose cost follows from the input alone:
/// embed: padded tokens (texts x the longest text's tokens, with [CLS]/[SEP]); generate: prompt
/// tokens plus `max_tokens`; image: UNet rows, the unit image batches are sized in (one per
/// image, two under guidance, times its pixels' share of [`IMAGE_REFERENCE_PIXELS`]).
/// Transcription costs are set later, from the probed audio duration. Estimates: the API holds
/// no tokenizer, and knows no image model's native size.
fn estimated_cost(kind: JobKind, input: &Value) -> i32 {
    let tokens = |s: &str| s.chars().count().div_ceil(CHARS_PER_TOKEN);
    let cost = match kind {
        JobKind::Embed => {
            let texts = input["texts"].as_array().map_or(&[][..], Vec::as_slice);
            let longest = texts.iter().filter_map(Value::as_str).map(|t| (tokens(t) + 2).min(EMBED_MAX_TOKENS)).max();
            texts.len() * longest.unwrap_or(2)
        }
        JobKind::Generate => {
            let prompt = match (input["prompt"].as_str(), input["messages"].as_array()) {
                (Some(p), _) => tokens(p),
                // ChatML adds about 5 tokens per message; calls and tools count as their JSON.
                (None, Some(m)) => m.iter().map(|m| tokens(m["content"].as_str().unwrap_or("")) + tokens(&m["tool_calls"].to_string()) + 5).sum(),
                _ => 0,
            };
            // A template shows tools as their JSON, with instructions around it.
            let prompt = prompt + input.get("tools").map_or(0, |t| tokens(&t.to_string()) + 100);
            let max_tokens = input["max_tokens"].as_u64().map_or(GENERATE_DEFAULT_MAX_TOKENS, |n| n as usize);
            prompt + max_tokens
        }
        JobKind::Image => {
            let images = input["n"].as_u64().unwrap_or(1);
            // Classifier-free guidance runs an unconditional row beside each image's.
            let guided = input["guidance"].as_f64().unwrap_or(IMAGE_DEFAULT_GUIDANCE) > 1.0;
            let pixels = match (input["width"].as_u64(), input["height"].as_u64()) {
                (Some(w), Some(h)) => w * h,
                _ => IMAGE_REFERENCE_PIXELS,
            };
            (images * if guided { 2 } else { 1 } * pixels.div_ceil(IMAGE_REFERENCE_PIXELS).max(1)) as usize
        }
        JobKind::Echo | JobKind::Transcribe | JobKind::AudioEmbed => 1,
    };
    cost.clamp(1, i32::MAX as usize) as i32
}

/// An integer as JSON Schema counts them: `5` and `5.0` alike.
fn integer(v: &Value) -> Option<i64> {
    v.as_i64().or_else(|| v.as_f64().filter(|f| f.fract() == 0.0 && f.abs() < 2f64.powi(53)).map(|f| f as i64))
}

/// Writes integral floats (`5.0`) of an input as integers (`5`): its schema counts them as
/// integers, and the worker reads integer fields with serde, which would refuse `5.0`.
fn integers_as_integers(value: &mut Value) {
    match value {
        Value::Number(n) if !n.is_i64() && !n.is_u64() => {
            if let Some(i) = integer(value) {
                *value = Value::from(i);
            }
        }
        Value::Array(items) => items.iter_mut().for_each(integers_as_integers),
        Value::Object(fields) => fields.values_mut().for_each(integers_as_integers),
        _ => {}
    }
}

fn unknown_kind(kind: &str) -> ApiError {
    let known: Vec<&str> = JobKind::ALL.iter().map(|k| k.as_str()).collect();
    ApiError::bad_request("unknown_kind", format!("unknown job kind {kind}; known kinds: {}", known.join(", ")))
}

fn invalid_priority(p: &str) -> ApiError {
    ApiError::bad_request("invalid_priority", format!("invalid priority {p}; use urgent, high, normal or low"))
}

fn parse_run_at(obj: &Map<String, Value>) -> Result<Option<DateTime<Utc>>, ApiError> {
    let run_at = match obj.get("run_at") {
        None | Some(Value::Null) => None,
        Some(Value::String(s)) => Some(
            DateTime::parse_from_rfc3339(s)
                .map_err(|_| invalid(format!("\"run_at\" must be an RFC 3339 time, got {s:?}")))?
                .with_timezone(&Utc),
        ),
        Some(_) => return Err(invalid("\"run_at\" must be an RFC 3339 time string")),
    };
    let delay = match obj.get("delay_ms") {
        None | Some(Value::Null) => None,
        Some(v) => Some(
            integer(v)
                .filter(|ms| (0..=366 * 24 * 3600 * 1000).contains(ms))
                .ok_or_else(|| invalid("\"delay_ms\" must be a non-negative integer of at most a year"))?,
        ),
    };
    match (run_at, delay) {
        (Some(_), Some(_)) => Err(invalid("give \"run_at\" or \"delay_ms\", not both")),
        (Some(at), None) => Ok(Some(at)),
        (None, Some(ms)) => Ok(Some(Utc::now() + chrono::Duration::milliseconds(ms))),
        (None, None) => Ok(None),
    }
}

/// SHA-256 of the request's canonical JSON (object keys sorted), to tell a replay from a
/// different request that reuses an idempotency key.
pub fn fingerprint(value: &Value) -> String {
    hex::encode(Sha256::digest(value.to_string().as_bytes()))
}

fn file_error(field: &str, e: FileRefError) -> ApiError {
    let status = match e {
        FileRefError::Shape | FileRefError::Scheme(_) => StatusCode::UNPROCESSABLE_ENTITY,
        FileRefError::TooLarge => StatusCode::PAYLOAD_TOO_LARGE,
        // The upload named does not exist (or is not one tern could have made).
        FileRefError::UploadKey(_) => StatusCode::NOT_FOUND,
        _ => StatusCode::BAD_REQUEST,
    };
    ApiError::new(status, e.code(), format!("input.{field}: {e}"))
}

/// Moves base64 files of a checked job into object storage, replacing them with their upload
/// key; checks that referenced uploads exist; and, for audio, probes the duration to set the
/// job's cost (30 s windows) and enforce `max_audio_seconds`. Audio given by URL is probed by
/// the worker instead (fetching arbitrary URLs at submit would stall the API).
pub async fn store_inline_files(job: &mut NewJob, objects: &ObjectStore, max_audio_seconds: f64) -> Result<(), ApiError> {
    let probes_audio = job.kind.costs_audio();
    for field in job.kind.file_fields() {
        let Some(file) = job.input.get(*field) else { continue };
        match FileRef::parse(file).map_err(|e| file_error(field, e))? {
            FileRef::Base64(data) => {
                let bytes = bytes::Bytes::from(FileRef::decode_base64(&data).map_err(|e| file_error(field, e))?);
                if probes_audio {
                    job.cost = audio_cost(bytes.clone(), max_audio_seconds).await?;
                }
                let key = format!("{}{}", tern_jobs::file_ref::UPLOAD_PREFIX, Uuid::now_v7());
                objects.put(&key, bytes, "application/octet-stream").await?;
                job.input[*field] = FileRef::UploadKey(key).to_json();
            }
            FileRef::UploadKey(key) => {
                if objects.size(&key).await?.is_none() {
                    return Err(ApiError::new(
                        StatusCode::NOT_FOUND,
                        "upload_not_found",
                        format!("input.{field}: nothing was uploaded under {key:?}"),
                    ));
                }
                if probes_audio {
                    job.cost = upload_cost(objects, &key, max_audio_seconds).await?;
                }
            }
            FileRef::Url(_) => {}
        }
    }
    Ok(())
}

/// The cost (30 s windows) of audio, probing its duration off the async runtime; a count of
/// frames stops past the limit.
async fn audio_cost(bytes: bytes::Bytes, max_audio_seconds: f64) -> Result<i32, ApiError> {
    let seconds = probe(move || audio::probe_duration_within(&bytes, max_audio_seconds)).await?;
    Ok(audio::windows_for(seconds) as i32)
}

/// The cost of an upload, from its first [`audio::HEADER_PREFIX_BYTES`] only: the duration its
/// headers state (WAV, FLAC, MP3 with a Xing header), else an estimate from the bitrate of the
/// audio in those bytes and the object's size (MP3 without one, OGG). The API never reads a
/// whole upload; the worker's decode holds the limit exactly and corrects the cost.
async fn upload_cost(objects: &ObjectStore, key: &str, max_audio_seconds: f64) -> Result<i32, ApiError> {
    let prefix = objects.get_prefix(key, audio::HEADER_PREFIX_BYTES as u64).await?;
    let size = objects.size(key).await?.map_or(prefix.len() as u64, |n| n.max(0) as u64);
    let (seconds, estimated) = probe(move || match audio::probe_prefix(&prefix)? {
        Some(seconds) if seconds > 0.0 => Ok((seconds, false)),
        _ => Ok((audio::estimate_from_prefix(&prefix, size)?, size > prefix.len() as u64)),
    })
    .await?;
    if seconds > max_audio_seconds {
        return Err(match estimated {
            false => too_long(seconds, max_audio_seconds),
            true => ApiError::new(
                StatusCode::PAYLOAD_TOO_LARGE,
                "audio_too_long",
                format!("the audio lasts about {seconds:.0} s (estimated from its bitrate); the limit is {max_audio_seconds:.0} s"),
            ),
        });
    }
    Ok(audio::windows_for(seconds) as i32)
}

/// Runs an audio probe off the async runtime, mapping its errors to the API's.
async fn probe<T: Send + 'static>(f: impl FnOnce() -> Result<T, audio::AudioError> + Send + 'static) -> Result<T, ApiError> {
    tokio::task::spawn_blocking(f)
        .await
        .map_err(|e| ApiError::new(StatusCode::INTERNAL_SERVER_ERROR, "internal", e.to_string()))?
        .map_err(|e| match e {
            audio::AudioError::TooLong { seconds, limit } => too_long(seconds, limit),
            e => ApiError::new(StatusCode::UNPROCESSABLE_ENTITY, e.code(), e.to_string()),
        })
}

fn too_long(seconds: f64, limit: f64) -> ApiError {
    ApiError::new(
        StatusCode::PAYLOAD_TOO_LARGE,
        "audio_too_long",
        format!("the audio lasts at least {seconds:.1} s; the limit is {limit:.0} s"),
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn an_image_job_costs_its_unet_rows() {
        let cost = |input: Value| parse(&json!({ "kind": "image", "input": input }), None).map(|s| s.job.cost);
        let prompt = "a lighthouse at dusk";
        // Guided by default: two rows an image.
        assert_eq!(cost(json!({ "prompt": prompt })).unwrap(), 2);
        assert_eq!(cost(json!({ "prompt": prompt, "n": 4, "steps": 30 })).unwrap(), 8);
        // Unguided (Turbo models): one; 8.0 is the integer 8, as JSON Schema counts it.
        assert_eq!(cost(json!({ "prompt": prompt, "n": 8.0, "guidance": 0 })).unwrap(), 8);
        assert_eq!(cost(json!({ "prompt": prompt, "guidance": 1 })).unwrap(), 1);
        // Larger than 512 x 512: its pixels' share, rounded up; smaller: still a row.
        assert_eq!(cost(json!({ "prompt": prompt, "width": 1024, "height": 1024, "guidance": 0 })).unwrap(), 4);
        assert_eq!(cost(json!({ "prompt": prompt, "width": 768, "height": 512, "n": 2 })).unwrap(), 8);
        assert_eq!(cost(json!({ "prompt": prompt, "width": 64, "height": 64, "guidance": 0 })).unwrap(), 1);
        assert_eq!(cost(json!({ "prompt": prompt, "width": 2048, "height": 2048, "n": 8 })).unwrap(), 256);
    }

    #[test]
    fn image_inputs_outside_their_limits_are_invalid_input() {
        let refused = |input: Value| parse(&json!({ "kind": "image", "input": input }), None).err().map(|e| (e.status.as_u16(), e.code));
        let prompt = "a lighthouse at dusk";
        for bad in [
            json!({}),
            json!({ "prompt": "" }),
            json!({ "prompt": "x".repeat(32769) }),
            json!({ "prompt": prompt, "width": 500 }),
            json!({ "prompt": prompt, "height": 56 }),
            json!({ "prompt": prompt, "width": 2056 }),
            json!({ "prompt": prompt, "steps": 0 }),
            json!({ "prompt": prompt, "steps": 151 }),
            json!({ "prompt": prompt, "guidance": -0.5 }),
            json!({ "prompt": prompt, "guidance": 30.5 }),
            json!({ "prompt": prompt, "seed": -1 }),
            json!({ "prompt": prompt, "seed": 1.5 }),
            json!({ "prompt": prompt, "n": 0 }),
            json!({ "prompt": prompt, "n": 9 }),
            json!({ "prompt": prompt, "scheduler": "lms" }),
            json!({ "prompt": prompt, "size": "512x512" }),
        ] {
            assert_eq!(refused(bad.clone()), Some((422, "invalid_input")), "{bad}");
        }
        let widest = json!({ "prompt": prompt, "negative_prompt": "fog", "width": 2048, "height": 64, "steps": 150, "guidance": 30, "seed": 9007199254740991_u64, "n": 8, "scheduler": "euler_a" });
        assert_eq!(refused(widest), None);
    }
}
