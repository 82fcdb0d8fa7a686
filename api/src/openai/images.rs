//! `POST /v1/images/generations` as an `image` job: `prompt`, `n` (1 to 8), `size` (`WxH`,
//! multiples of 8 from 64 to 2048, or `auto`: the model's native size), `response_format`
//! `url` (presigned, the default) or `b64_json`; tern's extensions `negative_prompt`, `seed`,
//! `steps`, `guidance` and `scheduler` as the kind takes them. Any `model` is accepted (the
//! workers' image model runs), `user` and `moderation` are taken and ignored (tern moderates
//! nothing); what tern cannot honour (`style`, `quality` other than `auto` or `standard`, a
//! transparent `background`, an `output_format` other than `png`, `output_compression`,
//! `stream`, `partial_images`) is refused by name.

use super::{OpenAiError, Waited};
use crate::auth::Caller;
use crate::error::ApiError;
use crate::state::AppState;
use axum::body::{Body, Bytes};
use axum::extract::rejection::BytesRejection;
use axum::extract::State;
use axum::http::{header, HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::Json;
use base64::Engine;
use futures::stream::{self, Stream, StreamExt};
use serde_json::{json, Map, Value};
use tern_jobs::object_store::ObjectBytes;
use tern_jobs::Job;

/// Smallest and largest side, pixels (the `image` kind's limits).
pub const SIDE_MIN: u64 = 64;
pub const SIDE_MAX: u64 = 2048;
/// Sides are multiples of this (the latents are an eighth of the image's size).
pub const SIDE_STEP: u64 = 8;

/// Request fields that are the `image` kind's input fields as they are: OpenAI's `n` and tern's
/// extensions.
const INPUT_FIELDS: &[&str] = &["n", "negative_prompt", "seed", "steps", "guidance", "scheduler"];

/// `size`: `(width, height)`, or `None` for `auto` (the model's native size).
pub fn parse_size(size: &str) -> Result<Option<(u64, u64)>, OpenAiError> {
    if size == "auto" {
        return Ok(None);
    }
    let invalid = || {
        OpenAiError::invalid(
            "invalid_size",
            format!("size {size:?}: use WIDTHxHEIGHT, each a multiple of {SIDE_STEP} from {SIDE_MIN} to {SIDE_MAX} (such as 512x512), or auto"),
            "size",
        )
    };
    let (width, height) = size.split_once('x').ok_or_else(invalid)?;
    let side = |s: &str| {
        s.parse::<u64>().ok().filter(|n| (SIDE_MIN..=SIDE_MAX).contains(n) && n % SIDE_STEP == 0 && s.bytes().all(|b| b.is_ascii_digit()))
    };
    match (side(width), side(height)) {
        (Some(w), Some(h)) => Ok(Some((w, h))),
        _ => Err(invalid()),
    }
}

/// An image generation request, read from its JSON body.
pub struct ImageGeneration {
    /// The `image` job's input.
    input: Value,
    /// `response_format` `b64_json`: the PNGs in the answer, rather than their URLs.
    pub b64_json: bool,
}

impl ImageGeneration {
    pub fn parse(value: &Value) -> Result<ImageGeneration, OpenAiError> {
        let body = value.as_object().ok_or_else(|| OpenAiError::invalid("invalid_request", "the body must be a JSON object", "body"))?;
        let prompt = body.get("prompt").and_then(Value::as_str).ok_or_else(|| OpenAiError::invalid("invalid_request", "\"prompt\" must be a string", "prompt"))?;
        let mut input = Map::new();
        input.insert("prompt".into(), json!(prompt));
        let given = |field: &str| body.get(field).filter(|v| !v.is_null());
        match given("size").map(|s| s.as_str().ok_or_else(|| OpenAiError::invalid("invalid_size", "size must be a string such as \"512x512\"", "size"))) {
            None => {}
            Some(size) => {
                if let Some((width, height)) = parse_size(size?)? {
                    input.insert("width".into(), json!(width));
                    input.insert("height".into(), json!(height));
                }
            }
        }
        // Checked as the kind's input (422 `invalid_input` outside its limits).
        for field in INPUT_FIELDS {
            if let Some(v) = given(field) {
                input.insert(field.to_string(), v.clone());
            }
        }
        let b64_json = match given("response_format").map(|f| f.as_str()) {
            None | Some(Some("url")) => false,
            Some(Some("b64_json")) => true,
            Some(other) => {
                return Err(OpenAiError::invalid(
                    "invalid_response_format",
                    format!("response_format {}: use url or b64_json", other.map_or_else(|| "must be a string".to_string(), |f| format!("{f:?}"))),
                    "response_format",
                ))
            }
        };
        refuse_unsupported(body)?;
        Ok(ImageGeneration { input: Value::Object(input), b64_json })
    }

    /// The `image` job it runs as (`POST /v1/jobs`'s body).
    pub fn job_request(&self) -> Value {
        json!({ "kind": "image", "input": self.input })
    }
}

/// What tern cannot honour, refused by name (400 `unsupported_parameter`) rather than ignored.
fn refuse_unsupported(body: &Map<String, Value>) -> Result<(), OpenAiError> {
    let given = |field: &str| body.get(field).filter(|v| !v.is_null());
    if given("style").is_some() {
        return Err(OpenAiError::unsupported("style", "tern's image models take no style: describe it in the prompt"));
    }
    if given("quality").is_some_and(|q| !matches!(q.as_str(), Some("auto" | "standard"))) {
        return Err(OpenAiError::unsupported("quality", "quality must be auto or standard: set steps and guidance instead"));
    }
    if given("background").is_some_and(|b| !matches!(b.as_str(), Some("auto" | "opaque"))) {
        return Err(OpenAiError::unsupported("background", "tern's images are opaque: background must be auto or opaque"));
    }
    if given("output_format").is_some_and(|f| f.as_str() != Some("png")) {
        return Err(OpenAiError::unsupported("output_format", "tern's images are PNGs: output_format must be png"));
    }
    if given("output_compression").is_some() {
        return Err(OpenAiError::unsupported("output_compression", "tern's images are lossless PNGs: output_compression does not apply"));
    }
    if given("stream").is_some_and(|s| s.as_bool() != Some(false)) {
        return Err(OpenAiError::unsupported("stream", "images are answered whole: stream must be false"));
    }
    if given("partial_images").is_some_and(|p| p.as_u64() != Some(0)) {
        return Err(OpenAiError::unsupported("partial_images", "tern sends no partial images: partial_images must be 0"));
    }
    Ok(())
}

/// The object keys of the output's images, in order.
fn keys(output: &Value) -> Vec<String> {
    output["images"].as_array().map_or(&[][..], Vec::as_slice).iter().filter_map(|i| i["key"].as_str().map(str::to_string)).collect()
}

/// Gives each image of an `image` job's output (`images[].key`) its download URL beside its
/// key (`url`), presigned now: a URL stored with the output would expire.
pub async fn add_urls(state: &AppState, output: &mut Value) -> Result<(), ApiError> {
    // `pointer_mut`: indexing would add the fields it looks for, as nulls, to another output.
    if let Some(images) = output.pointer_mut("/images").and_then(Value::as_array_mut) {
        for image in images {
            if let Some(key) = image["key"].as_str() {
                image["url"] = json!(state.objects.presign_get(key).await?);
            }
        }
    }
    Ok(())
}

/// OpenAI's answer naming each image by URL, from a finished job's output whose URLs
/// [`add_urls`] added.
pub fn url_response(job: &Job, output: &Value) -> Value {
    let data: Vec<Value> = output["images"].as_array().map_or(&[][..], Vec::as_slice).iter().map(|i| json!({ "url": i["url"] })).collect();
    json!({ "created": job.created_at.timestamp(), "data": data })
}

/// OpenAI's answer with each image's PNG as base64, streamed from object storage as it is
/// encoded: a request holds a chunk of one PNG at a time, not `n` images of up to 2048 x 2048
/// (about 12 MiB each, a third more as base64).
async fn b64_json_answer(state: &AppState, job: &Job, output: &Value) -> Result<Body, OpenAiError> {
    let mut pngs = Vec::new();
    // Every object is opened before the answer starts, so a missing one is a clean error.
    for key in keys(output) {
        let missing = || ApiError::new(StatusCode::INTERNAL_SERVER_ERROR, "internal", format!("the image {key} is not in storage"));
        let (_, bytes) = state.objects.stream(&key).await.map_err(ApiError::from)?.ok_or_else(missing)?;
        pngs.push(bytes);
    }
    let head = Bytes::from(format!("{{\"created\":{},\"data\":[", job.created_at.timestamp()));
    let images = pngs.into_iter().enumerate().map(|(i, png)| {
        let open = if i == 0 { "{\"b64_json\":\"" } else { ",{\"b64_json\":\"" };
        stream::once(async move { Ok(Bytes::from_static(open.as_bytes())) })
            .chain(base64_chunks(png))
            .chain(stream::once(async { Ok(Bytes::from_static(b"\"}")) }))
    });
    let body = stream::once(async { Ok(head) })
        .chain(stream::iter(images).flatten())
        .chain(stream::once(async { Ok::<_, std::io::Error>(Bytes::from_static(b"]}")) }));
    Ok(Body::from_stream(body))
}

/// `chunks` as standard base64, continuing across chunk boundaries: the bytes of a chunk past a
/// multiple of 3 wait for the next one, and the last are padded.
pub fn base64_chunks(chunks: ObjectBytes) -> impl Stream<Item = Result<Bytes, std::io::Error>> + Send {
    let engine = base64::engine::general_purpose::STANDARD;
    chunks.map(Some).chain(stream::once(async { None })).scan(Vec::new(), move |carry: &mut Vec<u8>, chunk| {
        let encoded = match chunk {
            Some(Ok(bytes)) => {
                carry.extend_from_slice(&bytes);
                let whole = carry.len() / 3 * 3;
                let text = engine.encode(&carry[..whole]);
                carry.drain(..whole);
                Ok(Bytes::from(text))
            }
            Some(Err(e)) => Err(std::io::Error::other(e.to_string())),
            None => Ok(Bytes::from(engine.encode(std::mem::take(carry)))),
        };
        std::future::ready(Some(encoded))
    })
}

/// Create images.
pub async fn generations(State(state): State<AppState>, caller: Caller, headers: HeaderMap, body: Result<Bytes, BytesRejection>) -> Result<Response, OpenAiError> {
    let principal = caller.require("jobs:write")?;
    let request = ImageGeneration::parse(&crate::extract::json_value(body)?)?;
    let mut waited = Waited::submit(&state, principal, request.job_request(), &headers).await?;
    let job_header = waited.header();
    let job = waited.finished().await?;
    let output = waited.output(&job).await?;
    if request.b64_json {
        let body = b64_json_answer(&state, &job, &output).await?;
        return Ok(([job_header, (header::CONTENT_TYPE, "application/json".parse().expect("a content type"))], body).into_response());
    }
    let mut output = output;
    add_urls(&state, &mut output).await?;
    Ok(([job_header], Json(url_response(&job, &output))).into_response())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_are_width_by_height_in_multiples_of_8_or_auto() {
        assert_eq!(parse_size("512x512").unwrap(), Some((512, 512)));
        assert_eq!(parse_size("1024x576").unwrap(), Some((1024, 576)));
        assert_eq!(parse_size("64x2048").unwrap(), Some((64, 2048)));
        assert_eq!(parse_size("auto").unwrap(), None);
        for bad in ["", "512", "512x", "x512", "512X512", "512x512x512", "500x512", "56x512", "2056x512", "+512x512", "512 x 512", "-512x512", "1e3x512"] {
            let e = parse_size(bad).expect_err(bad);
            assert_eq!((e.code.as_str(), e.param), ("invalid_size", Some("size")), "{bad}");
        }
    }

    #[test]
    fn requests_become_image_inputs() {
        let request = ImageGeneration::parse(&json!({
            "prompt": "a lighthouse at dusk", "model": "dall-e-3", "n": 2, "size": "768x512", "user": "u1",
            "response_format": "b64_json", "seed": 7, "steps": 20, "guidance": 6.5, "negative_prompt": "fog", "scheduler": "euler_a",
            "quality": "standard", "background": "auto", "output_format": "png", "moderation": "low", "stream": false,
        }))
        .unwrap();
        assert!(request.b64_json);
        assert_eq!(
            request.job_request(),
            json!({ "kind": "image", "input": {
                "prompt": "a lighthouse at dusk", "width": 768, "height": 512, "n": 2, "seed": 7, "steps": 20, "guidance": 6.5,
                "negative_prompt": "fog", "scheduler": "euler_a",
            }})
        );
        // No size, or auto: the model's native size.
        for body in [json!({ "prompt": "p" }), json!({ "prompt": "p", "size": "auto", "response_format": "url" }), json!({ "prompt": "p", "size": null })] {
            let request = ImageGeneration::parse(&body).unwrap();
            assert!(!request.b64_json);
            assert_eq!(request.job_request()["input"], json!({ "prompt": "p" }));
        }
    }

    #[test]
    fn what_tern_cannot_honour_is_refused_by_name() {
        let refused = |body: Value| ImageGeneration::parse(&body).err().map(|e| (e.code, e.param));
        let named = |code: &str, param: &'static str| Some((code.to_string(), Some(param)));
        assert_eq!(refused(json!({})), named("invalid_request", "prompt"));
        assert_eq!(refused(json!({ "prompt": 5 })), named("invalid_request", "prompt"));
        assert_eq!(refused(json!("a prompt")), named("invalid_request", "body"));
        assert_eq!(refused(json!({ "prompt": "p", "size": "huge" })), named("invalid_size", "size"));
        assert_eq!(refused(json!({ "prompt": "p", "size": 512 })), named("invalid_size", "size"));
        assert_eq!(refused(json!({ "prompt": "p", "response_format": "png" })), named("invalid_response_format", "response_format"));
        assert_eq!(refused(json!({ "prompt": "p", "response_format": 1 })), named("invalid_response_format", "response_format"));
        assert_eq!(refused(json!({ "prompt": "p", "style": "vivid" })), named("unsupported_parameter", "style"));
        assert_eq!(refused(json!({ "prompt": "p", "quality": "hd" })), named("unsupported_parameter", "quality"));
        assert_eq!(refused(json!({ "prompt": "p", "background": "transparent" })), named("unsupported_parameter", "background"));
        assert_eq!(refused(json!({ "prompt": "p", "output_format": "webp" })), named("unsupported_parameter", "output_format"));
        assert_eq!(refused(json!({ "prompt": "p", "output_compression": 80 })), named("unsupported_parameter", "output_compression"));
        assert_eq!(refused(json!({ "prompt": "p", "stream": true })), named("unsupported_parameter", "stream"));
        assert_eq!(refused(json!({ "prompt": "p", "partial_images": 2 })), named("unsupported_parameter", "partial_images"));
    }

    #[tokio::test]
    async fn base64_runs_on_across_chunks_of_any_length() {
        let bytes: Vec<u8> = (0..1000u32).map(|i| (i * 7 + i / 13) as u8).collect();
        for splits in [vec![1000], vec![1, 999], vec![2, 2, 2, 994], vec![3, 4, 5, 988], vec![0, 500, 0, 500], vec![999, 1], vec![]] {
            let mut at = 0;
            let mut chunks = Vec::new();
            for len in splits.iter().copied().chain(std::iter::once(1000 - splits.iter().sum::<usize>())) {
                chunks.push(Ok(Bytes::copy_from_slice(&bytes[at..at + len])));
                at += len;
            }
            let source: ObjectBytes = Box::pin(stream::iter(chunks));
            let encoded: Vec<Bytes> = base64_chunks(source).map(Result::unwrap).collect().await;
            let text: String = encoded.iter().map(|b| std::str::from_utf8(b).unwrap()).collect();
            assert_eq!(text, base64::engine::general_purpose::STANDARD.encode(&bytes), "{splits:?}");
        }
    }
}
