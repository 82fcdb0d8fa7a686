//! `tern-bench-fairness`: how tenants share the workers (issue 22, item 3), echo jobs through
//! the real API, queue and workers.
//!
//! - backlog: tenant `bulk` queues `--backlog` jobs while the workers run, then tenant `small`
//!   submits `--small` jobs: how long until small's last job starts, and how many of bulk's
//!   started meanwhile;
//! - weights: tenants `heavy` (weight `--weight`) and `light` (weight 1) each queue `--each`
//!   jobs, then the workers start: the shares of jobs started at each tenth of the run, while
//!   both have jobs waiting;
//! - cost: the drain rate of one tenant's backlog against the same backlog spread over
//!   `--tenants` tenants, which is what choosing a tenant per job costs the pull.

use anyhow::{ensure, Result};
use clap::Parser;
use serde_json::{json, Value};
use std::collections::HashMap;
use std::time::{Duration, Instant};
use tern_e2e::{progress_bar, Cluster};
use uuid::Uuid;

#[derive(Parser, Debug)]
#[command(name = "tern-bench-fairness", version, about = "Measure how tenants share tern's workers")]
struct Args {
    /// Jobs bulk queues before small submits.
    #[arg(long, default_value_t = 50_000)]
    backlog: usize,
    /// Jobs small submits.
    #[arg(long, default_value_t = 20)]
    small: usize,
    /// Jobs each of heavy and light queue.
    #[arg(long, default_value_t = 10_000)]
    each: usize,
    /// heavy's weight (light's is 1).
    #[arg(long, default_value_t = 3)]
    weight: i64,
    /// Tenants the cost run spreads its backlog over.
    #[arg(long, default_value_t = 100)]
    tenants: usize,
    /// Jobs of the cost run.
    #[arg(long, default_value_t = 30_000)]
    cost_jobs: usize,
    /// Worker processes.
    #[arg(long, default_value_t = 1)]
    workers: usize,
    /// Jobs per worker batch (TERN_BATCH_SIZE).
    #[arg(long, default_value_t = 64)]
    batch_size: usize,
    /// Batches in flight per worker (TERN_CONCURRENCY).
    #[arg(long, default_value_t = 4)]
    concurrency: usize,
}

/// Submits `n` echo jobs as the tenant whose client this is, 1,000 a request, 4 in flight.
async fn submit(cluster: &Cluster, client: &reqwest::Client, n: usize, what: &str) -> Result<Vec<Uuid>> {
    let jobs: Vec<Value> = (0..n).map(|i| json!({"kind": "echo", "input": {"message": i}})).collect();
    let pb = progress_bar(n as u64, what);
    let mut ids = Vec::with_capacity(n);
    let chunks: Vec<&[Value]> = jobs.chunks(1000).collect();
    for group in chunks.chunks(4) {
        let sends = group.iter().map(|chunk| async move {
            let resp = client.post(cluster.url("/v1/jobs/batch")).json(&json!({ "jobs": chunk })).send().await?;
            ensure!(resp.status() == 201, "batch submit answered {}", resp.status());
            let body: Value = resp.json().await?;
            Ok(body["jobs"].as_array().map(|a| a.iter().filter_map(|j| j["id"].as_str()?.parse().ok()).collect::<Vec<Uuid>>()))
        });
        for r in futures::future::join_all(sends).await {
            let got = r?.unwrap_or_default();
            pb.inc(got.len() as u64);
            ids.extend(got);
        }
    }
    pb.finish_and_clear();
    Ok(ids)
}

async fn started_by_tenant(cluster: &Cluster) -> Result<HashMap<String, i64>> {
    let rows: Vec<(String, i64)> =
        sqlx::query_as("SELECT tenant, count(*) FROM jobs WHERE started_at IS NOT NULL GROUP BY tenant")
            .fetch_all(&cluster.pg)
            .await?;
    Ok(rows.into_iter().collect())
}

async fn succeeded(cluster: &Cluster) -> Result<i64> {
    Ok(sqlx::query_scalar("SELECT count(*) FROM jobs WHERE state = 'succeeded'").fetch_one(&cluster.pg).await?)
}

struct Bench {
    args: Args,
}

impl Bench {
    fn workers(&self, cluster: &mut Cluster) -> Result<Vec<tern_e2e::Process>> {
        let (batch, conc) = (self.args.batch_size.to_string(), self.args.concurrency.to_string());
        let env = [("TERN_LOG", "warn"), ("TERN_BATCH_SIZE", batch.as_str()), ("TERN_CONCURRENCY", conc.as_str())];
        (0..self.args.workers).map(|_| cluster.spawn_worker(&env)).collect()
    }

    async fn key(&self, cluster: &Cluster, tenant: &str) -> Result<reqwest::Client> {
        cluster.client_for(&cluster.create_key(tenant, "jobs:write,jobs:read")?)
    }

    async fn backlog(&self) -> Result<()> {
        let mut cluster = Cluster::start(&[("TERN_LOG", "warn")]).await?;
        let (bulk, small) = (self.key(&cluster, "bulk").await?, self.key(&cluster, "small").await?);
        let _workers = self.workers(&mut cluster)?;
        submit(&cluster, &bulk, self.args.backlog, "bulk's backlog").await?;
        let waiting: i64 = sqlx::query_scalar("SELECT count(*) FROM jobs WHERE started_at IS NULL").fetch_one(&cluster.pg).await?;
        let ids = submit(&cluster, &small, self.args.small, "small's jobs").await?;
        cluster.wait_terminal(&ids, Duration::from_secs(300)).await?;
        let (submitted, first, last): (chrono::DateTime<chrono::Utc>, chrono::DateTime<chrono::Utc>, chrono::DateTime<chrono::Utc>) =
            sqlx::query_as("SELECT min(created_at), min(started_at), max(started_at) FROM jobs WHERE id = ANY($1)")
                .bind(&ids)
                .fetch_one(&cluster.pg)
                .await?;
        let overtaking: i64 =
            sqlx::query_scalar("SELECT count(*) FROM jobs WHERE tenant = 'bulk' AND started_at >= $1 AND started_at < $2")
                .bind(submitted)
                .bind(last)
                .fetch_one(&cluster.pg)
                .await?;
        let secs = |t: chrono::DateTime<chrono::Utc>| (t - submitted).num_microseconds().unwrap_or(0) as f64 / 1e6;
        println!(
            "backlog: bulk had {waiting} jobs waiting; small's {} started {:.3} s (first) to {:.3} s (last) after their submit; \
             {overtaking} of bulk's started meanwhile (one batch per loop is {})",
            ids.len(),
            secs(first),
            secs(last),
            self.args.workers * self.args.concurrency * self.args.batch_size
        );
        Ok(())
    }

    async fn weights(&self) -> Result<()> {
        let mut cluster = Cluster::start(&[("TERN_LOG", "warn")]).await?;
        let (heavy, light) = (self.key(&cluster, "heavy").await?, self.key(&cluster, "light").await?);
        let resp = cluster.http.put(cluster.url("/v1/admin/tenants/heavy")).json(&json!({"weight": self.args.weight})).send().await?;
        ensure!(resp.status() == 200, "setting the weight answered {}", resp.status());
        let (status, _) = cluster.post("/v1/admin/queues/echo/pause", &json!({})).await?;
        ensure!(status == 200);
        submit(&cluster, &light, self.args.each, "light's backlog").await?;
        submit(&cluster, &heavy, self.args.each, "heavy's backlog").await?;
        let _workers = self.workers(&mut cluster)?;
        let (status, _) = cluster.post("/v1/admin/queues/echo/resume", &json!({})).await?;
        ensure!(status == 200);
        // Both are backlogged until heavy's run out, at about each * (w + 1) / w started.
        let horizon = (self.args.each as f64 * (self.args.weight as f64 + 1.0) / self.args.weight as f64 * 0.9) as i64;
        println!("weights {}:1, {} jobs each; started per tenant while both have jobs waiting:", self.args.weight, self.args.each);
        println!("{:>10} {:>8} {:>8} {:>10}", "started", "heavy", "light", "ratio");
        let mut next = horizon / 10;
        let mut worst: f64 = 0.0;
        let deadline = Instant::now() + Duration::from_secs(600);
        while next <= horizon {
            let counts = started_by_tenant(&cluster).await?;
            let (h, l) = (counts.get("heavy").copied().unwrap_or(0), counts.get("light").copied().unwrap_or(0));
            if h + l >= next {
                let ratio = h as f64 / l.max(1) as f64;
                worst = worst.max((ratio / self.args.weight as f64 - 1.0).abs());
                println!("{:>10} {:>8} {:>8} {:>10.3}", h + l, h, l, ratio);
                next += horizon / 10;
            }
            ensure!(Instant::now() < deadline, "the workers stalled");
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        println!("weights: largest deviation from {}:1 at a snapshot: {:.1}%", self.args.weight, worst * 100.0);
        Ok(())
    }

    /// Drain rate of `jobs` spread over `tenants` tenants.
    async fn drain(&self, tenants: usize) -> Result<f64> {
        let mut cluster = Cluster::start(&[("TERN_LOG", "warn")]).await?;
        let (status, _) = cluster.post("/v1/admin/queues/echo/pause", &json!({})).await?;
        ensure!(status == 200);
        let per = self.args.cost_jobs / tenants;
        let pb = progress_bar(tenants as u64, "queueing per tenant");
        for t in 0..tenants {
            let client = self.key(&cluster, &format!("tenant-{t}")).await?;
            let jobs: Vec<Value> = (0..per).map(|i| json!({"kind": "echo", "input": {"message": i}})).collect();
            for chunk in jobs.chunks(1000) {
                let resp = client.post(cluster.url("/v1/jobs/batch")).json(&json!({ "jobs": chunk })).send().await?;
                ensure!(resp.status() == 201);
            }
            pb.inc(1);
        }
        pb.finish_and_clear();
        let total = (per * tenants) as i64;
        let _workers = self.workers(&mut cluster)?;
        let start = Instant::now();
        let (status, _) = cluster.post("/v1/admin/queues/echo/resume", &json!({})).await?;
        ensure!(status == 200);
        let pb = progress_bar(total as u64, &format!("draining, {tenants} tenants"));
        loop {
            let done = succeeded(&cluster).await?;
            pb.set_position(done as u64);
            if done >= total {
                break;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        pb.finish_and_clear();
        Ok(total as f64 / start.elapsed().as_secs_f64())
    }
}

#[tokio::main]
async fn main() -> Result<()> {
    let bench = Bench { args: Args::parse() };
    println!(
        "tern-bench-fairness: {} worker(s), batch {} x {} in flight",
        bench.args.workers, bench.args.batch_size, bench.args.concurrency
    );
    bench.backlog().await?;
    bench.weights().await?;
    let one = bench.drain(1).await?;
    let many = bench.drain(bench.args.tenants).await?;
    println!(
        "cost: {} jobs drained at {one:.0} jobs/s from 1 tenant, {many:.0} jobs/s from {} tenants ({:+.1}%)",
        bench.args.cost_jobs,
        bench.args.tenants,
        (many / one - 1.0) * 100.0
    );
    Ok(())
}
