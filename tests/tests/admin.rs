//! The admin API: queue counts, pause/resume, retry of failed jobs, purge, delete, timelines.

use serde_json::{json, Value};
use std::time::Duration;
use tern_e2e::Cluster;
use uuid::Uuid;

fn queue<'a>(body: &'a Value, kind: &str) -> &'a Value {
    body["queues"].as_array().unwrap().iter().find(|q| q["kind"] == kind).unwrap()
}

#[tokio::test]
async fn a_paused_kind_keeps_accepting_jobs_that_no_worker_pulls_until_it_is_resumed() {
    let mut cluster = Cluster::start(&[("TERN_RECONCILE_INTERVAL_MS", "500")]).await.unwrap();
    let (status, body) = cluster.post("/v1/admin/queues/echo/pause", &json!({})).await.unwrap();
    assert_eq!(status, 200, "{body}");
    let _worker = cluster.spawn_worker(&[]).unwrap();
    let jobs: Vec<Value> = (0..20)
        .map(|i| json!({"kind": "echo", "priority": if i % 2 == 0 { "high" } else { "low" }, "input": {"message": format!("job {i}")}}))
        .collect();
    let ids = cluster.submit_all(&jobs).await.unwrap();
    // The worker polls at least every 100 ms: two seconds is twenty chances to pull.
    tokio::time::sleep(Duration::from_secs(2)).await;
    let (_, body) = cluster.get("/v1/admin/queues").await.unwrap();
    let echo = queue(&body, "echo");
    assert_eq!(echo["paused"], true, "{echo}");
    assert_eq!(echo["total"]["queued"], 20, "{echo}");
    assert_eq!(echo["priorities"]["high"]["queued"], 10, "{echo}");
    assert_eq!(echo["priorities"]["low"]["queued"], 10, "{echo}");
    assert_eq!(echo["redis_depth"], 20, "{echo}");
    assert!(echo["oldest_queued_seconds"].as_f64().unwrap() >= 1.5, "{echo}");
    for id in &ids {
        assert_eq!(cluster.state_of(*id).await.unwrap(), "queued");
    }

    // Redis loses this deployment's data: the reconciler restores the jobs and the pause.
    let mut redis = cluster.redis().await.unwrap();
    let keys: Vec<String> = redis::cmd("KEYS").arg(format!("{}:*", cluster.redis_prefix)).query_async(&mut redis).await.unwrap();
    assert!(!keys.is_empty());
    let _: () = redis::cmd("DEL").arg(&keys).query_async(&mut redis).await.unwrap();
    cluster
        .wait_until("the reconciler restores the queue", Duration::from_secs(20), || async {
            let (_, body) = cluster.get("/v1/admin/queues").await?;
            Ok(queue(&body, "echo")["redis_depth"] == 20)
        })
        .await
        .unwrap();
    tokio::time::sleep(Duration::from_secs(1)).await;
    let (_, body) = cluster.get("/v1/admin/queues").await.unwrap();
    let echo = queue(&body, "echo");
    assert_eq!((echo["paused"].as_bool(), echo["total"]["queued"].as_i64()), (Some(true), Some(20)), "still paused: {echo}");

    let (status, _) = cluster.post("/v1/admin/queues/echo/resume", &json!({})).await.unwrap();
    assert_eq!(status, 200);
    let counts = cluster.wait_terminal(&ids, Duration::from_secs(60)).await.unwrap();
    assert_eq!(counts.get("succeeded"), Some(&20), "{counts:?}");
    let (_, body) = cluster.get("/v1/admin/queues").await.unwrap();
    let echo = queue(&body, "echo");
    assert_eq!(echo["paused"], false);
    assert_eq!(echo["total"]["queued"], 0, "{echo}");
    assert_eq!(echo["succeeded"]["last_1m"], 20, "{echo}");
    assert_eq!(echo["oldest_queued_seconds"], Value::Null);
}

#[tokio::test]
async fn failed_jobs_are_counted_retried_from_the_admin_api_and_keep_their_timeline() {
    let mut cluster = Cluster::start(&[]).await.unwrap();
    let _worker = cluster.spawn_worker(&[]).unwrap();
    // Fails its first attempt for good (max_attempts 1), succeeds on the retry (attempt 2).
    let failing: Vec<Value> = (0..3)
        .map(|_| json!({"kind": "echo", "max_attempts": 1, "input": {"fail_attempts": 1}}))
        .collect();
    let ids = cluster.submit_all(&failing).await.unwrap();
    let counts = cluster.wait_terminal(&ids, Duration::from_secs(30)).await.unwrap();
    assert_eq!(counts.get("failed"), Some(&3), "{counts:?}");
    let (_, body) = cluster.get("/v1/admin/queues").await.unwrap();
    assert_eq!(queue(&body, "echo")["total"]["failed"], 3, "{body}");
    assert_eq!(queue(&body, "echo")["failed"]["last_1m"], 3, "{body}");
    let (_, body) = cluster.get("/v1/admin/jobs?state=failed&kind=echo").await.unwrap();
    assert_eq!(body["jobs"].as_array().unwrap().len(), 3, "{body}");

    // One by id, then the rest by kind.
    let (status, body) = cluster.post("/v1/admin/jobs/retry", &json!({"ids": [ids[0]]})).await.unwrap();
    assert_eq!(status, 200, "{body}");
    assert_eq!(body["retried"], json!([ids[0]]));
    let (status, body) = cluster.post("/v1/admin/jobs/retry", &json!({"kind": "echo"})).await.unwrap();
    assert_eq!(status, 200, "{body}");
    assert_eq!(body["retried"].as_array().unwrap().len(), 2, "{body}");
    cluster
        .wait_until("retried jobs succeed", Duration::from_secs(30), || async {
            let mut all = true;
            for id in &ids {
                all &= cluster.state_of(*id).await? == "succeeded";
            }
            Ok(all)
        })
        .await
        .unwrap();

    // The timeline shows the failure, the admin retry and the success.
    let (status, job) = cluster.get(&format!("/v1/admin/jobs/{}", ids[0])).await.unwrap();
    assert_eq!(status, 200, "{job}");
    let states: Vec<&str> = job["events"].as_array().unwrap().iter().map(|e| e["state"].as_str().unwrap()).collect();
    assert_eq!(states, ["queued", "running", "failed", "queued", "running", "succeeded"], "{job}");
    let retry_event = &job["events"][3];
    assert_eq!(retry_event["detail"]["retried_by"], "admin", "{job}");
    assert_eq!(job["attempts"], 2);
    assert!(job["deliveries"].is_array());

    // Nothing failed is left to retry.
    let (status, body) = cluster.post("/v1/admin/jobs/retry", &json!({"ids": [Uuid::now_v7()]})).await.unwrap();
    assert_eq!(status, 200);
    assert_eq!(body["retried"], json!([]));
    let (status, body) = cluster.post("/v1/admin/jobs/retry", &json!({})).await.unwrap();
    assert_eq!((status, body["error"]["code"].as_str()), (400, Some("nothing_to_retry")), "{body}");
}

#[tokio::test]
async fn purge_needs_confirmation_and_cancels_only_waiting_jobs_and_delete_only_finished_ones() {
    let mut cluster = Cluster::start(&[]).await.unwrap();
    let ids = cluster.submit_all(&vec![json!({"kind": "echo", "input": {}}); 5]).await.unwrap();
    let (status, body) = cluster.post("/v1/admin/queues/echo/purge", &json!({})).await.unwrap();
    assert_eq!((status, body["error"]["code"].as_str()), (400, Some("confirm_required")), "{body}");
    let (status, body) = cluster.post("/v1/admin/queues/echo/purge?confirm=embed", &json!({})).await.unwrap();
    assert_eq!(status, 400, "{body}");
    let (status, body) = cluster.post("/v1/admin/queues/nope/purge?confirm=nope", &json!({})).await.unwrap();
    assert_eq!((status, body["error"]["code"].as_str()), (404, Some("unknown_kind")), "{body}");

    // A deleted job must be finished.
    let (http, base) = (cluster.http.clone(), cluster.url(""));
    let delete = |id: Uuid| {
        let (c, url) = (http.clone(), format!("{base}/v1/admin/jobs/{id}"));
        async move { c.delete(url).send().await.unwrap().status().as_u16() }
    };
    assert_eq!(delete(ids[0]).await, 409);

    let (status, body) = cluster.post("/v1/admin/queues/echo/purge?confirm=echo", &json!({})).await.unwrap();
    assert_eq!(status, 200, "{body}");
    assert_eq!(body["canceled"], 5, "{body}");
    for id in &ids {
        assert_eq!(cluster.state_of(*id).await.unwrap(), "canceled");
    }
    assert_eq!(cluster.queue_len("echo", "ready").await.unwrap(), 0);
    // A worker started now finds nothing to run.
    let _worker = cluster.spawn_worker(&[]).unwrap();
    tokio::time::sleep(Duration::from_millis(500)).await;
    for id in &ids {
        assert_eq!(cluster.state_of(*id).await.unwrap(), "canceled");
    }

    assert_eq!(delete(ids[0]).await, 204);
    let (status, _) = cluster.get(&format!("/v1/admin/jobs/{}", ids[0])).await.unwrap();
    assert_eq!(status, 404);
    assert_eq!(delete(ids[0]).await, 404);
    let events: i64 = sqlx::query_scalar("SELECT count(*) FROM job_events WHERE job_id = $1")
        .bind(ids[0])
        .fetch_one(&cluster.pg)
        .await
        .unwrap();
    assert_eq!(events, 0);
}

#[tokio::test]
async fn admin_routes_refuse_keys_without_the_admin_scope_and_see_every_tenant() {
    let cluster = Cluster::start(&[]).await.unwrap();
    let key = cluster.create_key("acme", "jobs:write,jobs:read").unwrap();
    let acme = cluster.client_for(&key).unwrap();
    let resp = acme.post(cluster.url("/v1/jobs")).json(&json!({"kind": "echo", "input": {}})).send().await.unwrap();
    assert_eq!(resp.status(), 201);
    let acme_job: Value = resp.json().await.unwrap();
    for (method, path) in [
        ("GET", "/v1/admin/queues"),
        ("POST", "/v1/admin/queues/echo/pause"),
        ("POST", "/v1/admin/jobs/retry"),
        ("GET", "/v1/admin/jobs"),
    ] {
        let req = if method == "GET" { acme.get(cluster.url(path)) } else { acme.post(cluster.url(path)).json(&json!({"kind": "echo"})) };
        let resp = req.send().await.unwrap();
        assert_eq!(resp.status(), 403, "{method} {path}");
    }
    // The admin (tenant `default`) sees acme's job, and can filter by tenant.
    let (_, body) = cluster.get("/v1/admin/jobs?tenant=acme").await.unwrap();
    let jobs = body["jobs"].as_array().unwrap();
    assert_eq!(jobs.len(), 1, "{body}");
    assert_eq!(jobs[0]["id"], acme_job["id"]);
    let (status, _) = cluster.get(&format!("/v1/admin/jobs/{}", acme_job["id"].as_str().unwrap())).await.unwrap();
    assert_eq!(status, 200);
    let (_, body) = cluster.get("/v1/admin/jobs?tenant=default").await.unwrap();
    assert_eq!(body["jobs"].as_array().unwrap().len(), 0, "{body}");
}

/// The admin view of worker `id`, once it has reported.
async fn worker_view(cluster: &Cluster, id: &str) -> Option<Value> {
    let (_, body) = cluster.get("/v1/admin/workers").await.unwrap();
    body["workers"].as_array().unwrap().iter().find(|w| w["id"] == id).cloned()
}

#[tokio::test]
async fn a_worker_killed_mid_job_shows_as_lost_and_its_job_runs_again_elsewhere() {
    let lease = ("TERN_LEASE_MS", "1500");
    let mut cluster = Cluster::start(&[lease]).await.unwrap();
    let mut doomed = cluster.spawn_worker(&[lease]).unwrap();
    // Long enough for a report (every 2 s) to land while the job is in hand, even on a busy CI.
    let (_, job) = cluster.post("/v1/jobs", &json!({"kind": "echo", "input": {"sleep_ms": 8000}})).await.unwrap();
    let id: Uuid = job["id"].as_str().unwrap().parse().unwrap();
    cluster
        .wait_until("the job runs on worker1", Duration::from_secs(20), || async {
            Ok(cluster.state_of(id).await? == "running"
                && worker_view(&cluster, "worker1").await.is_some_and(|w| w["batch_in_hand"] == 1))
        })
        .await
        .unwrap();
    let w = worker_view(&cluster, "worker1").await.unwrap();
    assert_eq!(w["state"], "active", "{w}");
    assert_eq!(w["kinds"], json!(["echo", "transcribe", "embed", "generate", "audio_embed", "image"]), "{w}");
    assert_eq!(w["device"], "cpu");
    assert!(w["memory"]["rss_bytes"].as_u64().unwrap() > 0, "{w}");

    doomed.kill9();
    cluster
        .wait_until("worker1 shows as lost", Duration::from_secs(20), || async {
            Ok(worker_view(&cluster, "worker1").await.is_some_and(|w| w["state"] == "lost"))
        })
        .await
        .unwrap();
    let _rescuer = cluster.spawn_worker(&[lease]).unwrap();
    cluster
        .wait_until("the job succeeds on worker2", Duration::from_secs(40), || async {
            Ok(cluster.state_of(id).await? == "succeeded")
        })
        .await
        .unwrap();
    let (_, job) = cluster.get(&format!("/v1/admin/jobs/{id}")).await.unwrap();
    assert_eq!(job["worker_id"], "worker2", "{job}");
    // worker2 can pull and finish the job before its first report lands.
    cluster
        .wait_until("worker2 reports as active", Duration::from_secs(10), || async {
            Ok(worker_view(&cluster, "worker2").await.is_some_and(|w| w["state"] == "active"))
        })
        .await
        .unwrap();
}

#[tokio::test]
async fn a_drained_worker_finishes_its_batch_and_pulls_nothing_until_undrained() {
    let mut cluster = Cluster::start(&[]).await.unwrap();
    let _worker = cluster.spawn_worker(&[]).unwrap();
    cluster
        .wait_until("worker1 reports", Duration::from_secs(10), || async { Ok(worker_view(&cluster, "worker1").await.is_some()) })
        .await
        .unwrap();
    let (_, running) = cluster.post("/v1/jobs", &json!({"kind": "echo", "input": {"sleep_ms": 1500}})).await.unwrap();
    let running: Uuid = running["id"].as_str().unwrap().parse().unwrap();
    cluster
        .wait_until("the first job runs", Duration::from_secs(10), || async { Ok(cluster.state_of(running).await? == "running") })
        .await
        .unwrap();
    let (status, body) = cluster.post("/v1/admin/workers/worker1/drain", &json!({})).await.unwrap();
    assert_eq!(status, 200, "{body}");
    let (status, _) = cluster.post("/v1/admin/workers/nobody/drain", &json!({})).await.unwrap();
    assert_eq!(status, 404);
    // The worker learns at its next report (every 2 s); the job in hand still finishes.
    tokio::time::sleep(Duration::from_millis(2500)).await;
    let ids = cluster.submit_all(&vec![json!({"kind": "echo", "input": {}}); 3]).await.unwrap();
    tokio::time::sleep(Duration::from_secs(2)).await;
    assert_eq!(cluster.state_of(running).await.unwrap(), "succeeded");
    for id in &ids {
        assert_eq!(cluster.state_of(*id).await.unwrap(), "queued");
    }
    let w = worker_view(&cluster, "worker1").await.unwrap();
    assert_eq!((w["state"].as_str(), w["batch_in_hand"].as_u64()), (Some("draining"), Some(0)), "{w}");

    let (status, _) = cluster.post("/v1/admin/workers/worker1/undrain", &json!({})).await.unwrap();
    assert_eq!(status, 200);
    let counts = cluster.wait_terminal(&ids, Duration::from_secs(15)).await.unwrap();
    assert_eq!(counts.get("succeeded"), Some(&3), "{counts:?}");
    // Counts reach the row at the worker's next report.
    cluster
        .wait_until("worker1 reports 4 jobs done", Duration::from_secs(10), || async {
            Ok(worker_view(&cluster, "worker1").await.is_some_and(|w| w["jobs_done"] == 4))
        })
        .await
        .unwrap();

    let (status, system) = cluster.get("/v1/admin/system").await.unwrap();
    assert_eq!(status, 200, "{system}");
    let w = &system["workers"][0];
    assert_eq!(w["id"], "worker1", "{system}");
    // No model loaded yet: nothing of the budget is in use.
    assert_eq!(w["memory"]["state"], "low", "{system}");
    assert!(w["memory"]["budget_bytes"].as_u64().unwrap() > 0, "{system}");
    assert!(w["optimisations"].as_array().unwrap().iter().any(|o| o.as_str().unwrap().contains("whisper")), "{system}");
    assert_eq!(system["queue"]["queued"], 0, "{system}");
    assert_eq!(system["redis"], json!({"cluster": false, "shards": 1}), "{system}");
}

/// Issue 20, item 10: the reconciler, which sets the Redis pause flags to what Postgres
/// records, never writes a reading older than an admin's pause or resume over it: after every
/// toggle (here with the reconciler sweeping without pause), the flag workers read is the one
/// the admin set, and stays so.
#[tokio::test]
async fn the_reconciler_never_undoes_a_pause_or_resume() {
    let cluster = Cluster::start(&[("TERN_RECONCILE_INTERVAL_MS", "1")])
        .await
        .unwrap();
    let mut redis = cluster.redis().await.unwrap();
    let flag = format!("{}:{{echo}}:paused", cluster.redis_prefix);
    let mut undone = Vec::new();
    for i in 0..80 {
        let pause = i % 2 == 0;
        let action = if pause { "pause" } else { "resume" };
        let (status, _) = cluster
            .post(&format!("/v1/admin/queues/echo/{action}"), &json!({}))
            .await
            .unwrap();
        assert_eq!(status, 200);
        tokio::time::sleep(Duration::from_millis(20)).await;
        let set: bool = redis::cmd("EXISTS")
            .arg(&flag)
            .query_async(&mut redis)
            .await
            .unwrap();
        if set != pause {
            undone.push(i);
        }
    }
    assert!(
        undone.is_empty(),
        "toggles undone by the reconciler: {undone:?}"
    );
}
