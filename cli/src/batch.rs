//! `tern batch create|get|list|cancel`: OpenAI-style batches (`/v1/files`, `/v1/batches`).

use crate::api::Api;
use crate::output::Output;
use crate::Outcome;
use anyhow::{Context, Result};
use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};
use serde_json::{json, Value};
use std::path::PathBuf;
use std::time::Duration;

#[derive(clap::Subcommand)]
pub enum Command {
    /// Upload a JSONL file of requests (`{"custom_id", "method": "POST", "url", "body"}` a
    /// line) and run it as a batch.
    Create {
        file: PathBuf,
        /// The batch's endpoint; default: the first line's url.
        #[arg(long)]
        endpoint: Option<String>,
        /// How long it may take: 1h to 168h.
        #[arg(long, default_value = "24h")]
        completion_window: String,
        /// The jobs' priority: urgent, high, normal or low (default low).
        #[arg(long)]
        priority: Option<String>,
        /// Wait for it to end, with its progress, and download its output and error files.
        #[arg(long)]
        wait: bool,
        /// Where --wait puts the output and error files; default: the current directory.
        #[arg(long, short = 'o')]
        output_dir: Option<PathBuf>,
    },
    /// A batch.
    Get { id: String },
    /// Batches, newest first.
    List {
        #[arg(long, default_value_t = 20)]
        limit: u32,
    },
    /// Cancel a batch: what finished stays in its output file.
    Cancel { id: String },
}

const FINAL: &[&str] = &["completed", "failed", "expired", "cancelled"];

pub async fn run(api: &Api, out: &Output, command: Command) -> Result<Outcome> {
    match command {
        Command::Create { file, endpoint, completion_window, priority, wait, output_dir } => {
            let bytes = std::fs::read(&file).with_context(|| format!("reading {}", file.display()))?;
            let endpoint = match endpoint {
                Some(e) => e,
                None => {
                    let first = String::from_utf8_lossy(&bytes).lines().find(|l| !l.trim().is_empty()).map(str::to_string).unwrap_or_default();
                    let line: Value = serde_json::from_str(&first).context("the file's first line is not JSON")?;
                    line["url"].as_str().context("the first line has no url: give --endpoint")?.to_string()
                }
            };
            let name = file.file_name().map_or("batch.jsonl".into(), |n| n.to_string_lossy().to_string());
            let form = reqwest::multipart::Form::new().text("purpose", "batch").part("file", reqwest::multipart::Part::bytes(bytes).file_name(name));
            let uploaded = api.send(api.long_request(reqwest::Method::POST, "/v1/files").multipart(form)).await?;
            let mut request = api
                .request(reqwest::Method::POST, "/v1/batches")
                .json(&json!({ "input_file_id": uploaded["id"], "endpoint": endpoint, "completion_window": completion_window }));
            if let Some(p) = &priority {
                request = request.header("X-Tern-Priority", p);
            }
            let batch = api.send(request).await?;
            if !wait {
                out.print(&batch);
                return Ok(Outcome::Ok);
            }
            let batch = wait_for(api, out, batch["id"].as_str().context("a batch id")?).await?;
            let dir = output_dir.unwrap_or_else(|| PathBuf::from("."));
            std::fs::create_dir_all(&dir)?;
            let mut result = batch.clone();
            for (field, suffix) in [("output_file_id", "output"), ("error_file_id", "errors")] {
                if let Some(file_id) = batch[field].as_str() {
                    let path = dir.join(format!("{}_{suffix}.jsonl", batch["id"].as_str().unwrap_or("batch")));
                    std::fs::write(&path, api.download(&format!("/v1/files/{file_id}/content")).await?)?;
                    result[format!("{suffix}_path")] = json!(path);
                }
            }
            out.print(&result);
            let counts = &batch["request_counts"];
            if batch["status"] != "completed" || counts["failed"].as_u64().unwrap_or(0) > 0 {
                out.note(&format!("batch {}: {}, {} of {} requests failed", batch["id"].as_str().unwrap_or(""), batch["status"].as_str().unwrap_or(""), counts["failed"], counts["total"]));
                return Ok(Outcome::JobFailed);
            }
        }
        Command::Get { id } => out.print(&api.get(&format!("/v1/batches/{id}")).await?),
        Command::List { limit } => {
            let page = api.get(&format!("/v1/batches?limit={limit}")).await?;
            let rows: Vec<Value> = page["data"]
                .as_array()
                .map_or(&[][..], Vec::as_slice)
                .iter()
                .map(|b| {
                    let c = &b["request_counts"];
                    json!({ "id": b["id"], "status": b["status"], "endpoint": b["endpoint"],
                            "requests": format!("{}/{} done, {} failed", c["completed"], c["total"], c["failed"]), "created_at": b["created_at"] })
                })
                .collect();
            out.table(&rows, &["id", "status", "endpoint", "requests", "created_at"]);
        }
        Command::Cancel { id } => out.print(&api.post(&format!("/v1/batches/{id}/cancel"), &json!({})).await?),
    }
    Ok(Outcome::Ok)
}

/// Polls the batch until it ends, its requests on a bar.
async fn wait_for(api: &Api, out: &Output, id: &str) -> Result<Value> {
    let bar = ProgressBar::new(1);
    if !out.bars {
        bar.set_draw_target(ProgressDrawTarget::hidden());
    }
    bar.set_style(ProgressStyle::with_template("{spinner} {msg} {bar:40} {pos}/{len} [{elapsed}]").expect("a template"));
    bar.enable_steady_tick(Duration::from_millis(120));
    let mut last_status = String::new();
    loop {
        let batch = api.get(&format!("/v1/batches/{id}")).await?;
        let status = batch["status"].as_str().unwrap_or_default().to_string();
        let counts = &batch["request_counts"];
        bar.set_length(counts["total"].as_u64().unwrap_or(0).max(1));
        bar.set_position(counts["completed"].as_u64().unwrap_or(0) + counts["failed"].as_u64().unwrap_or(0));
        bar.set_message(format!("{id} {status}"));
        if status != last_status && !out.bars {
            out.note(&format!("batch {id}: {status} ({} of {} answered)", counts["completed"].as_u64().unwrap_or(0) + counts["failed"].as_u64().unwrap_or(0), counts["total"]));
            last_status = status.clone();
        }
        if FINAL.contains(&status.as_str()) {
            bar.finish_and_clear();
            return Ok(batch);
        }
        tokio::time::sleep(Duration::from_secs(1)).await;
    }
}
