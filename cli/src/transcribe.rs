//! `tern transcribe`: files, URLs and directories of recordings, each a `transcribe` job.
//!
//! With `--output-dir`, each transcript is written there (a directory's recordings keep their
//! relative paths), and the run can be stopped and started again at will: what has a
//! transcript is skipped, and the jobs a run submitted are in `.tern-transcribe.jsonl` there,
//! so the next run waits for them rather than submitting them again. Every job has an
//! idempotency key made of its file's content and options, so even a job whose submission was
//! cut off before it was recorded is not made twice: files up to 8 MiB go inline, larger ones
//! as uploads whose key is recorded before the job is submitted, so a run again names the same
//! upload (the same request, a replay) instead of a new one (a conflict) and uploads nothing
//! for a job already made.

use crate::api::Api;
use crate::output::Output;
use crate::watch::{self, Watched};
use crate::Outcome;
use anyhow::{bail, Context, Result};
use base64::Engine;
use serde_json::{json, Value};
use sha2::{Digest, Sha256};
use std::collections::HashMap;
use std::io::Write;
use std::path::{Path, PathBuf};

/// Audio the workers decode.
const AUDIO_EXTENSIONS: &[&str] = &["wav", "flac", "mp3", "ogg", "oga"];
/// Files up to this size are sent inline (base64); larger ones as uploads.
const INLINE_MAX_BYTES: u64 = 8 * 1024 * 1024;
/// The resume record in the output directory.
const STATE_FILE: &str = ".tern-transcribe.jsonl";

#[derive(clap::Args)]
pub struct Args {
    /// Audio files (WAV, FLAC, MP3, OGG), http(s) URLs, or directories searched for them.
    #[arg(required = true)]
    inputs: Vec<String>,
    /// The spoken language (ISO 639-1, e.g. en, de); default: detected.
    #[arg(long)]
    language: Option<String>,
    /// Translate into English instead of transcribing (multilingual models).
    #[arg(long)]
    translate: bool,
    /// What to write: txt, srt, vtt or json (segments with times).
    #[arg(long, default_value = "txt", value_parser = ["txt", "srt", "vtt", "json"])]
    format: String,
    /// Write each transcript here (and skip inputs already transcribed there).
    #[arg(long, short = 'o')]
    output_dir: Option<PathBuf>,
    /// urgent, high, normal or low.
    #[arg(long)]
    priority: Option<String>,
    /// Jobs watched at once.
    #[arg(long, default_value_t = 8)]
    parallel: usize,
    /// Submit and print the job ids without waiting.
    #[arg(long)]
    no_wait: bool,
}

/// One recording to transcribe.
struct Input {
    /// What the user named (a path or URL).
    label: String,
    source: Source,
    /// Where its transcript goes, relative to the output directory.
    relative_output: PathBuf,
}

enum Source {
    File(PathBuf),
    Url(String),
}

/// The inputs: files as named, directories searched (sorted, recursively), URLs.
fn expand(inputs: &[String], format: &str) -> Result<Vec<Input>> {
    let mut out = Vec::new();
    for input in inputs {
        if input.starts_with("http://") || input.starts_with("https://") {
            let name = input.rsplit('/').next().filter(|n| !n.is_empty()).unwrap_or("audio");
            out.push(Input { label: input.clone(), source: Source::Url(input.clone()), relative_output: with_extension(Path::new(name), format) });
            continue;
        }
        let path = PathBuf::from(input);
        if path.is_dir() {
            let mut files = Vec::new();
            collect(&path, &mut files)?;
            files.sort();
            for file in files {
                let relative = file.strip_prefix(&path).unwrap_or(&file).to_path_buf();
                out.push(Input { label: file.display().to_string(), relative_output: with_extension(&relative, format), source: Source::File(file) });
            }
        } else if path.is_file() {
            let name = PathBuf::from(path.file_name().context("a file name")?);
            out.push(Input { label: input.clone(), relative_output: with_extension(&name, format), source: Source::File(path) });
        } else {
            bail!("{input}: no such file or directory (or http(s) URL)");
        }
    }
    Ok(out)
}

fn collect(dir: &Path, files: &mut Vec<PathBuf>) -> Result<()> {
    for entry in std::fs::read_dir(dir).with_context(|| format!("reading {}", dir.display()))? {
        let path = entry?.path();
        if path.is_dir() {
            collect(&path, files)?;
        } else if path.extension().and_then(|e| e.to_str()).is_some_and(|e| AUDIO_EXTENSIONS.contains(&e.to_ascii_lowercase().as_str())) {
            files.push(path);
        }
    }
    Ok(())
}

fn with_extension(path: &Path, format: &str) -> PathBuf {
    let mut p = path.to_path_buf();
    p.set_extension(format);
    p
}

/// What earlier runs recorded in the output directory, by idempotency key: the jobs they
/// submitted, and the uploads they made for jobs (recorded before submitting).
#[derive(Default)]
struct Recorded {
    jobs: HashMap<String, String>,
    uploads: HashMap<String, String>,
}

fn load_state(dir: &Path) -> Result<Recorded> {
    let path = dir.join(STATE_FILE);
    let Ok(text) = std::fs::read_to_string(&path) else { return Ok(Recorded::default()) };
    let mut recorded = Recorded::default();
    for v in text.lines().filter_map(|l| serde_json::from_str::<Value>(l).ok()) {
        let Some(key) = v["key"].as_str() else { continue };
        if let Some(id) = v["job_id"].as_str() {
            recorded.jobs.insert(key.to_string(), id.to_string());
        } else if let Some(upload) = v["upload_key"].as_str() {
            recorded.uploads.insert(key.to_string(), upload.to_string());
        }
    }
    Ok(recorded)
}

fn record(file: &mut Option<std::fs::File>, line: Value) -> Result<()> {
    if let Some(file) = file {
        writeln!(file, "{line}")?;
        file.flush()?;
    }
    Ok(())
}

pub async fn run(api: &Api, out: &Output, args: Args) -> Result<Outcome> {
    let inputs = expand(&args.inputs, &args.format)?;
    if inputs.is_empty() {
        bail!("no audio files ({}) among the inputs", AUDIO_EXTENSIONS.join(", "));
    }
    let mut options = json!({ "task": if args.translate { "translate" } else { "transcribe" } });
    if let Some(language) = &args.language {
        options["language"] = json!(language);
    }
    let known = match &args.output_dir {
        Some(dir) => {
            std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
            load_state(dir)?
        }
        None => Recorded::default(),
    };
    let mut state_file = match &args.output_dir {
        Some(dir) => Some(std::fs::OpenOptions::new().create(true).append(true).open(dir.join(STATE_FILE))?),
        None => None,
    };

    let (mut watched, mut skipped, mut outputs) = (Vec::new(), 0usize, HashMap::new());
    let total = inputs.len();
    for (i, input) in inputs.into_iter().enumerate() {
        if let Some(dir) = &args.output_dir {
            let target = dir.join(&input.relative_output);
            if std::fs::metadata(&target).is_ok_and(|m| m.len() > 0) {
                skipped += 1;
                if out.json {
                    out.print(&json!({ "input": input.label, "state": "skipped", "output": target }));
                }
                continue;
            }
        }
        let (source, key) = read_source(&input.source, &options)?;
        let job_id = match known.jobs.get(&key) {
            Some(id) if !finished_badly(api, id).await? => id.clone(),
            // None yet, or the last one failed: a new job (a fresh key, so it is not a replay).
            previous => {
                let job_key = if previous.is_some() { format!("{key}.{}", uuid_suffix()) } else { key.clone() };
                let mut request = json!({ "kind": "transcribe", "input": options.clone(), "idempotency_key": job_key });
                if let Some(p) = &args.priority {
                    request["priority"] = json!(p);
                }
                // An upload recorded for this key by a run cut off before its job was recorded:
                // the same request again.
                let recorded = known.uploads.get(&job_key).cloned();
                let audio = match (&source, recorded) {
                    (Audio::Upload(_), Some(upload_key)) => json!({ "upload_key": upload_key }),
                    (Audio::Upload(bytes), None) => upload(api, bytes.clone(), &mut state_file, &input.label, &job_key).await?,
                    (Audio::Inline(value), _) => value.clone(),
                };
                request["input"]["audio"] = audio;
                let submitted = match (api.post("/v1/jobs", &request).await, &source) {
                    // The recorded upload is gone (expired, or never stored): upload it anew.
                    (Err(e), Audio::Upload(bytes)) if is_upload_not_found(&e) => {
                        request["input"]["audio"] = upload(api, bytes.clone(), &mut state_file, &input.label, &job_key).await?;
                        api.post("/v1/jobs", &request).await
                    }
                    (other, _) => other,
                };
                let job = submitted.with_context(|| format!("submitting {}", input.label))?;
                job["id"].as_str().context("a job id")?.to_string()
            }
        };
        record(&mut state_file, json!({ "input": input.label, "key": key, "job_id": job_id }))?;
        if !out.bars {
            out.note(&format!("submitted {}/{total}: {} as {job_id}", i + 1, input.label));
        }
        outputs.insert(job_id.clone(), input.relative_output.clone());
        watched.push(Watched { id: job_id, label: input.label });
    }
    if skipped > 0 {
        out.note(&format!("{skipped} of {total} already transcribed in the output directory: skipped"));
    }
    if args.no_wait {
        for w in &watched {
            out.print(&json!({ "input": w.label, "job_id": w.id, "state": "submitted" }));
        }
        return Ok(Outcome::Ok);
    }
    let mut failures = 0usize;
    let format = args.format.clone();
    watch::wait_all(api, out, watched, args.parallel, |w, job| {
        let relative = outputs.get(&w.id).cloned().unwrap_or_default();
        let output_dir = args.output_dir.clone();
        let format = format.clone();
        let failed = job["state"] != "succeeded";
        failures += usize::from(failed);
        async move {
            if failed {
                out.note(&format!("{}: {} ({})", w.label, job["state"].as_str().unwrap_or_default(), job["error"]["message"].as_str().unwrap_or("")));
                if out.json {
                    out.print(&json!({ "input": w.label, "job_id": w.id, "state": job["state"], "error": job["error"] }));
                }
                return Ok(());
            }
            let transcript = rendering(api, &job, &format).await?;
            match output_dir {
                Some(dir) => {
                    let target = dir.join(&relative);
                    if let Some(parent) = target.parent() {
                        std::fs::create_dir_all(parent)?;
                    }
                    // Written whole then renamed, so a transcript that exists is complete.
                    let partial = target.with_extension(format!("{format}.partial"));
                    std::fs::write(&partial, &transcript)?;
                    std::fs::rename(&partial, &target)?;
                    if out.json {
                        out.print(&json!({ "input": w.label, "job_id": w.id, "state": "succeeded", "output": target }));
                    }
                }
                None => {
                    let text = String::from_utf8_lossy(&transcript).to_string();
                    out.text_or(&text, &json!({ "input": w.label, "job_id": w.id, "state": "succeeded", "transcript": text }));
                }
            }
            Ok(())
        }
    })
    .await?;
    Ok(if failures > 0 { Outcome::JobFailed } else { Outcome::Ok })
}

/// A recording as the job will name it: inline (a URL, or a file of up to 8 MiB as base64), or
/// the bytes of a larger file to upload.
enum Audio {
    Inline(Value),
    Upload(Vec<u8>),
}

/// The recording and the idempotency key of its job with `options` (its content and options).
fn read_source(source: &Source, options: &Value) -> Result<(Audio, String)> {
    let mut hash = Sha256::new();
    hash.update(options.to_string().as_bytes());
    match source {
        Source::Url(url) => {
            hash.update(url.as_bytes());
            Ok((Audio::Inline(json!({ "url": url })), format!("tern-cli/transcribe/{}", hex::encode(hash.finalize()))))
        }
        Source::File(path) => {
            let bytes = std::fs::read(path).with_context(|| format!("reading {}", path.display()))?;
            hash.update(&bytes);
            let key = format!("tern-cli/transcribe/{}", hex::encode(hash.finalize()));
            if bytes.len() as u64 <= INLINE_MAX_BYTES {
                return Ok((Audio::Inline(json!({ "base64": base64::engine::general_purpose::STANDARD.encode(&bytes) })), key));
            }
            Ok((Audio::Upload(bytes), key))
        }
    }
}

/// Uploads `bytes` and records the upload under the job's idempotency key before the job is
/// submitted; the job input's file reference.
async fn upload(api: &Api, bytes: Vec<u8>, state_file: &mut Option<std::fs::File>, label: &str, job_key: &str) -> Result<Value> {
    let upload = api.post("/v1/uploads", &json!({})).await?;
    api.put_presigned(upload["url"].as_str().context("an upload URL")?, bytes).await?;
    let upload_key = upload["upload_key"].as_str().context("an upload key")?;
    record(state_file, json!({ "input": label, "key": job_key, "upload_key": upload_key }))?;
    Ok(json!({ "upload_key": upload_key }))
}

fn is_upload_not_found(e: &anyhow::Error) -> bool {
    e.downcast_ref::<crate::api::ApiFailure>().is_some_and(|f| f.code == "upload_not_found")
}

/// Whether job `id` failed or was canceled (a run again submits it anew); a job that is gone
/// counts as failed.
async fn finished_badly(api: &Api, id: &str) -> Result<bool> {
    match api.get(&format!("/v1/jobs/{id}")).await {
        Ok(job) => Ok(matches!(job["state"].as_str(), Some("failed" | "canceled"))),
        Err(e) if e.downcast_ref::<crate::api::ApiFailure>().is_some_and(|f| f.status == 404) => Ok(true),
        Err(e) => Err(e),
    }
}

fn uuid_suffix() -> String {
    let nanos = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap_or_default().as_nanos();
    format!("{nanos:x}")
}

/// The finished job's transcript as `format` asks.
async fn rendering(api: &Api, job: &Value, format: &str) -> Result<Vec<u8>> {
    let output = &job["output"];
    match format {
        "srt" | "vtt" => {
            let url = output["formats"][format]["url"].as_str().with_context(|| format!("the job has no {format} rendering"))?;
            api.download(url).await
        }
        _ => {
            let url = output["url"].as_str().context("the job has no output")?;
            let bytes = api.download(url).await?;
            if format == "json" {
                return Ok(bytes);
            }
            let value: Value = serde_json::from_slice(&bytes)?;
            Ok(format!("{}\n", value["text"].as_str().unwrap_or_default().trim()).into_bytes())
        }
    }
}
