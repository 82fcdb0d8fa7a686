//! `tern-bench-transcribe`: transcription throughput through the whole service (API, queue,
//! worker, Whisper on candle, S3), in audio seconds transcribed per wall-clock second.
//!
//! Two workloads, each at several worker batch budgets (`TERN_TRANSCRIBE_BATCH_WINDOWS`, in 30 s
//! windows; windows of several jobs are encoded and decoded together up to it; `measured` leaves
//! it to the worker, which sizes batches from the memory it measured):
//! - short: `--clips` LibriVox clips of 3-7 s, submitted together;
//! - long: one recording of about `--long-seconds` seconds, built from the clips with pauses.
//!
//! The clock runs from the submit to the last job's success; the worker is started (and its
//! model loaded by a warm-up job) before the clock starts. Beside each figure, the share of that
//! time the worker's model thread was busy in model calls (its `tern_engine_busy_seconds`
//! gauge): on a GPU, how busy the service keeps the device.

use anyhow::{Context, Result};
use base64::Engine;
use clap::Parser;
use indicatif::{ProgressBar, ProgressStyle};
use serde_json::{json, Value};
use std::time::Duration;
use tern_e2e::Cluster;

#[derive(Parser, Debug)]
#[command(name = "tern-bench-transcribe", version, about = "Measure transcription throughput through tern")]
struct Args {
    /// Short clips per run.
    #[arg(long, default_value_t = 20)]
    clips: usize,
    /// Length of the long recording, seconds.
    #[arg(long, default_value_t = 120.0)]
    long_seconds: f64,
    /// Worker batch budgets to measure, in 30 s windows, comma-separated; `measured` for the
    /// worker's own, sized by the memory it measured.
    #[arg(long, value_delimiter = ',', default_value = "1,4,8,16")]
    budgets: Vec<String>,
    /// Whisper model folder under the models directory.
    #[arg(long, default_value = "whisper-tiny.en")]
    model: String,
    /// The worker's device (`TERN_DEVICE`): `cpu`, or `cuda[:N]` with a worker built with
    /// `--features cuda`.
    #[arg(long, default_value = "cpu")]
    device: String,
    /// More of the worker's settings, `KEY=VALUE`, comma-separated (the worker is started
    /// with the test cluster's environment alone, not this process's): e.g.
    /// `TERN_WHISPER_BEAM_SIZE=1` or `TERN_MEMORY_PRECHECK=false`.
    #[arg(long, value_delimiter = ',')]
    worker_env: Vec<String>,
}

fn b64(bytes: &[u8]) -> String {
    base64::engine::general_purpose::STANDARD.encode(bytes)
}

/// The worker's model-thread busy seconds, from its `/metrics`.
async fn busy_seconds(metrics: &str) -> Result<f64> {
    let text = reqwest::get(metrics).await?.text().await?;
    let line = text.lines().find(|l| l.starts_with("tern_engine_busy_seconds ")).context("no tern_engine_busy_seconds in the worker's metrics")?;
    Ok(line.rsplit(' ').next().unwrap_or_default().parse()?)
}

/// A run's figures: seconds from the submit to the last job's `finished_at`, and the share of
/// them the model thread was busy.
struct Timed {
    seconds: f64,
    busy: f64,
}

/// [`run`], with the busy share read from the worker's metrics at `metrics`.
async fn timed(cluster: &Cluster, jobs: &[Value], what: &str, metrics: &str) -> Result<Timed> {
    let busy_before = busy_seconds(metrics).await?;
    let seconds = run(cluster, jobs, what).await?;
    // The gauge is read at scrape time; the last batch's time is in once its jobs settled.
    let busy = busy_seconds(metrics).await? - busy_before;
    Ok(Timed { seconds, busy: busy / seconds })
}

/// Submits the jobs, waits until all succeeded; returns seconds from the submit to the last
/// job's `finished_at` (read from Postgres, so the 100 ms polling does not round the figure up).
async fn run(cluster: &Cluster, jobs: &[Value], what: &str) -> Result<f64> {
    let pb = ProgressBar::new(jobs.len() as u64);
    pb.set_style(ProgressStyle::with_template("{msg:>24} [{bar:30}] {pos}/{len} {elapsed}")?.progress_chars("=> "));
    pb.set_message(what.to_string());
    let start = chrono::Utc::now();
    let ids = cluster.submit_all(jobs).await?;
    loop {
        let done: i64 = sqlx::query_scalar("SELECT count(*) FROM jobs WHERE id = ANY($1) AND state IN ('succeeded', 'failed', 'canceled')")
            .bind(&ids)
            .fetch_one(&cluster.pg)
            .await?;
        pb.set_position(done as u64);
        if done as usize == ids.len() {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let last: chrono::DateTime<chrono::Utc> = sqlx::query_scalar("SELECT max(finished_at) FROM jobs WHERE id = ANY($1)")
        .bind(&ids)
        .fetch_one(&cluster.pg)
        .await?;
    let secs = (last - start).as_seconds_f64();
    pb.finish_and_clear();
    let failed: i64 = sqlx::query_scalar("SELECT count(*) FROM jobs WHERE id = ANY($1) AND state <> 'succeeded'")
        .bind(&ids)
        .fetch_one(&cluster.pg)
        .await?;
    anyhow::ensure!(failed == 0, "{failed} jobs did not succeed");
    Ok(secs)
}

#[tokio::main]
async fn main() -> Result<()> {
    let args = Args::parse();
    let dir = tern_e2e::models_dir().join("testdata/librivox");
    let mut clips: Vec<Vec<u8>> = Vec::new();
    for entry in std::fs::read_dir(&dir).context("test speech missing: run scripts/models.sh")? {
        let path = entry?.path();
        if path.extension().is_some_and(|e| e == "wav") {
            clips.push(std::fs::read(&path)?);
        }
    }
    clips.sort();
    let pcm: Vec<Vec<f32>> = clips.iter().map(|c| tern_models::audio::decode_mono_16k(c)).collect::<Result<_, _>>()?;
    let short: Vec<usize> = (0..args.clips).map(|i| i % clips.len()).collect();
    let short_seconds: f64 = short.iter().map(|i| pcm[*i].len() as f64 / 16_000.0).sum();
    let mut long = Vec::new();
    for p in pcm.iter().cycle() {
        if long.len() as f64 / 16_000.0 >= args.long_seconds {
            break;
        }
        long.extend_from_slice(p);
        long.extend(std::iter::repeat_n(0.0f32, 8_000));
    }
    let long_seconds = long.len() as f64 / 16_000.0;
    let long_wav = tern_e2e::wav_16k_mono(&long);
    println!(
        "tern-bench-transcribe: {}, {} clips ({short_seconds:.1} s of audio), one {long_seconds:.1} s recording",
        args.model, args.clips
    );
    println!("{:>14} {:>22} {:>6} {:>22} {:>6}", "batch budget", "short clips audio-s/s", "busy", "long file audio-s/s", "busy");
    for budget in &args.budgets {
        // TERN_BENCH_API_LOG=info shows each request and its latency in the API's log.
        let api_log = std::env::var("TERN_BENCH_API_LOG").unwrap_or_else(|_| "warn".into());
        let mut cluster = Cluster::start(&[("TERN_LOG", &api_log)]).await?;
        // TERN_BENCH_WORKER_LOG=info shows each model batch in the worker's log.
        let worker_log = std::env::var("TERN_BENCH_WORKER_LOG").unwrap_or_else(|_| "warn".into());
        let metrics_addr = format!("127.0.0.1:{}", tern_e2e::free_port());
        let metrics = format!("http://{metrics_addr}/metrics");
        let mut env = vec![
            ("TERN_LOG", worker_log.as_str()),
            ("TERN_WORKER_KINDS", "transcribe"),
            ("TERN_WHISPER_MODEL", &args.model),
            ("TERN_DEVICE", &args.device),
            ("TERN_METRICS_ADDR", &metrics_addr),
        ];
        for setting in &args.worker_env {
            let (key, value) = setting.split_once('=').with_context(|| format!("--worker-env {setting:?}: KEY=VALUE"))?;
            env.push((key, value));
        }
        if budget != "measured" {
            budget.parse::<u32>().with_context(|| format!("budget {budget:?}: a number of windows or `measured`"))?;
            env.push(("TERN_TRANSCRIBE_BATCH_WINDOWS", budget));
        }
        let _worker = cluster.spawn_worker(&env)?;
        // Warm-up: the model loads on its first job.
        run(&cluster, &[json!({"kind": "transcribe", "input": {"audio": {"base64": b64(&clips[0])}}})], "warm-up").await?;
        let jobs: Vec<Value> = short
            .iter()
            .map(|i| json!({"kind": "transcribe", "input": {"audio": {"base64": b64(&clips[*i])}}}))
            .collect();
        let short = timed(&cluster, &jobs, "short clips", &metrics).await?;
        let long_job = [json!({"kind": "transcribe", "input": {"audio": {"base64": b64(&long_wav)}}})];
        let long = timed(&cluster, &long_job, "long file", &metrics).await?;
        println!(
            "{:>14} {:>22.2} {:>5.0}% {:>22.2} {:>5.0}%",
            budget,
            short_seconds / short.seconds,
            short.busy * 100.0,
            long_seconds / long.seconds,
            long.busy * 100.0
        );
        // How the worker sized its batches: the measured bytes per window, the budget, the
        // device's free memory and the batches split for want of memory.
        let text = reqwest::get(&metrics).await?.text().await?;
        for line in text.lines().filter(|l| BATCHING_GAUGES.iter().any(|g| l.starts_with(g))) {
            println!("{:>14} {line}", "");
        }
    }
    Ok(())
}

/// The worker's metrics that show how it sized its batches, printed after each budget's run.
const BATCHING_GAUGES: [&str; 4] = ["tern_engine_batch_budget", "tern_model_unit_bytes", "tern_engine_device_free_bytes", "tern_engine_oom_splits_total"];
