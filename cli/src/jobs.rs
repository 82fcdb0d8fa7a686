//! `tern embed`, `tern generate`, `tern submit`, and `tern jobs list|get|watch|cancel|retry`.

use crate::api::Api;
use crate::output::Output;
use crate::watch::{self, Watched};
use crate::Outcome;
use anyhow::{bail, Context, Result};
use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};
use serde_json::{json, Value};
use std::io::{BufRead, Write};
use std::path::PathBuf;

#[derive(clap::Subcommand)]
pub enum Command {
    /// Jobs, newest first.
    List {
        /// queued, scheduled, running, retrying, succeeded, failed or canceled.
        #[arg(long)]
        state: Option<String>,
        #[arg(long)]
        kind: Option<String>,
        /// 1 to 500.
        #[arg(long, default_value_t = 20)]
        limit: u32,
    },
    /// A job, with its timeline.
    Get { id: String },
    /// Follow a job live (its state changes, progress and text) until it finishes; exit 1
    /// unless it succeeded.
    Watch { id: String },
    /// Cancel jobs: waiting ones at once, running ones at their worker's next check.
    Cancel {
        #[arg(required = true)]
        ids: Vec<String>,
    },
    /// Queue failed jobs again (admin).
    Retry {
        #[arg(required = true)]
        ids: Vec<String>,
    },
}

/// Waits for one job with its progress; the finished job.
pub(crate) async fn wait_one(api: &Api, out: &Output, id: &str, label: &str) -> Result<Value> {
    let mut last = Value::Null;
    watch::wait_all(api, out, vec![Watched { id: id.into(), label: label.into() }], 1, |_, job| {
        last = job;
        async { Ok(()) }
    })
    .await?;
    Ok(last)
}

/// The output of a finished job: inline, or downloaded.
pub(crate) async fn output_of(api: &Api, job: &Value) -> Result<Value> {
    if let Some(inline) = job["output"].get("inline") {
        return Ok(inline.clone());
    }
    let url = job["output"]["url"].as_str().context("the job has no output")?;
    Ok(serde_json::from_slice(&api.download(url).await?)?)
}

pub(crate) fn outcome(job: &Value) -> Outcome {
    if job["state"] == "succeeded" {
        Outcome::Ok
    } else {
        Outcome::JobFailed
    }
}

pub(crate) fn failure_note(out: &Output, job: &Value) {
    if job["state"] != "succeeded" {
        out.note(&format!("job {} {}: {}", job["id"].as_str().unwrap_or(""), job["state"].as_str().unwrap_or(""), job["error"]["message"].as_str().unwrap_or("")));
    }
}

pub async fn embed(api: &Api, out: &Output, mut texts: Vec<String>, file: Option<PathBuf>, priority: Option<String>) -> Result<Outcome> {
    if let Some(path) = file {
        let reader: Box<dyn BufRead> = if path.as_os_str() == "-" {
            Box::new(std::io::stdin().lock())
        } else {
            Box::new(std::io::BufReader::new(std::fs::File::open(&path).with_context(|| format!("opening {}", path.display()))?))
        };
        for line in reader.lines() {
            let line = line?;
            if !line.trim().is_empty() {
                texts.push(line);
            }
        }
    }
    if texts.is_empty() {
        bail!("nothing to embed: give texts, or --file");
    }
    let mut request = json!({ "kind": "embed", "input": { "texts": texts } });
    if let Some(p) = priority {
        request["priority"] = json!(p);
    }
    let job = api.post("/v1/jobs", &request).await?;
    let job = wait_one(api, out, job["id"].as_str().context("a job id")?, "embed").await?;
    failure_note(out, &job);
    if job["state"] == "succeeded" {
        out.print(&output_of(api, &job).await?);
    }
    Ok(outcome(&job))
}

pub struct GenerateArgs {
    pub prompt: String,
    pub system: Option<String>,
    pub max_tokens: u32,
    pub temperature: f64,
    pub priority: Option<String>,
}

pub async fn generate(api: &Api, out: &Output, args: GenerateArgs) -> Result<Outcome> {
    let mut input = json!({ "max_tokens": args.max_tokens, "temperature": args.temperature });
    match &args.system {
        Some(system) => input["messages"] = json!([{ "role": "system", "content": system }, { "role": "user", "content": args.prompt }]),
        None => input["prompt"] = json!(args.prompt),
    }
    let mut request = json!({ "kind": "generate", "input": input });
    if let Some(p) = &args.priority {
        request["priority"] = json!(p);
    }
    let job = api.post("/v1/jobs", &request).await?;
    let id = job["id"].as_str().context("a job id")?.to_string();
    if out.json {
        let job = wait_one(api, out, &id, "generate").await?;
        failure_note(out, &job);
        if job["state"] == "succeeded" {
            out.print(&output_of(api, &job).await?);
        }
        return Ok(outcome(&job));
    }
    // On a terminal, the text as it comes.
    let job = follow(api, &id, |event, data| {
        if event == "text" {
            print!("{}", data["delta"].as_str().unwrap_or_default());
            let _ = std::io::stdout().flush();
        }
    })
    .await?;
    println!();
    failure_note(out, &job);
    Ok(outcome(&job))
}

/// Follows a job's stream (`GET /v1/jobs/{id}/stream`), calling `on_event` with each event,
/// until the job finishes; reconnects with `Last-Event-ID` if the connection drops. The
/// finished job.
async fn follow(api: &Api, id: &str, mut on_event: impl FnMut(&str, &Value)) -> Result<Value> {
    let mut last_id: Option<String> = None;
    let mut failures = 0;
    loop {
        let mut request = api.long_request(reqwest::Method::GET, &format!("/v1/jobs/{id}/stream"));
        if let Some(last) = &last_id {
            request = request.header("Last-Event-ID", last);
        }
        let mut response = match request.send().await {
            Ok(r) if r.status().is_success() => r,
            Ok(r) => {
                Api::json(r).await?;
                unreachable!("a refusal is an error")
            }
            Err(e) if failures < 30 => {
                failures += 1;
                tracing_note(&e);
                tokio::time::sleep(std::time::Duration::from_secs(1)).await;
                continue;
            }
            Err(e) => return Err(e.into()),
        };
        let mut buffer = String::new();
        while let Ok(Some(chunk)) = response.chunk().await {
            failures = 0;
            buffer.push_str(&String::from_utf8_lossy(&chunk));
            while let Some(end) = buffer.find("\n\n") {
                let block: String = buffer.drain(..end + 2).collect();
                let (mut event, mut data) = (String::from("message"), Value::Null);
                for line in block.lines() {
                    if let Some(v) = line.strip_prefix("event:") {
                        event = v.trim().to_string();
                    } else if let Some(v) = line.strip_prefix("id:") {
                        last_id = Some(v.trim().to_string());
                    } else if let Some(v) = line.strip_prefix("data:") {
                        data = serde_json::from_str(v.trim()).unwrap_or(Value::Null);
                    }
                }
                if data.is_null() {
                    continue;
                }
                on_event(&event, &data);
                if event == "job" {
                    return Ok(data);
                }
                if event == "error" {
                    bail!("the job's stream failed: {}", data["message"].as_str().unwrap_or_default());
                }
            }
        }
        // The connection dropped before the job finished: resume where it stopped.
        tokio::time::sleep(std::time::Duration::from_millis(500)).await;
    }
}

fn tracing_note(e: &reqwest::Error) {
    eprintln!("the stream dropped ({e}); reconnecting");
}

pub async fn submit(api: &Api, out: &Output, kind: &str, input: &str, priority: Option<String>, key: Option<String>, wait: bool) -> Result<Outcome> {
    let text = match input.strip_prefix('@') {
        Some(path) => std::fs::read_to_string(path).with_context(|| format!("reading {path}"))?,
        None => input.to_string(),
    };
    let input: Value = serde_json::from_str(&text).context("--input is not JSON")?;
    let mut request = json!({ "kind": kind, "input": input });
    if let Some(p) = priority {
        request["priority"] = json!(p);
    }
    if let Some(k) = key {
        request["idempotency_key"] = json!(k);
    }
    let job = api.post("/v1/jobs", &request).await?;
    if !wait {
        out.print(&job);
        return Ok(Outcome::Ok);
    }
    let job = wait_one(api, out, job["id"].as_str().context("a job id")?, kind).await?;
    failure_note(out, &job);
    out.print(&job);
    Ok(outcome(&job))
}

pub async fn run(api: &Api, out: &Output, command: Command) -> Result<Outcome> {
    match command {
        Command::List { state, kind, limit } => {
            let mut path = format!("/v1/jobs?limit={limit}");
            if let Some(s) = state {
                path.push_str(&format!("&state={s}"));
            }
            if let Some(k) = kind {
                path.push_str(&format!("&kind={k}"));
            }
            let page = api.get(&path).await?;
            let rows: Vec<Value> = page["jobs"].as_array().cloned().unwrap_or_default();
            out.table(&rows, &["id", "kind", "priority", "state", "attempts", "created_at"]);
        }
        Command::Get { id } => {
            let mut job = api.get(&format!("/v1/jobs/{id}")).await?;
            job["events"] = api.get(&format!("/v1/jobs/{id}/events")).await?["events"].clone();
            out.print(&job);
        }
        Command::Watch { id } => {
            api.get(&format!("/v1/jobs/{id}")).await?;
            let bar = ProgressBar::new(1);
            if !out.bars {
                bar.set_draw_target(ProgressDrawTarget::hidden());
            }
            bar.set_style(ProgressStyle::with_template("{spinner} {msg} {bar:30} {pos}/{len} [{elapsed}]").expect("a template"));
            bar.enable_steady_tick(std::time::Duration::from_millis(120));
            let json = out.json;
            let job = follow(api, &id, |event, data| {
                if json {
                    println!("{}", json!({ "event": event, "data": data }));
                }
                match event {
                    "state" => bar.set_message(data["state"].as_str().unwrap_or_default().to_string()),
                    "progress" => {
                        bar.set_length(data["total"].as_u64().unwrap_or(1).max(1));
                        bar.set_position(data["done"].as_u64().unwrap_or(0));
                    }
                    "text" if !json => bar.suspend(|| {
                        print!("{}", data["delta"].as_str().unwrap_or_default());
                        let _ = std::io::stdout().flush();
                    }),
                    _ => {}
                }
            })
            .await?;
            bar.finish_and_clear();
            if !out.json {
                println!();
                out.print(&json!({ "id": job["id"], "state": job["state"], "error": job["error"], "output": job["output"] }));
            }
            failure_note(out, &job);
            return Ok(outcome(&job));
        }
        Command::Cancel { ids } => {
            for id in ids {
                let job = api.post(&format!("/v1/jobs/{id}/cancel"), &json!({})).await?;
                out.print(&json!({ "id": job["id"], "state": job["state"], "cancel_requested": job["cancel_requested"] }));
            }
        }
        Command::Retry { ids } => {
            let retried = api.post("/v1/admin/jobs/retry", &json!({ "ids": ids })).await?;
            out.print(&retried);
        }
    }
    Ok(Outcome::Ok)
}
