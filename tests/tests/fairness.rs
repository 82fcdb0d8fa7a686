//! Fair scheduling across tenants (issue 22, item 3): within a priority, tenants share a kind's
//! workers by weight on job cost, a tenant's backlog does not hold back another tenant, and a
//! cap bounds a tenant's running jobs. Real API, workers, Postgres and Redis; echo jobs.

use serde_json::{json, Value};
use std::collections::HashMap;
use std::time::{Duration, Instant};
use tern_e2e::Cluster;
use uuid::Uuid;

/// Submits `jobs` through `POST /v1/jobs/batch` with `client` (a tenant's key), 1,000 a call.
async fn submit_as(cluster: &Cluster, client: &reqwest::Client, jobs: &[Value]) -> Vec<Uuid> {
    let mut ids = Vec::with_capacity(jobs.len());
    for chunk in jobs.chunks(1000) {
        let resp = client.post(cluster.url("/v1/jobs/batch")).json(&json!({ "jobs": chunk })).send().await.unwrap();
        assert_eq!(resp.status(), 201);
        let body: Value = resp.json().await.unwrap();
        ids.extend(body["jobs"].as_array().unwrap().iter().map(|j| j["id"].as_str().unwrap().parse::<Uuid>().unwrap()));
    }
    ids
}

fn echo_jobs(n: usize, input: Value) -> Vec<Value> {
    (0..n).map(|_| json!({"kind": "echo", "input": input})).collect()
}

/// Jobs of each tenant that have started (running or finished), in one snapshot.
async fn started(cluster: &Cluster) -> HashMap<String, i64> {
    let rows: Vec<(String, i64)> =
        sqlx::query_as("SELECT tenant, count(*) FROM jobs WHERE started_at IS NOT NULL GROUP BY tenant")
            .fetch_all(&cluster.pg)
            .await
            .unwrap();
    rows.into_iter().collect()
}

#[tokio::test]
async fn a_tenant_with_fifty_thousand_jobs_queued_does_not_hold_back_another_tenants_twenty() {
    let mut cluster = Cluster::start(&[]).await.unwrap();
    let bulk = cluster.client_for(&cluster.create_key("bulk", "jobs:write,jobs:read").unwrap()).unwrap();
    let small = cluster.client_for(&cluster.create_key("small", "jobs:write,jobs:read").unwrap()).unwrap();
    let (loops, batch) = (4, 64);
    // Bulk's backlog is all in place before the worker pulls (a fast worker on a slow machine
    // could otherwise run most of it while it is still being submitted), and the worker is
    // busy on it when small submits.
    let (status, _) = cluster.post("/v1/admin/queues/echo/pause", &json!({})).await.unwrap();
    assert_eq!(status, 200);
    submit_as(&cluster, &bulk, &echo_jobs(50_000, json!({"message": "bulk"}))).await;
    let _worker = cluster.spawn_worker(&[("TERN_CONCURRENCY", "4"), ("TERN_BATCH_SIZE", "64")]).unwrap();
    let (status, _) = cluster.post("/v1/admin/queues/echo/resume", &json!({})).await.unwrap();
    assert_eq!(status, 200);
    let deadline = Instant::now() + Duration::from_secs(60);
    while started(&cluster).await.get("bulk").copied().unwrap_or(0) < loops * batch {
        assert!(Instant::now() < deadline, "the worker started none of bulk's jobs in a minute");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let waiting: i64 = sqlx::query_scalar("SELECT count(*) FROM jobs WHERE tenant = 'bulk' AND started_at IS NULL")
        .fetch_one(&cluster.pg)
        .await
        .unwrap();
    assert!(waiting > 10_000, "the worker was to have a backlog of bulk's jobs when small submits; {waiting} left");

    let ids = submit_as(&cluster, &small, &echo_jobs(20, json!({"message": "small"}))).await;
    cluster.wait_terminal(&ids, Duration::from_secs(60)).await.unwrap();
    let (submitted, last_start): (chrono::DateTime<chrono::Utc>, chrono::DateTime<chrono::Utc>) =
        sqlx::query_as("SELECT min(created_at), max(started_at) FROM jobs WHERE id = ANY($1)")
            .bind(&ids)
            .fetch_one(&cluster.pg)
            .await
            .unwrap();
    // Bulk's jobs that started after small's arrived and before small's last one: only the
    // batches each loop had pulled before small's jobs existed may be among them.
    let overtaking: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM jobs WHERE tenant = 'bulk' AND started_at >= $1 AND started_at < $2",
    )
    .bind(submitted)
    .bind(last_start)
    .fetch_one(&cluster.pg)
    .await
    .unwrap();
    println!(
        "small's 20 jobs all started {:.3} s after they were submitted; {overtaking} of bulk's started meanwhile",
        (last_start - submitted).num_milliseconds() as f64 / 1000.0
    );
    assert!(
        overtaking <= loops * batch,
        "{overtaking} of bulk's jobs started between small's submit and small's last start; at most one batch per loop ({})",
        loops * batch
    );
}

#[tokio::test]
async fn weights_of_three_to_one_share_the_work_three_to_one() {
    let mut cluster = Cluster::start(&[]).await.unwrap();
    let heavy = cluster.client_for(&cluster.create_key("heavy", "jobs:write").unwrap()).unwrap();
    let light = cluster.client_for(&cluster.create_key("light", "jobs:write").unwrap()).unwrap();
    let resp = cluster.http.put(cluster.url("/v1/admin/tenants/heavy")).json(&json!({"weight": 3})).send().await.unwrap();
    assert_eq!(resp.status(), 200);
    assert_eq!(resp.json::<Value>().await.unwrap(), json!({"tenant": "heavy", "weight": 3, "max_running": null}));

    // Both backlogs are in place before any worker pulls.
    let (status, _) = cluster.post("/v1/admin/queues/echo/pause", &json!({})).await.unwrap();
    assert_eq!(status, 200);
    submit_as(&cluster, &light, &echo_jobs(3_000, json!({}))).await;
    submit_as(&cluster, &heavy, &echo_jobs(3_000, json!({}))).await;
    let _worker = cluster.spawn_worker(&[("TERN_CONCURRENCY", "2"), ("TERN_BATCH_SIZE", "64")]).unwrap();
    let (status, _) = cluster.post("/v1/admin/queues/echo/resume", &json!({})).await.unwrap();
    assert_eq!(status, 200);

    // Snapshots while both still have jobs waiting: 2,000 started of 6,000 leaves heavy 1,500.
    let deadline = Instant::now() + Duration::from_secs(120);
    let counts = loop {
        let counts = started(&cluster).await;
        if counts.values().sum::<i64>() >= 2_000 {
            break counts;
        }
        assert!(Instant::now() < deadline, "the worker started only {counts:?} in 2 minutes");
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    let (h, l) = (counts.get("heavy").copied().unwrap_or(0), counts.get("light").copied().unwrap_or(0));
    let ratio = h as f64 / l.max(1) as f64;
    println!("started: heavy {h}, light {l}: {ratio:.3} to 1");
    assert!(h < 3_000 && l < 3_000, "both were to have jobs waiting: {counts:?}");
    assert!((ratio - 3.0).abs() <= 0.3, "weights 3:1 gave {ratio:.3}:1 ({counts:?})");

    // The admin list shows the share and the backlog.
    let (status, body) = cluster.get("/v1/admin/tenants").await.unwrap();
    assert_eq!(status, 200);
    let listed: Vec<&Value> = body["tenants"].as_array().unwrap().iter().collect();
    let heavy_row = listed.iter().find(|t| t["tenant"] == "heavy").unwrap();
    assert_eq!(heavy_row["weight"], 3);
    assert!(heavy_row["updated_at"].is_string());
    let light_row = listed.iter().find(|t| t["tenant"] == "light").unwrap();
    assert_eq!((light_row["weight"].as_i64(), light_row["updated_at"].is_null()), (Some(1), true));
}

#[tokio::test]
async fn a_capped_tenant_never_runs_more_than_its_cap_while_others_run_freely() {
    let mut cluster = Cluster::start(&[]).await.unwrap();
    let capped = cluster.client_for(&cluster.create_key("capped", "jobs:write").unwrap()).unwrap();
    let free = cluster.client_for(&cluster.create_key("free", "jobs:write").unwrap()).unwrap();
    let resp = cluster.http.put(cluster.url("/v1/admin/tenants/capped")).json(&json!({"max_running": 2})).send().await.unwrap();
    assert_eq!(resp.status(), 200);
    // Bad shares are refused with their codes.
    for (body, code) in [
        (json!({"weight": 0}), "invalid_weight"),
        (json!({"weight": 1001}), "invalid_weight"),
        (json!({"max_running": 0}), "invalid_max_running"),
    ] {
        let resp = cluster.http.put(cluster.url("/v1/admin/tenants/capped")).json(&body).send().await.unwrap();
        assert_eq!(resp.status(), 400);
        assert_eq!(resp.json::<Value>().await.unwrap()["error"]["code"], code);
    }
    let resp = cluster.http.put(cluster.url("/v1/admin/tenants/no%20spaces")).json(&json!({})).send().await.unwrap();
    assert_eq!(resp.status(), 400);

    let mut ids = submit_as(&cluster, &capped, &echo_jobs(10, json!({"sleep_ms": 300}))).await;
    ids.extend(submit_as(&cluster, &free, &echo_jobs(10, json!({"sleep_ms": 300}))).await);
    let _worker = cluster.spawn_worker(&[("TERN_CONCURRENCY", "4"), ("TERN_BATCH_SIZE", "8")]).unwrap();
    let mut most: HashMap<String, i64> = HashMap::new();
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let rows: Vec<(String, i64, i64)> = sqlx::query_as(
            "SELECT tenant, count(*) FILTER (WHERE state = 'running'), count(*) FILTER (WHERE state = 'succeeded')
             FROM jobs GROUP BY tenant",
        )
        .fetch_all(&cluster.pg)
        .await
        .unwrap();
        for (tenant, running, _) in &rows {
            let m = most.entry(tenant.clone()).or_default();
            *m = (*m).max(*running);
        }
        if rows.iter().map(|r| r.2).sum::<i64>() == 20 {
            break;
        }
        assert!(Instant::now() < deadline, "not every job finished: {rows:?}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    println!("most running at once: {most:?}");
    assert!(most["capped"] <= 2, "the capped tenant ran {} at once", most["capped"]);
    assert!(most["free"] > 2, "the uncapped tenant was held to {} at once", most["free"]);

    // Back to the defaults: the cap is gone from Redis too.
    let resp = cluster.http.delete(cluster.url("/v1/admin/tenants/capped")).send().await.unwrap();
    assert_eq!(resp.status(), 204);
    let mut redis = cluster.redis().await.unwrap();
    let cap: Option<i64> = redis::cmd("HGET")
        .arg(format!("{}:{{echo}}:caps", cluster.redis_prefix))
        .arg("capped")
        .query_async(&mut redis)
        .await
        .unwrap();
    assert_eq!(cap, None);
}
