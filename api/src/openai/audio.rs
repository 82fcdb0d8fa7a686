//! `POST /v1/audio/transcriptions` and `/v1/audio/translations`: multipart audio of any length
//! the transcribe kind accepts (`TERN_MAX_AUDIO_SECONDS`, `TERN_MAX_AUDIO_UPLOAD_BYTES`), not
//! OpenAI's 25 MB. The file streams into storage as an upload as it arrives (a request holds
//! one part of it at a time, never the whole), then is transcribed as a `transcribe` job.

use super::{sse_data, OpenAiError, Waited};
use crate::auth::Caller;
use tern_jobs::api_keys::Principal;
use crate::state::AppState;
use crate::error::ApiError;
use axum::extract::multipart::MultipartRejection;
use axum::extract::{Multipart, State};
use axum::http::{header, HeaderMap, StatusCode};
use axum::response::sse::{KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use axum::Json;
use futures::StreamExt;
use serde_json::{json, Value};
use tern_jobs::file_ref::UPLOAD_PREFIX;
use uuid::Uuid;

/// What a `response_format` asks for.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Format {
    Json,
    Text,
    Srt,
    Vtt,
    VerboseJson,
}

impl Format {
    fn parse(s: &str) -> Result<Format, OpenAiError> {
        Ok(match s {
            "json" => Format::Json,
            "text" => Format::Text,
            "srt" => Format::Srt,
            "vtt" => Format::Vtt,
            "verbose_json" => Format::VerboseJson,
            other => {
                return Err(OpenAiError::invalid(
                    "invalid_response_format",
                    format!("response_format {other:?}: use json, text, srt, vtt or verbose_json"),
                    "response_format",
                ))
            }
        })
    }
}

/// A transcription or translation request's options: every field but the file.
pub struct Transcription {
    /// `transcribe` or `translate`.
    task: &'static str,
    language: Option<String>,
    format: Format,
    stream: bool,
    word_timestamps: bool,
    prompt: Option<String>,
    /// The first decoding pass's temperature; 0 is greedy.
    temperature: f64,
}

/// The longest `prompt` taken, in characters (the model reads its last 223 tokens).
const MAX_PROMPT_CHARS: usize = 4000;

impl Transcription {
    fn new(task: &'static str) -> Transcription {
        Transcription { task, language: None, format: Format::Json, stream: false, word_timestamps: false, prompt: None, temperature: 0.0 }
    }

    /// Takes one form field; refuses what tern cannot honour rather than ignoring it.
    fn set(&mut self, name: &str, value: String) -> Result<(), OpenAiError> {
        match name {
            // Any model name: the workers' Whisper model runs (its name is in verbose_json).
            "model" => {}
            "language" if !value.is_empty() => self.language = Some(value),
            "response_format" => self.format = Format::parse(&value)?,
            "stream" => self.stream = value == "true",
            "temperature" => {
                self.temperature = value
                    .trim()
                    .parse::<f64>()
                    .ok()
                    .filter(|t| (0.0..=1.0).contains(t))
                    .ok_or_else(|| OpenAiError::invalid("invalid_temperature", "temperature must be a number from 0 to 1", "temperature"))?;
            }
            "prompt" if !value.trim().is_empty() => {
                if value.chars().count() > MAX_PROMPT_CHARS {
                    return Err(OpenAiError::invalid("prompt_too_long", format!("prompt: at most {MAX_PROMPT_CHARS} characters"), "prompt"));
                }
                self.prompt = Some(value);
            }
            "timestamp_granularities[]" | "timestamp_granularities" => match value.as_str() {
                "segment" => {}
                "word" => self.word_timestamps = true,
                other => return Err(OpenAiError::invalid("invalid_timestamp_granularity", format!("{other:?}: use segment or word"), "timestamp_granularities")),
            },
            _ => {}
        }
        Ok(())
    }

    /// Checks the options together, once every field is in.
    fn check(self) -> Result<Transcription, OpenAiError> {
        if self.word_timestamps && self.format != Format::VerboseJson && !self.stream {
            return Err(OpenAiError::invalid(
                "invalid_timestamp_granularity",
                "word timestamps come in verbose_json: set response_format to verbose_json",
                "timestamp_granularities",
            ));
        }
        if self.stream && self.format != Format::Json && self.format != Format::Text {
            return Err(OpenAiError::unsupported("stream", "streamed transcripts are text: response_format json or text"));
        }
        Ok(self)
    }

    /// A request given as JSON (a batch line's `body`): the form's fields, with `file` an
    /// http(s) URL or an upload key (`POST /v1/uploads`). Returns the options and the file as
    /// the job's input names it.
    pub fn from_json(body: &Value, task: &'static str) -> Result<(Transcription, Value), OpenAiError> {
        let fields = body.as_object().ok_or_else(|| OpenAiError::invalid("invalid_request", "the body must be a JSON object", "body"))?;
        let mut request = Transcription::new(task);
        let mut file = None;
        for (name, value) in fields {
            let text = |v: &Value| match v {
                Value::String(s) => s.clone(),
                other => other.to_string(),
            };
            match (name.as_str(), value) {
                ("file", Value::String(f)) if f.starts_with("http://") || f.starts_with("https://") => file = Some(json!({ "url": f })),
                ("file", Value::String(f)) if !f.is_empty() => file = Some(json!({ "upload_key": f })),
                ("file", _) => {}
                ("timestamp_granularities", Value::Array(items)) => {
                    for item in items {
                        request.set(name, text(item))?;
                    }
                }
                (_, Value::Null) => {}
                _ => request.set(name, text(value))?,
            }
        }
        let file = file.ok_or_else(|| OpenAiError::invalid("invalid_file", "\"file\" must be an http(s) URL or an upload key", "file"))?;
        Ok((request.check()?, file))
    }

    /// Whether it asks for a stream of transcript events.
    pub fn stream(&self) -> bool {
        self.stream
    }

    /// The `transcribe` job it runs as (`POST /v1/jobs`'s body), for the audio `file` (a file
    /// reference as job inputs take them).
    pub fn job_request(&self, file: Value) -> Value {
        let mut input = json!({ "audio": file, "task": self.task });
        if let Some(language) = &self.language {
            input["language"] = json!(language);
        }
        if let Some(prompt) = &self.prompt {
            input["prompt"] = json!(prompt);
        }
        if self.temperature > 0.0 {
            input["temperature"] = json!(self.temperature);
        }
        if self.word_timestamps && !self.stream {
            input["word_timestamps"] = json!(true);
        }
        json!({ "kind": "transcribe", "input": input })
    }

    /// OpenAI's answer from the finished job's output, as JSON; text formats (`text`, `srt`,
    /// `vtt`) are a JSON string.
    pub fn response_value(&self, output: &Value) -> Value {
        match self.answer(output) {
            Answer::Json(v) => v,
            Answer::Plain(text, _) => json!(text),
        }
    }

    fn answer(&self, output: &Value) -> Answer {
        let text = output["text"].as_str().unwrap_or_default().trim().to_string();
        match self.format {
            Format::Json => Answer::Json(json!({ "text": text, "usage": usage(output) })),
            Format::Text => Answer::Plain(format!("{text}\n"), "text/plain; charset=utf-8"),
            Format::Srt => Answer::Plain(subtitles(output, false), "application/x-subrip; charset=utf-8"),
            Format::Vtt => Answer::Plain(subtitles(output, true), "text/vtt; charset=utf-8"),
            Format::VerboseJson => Answer::Json(verbose(output, self.task, &text, self.word_timestamps)),
        }
    }
}

/// A transcription answer: JSON, or text with its content type.
enum Answer {
    Json(Value),
    Plain(String, &'static str),
}

/// An audio file streamed from a form into object storage as an upload, and its SHA-256.
pub struct StoredUpload {
    pub key: String,
    pub sha256: String,
}

/// Reads the multipart form: the file (streamed to storage) and the options.
async fn read(state: &AppState, tenant: &str, form: Result<Multipart, MultipartRejection>, task: &'static str) -> Result<(Transcription, StoredUpload), OpenAiError> {
    let mut request = Transcription::new(task);
    let file = read_form(state, tenant, form, |name, value| request.set(name, value)).await?;
    match request.check() {
        Ok(request) => Ok((request, file)),
        Err(e) => {
            discard(state, &file).await;
            Err(e)
        }
    }
}

/// Removes an upload no job will read (a refused request's, or a replayed one's).
async fn discard(state: &AppState, upload: &StoredUpload) {
    if let Err(e) = state.objects.delete(&upload.key).await {
        tracing::warn!(key = %upload.key, error = %e, "could not remove an unused upload; it stays until removed");
    }
}

/// Reads a multipart form of an audio `file` and options, each option handed to `set`. The
/// file goes to object storage as it arrives, a part at a time (the request never holds it
/// whole), under a new upload key of `tenant`'s; it must not be empty. The whole form is read
/// before a bad option is refused: answering with the upload still unread makes the server
/// close the connection, which a client may be reusing. A refused form leaves no upload.
async fn read_form(
    state: &AppState,
    tenant: &str,
    form: Result<Multipart, MultipartRejection>,
    mut set: impl FnMut(&str, String) -> Result<(), OpenAiError>,
) -> Result<StoredUpload, OpenAiError> {
    // axum's own rejection (no multipart content type, no boundary) answers in plain text.
    let mut form = form.map_err(|e| OpenAiError { status: e.status(), code: "invalid_multipart".into(), message: format!("the multipart form: {}", e.body_text()), param: None })?;
    let bad_form = |e: axum::extract::multipart::MultipartError| {
        let status = e.status();
        OpenAiError { status, code: "invalid_multipart".into(), message: format!("the multipart form: {}", e.body_text()), param: None }
    };
    let (mut file, mut refused) = (None::<(StoredUpload, u64)>, None);
    let read = async {
        while let Some(mut field) = form.next_field().await.map_err(bad_form)? {
            let name = field.name().unwrap_or_default().to_string();
            if name == "file" && file.is_none() {
                let key = format!("{UPLOAD_PREFIX}{}/{}", crate::routes::uploads::tenant_segment(tenant), Uuid::now_v7());
                let mut writer = state.objects.writer(&key, "application/octet-stream");
                // Known to storage from here: a failure below removes it.
                file = Some((StoredUpload { key, sha256: String::new() }, 0));
                while let Some(chunk) = field.chunk().await.map_err(bad_form)? {
                    writer.write(&chunk).await.map_err(ApiError::from)?;
                }
                let stored = writer.finish().await.map_err(ApiError::from)?;
                if let Some((upload, bytes)) = file.as_mut() {
                    upload.sha256 = stored.sha256;
                    *bytes = stored.size.max(0) as u64;
                }
                continue;
            }
            let value = field.text().await.map_err(bad_form)?;
            let checked = match value.contains('\0') {
                // Postgres cannot store a NUL: refused as POST /v1/jobs refuses one.
                true => Err(crate::extract::nul_error(&format!("the field {name:?}")).into()),
                false => set(&name, value),
            };
            if let (Err(e), None) = (checked, &refused) {
                refused = Some(e);
            }
        }
        Ok::<(), OpenAiError>(())
    }
    .await;
    let problem = match (read, refused, &file) {
        (Err(e), _, _) | (Ok(()), Some(e), _) => Some(e),
        (Ok(()), None, Some((_, 0)) | None) => Some(OpenAiError::invalid("invalid_file", "the form needs a non-empty \"file\"", "file")),
        (Ok(()), None, Some(_)) => None,
    };
    match (problem, file) {
        (None, Some((upload, _))) => Ok(upload),
        (Some(e), Some((upload, _))) => {
            discard(state, &upload).await;
            Err(e)
        }
        (Some(e), None) => Err(e),
        (None, None) => unreachable!("a form without a file is refused above"),
    }
}

/// Submits `value`, a job reading `upload` as its `input.audio`. With an `Idempotency-Key`,
/// the request is told from another by its file's content, not by the upload key each try
/// mints: a retry of the same form gets the first job (and its own copy of the file goes); a
/// different file under the same key gets 409. A refused request leaves no upload behind.
async fn submit_upload(state: &AppState, caller: &Principal, value: Value, headers: &HeaderMap, upload: &StoredUpload) -> Result<Waited, OpenAiError> {
    let mut canonical = value.clone();
    canonical["input"]["audio"] = json!({ "upload_sha256": upload.sha256 });
    match Waited::submit_as(state, caller, value, headers, Some(&canonical)).await {
        Ok(waited) => {
            if !waited.owned() {
                discard(state, upload).await;
            }
            Ok(waited)
        }
        Err(e) => {
            discard(state, upload).await;
            Err(e)
        }
    }
}

/// Transcribe audio.
pub async fn transcriptions(state: State<AppState>, caller: Caller, headers: HeaderMap, form: Result<Multipart, MultipartRejection>) -> Result<Response, OpenAiError> {
    run(state, caller, headers, form, "transcribe").await
}

/// Translate audio into English text.
pub async fn translations(state: State<AppState>, caller: Caller, headers: HeaderMap, form: Result<Multipart, MultipartRejection>) -> Result<Response, OpenAiError> {
    run(state, caller, headers, form, "translate").await
}

async fn run(State(state): State<AppState>, caller: Caller, headers: HeaderMap, form: Result<Multipart, MultipartRejection>, task: &'static str) -> Result<Response, OpenAiError> {
    let principal = caller.require("jobs:write")?;
    let tenant = principal.tenant.clone();
    let (request, upload) = read(&state, &tenant, form, task).await?;
    let value = request.job_request(json!({ "upload_key": upload.key }));
    let mut waited = submit_upload(&state, principal, value, &headers, &upload).await?;
    let job_header = waited.header();
    if request.stream {
        // The transcript comes as the worker finishes windows (the text of the leading ones
        // done); comments keep the connection open meanwhile. Dropped early (the client left),
        // the stream drops `waited`, which cancels the job.
        let live = Live { waited, sent: 0, attempt: None, done: false };
        let events = futures::stream::unfold(live, |mut live| async move {
            if live.done {
                return None;
            }
            let events = live.next_events().await;
            Some((futures::stream::iter(events.into_iter().map(Ok::<_, std::convert::Infallible>)), live))
        })
        .flatten();
        return Ok(([job_header], Sse::new(events).keep_alive(KeepAlive::default())).into_response());
    }
    let job = waited.finished().await?;
    let output = waited.output(&job).await?;
    Ok(match request.answer(&output) {
        Answer::Json(v) => ([job_header], Json(v)).into_response(),
        Answer::Plain(body, content_type) => {
            (StatusCode::OK, [job_header, (header::CONTENT_TYPE, content_type.parse().expect("a content type"))], body).into_response()
        }
    })
}

/// Billing as OpenAI reports it for Whisper: seconds of audio.
fn usage(output: &Value) -> Value {
    json!({ "type": "duration", "seconds": output["duration"].as_f64().unwrap_or(0.0).ceil() as u64 })
}

fn segments(output: &Value) -> &[Value] {
    output["segments"].as_array().map_or(&[], Vec::as_slice)
}

/// `verbose_json`: the text with its language, duration and timed segments, and with `words`
/// its timed words (OpenAI's shape: the word without its leading space, start, end).
fn verbose(output: &Value, task: &str, text: &str, words: bool) -> Value {
    let numbered: Vec<Value> = segments(output)
        .iter()
        .enumerate()
        .map(|(id, s)| json!({ "id": id, "seek": 0, "start": s["start"], "end": s["end"], "text": s["text"], "tokens": [], "temperature": 0.0 }))
        .collect();
    let mut v = json!({
        "task": task,
        "language": output["language"],
        "duration": output["duration"],
        "text": text,
        "segments": numbered,
        "usage": usage(output),
    });
    if words {
        let words: Vec<Value> = segments(output)
            .iter()
            .flat_map(|s| s["words"].as_array().map_or(&[][..], Vec::as_slice))
            .map(|w| json!({ "word": w["word"].as_str().unwrap_or_default().trim(), "start": w["start"], "end": w["end"] }))
            .collect();
        v["words"] = json!(words);
    }
    v
}


/// SRT (`00:00:01,500`) or WebVTT (`00:00:01.500`, with its header) from the segments.
fn subtitles(output: &Value, vtt: bool) -> String {
    let stamp = |seconds: f64| {
        let ms = (seconds.max(0.0) * 1000.0).round() as u64;
        let (h, m, s, ms) = (ms / 3_600_000, ms / 60_000 % 60, ms / 1000 % 60, ms % 1000);
        if vtt {
            format!("{h:02}:{m:02}:{s:02}.{ms:03}")
        } else {
            format!("{h:02}:{m:02}:{s:02},{ms:03}")
        }
    };
    let mut out = String::from(if vtt { "WEBVTT\n\n" } else { "" });
    for (i, s) in segments(output).iter().enumerate() {
        let (start, end) = (s["start"].as_f64().unwrap_or(0.0), s["end"].as_f64().unwrap_or(0.0));
        let text = s["text"].as_str().unwrap_or_default().trim();
        if !vtt {
            out.push_str(&format!("{}\n", i + 1));
        }
        out.push_str(&format!("{} --> {}\n{text}\n\n", stamp(start), stamp(end)));
    }
    out
}

/// How often a live transcript looks for new text.
const STREAM_POLL: std::time::Duration = std::time::Duration::from_millis(100);

/// A streamed transcript, OpenAI's events: `transcript.text.delta` as windows finish (the
/// worker reports the text of the leading windows done, which only grows at its end), the
/// rest per segment once the job is done, then `transcript.text.done` with the whole text,
/// which the deltas add up to.
struct Live {
    /// Dropped with the stream when the client leaves: the job is canceled.
    waited: Waited,
    /// Bytes of the text sent so far.
    sent: usize,
    /// The attempt whose text was sent, once some was.
    attempt: Option<i32>,
    done: bool,
}

impl Live {
    fn delta(delta: &str) -> axum::response::sse::Event {
        sse_data(&json!({ "type": "transcript.text.delta", "delta": delta }))
    }

    async fn next_events(&mut self) -> Vec<axum::response::sse::Event> {
        loop {
            // The text before the job: text of a later attempt is then seen with its attempt.
            let (job, progress) = match self.waited.poll(self.sent).await {
                Ok(read) => read,
                Err(e) => return self.fail(e),
            };
            if let Some(e) = super::retried_since(self.attempt, &job) {
                return self.fail(e);
            }
            if job.state.is_terminal() {
                let output = match self.waited.output(&job).await {
                    Ok(output) => output,
                    Err(e) => return self.fail(e),
                };
                self.done = true;
                let text = output["text"].as_str().unwrap_or_default().trim();
                // What was sent live is the start of the final text; the rest goes per segment.
                let sent = if text.is_char_boundary(self.sent.min(text.len())) { self.sent.min(text.len()) } else { 0 };
                let mut events: Vec<_> = deltas(&text[sent..], &output).into_iter().map(Self::delta).collect();
                events.push(sse_data(&json!({ "type": "transcript.text.done", "text": text, "usage": usage(&output) })));
                return events;
            }
            if let Some(text) = progress.and_then(|p| p.text) {
                if let Some(delta) = text.get(self.sent..).filter(|d| !d.is_empty()) {
                    self.sent = text.len();
                    self.attempt = Some(super::attempt_in_progress(&job));
                    return vec![Self::delta(delta)];
                }
            }
            self.waited.pause(STREAM_POLL).await;
        }
    }

    fn fail(&mut self, e: OpenAiError) -> Vec<axum::response::sse::Event> {
        self.done = true;
        vec![sse_data(&json!({ "type": "error", "error": { "code": e.code, "message": e.message } }))]
    }
}

/// `text` cut where each segment's text ends in it (the spaces between them go with the next
/// segment), so that the pieces add up to `text` exactly.
fn deltas<'a>(text: &'a str, output: &Value) -> Vec<&'a str> {
    let (mut pieces, mut at) = (Vec::new(), 0);
    for segment in segments(output).iter().filter_map(|s| s["text"].as_str()).map(str::trim).filter(|s| !s.is_empty()) {
        if let Some(found) = text[at..].find(segment) {
            let end = at + found + segment.len();
            pieces.push(&text[at..end]);
            at = end;
        }
    }
    if at < text.len() {
        pieces.push(&text[at..]);
    }
    pieces
}

#[cfg(test)]
mod tests {
    use super::*;

    fn output() -> Value {
        json!({ "text": " Hello there. General Kenobi.", "language": "en", "duration": 3723.25, "segments": [
            { "start": 0.0, "end": 1.5, "text": " Hello there." },
            { "start": 3722.0, "end": 3723.25, "text": " General Kenobi." },
        ]})
    }

    #[test]
    fn srt_numbers_cues_and_uses_commas() {
        assert_eq!(
            subtitles(&output(), false),
            "1\n00:00:00,000 --> 00:00:01,500\nHello there.\n\n2\n01:02:02,000 --> 01:02:03,250\nGeneral Kenobi.\n\n"
        );
    }

    #[test]
    fn vtt_has_its_header_and_uses_dots() {
        let vtt = subtitles(&output(), true);
        assert!(vtt.starts_with("WEBVTT\n\n00:00:00.000 --> 00:00:01.500\nHello there.\n"), "{vtt}");
    }

    #[test]
    fn stream_deltas_add_up_to_the_text() {
        let text = "Hello there. General Kenobi.";
        assert_eq!(deltas(text, &output()), vec!["Hello there.", " General Kenobi."]);
        let odd = json!({ "segments": [{ "text": "not in it" }, { "text": "there." }] });
        assert_eq!(deltas(text, &odd).concat(), text);
    }

    #[test]
    fn prompt_temperature_and_word_timestamps_reach_the_job_or_are_refused_by_name() {
        let body = json!({ "file": "https://example.com/a.wav", "prompt": "Kenobi", "temperature": 0.4,
            "response_format": "verbose_json", "timestamp_granularities": ["segment", "word"] });
        let (request, file) = Transcription::from_json(&body, "transcribe").unwrap();
        let job = request.job_request(file);
        assert_eq!(job["input"]["prompt"], "Kenobi");
        assert_eq!(job["input"]["temperature"], 0.4);
        assert_eq!(job["input"]["word_timestamps"], true);
        let refused = |body: Value| Transcription::from_json(&body, "transcribe").err().map(|e| (e.code, e.param));
        assert_eq!(refused(json!({ "file": "up", "temperature": 1.5 })), Some(("invalid_temperature".into(), Some("temperature"))));
        assert_eq!(
            refused(json!({ "file": "up", "timestamp_granularities": ["word"] })),
            Some(("invalid_timestamp_granularity".into(), Some("timestamp_granularities")))
        );
        assert_eq!(refused(json!({ "file": "up", "prompt": "x".repeat(MAX_PROMPT_CHARS + 1) })).unwrap().0, "prompt_too_long");
        // Greedy and without words, the job asks for neither.
        let (plain, file) = Transcription::from_json(&json!({ "file": "up", "temperature": 0 }), "transcribe").unwrap();
        let job = plain.job_request(file);
        assert!(job["input"].get("temperature").is_none() && job["input"].get("word_timestamps").is_none(), "{job}");
    }

    #[test]
    fn verbose_json_lists_the_words_of_every_segment_without_their_spaces() {
        let mut out = output();
        out["segments"][0]["words"] = json!([{ "word": " Hello", "start": 0.0, "end": 0.5, "probability": 0.9 }, { "word": " there.", "start": 0.5, "end": 1.5, "probability": 0.8 }]);
        out["segments"][1]["words"] = json!([{ "word": " General", "start": 3722.0, "end": 3722.6, "probability": 0.9 }]);
        let v = verbose(&out, "transcribe", "Hello there. General", true);
        assert_eq!(v["words"], json!([
            { "word": "Hello", "start": 0.0, "end": 0.5 }, { "word": "there.", "start": 0.5, "end": 1.5 }, { "word": "General", "start": 3722.0, "end": 3722.6 },
        ]));
        assert!(verbose(&out, "transcribe", "", false).get("words").is_none());
    }

    #[test]
    fn usage_counts_whole_seconds_and_verbose_json_numbers_segments() {
        assert_eq!(usage(&output()), json!({ "type": "duration", "seconds": 3724 }));
        let v = verbose(&output(), "transcribe", "Hello there. General Kenobi.", false);
        assert_eq!(v["segments"][1]["id"], 1);
        assert_eq!(v["segments"][1]["end"], 3723.25);
    }
}

/// Embed audio: `POST /v1/audio/embeddings`, a multipart form with the `file` (as for
/// transcriptions) and optionally `encoding_format` (`float`, the default, or `base64`: little-
/// endian f32) and `windows` (`true` adds each 30 s window's vector after the recording's, with
/// its `start` and `end` in seconds). Runs an `audio_embed` job; OpenAI's embeddings list, with
/// the recording's vector at index 0 and usage in seconds of audio as for transcriptions.
pub async fn embeddings(State(state): State<AppState>, caller: Caller, headers: HeaderMap, form: Result<Multipart, MultipartRejection>) -> Result<Response, OpenAiError> {
    let principal = caller.require("jobs:write")?;
    let tenant = principal.tenant.clone();
    let (mut base64, mut windows) = (false, false);
    let upload = read_form(&state, &tenant, form, |name, value| {
        match (name, value.as_str()) {
            ("encoding_format", "float" | "base64") => base64 = value == "base64",
            ("encoding_format", other) => {
                return Err(OpenAiError::invalid("invalid_encoding_format", format!("{other:?}: use float or base64"), "encoding_format"))
            }
            ("windows", "true" | "false") => windows = value == "true",
            ("windows", other) => return Err(OpenAiError::invalid("invalid_windows", format!("{other:?}: use true or false"), "windows")),
            // Any model name (the workers' Whisper runs) and other fields are ignored, as by
            // transcriptions: clients send fields of their own.
            _ => {}
        }
        Ok(())
    })
    .await?;
    let job = json!({ "kind": "audio_embed", "input": { "audio": { "upload_key": upload.key }, "windows": windows } });
    let mut waited = submit_upload(&state, principal, job, &headers, &upload).await?;
    let job_header = waited.header();
    let job = waited.finished().await?;
    let output = waited.output(&job).await?;
    Ok(([job_header], Json(audio_embeddings_response(&output, base64))).into_response())
}

/// OpenAI's embeddings list from an `audio_embed` output: the recording's vector, then its
/// windows' (with `start` and `end`) where asked for.
fn audio_embeddings_response(output: &Value, base64: bool) -> Value {
    let encode = |vector: &Value| {
        if !base64 {
            return vector.clone();
        }
        let floats = vector.as_array().map_or(&[][..], Vec::as_slice);
        let bytes: Vec<u8> = floats.iter().flat_map(|f| (f.as_f64().unwrap_or(0.0) as f32).to_le_bytes()).collect();
        json!(base64::Engine::encode(&base64::engine::general_purpose::STANDARD, bytes))
    };
    let mut data = vec![json!({ "object": "embedding", "index": 0, "embedding": encode(&output["embedding"]) })];
    for (i, w) in output["windows"].as_array().map_or(&[][..], Vec::as_slice).iter().enumerate() {
        data.push(json!({ "object": "embedding", "index": i + 1, "embedding": encode(&w["embedding"]), "start": w["start"], "end": w["end"] }));
    }
    json!({ "object": "list", "data": data, "model": output["model"], "usage": usage(output) })
}
