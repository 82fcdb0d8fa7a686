//! The fault-injection run (issue 20): thousands of jobs with webhooks go through tern while its
//! workers are killed with SIGKILL every few seconds, Redis is flushed and then killed and
//! restarted empty, Postgres goes away (every connection cut, new ones refused) and comes back,
//! the S3 server is unreachable for a while, and the API is killed. Then every accepted job is
//! in exactly one terminal state, none succeeded twice, every output's SHA-256 matches its
//! object, and every success's webhook arrived and verifies. The figures are printed (and kept
//! in docs/benchmarks.md).
//!
//! Redis here is a private `redis-server` this test kills; Postgres and S3 are the real servers
//! behind relays this test cuts, so other suites' services are left alone.

use axum::body::Bytes;
use axum::http::HeaderMap;
use base64::Engine;
use futures::StreamExt;
use hmac::{Hmac, Mac};
use serde_json::{json, Value};
use sha2::{Digest, Sha256};
use std::collections::{HashMap, HashSet};
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use tern_e2e::{Cluster, Process, Relay};
use uuid::Uuid;

const JOBS: usize = 3000;
const BATCH: usize = 50;
const SECRET: &str = "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw";
const WORKERS: usize = 3;

/// A `redis-server` of this test's own, without persistence: a restart comes back empty.
struct PrivateRedis {
    port: u16,
    child: Option<Child>,
}

impl PrivateRedis {
    async fn start(port: u16) -> PrivateRedis {
        let child = Command::new("redis-server")
            .args(["--port", &port.to_string(), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("redis-server runs (scripts/services.sh installs it)");
        let redis = PrivateRedis { port, child: Some(child) };
        let deadline = Instant::now() + Duration::from_secs(10);
        while redis.connection().await.is_err() {
            assert!(Instant::now() < deadline, "the private redis-server did not come up");
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        redis
    }
    fn url(&self) -> String {
        format!("redis://127.0.0.1:{}", self.port)
    }
    async fn connection(&self) -> redis::RedisResult<redis::aio::MultiplexedConnection> {
        redis::Client::open(self.url())?.get_multiplexed_async_connection().await
    }
    fn kill9(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

impl Drop for PrivateRedis {
    fn drop(&mut self) {
        self.kill9();
    }
}

/// What the webhook receiver got: per job id, whether a `job.succeeded` delivery verified.
#[derive(Clone, Default)]
struct Received {
    succeeded: Arc<Mutex<HashMap<Uuid, bool>>>,
    requests: Arc<Mutex<usize>>,
}

fn verifies(id: &str, timestamp: &str, body: &[u8], signatures: &str) -> bool {
    let key = base64::engine::general_purpose::STANDARD.decode(SECRET.trim_start_matches("whsec_")).unwrap();
    let mut mac = Hmac::<Sha256>::new_from_slice(&key).unwrap();
    mac.update(format!("{id}.{timestamp}.").as_bytes());
    mac.update(body);
    let expected = base64::engine::general_purpose::STANDARD.encode(mac.finalize().into_bytes());
    signatures.split(' ').filter_map(|s| s.strip_prefix("v1,")).any(|s| s == expected)
}

async fn start_receiver(got: Received) -> String {
    let app = axum::Router::new().route(
        "/hook",
        axum::routing::post(move |headers: HeaderMap, body: Bytes| {
            let got = got.clone();
            async move {
                let header = |n: &str| headers.get(n).and_then(|v| v.to_str().ok()).unwrap_or("").to_string();
                let ok = verifies(&header("webhook-id"), &header("webhook-timestamp"), &body, &header("webhook-signature"));
                *got.requests.lock().unwrap() += 1;
                let event: Value = serde_json::from_slice(&body).unwrap_or(Value::Null);
                if event["type"] == "job.succeeded" {
                    if let Some(id) = event["data"]["id"].as_str().and_then(|s| s.parse().ok()) {
                        *got.succeeded.lock().unwrap().entry(id).or_default() |= ok;
                    }
                }
                axum::http::StatusCode::OK
            }
        }),
    );
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}/hook", listener.local_addr().unwrap());
    tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
    url
}

/// `HOST:PORT` of a URL (without any `user@`).
fn host_port(url: &str) -> String {
    let authority = url.split("://").nth(1).unwrap_or_default().split('/').next().unwrap_or_default();
    authority.rsplit('@').next().unwrap_or_default().to_string()
}

/// Jobs of `ids` whose events hold other than exactly one terminal state.
async fn jobs_without_one_end(cluster: &Cluster, ids: &[Uuid]) -> i64 {
    sqlx::query_scalar(
        "SELECT count(*) FROM unnest($1::uuid[]) AS j(id)
         WHERE (SELECT count(*) FROM job_events e WHERE e.job_id = j.id AND e.state IN ('succeeded', 'failed', 'canceled')) <> 1",
    )
    .bind(ids)
    .fetch_one(&cluster.pg)
    .await
    .unwrap()
}

/// Submits every job in batches, retrying each batch (same idempotency keys, so a retry after
/// a lost answer is the same jobs) until it is accepted; returns the accepted ids.
async fn submit_through_faults(http: reqwest::Client, base: String, hook: String) -> Vec<Uuid> {
    let mut ids = Vec::with_capacity(JOBS);
    for start in (0..JOBS).step_by(BATCH) {
        let jobs: Vec<Value> = (start..(start + BATCH).min(JOBS))
            .map(|i| {
                json!({"kind": "echo", "input": {"message": i, "sleep_ms": 20}, "max_attempts": 20,
                       "idempotency_key": format!("fault-{i}"),
                       "webhook": {"url": hook, "events": ["job.succeeded"]}})
            })
            .collect();
        loop {
            let sent = http.post(format!("{base}/v1/jobs/batch")).json(&json!({ "jobs": jobs })).send().await;
            if let Ok(resp) = sent {
                if resp.status() == 201 {
                    let body: Value = resp.json().await.unwrap();
                    ids.extend(body["jobs"].as_array().unwrap().iter().map(|j| j["id"].as_str().unwrap().parse::<Uuid>().unwrap()));
                    break;
                }
                assert!(resp.status().is_server_error(), "a batch was refused: {}", resp.status());
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
        tokio::time::sleep(Duration::from_millis(600)).await;
    }
    ids
}

#[tokio::test]
async fn thousands_of_jobs_survive_killed_workers_and_every_backing_service_failing() {
    let began = Instant::now();
    let mut redis = PrivateRedis::start(tern_e2e::free_port()).await;
    let pg_port = tern_e2e::free_port();
    let s3_port = tern_e2e::free_port();
    let pg_target = host_port(&tern_e2e::postgres_admin_url());
    let s3_target = host_port(&tern_e2e::s3_endpoint());
    let mut pg_relay = Some(Relay::start(pg_port, &pg_target).await.unwrap());
    let mut s3_relay = Some(Relay::start(s3_port, &s3_target).await.unwrap());
    let received = Received::default();
    let hook = start_receiver(received.clone()).await;

    let mut cluster = Cluster::start(&[]).await.unwrap();
    let mut database_url = reqwest::Url::parse(&cluster.database_url).unwrap();
    database_url.set_port(Some(pg_port)).unwrap();
    let services = [
        ("TERN_DATABASE_URL", database_url.to_string()),
        ("TERN_REDIS_URL", redis.url()),
        ("TERN_S3_ENDPOINT", format!("http://127.0.0.1:{s3_port}")),
        ("TERN_LEASE_MS", "2000".to_string()),
    ];
    cluster.api.as_mut().unwrap().kill9();
    for (k, v) in &services {
        cluster.set_api_env(k, v);
    }
    for (k, v) in [
        ("TERN_WEBHOOK_SECRETS", SECRET),
        ("TERN_WEBHOOK_SCHEDULE_MS", "0,200,500,1000,2000,2000,2000,2000,2000,2000,2000,2000"),
        ("TERN_WEBHOOK_POLL_MS", "50"),
        ("TERN_RECONCILE_INTERVAL_MS", "500"),
        ("TERN_REAPER_INTERVAL_MS", "250"),
    ] {
        cluster.set_api_env(k, v);
    }
    cluster.start_api().await.unwrap();
    let worker_env: Vec<(&str, &str)> =
        services.iter().map(|(k, v)| (*k, v.as_str())).chain([("TERN_WORKER_KINDS", "echo")]).collect();
    let mut workers: Vec<Process> = (0..WORKERS).map(|_| cluster.spawn_worker(&worker_env).unwrap()).collect();

    let submitter = tokio::spawn(submit_through_faults(cluster.http.clone(), cluster.url(""), hook));
    let t0 = Instant::now();
    let at = |s: u64| t0 + Duration::from_secs(s);
    let mut kills = 0;
    let mut next_kill = at(2);
    let mut log = Vec::new();
    // (second, fault) in order; worker kills go on every 3 s throughout.
    let mut faults: Vec<(u64, &str)> =
        vec![(8, "redis flushall"), (16, "redis killed"), (24, "postgres down"), (32, "s3 down"), (40, "api killed")];
    faults.reverse();
    let mut last_fault_end = Instant::now();
    while t0.elapsed() < Duration::from_secs(46) {
        if Instant::now() >= next_kill {
            let victim = kills % workers.len();
            workers[victim].kill9();
            workers[victim] = cluster.spawn_worker(&worker_env).unwrap();
            kills += 1;
            next_kill += Duration::from_secs(3);
            last_fault_end = Instant::now();
        }
        if let Some((second, fault)) = faults.last().copied() {
            if Instant::now() >= at(second) {
                faults.pop();
                log.push(format!("{:.1}s {fault}", t0.elapsed().as_secs_f64()));
                match fault {
                    "redis flushall" => {
                        let mut c = redis.connection().await.unwrap();
                        let _: () = redis::cmd("FLUSHALL").arg("ASYNC").query_async(&mut c).await.unwrap();
                    }
                    "redis killed" => {
                        redis.kill9();
                        tokio::time::sleep(Duration::from_secs(2)).await;
                        redis = PrivateRedis::start(redis.port).await;
                    }
                    "postgres down" => {
                        drop(pg_relay.take());
                        tokio::time::sleep(Duration::from_secs(4)).await;
                        pg_relay = Some(Relay::start(pg_port, &pg_target).await.unwrap());
                    }
                    "s3 down" => {
                        drop(s3_relay.take());
                        tokio::time::sleep(Duration::from_secs(6)).await;
                        s3_relay = Some(Relay::start(s3_port, &s3_target).await.unwrap());
                    }
                    "api killed" => {
                        cluster.api.as_mut().unwrap().kill9();
                        tokio::time::sleep(Duration::from_secs(1)).await;
                        cluster.start_api().await.unwrap();
                    }
                    _ => unreachable!(),
                }
                last_fault_end = Instant::now();
            }
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert!(faults.is_empty() && pg_relay.is_some() && s3_relay.is_some());
    let ids = submitter.await.unwrap();
    assert_eq!(ids.len(), JOBS, "every job was accepted in the end");
    assert_eq!(ids.iter().collect::<HashSet<_>>().len(), JOBS, "a retried batch is the same jobs, not new ones");

    let states = cluster.wait_terminal(&ids, Duration::from_secs(180)).await.unwrap();
    let recovery = last_fault_end.elapsed();
    let terminal: i64 = states.values().sum();
    let lost = JOBS as i64 - terminal;
    // Exactly one terminal event per job, and at most one success.
    let not_one_end = jobs_without_one_end(&cluster, &ids).await;
    let twice: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM unnest($1::uuid[]) AS j(id)
         WHERE (SELECT count(*) FROM job_events e WHERE e.job_id = j.id AND e.state = 'succeeded') > 1",
    )
    .bind(&ids)
    .fetch_one(&cluster.pg)
    .await
    .unwrap();
    let reruns: i64 = sqlx::query_scalar("SELECT count(*) FROM jobs WHERE id = ANY($1) AND attempts > 1")
        .bind(&ids)
        .fetch_one(&cluster.pg)
        .await
        .unwrap();

    // Every output, an S3 object or bytes in the job's row, has the SHA-256 Postgres recorded.
    let outputs: Vec<(Uuid, Option<String>, String, Option<Vec<u8>>)> = sqlx::query_as(
        "SELECT id, output->>'key', output->>'sha256', output_body FROM jobs WHERE id = ANY($1) AND state = 'succeeded'",
    )
    .bind(&ids)
    .fetch_all(&cluster.pg)
    .await
    .unwrap();
    let objects = cluster.objects.clone();
    let mismatched: Vec<Uuid> = futures::stream::iter(outputs.clone())
        .map(|(id, key, sha, in_row)| {
            let objects = objects.clone();
            async move {
                let body = match key {
                    Some(key) => objects.get(&key, 1 << 20).await.unwrap().to_vec(),
                    None => in_row.expect("an output without key or row bytes"),
                };
                (hex::encode(Sha256::digest(&body)) != sha).then_some(id)
            }
        })
        .buffer_unordered(16)
        .filter_map(|m| async move { m })
        .collect()
        .await;

    // Every success's webhook arrives, signed.
    let succeeded: Vec<Uuid> = outputs.iter().map(|(id, _, _, _)| *id).collect();
    let _ = cluster
        .wait_until("every success's webhook", Duration::from_secs(90), || async {
            let got = received.succeeded.lock().unwrap();
            Ok(succeeded.iter().all(|id| got.get(id) == Some(&true)))
        })
        .await;
    let missing_webhooks = {
        let got = received.succeeded.lock().unwrap();
        succeeded.iter().filter(|id| got.get(id) != Some(&true)).count()
    };
    let webhook_requests = *received.requests.lock().unwrap();

    println!(
        "fault run: {JOBS} jobs accepted, {terminal} terminal ({states:?}), {lost} lost, {twice} succeeded twice, \
         {not_one_end} without exactly one end, {reruns} run more than once, {kills} workers killed, faults: {}; \
         recovery after the last fault {:.1} s; {} outputs checked, {} mismatched; {missing_webhooks} successes without \
         a verified webhook ({webhook_requests} webhook requests); {:.0} s in all",
        log.join(", "),
        recovery.as_secs_f64(),
        outputs.len(),
        mismatched.len(),
        began.elapsed().as_secs_f64(),
    );
    assert_eq!(lost, 0);
    assert_eq!(not_one_end, 0);
    assert_eq!(twice, 0);
    assert_eq!(states.get("succeeded").copied(), Some(JOBS as i64), "{states:?}");
    assert!(mismatched.is_empty(), "outputs whose object does not match: {mismatched:?}");
    assert_eq!(missing_webhooks, 0);
    assert!(kills >= 10);
}

/// Issue 36, item 5, as a fault: jobs whose starts are recorded only with their outcomes
/// (`TERN_RECORD_START_AFTER_MS` longer than the job) are `queued` in Postgres while their
/// workers run them; Redis is flushed meanwhile and the reconciler restores them. A restored job
/// must not be handed to a second worker while the first may still run it, and the capped
/// tenant's running count is rebuilt from the leases. Each job's run ends by fetching a URL of
/// its own from this test, so a second execution is counted even where its settle is refused.
#[tokio::test]
async fn a_job_running_with_its_start_unrecorded_runs_once_when_redis_loses_its_data() {
    const N: usize = 48;
    const CAP: i64 = 6;
    let redis = PrivateRedis::start(tern_e2e::free_port()).await;
    let fetched: Arc<Mutex<HashMap<String, usize>>> = Arc::default();
    let counter = {
        let fetched = fetched.clone();
        let app = axum::Router::new().route(
            "/run/{tag}",
            axum::routing::get(move |axum::extract::Path(tag): axum::extract::Path<String>| {
                let fetched = fetched.clone();
                async move {
                    *fetched.lock().unwrap().entry(tag).or_default() += 1;
                    "ran"
                }
            }),
        );
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let base = format!("http://{}/run", listener.local_addr().unwrap());
        tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
        base
    };

    let mut cluster = Cluster::start(&[]).await.unwrap();
    cluster.api.as_mut().unwrap().kill9();
    let services = [("TERN_REDIS_URL", redis.url()), ("TERN_LEASE_MS", "2000".to_string())];
    for (k, v) in &services {
        cluster.set_api_env(k, v);
    }
    cluster.set_api_env("TERN_RECONCILE_INTERVAL_MS", "200");
    cluster.start_api().await.unwrap();
    let capped = cluster.client_for(&cluster.create_key("capped", "jobs:write").unwrap()).unwrap();
    let resp = cluster.http.put(cluster.url("/v1/admin/tenants/capped")).json(&json!({"max_running": CAP})).send().await.unwrap();
    assert_eq!(resp.status(), 200);
    // Starts recorded only with the outcome: every run below is `queued` in Postgres throughout.
    let worker_env: Vec<(&str, &str)> = services
        .iter()
        .map(|(k, v)| (*k, v.as_str()))
        .chain([("TERN_WORKER_KINDS", "echo"), ("TERN_RECORD_START_AFTER_MS", "30000"), ("TERN_CONCURRENCY", "8")])
        .collect();
    let _workers: Vec<Process> = (0..2).map(|_| cluster.spawn_worker(&worker_env).unwrap()).collect();

    // Runs of 700 ms end before the worker's first heartbeat (half a lease), so a worker can
    // finish and settle a job Redis has forgotten without ever hearing its lease is lost.
    let jobs: Vec<Value> = (0..N)
        .map(|i| json!({"kind": "echo", "input": {"sleep_ms": 700, "file": {"url": format!("{counter}/{i}")}}, "max_attempts": 5}))
        .collect();
    let resp = capped.post(cluster.url("/v1/jobs/batch")).json(&json!({ "jobs": jobs })).send().await.unwrap();
    assert_eq!(resp.status(), 201);
    let body: Value = resp.json().await.unwrap();
    let ids: Vec<Uuid> = body["jobs"].as_array().unwrap().iter().map(|j| j["id"].as_str().unwrap().parse().unwrap()).collect();

    // Flush twice, each time while a wave of CAP jobs is mid-run.
    let mut flushed_running = Vec::new();
    for _ in 0..2 {
        let mut c = redis.connection().await.unwrap();
        let deadline = Instant::now() + Duration::from_secs(20);
        loop {
            let running: Option<i64> =
                redis::cmd("HGET").arg(format!("{}:{{echo}}:running", cluster.redis_prefix)).arg("capped").query_async(&mut c).await.unwrap();
            if running.unwrap_or(0) >= CAP {
                flushed_running.push(running.unwrap_or(0));
                break;
            }
            assert!(Instant::now() < deadline, "the capped tenant never had {CAP} jobs running");
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        tokio::time::sleep(Duration::from_millis(150)).await;
        let _: () = redis::cmd("FLUSHALL").query_async(&mut c).await.unwrap();
        tokio::time::sleep(Duration::from_millis(1500)).await;
    }

    let states = cluster.wait_terminal(&ids, Duration::from_secs(120)).await.unwrap();
    assert_eq!(states.get("succeeded").copied(), Some(N as i64), "{states:?}");
    assert_eq!(jobs_without_one_end(&cluster, &ids).await, 0, "a job without exactly one end");
    // A run stopped when its worker heard the lease was lost ends before its fetch; every run
    // that reached its end fetched once.
    let fetched = fetched.lock().unwrap().clone();
    let runs: Vec<usize> = (0..N).map(|i| fetched.get(&i.to_string()).copied().unwrap_or(0)).collect();
    let more_than_once: Vec<usize> = (0..N).filter(|&i| runs[i] > 1).collect();
    println!("flushed with {flushed_running:?} running; runs per job {runs:?}");
    assert!(more_than_once.is_empty(), "jobs run to their end more than once: {more_than_once:?} ({runs:?})");
    assert!(runs.iter().all(|&r| r == 1), "every job ran to its end once: {runs:?}");

    // The tenant's running count came back to nothing: rebuilt from the leases, not left high.
    let mut c = redis.connection().await.unwrap();
    let running: Option<i64> =
        redis::cmd("HGET").arg(format!("{}:{{echo}}:running", cluster.redis_prefix)).arg("capped").query_async(&mut c).await.unwrap();
    assert_eq!(running.unwrap_or(0), 0, "the capped tenant's running count after every job ended");
    let default_running: Option<i64> =
        redis::cmd("HGET").arg(format!("{}:{{echo}}:running", cluster.redis_prefix)).arg("default").query_async(&mut c).await.unwrap();
    assert!(default_running.unwrap_or(0) >= 0, "tenant default counted leases off it never held: {default_running:?}");
}
