//! `tern-bench`: end-to-end throughput and latency of tern with real services, echo jobs.
//!
//! For each worker count it starts a private deployment (database, Redis prefix, bucket, one
//! tern-api, N tern-workers) and measures:
//! - bulk submit: jobs/s through `POST /v1/jobs/batch` (1,000 per request, 4 in flight);
//! - drain: a backlog of `--jobs` waiting jobs, workers started, until all succeeded;
//! - end to end: workers running, `--jobs` submitted, from the first submit to all succeeded;
//! - submit latency: p50/p99 of single `POST /v1/jobs` one after another.
//!
//! Every state change is durable (Postgres commits), and every output is an S3 object.

use anyhow::Result;
use clap::Parser;
use serde_json::{json, Value};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};
use tern_e2e::{progress_bar, Cluster};

#[derive(Parser, Debug)]
#[command(name = "tern-bench", version, about = "Measure tern's end-to-end echo throughput and submit latency")]
struct Args {
    /// Jobs per measurement (the drain backlog and the end-to-end run).
    #[arg(long, env = "TERN_BENCH_JOBS", default_value_t = 50_000)]
    jobs: usize,
    /// Worker process counts to measure, comma-separated.
    #[arg(long, env = "TERN_BENCH_WORKERS", value_delimiter = ',', default_value = "1,2,4")]
    workers: Vec<usize>,
    /// Single submits timed for the latency figures.
    #[arg(long, env = "TERN_BENCH_LATENCY_SAMPLES", default_value_t = 1_000)]
    latency_samples: usize,
    /// Jobs per worker batch (TERN_BATCH_SIZE of the workers).
    #[arg(long, default_value_t = 512)]
    batch_size: usize,
    /// Batches in flight per worker (TERN_CONCURRENCY of the workers).
    #[arg(long, default_value_t = 4)]
    concurrency: usize,
    /// Run the queue on this Redis Cluster (seed node URLs, comma-separated) instead of the
    /// test Redis, e.g. `scripts/services.sh redis-cluster`'s
    /// `redis://127.0.0.1:7000,redis://127.0.0.1:7001,redis://127.0.0.1:7002`.
    #[arg(long)]
    redis_cluster: Option<String>,
    /// Shards each kind's queue is spread over (TERN_QUEUE_SHARDS of the API and workers).
    #[arg(long, default_value_t = 1)]
    queue_shards: u16,
}

fn jobs(n: usize) -> Vec<Value> {
    let priorities = ["urgent", "high", "normal", "low"];
    (0..n).map(|i| json!({"kind": "echo", "priority": priorities[i % 4], "input": {"message": i}})).collect()
}

/// Submits with 4 batch requests in flight (a new one as soon as one is answered); returns
/// seconds taken.
async fn bulk_submit(cluster: &Cluster, n: usize, submitted: &AtomicUsize, what: &str) -> Result<f64> {
    use futures::StreamExt;
    let all = jobs(n);
    let pb = progress_bar(n as u64, what);
    let start = Instant::now();
    let mut sends = futures::stream::iter(all.chunks(1000).map(|c| cluster.submit_all(c))).buffer_unordered(4);
    while let Some(r) = sends.next().await {
        let ids = r?;
        submitted.fetch_add(ids.len(), Ordering::Release);
        pb.inc(ids.len() as u64);
    }
    pb.finish_and_clear();
    Ok(start.elapsed().as_secs_f64())
}

/// What stands in for autovacuum while a run lasts, where the server has it off (this
/// machine's Postgres does: `autovacuum = off` in its configuration): `VACUUM (ANALYZE)` of
/// the queue's tables every 20 s, as autovacuum would run on any production server. Without
/// it, a run of a million jobs slows to a few hundred jobs/s on dead tuples and stale plans.
async fn vacuum_stand_in(cluster: &Cluster) -> Result<Option<tokio::task::JoinHandle<()>>> {
    let autovacuum: String = sqlx::query_scalar("SHOW autovacuum").fetch_one(&cluster.pg).await?;
    if autovacuum == "on" {
        return Ok(None);
    }
    let pg = cluster.pg.clone();
    Ok(Some(tokio::spawn(async move {
        loop {
            tokio::time::sleep(Duration::from_secs(20)).await;
            if let Err(e) = sqlx::query("VACUUM (ANALYZE) jobs, job_events").execute(&pg).await {
                eprintln!("tern-bench: VACUUM failed: {e}");
            }
        }
    })))
}

/// Jobs not finished yet, counted (through `jobs_active`, which holds only those): for the
/// progress bar, every few seconds, as counting half a million costs a good part of a core.
async fn unfinished(cluster: &Cluster) -> Result<i64> {
    Ok(sqlx::query_scalar("SELECT count(*) FROM jobs WHERE state IN ('queued', 'scheduled', 'running', 'retrying')")
        .fetch_one(&cluster.pg)
        .await?)
}

/// Whether any job is unfinished: one probe of `jobs_active`, cheap at any size.
async fn any_unfinished(cluster: &Cluster) -> Result<bool> {
    Ok(sqlx::query_scalar(
        "SELECT EXISTS (SELECT 1 FROM jobs WHERE state IN ('queued', 'scheduled', 'running', 'retrying'))",
    )
    .fetch_one(&cluster.pg)
    .await?)
}

/// Waits until all `n` jobs were submitted (`submitted` counts those the API answered for)
/// and none is unfinished.
async fn wait_all_finished(cluster: &Cluster, n: usize, submitted: &AtomicUsize, what: &str) -> Result<()> {
    let pb = progress_bar(n as u64, what);
    let mut counted = Instant::now() - Duration::from_secs(60);
    loop {
        let sent = submitted.load(Ordering::Acquire);
        if sent >= n && !any_unfinished(cluster).await? {
            break;
        }
        if counted.elapsed() >= Duration::from_secs(5) {
            let left = unfinished(cluster).await? as usize;
            pb.set_position(sent.saturating_sub(left) as u64);
            counted = Instant::now();
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    pb.finish_and_clear();
    Ok(())
}

/// After a timed run: every job succeeded.
async fn check_all_succeeded(cluster: &Cluster, n: usize) -> Result<()> {
    let succeeded: i64 = sqlx::query_scalar("SELECT count(*) FROM jobs WHERE state = 'succeeded'").fetch_one(&cluster.pg).await?;
    anyhow::ensure!(succeeded == n as i64, "{succeeded} of {n} jobs succeeded");
    Ok(())
}

fn percentile(sorted: &[f64], p: f64) -> f64 {
    sorted[((sorted.len() as f64 - 1.0) * p).round() as usize]
}

#[tokio::main]
async fn main() -> Result<()> {
    let args = Args::parse();
    // What the API and the workers share: the log level and where the queue is.
    let mut shared: Vec<(String, String)> =
        vec![("TERN_LOG".into(), "warn".into()), ("TERN_QUEUE_SHARDS".into(), args.queue_shards.to_string())];
    if let Some(seeds) = &args.redis_cluster {
        shared.push(("TERN_REDIS_URL".into(), seeds.clone()));
        shared.push(("TERN_REDIS_CLUSTER".into(), "true".into()));
    }
    let quiet: Vec<(&str, &str)> = shared.iter().map(|(k, v)| (k.as_str(), v.as_str())).collect();
    let quiet = quiet.as_slice();
    let worker_env = |batch: &str, conc: &str| -> Vec<(String, String)> {
        let mut env = shared.clone();
        env.push(("TERN_BATCH_SIZE".into(), batch.into()));
        env.push(("TERN_CONCURRENCY".into(), conc.into()));
        env
    };
    let batch = args.batch_size.to_string();
    let conc = args.concurrency.to_string();
    let redis = match &args.redis_cluster {
        Some(_) => format!("a Redis Cluster, {} shard(s) a kind", args.queue_shards),
        None => format!("one Redis, {} shard(s) a kind", args.queue_shards),
    };
    println!("tern-bench: {} jobs per run, worker batch {} x {} in flight, {redis}", args.jobs, batch, conc);
    println!("{:>8} {:>14} {:>14} {:>14}", "workers", "submit jobs/s", "drain jobs/s", "e2e jobs/s");
    for &workers in &args.workers {
        // Drain: a backlog first, then the workers.
        let mut cluster = Cluster::start(quiet).await?;
        let vacuum = vacuum_stand_in(&cluster).await?;
        let submitted = AtomicUsize::new(0);
        let submit_secs = bulk_submit(&cluster, args.jobs, &submitted, "submitting backlog").await?;
        let start = Instant::now();
        let env = worker_env(&batch, &conc);
        let env_ref: Vec<(&str, &str)> = env.iter().map(|(k, v)| (k.as_str(), v.as_str())).collect();
        let mut procs = Vec::new();
        for _ in 0..workers {
            procs.push(cluster.spawn_worker(&env_ref)?);
        }
        wait_all_finished(&cluster, args.jobs, &submitted, "draining backlog").await?;
        let drain_secs = start.elapsed().as_secs_f64();
        check_all_succeeded(&cluster, args.jobs).await?;
        vacuum.inspect(|v| v.abort());
        drop(procs);
        drop(cluster);

        // End to end: workers running while the jobs arrive.
        let mut cluster = Cluster::start(quiet).await?;
        let vacuum = vacuum_stand_in(&cluster).await?;
        let mut procs = Vec::new();
        for _ in 0..workers {
            procs.push(cluster.spawn_worker(&env_ref)?);
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
        let start = Instant::now();
        let submitted = AtomicUsize::new(0);
        let (sent, waited) = tokio::join!(
            bulk_submit(&cluster, args.jobs, &submitted, "submitting"),
            wait_all_finished(&cluster, args.jobs, &submitted, "running")
        );
        sent?;
        waited?;
        let e2e_secs = start.elapsed().as_secs_f64();
        check_all_succeeded(&cluster, args.jobs).await?;
        vacuum.inspect(|v| v.abort());
        drop(procs);
        drop(cluster);
        println!(
            "{:>8} {:>14.0} {:>14.0} {:>14.0}",
            workers,
            args.jobs as f64 / submit_secs,
            args.jobs as f64 / drain_secs,
            args.jobs as f64 / e2e_secs
        );
    }

    // Latency of single submits, one at a time, with nothing else running.
    let cluster = Cluster::start(quiet).await?;
    let pb = progress_bar(args.latency_samples as u64, "timing single submits");
    let mut samples = Vec::with_capacity(args.latency_samples);
    for i in 0..args.latency_samples {
        let body = json!({"kind": "echo", "input": {"message": i}});
        let start = Instant::now();
        let (status, _) = cluster.post("/v1/jobs", &body).await?;
        samples.push(start.elapsed().as_secs_f64() * 1000.0);
        anyhow::ensure!(status == 201, "submit answered {status}");
        pb.inc(1);
    }
    pb.finish_and_clear();
    samples.sort_by(|a, b| a.partial_cmp(b).expect("no NaN"));
    println!(
        "submit latency (single POST /v1/jobs, sequential): p50 {:.2} ms, p99 {:.2} ms, max {:.2} ms",
        percentile(&samples, 0.5),
        percentile(&samples, 0.99),
        samples[samples.len() - 1]
    );
    Ok(())
}
