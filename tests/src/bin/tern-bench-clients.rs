//! `tern-bench-clients`: the clients' work at the scale issue 21 names, end to end on a private
//! deployment (real Postgres, Redis, S3, one API, one worker):
//! - a Batch API file of `--batch-lines` embedding requests (default 50,000): uploaded, run to
//!   its output file, and every line checked answered once;
//! - `tern transcribe DIR` over `--recordings` recordings (default 1,000; the LibriVox clips,
//!   each made distinct by a few ms of leading silence): the whole directory with one command,
//!   then again, with nothing left to do.
//!
//! Prints the times and rates; the checks fail the run rather than print a figure.

use anyhow::{bail, ensure, Context, Result};
use clap::Parser;
use serde_json::{json, Value};
use std::collections::HashSet;
use std::time::{Duration, Instant};
use tern_e2e::{progress_bar, Cluster};

#[derive(Parser, Debug)]
#[command(name = "tern-bench-clients", version, about = "Run a 50,000-line batch and a 1,000-recording directory through tern")]
struct Args {
    /// Lines of the embeddings batch (0 skips it).
    #[arg(long, env = "TERN_BENCH_BATCH_LINES", default_value_t = 50_000)]
    batch_lines: usize,
    /// Recordings in the directory `tern transcribe` runs over (0 skips it).
    #[arg(long, env = "TERN_BENCH_RECORDINGS", default_value_t = 1_000)]
    recordings: usize,
}

/// Uploads, runs and checks a batch of `n` embedding lines; prints its figures.
async fn batch(n: usize) -> Result<()> {
    let mut cluster = Cluster::start(&[("TERN_LOG", "warn")]).await?;
    let _worker = cluster.spawn_worker(&[("TERN_LOG", "warn"), ("TERN_WORKER_KINDS", "embed")])?;
    let body: String = (0..n)
        .map(|i| {
            json!({ "custom_id": format!("line-{i}"), "method": "POST", "url": "/v1/embeddings",
                    "body": { "model": "text-embedding-3-small", "input": format!("request number {i} of the batch") } })
            .to_string()
                + "\n"
        })
        .collect();
    let bytes = body.len();
    let started = Instant::now();
    let form = reqwest::multipart::Form::new()
        .text("purpose", "batch")
        .part("file", reqwest::multipart::Part::bytes(body.into_bytes()).file_name("requests.jsonl"));
    let response = cluster.http.post(cluster.url("/v1/files")).multipart(form).send().await?;
    ensure!(response.status() == 200, "upload answered {}", response.status());
    let file: Value = response.json().await?;
    let uploaded = started.elapsed().as_secs_f64();
    let (status, created) = cluster
        .post("/v1/batches", &json!({ "input_file_id": file["id"], "endpoint": "/v1/embeddings", "completion_window": "24h" }))
        .await?;
    ensure!(status == 200, "create answered {status}: {created}");
    let id = created["id"].as_str().context("a batch id")?.to_string();
    let pb = progress_bar(n as u64, "batch lines answered");
    let finished = loop {
        let (_, b) = cluster.get(&format!("/v1/batches/{id}")).await?;
        let counts = &b["request_counts"];
        pb.set_position(counts["completed"].as_u64().unwrap_or(0) + counts["failed"].as_u64().unwrap_or(0));
        match b["status"].as_str().unwrap_or_default() {
            "completed" => break b,
            "failed" | "expired" | "cancelled" => bail!("the batch ended {}: {b}", b["status"]),
            _ => tokio::time::sleep(Duration::from_millis(500)).await,
        }
    };
    pb.finish_and_clear();
    let total = started.elapsed().as_secs_f64();
    let out = finished["output_file_id"].as_str().context("an output file")?;
    let text = cluster.http.get(cluster.url(&format!("/v1/files/{out}/content"))).send().await?.text().await?;
    let mut seen = HashSet::new();
    for line in text.lines() {
        let v: Value = serde_json::from_str(line)?;
        ensure!(v["response"]["status_code"] == 200, "a line failed: {v}");
        ensure!(seen.insert(v["custom_id"].as_str().unwrap_or_default().to_string()), "a line answered twice: {v}");
    }
    ensure!(seen.len() == n, "{} of {n} lines answered", seen.len());
    println!(
        "batch: {n} embedding lines ({:.1} MB) uploaded in {uploaded:.1} s, completed in {total:.1} s: {:.0} lines/s, every line answered once",
        bytes as f64 / 1e6,
        n as f64 / total
    );
    Ok(())
}

/// Writes `n` distinct recordings, transcribes the directory with the CLI, then again.
async fn directory(n: usize) -> Result<()> {
    let mut cluster = Cluster::start(&[("TERN_LOG", "warn")]).await?;
    let _worker = cluster.spawn_worker(&[("TERN_LOG", "warn"), ("TERN_WORKER_KINDS", "transcribe")])?;
    let librivox = tern_e2e::models_dir().join("testdata/librivox");
    let mut clips: Vec<Vec<f32>> = Vec::new();
    let mut names: Vec<_> = std::fs::read_dir(&librivox)?.map(|e| e.map(|e| e.path())).collect::<std::io::Result<_>>()?;
    names.retain(|p| p.extension().is_some_and(|x| x == "wav"));
    names.sort();
    for path in &names {
        clips.push(tern_models::audio::decode_mono_16k(&std::fs::read(path)?)?);
    }
    ensure!(!clips.is_empty(), "no test recordings under {}", librivox.display());
    let work = std::env::temp_dir().join(format!("tern-bench-clients-{}", std::process::id()));
    let (recordings, transcripts) = (work.join("recordings"), work.join("transcripts"));
    std::fs::create_dir_all(&recordings)?;
    let mut audio_seconds = 0.0;
    for i in 0..n {
        // Distinct content (the CLI keys jobs by a hash of the file): i samples of silence first.
        let mut pcm = vec![0f32; i];
        pcm.extend_from_slice(&clips[i % clips.len()]);
        audio_seconds += pcm.len() as f64 / 16_000.0;
        std::fs::write(recordings.join(format!("recording-{i:04}.wav")), tern_e2e::wav_16k_mono(&pcm))?;
    }
    let run = || {
        let mut cmd = std::process::Command::new(tern_e2e::bin_dir().join("tern"));
        cmd.env("TERN_URL", cluster.url(""))
            .env("TERN_API_KEY", &cluster.api_key)
            .env("TERN_CONFIG", work.join("config.toml"))
            .args(["transcribe", recordings.to_str().expect("a UTF-8 path"), "--output-dir", transcripts.to_str().expect("a UTF-8 path")])
            .stderr(std::process::Stdio::inherit());
        let started = Instant::now();
        let output = cmd.output()?;
        ensure!(output.status.success(), "tern transcribe exited {}", output.status);
        let lines: Vec<Value> = String::from_utf8_lossy(&output.stdout).lines().map(serde_json::from_str).collect::<Result<_, _>>()?;
        Ok::<_, anyhow::Error>((started.elapsed().as_secs_f64(), lines))
    };
    let (first, lines) = run()?;
    ensure!(lines.len() == n && lines.iter().all(|l| l["state"] == "succeeded"), "the first run: {} lines", lines.len());
    // The transcripts, beside the CLI's own record of the run (.tern-transcribe.jsonl).
    let written = std::fs::read_dir(&transcripts)?.filter(|e| e.as_ref().is_ok_and(|e| e.path().extension().is_some_and(|x| x == "txt"))).count();
    ensure!(written == n, "{written} transcripts for {n} recordings");
    let (second, lines) = run()?;
    ensure!(lines.iter().all(|l| l["state"] == "skipped"), "the second run transcribed again");
    let jobs: i64 = sqlx::query_scalar("SELECT count(*) FROM jobs").fetch_one(&cluster.pg).await?;
    ensure!(jobs == n as i64, "{jobs} jobs for {n} recordings");
    println!(
        "directory: {n} recordings ({audio_seconds:.0} s of audio) transcribed by one `tern transcribe` in {first:.1} s \
         ({:.1} recordings/s, {:.1} audio-s/s); again in {second:.2} s with nothing left to do",
        n as f64 / first,
        audio_seconds / first
    );
    std::fs::remove_dir_all(&work)?;
    Ok(())
}

#[tokio::main]
async fn main() -> Result<()> {
    let args = Args::parse();
    if args.batch_lines > 0 {
        batch(args.batch_lines).await?;
    }
    if args.recordings > 0 {
        directory(args.recordings).await?;
    }
    Ok(())
}
