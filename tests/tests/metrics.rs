//! `/metrics` of the API and of a worker: valid Prometheus text whose counters match the jobs
//! that ran.

use serde_json::{json, Value};
use std::time::Duration;
use tern_e2e::Cluster;

/// Scrapes `url` and parses it with an independent Prometheus text parser.
async fn scrape(url: &str) -> prometheus_parse::Scrape {
    let resp = reqwest::get(url).await.unwrap();
    assert_eq!(resp.status(), 200);
    let content_type = resp.headers()["content-type"].to_str().unwrap().to_string();
    assert!(content_type.starts_with("text/plain; version=0.0.4"), "{content_type}");
    let body = resp.text().await.unwrap();
    let lines = body.lines().map(|l| Ok(l.to_string()));
    prometheus_parse::Scrape::parse(lines).unwrap_or_else(|e| panic!("unparseable metrics: {e}\n{body}"))
}

/// Sum of the samples of `name` whose labels include every pair of `labels`.
fn sum(scrape: &prometheus_parse::Scrape, name: &str, labels: &[(&str, &str)]) -> f64 {
    scrape
        .samples
        .iter()
        .filter(|s| s.metric == name && labels.iter().all(|(k, v)| s.labels.get(k) == Some(*v)))
        .map(|s| match s.value {
            prometheus_parse::Value::Counter(v) | prometheus_parse::Value::Gauge(v) | prometheus_parse::Value::Untyped(v) => v,
            _ => 0.0,
        })
        .sum()
}

#[tokio::test]
async fn api_and_worker_metrics_parse_and_count_the_jobs_that_ran() {
    let mut cluster = Cluster::start(&[]).await.unwrap();
    let port = tern_e2e::free_port();
    let addr = format!("127.0.0.1:{port}");
    let _worker = cluster.spawn_worker(&[("TERN_METRICS_ADDR", &addr)]).unwrap();
    let mut jobs: Vec<Value> = (0..25).map(|i| json!({"kind": "echo", "priority": "high", "input": {"message": format!("{i}")}})).collect();
    jobs.extend((0..5).map(|_| json!({"kind": "echo", "priority": "low", "input": {"fail_permanently": true}})));
    let ids = cluster.submit_all(&jobs).await.unwrap();
    let counts = cluster.wait_terminal(&ids, Duration::from_secs(60)).await.unwrap();
    assert_eq!((counts.get("succeeded"), counts.get("failed")), (Some(&25), Some(&5)), "{counts:?}");
    for id in &ids[..3] {
        let (status, _) = cluster.get(&format!("/v1/jobs/{id}")).await.unwrap();
        assert_eq!(status, 200);
    }

    let api = scrape(&cluster.url("/metrics")).await;
    assert_eq!(sum(&api, "tern_jobs_submitted_total", &[("kind", "echo")]), 30.0);
    assert_eq!(sum(&api, "tern_jobs_submitted_total", &[("kind", "echo"), ("priority", "low")]), 5.0);
    assert_eq!(sum(&api, "tern_http_requests_total", &[("route", "/v1/jobs/batch"), ("status", "201")]), 1.0);
    assert_eq!(sum(&api, "tern_http_requests_total", &[("route", "/v1/jobs/:id"), ("method", "GET"), ("status", "200")]), 3.0);
    assert_eq!(sum(&api, "tern_http_request_duration_seconds_count", &[("route", "/v1/jobs/:id")]), 3.0);
    assert_eq!(sum(&api, "tern_queue_jobs", &[("kind", "echo"), ("state", "failed")]), 5.0);
    assert_eq!(sum(&api, "tern_queue_jobs", &[("kind", "echo"), ("state", "failed"), ("priority", "low")]), 5.0);
    assert_eq!(sum(&api, "tern_queue_jobs", &[("kind", "echo"), ("state", "queued")]), 0.0);

    // The worker settles in batches after the jobs' states are written: scrape until it has.
    let worker_url = format!("http://{addr}/metrics");
    let mut worker = scrape(&worker_url).await;
    // Up to 20 s: a loaded CI machine can be slow to run the last batch.
    for _ in 0..200 {
        if sum(&worker, "tern_jobs_settled_total", &[("kind", "echo")]) >= 30.0 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
        worker = scrape(&worker_url).await;
    }
    assert_eq!(sum(&worker, "tern_jobs_settled_total", &[("kind", "echo"), ("state", "succeeded")]), 25.0);
    assert_eq!(sum(&worker, "tern_jobs_settled_total", &[("kind", "echo"), ("state", "failed")]), 5.0);
    assert_eq!(sum(&worker, "tern_job_run_seconds_count", &[("kind", "echo")]), 30.0);
    assert_eq!(sum(&worker, "tern_job_wait_seconds_count", &[("kind", "echo")]), 30.0);
    assert_eq!(sum(&worker, "tern_batch_jobs_sum", &[("kind", "echo")]), 30.0);
    assert_eq!(sum(&worker, "tern_batch_cost_sum", &[("kind", "echo")]), 30.0);
}
