//! Jobs flow through API, Redis queue, workers and S3, in priority order, and retry as told.

use serde_json::{json, Value};
use sha2::{Digest, Sha256};
use std::time::Duration;
use tern_e2e::Cluster;
use uuid::Uuid;

/// Every third job's output is over the workers' 300-byte limit for outputs kept in Postgres,
/// so it is an S3 object; the others live in the job's row.
#[tokio::test]
async fn a_thousand_echo_jobs_of_mixed_priority_all_succeed_with_outputs_matching_their_sha256() {
    let mut cluster = Cluster::start(&[]).await.unwrap();
    let priorities = ["urgent", "high", "normal", "low"];
    let message = |i: usize| if i % 3 == 0 { format!("job {i} {}", "x".repeat(300)) } else { format!("job {i}") };
    let jobs: Vec<Value> =
        (0..1000).map(|i| json!({"kind": "echo", "priority": priorities[i % 4], "input": {"message": message(i)}})).collect();
    let ids = cluster.submit_all(&jobs).await.unwrap();
    assert_eq!(ids.len(), 1000);
    let limit = [("TERN_OUTPUT_IN_POSTGRES_MAX_BYTES", "300")];
    let _w1 = cluster.spawn_worker(&limit).unwrap();
    let _w2 = cluster.spawn_worker(&limit).unwrap();
    let counts = cluster.wait_terminal(&ids, Duration::from_secs(120)).await.unwrap();
    assert_eq!(counts.get("succeeded"), Some(&1000), "{counts:?}");

    // Every output, object or row, holds what Postgres says it holds.
    let rows: Vec<(Uuid, Value, Value, Option<Vec<u8>>)> =
        sqlx::query_as("SELECT id, input, output, output_body FROM jobs WHERE id = ANY($1)")
            .bind(&ids)
            .fetch_all(&cluster.pg)
            .await
            .unwrap();
    let checks = rows.iter().map(|(id, input, output, in_row)| {
        let objects = cluster.objects.clone();
        async move {
            let long = input["message"].as_str().unwrap().len() > 300;
            let body = match output["key"].as_str() {
                Some(key) => {
                    assert!(long && in_row.is_none(), "job {id}: only outputs over the limit go to S3");
                    objects.get(key, 1 << 20).await.unwrap().to_vec()
                }
                None => {
                    assert!(!long, "job {id}: an output over the limit stayed in Postgres");
                    in_row.clone().unwrap_or_else(|| panic!("job {id}: an output without key or row bytes"))
                }
            };
            assert_eq!(hex::encode(Sha256::digest(&body)), output["sha256"].as_str().unwrap(), "job {id}");
            assert_eq!(body.len() as i64, output["size"].as_i64().unwrap());
            let echoed: Value = serde_json::from_slice(&body).unwrap();
            assert_eq!(&echoed["input"], input);
            tern_jobs::schemas::validate_output(tern_jobs::JobKind::Echo, &echoed).unwrap();
        }
    });
    futures::future::join_all(checks).await;

    // Each job has exactly one terminal event.
    let multi: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM (SELECT job_id FROM job_events WHERE state IN ('succeeded','failed','canceled')
         GROUP BY job_id HAVING count(*) <> 1) t",
    )
    .fetch_one(&cluster.pg)
    .await
    .unwrap();
    assert_eq!(multi, 0);

    // The URL on GET downloads the output without a key, wherever it lives: a presigned S3 URL
    // (job 0) or a signed link to the row (job 1), which is refused once tampered with.
    for (i, in_s3) in [(0, true), (1, false)] {
        let (status, job) = cluster.get(&format!("/v1/jobs/{}", ids[i])).await.unwrap();
        assert_eq!(status, 200);
        assert_eq!(job["state"], "succeeded");
        assert_eq!(job["output"].get("key").is_some(), in_s3, "{job}");
        let url = job["output"]["url"].as_str().unwrap();
        let response = reqwest::get(url).await.unwrap();
        assert_eq!(response.status(), 200, "{url}");
        assert_eq!(response.headers()["content-type"], "application/json");
        let body = response.bytes().await.unwrap();
        assert_eq!(hex::encode(Sha256::digest(&body)), job["output"]["sha256"].as_str().unwrap());
        if !in_s3 {
            assert!(url.starts_with(&format!("{}/outputs/{}?", cluster.url(""), ids[i])), "{url}");
            let other = url.replace(&ids[i].to_string(), &ids[2].to_string());
            let refused = reqwest::get(&other).await.unwrap();
            assert_eq!(refused.status(), 403);
            let error: Value = refused.json().await.unwrap();
            assert_eq!(error["error"]["code"], "invalid_signature", "{error}");
        }
    }
}

#[tokio::test]
async fn urgent_jobs_submitted_with_low_jobs_all_finish_before_any_low_job_with_one_worker_one_job_at_a_time() {
    let mut cluster = Cluster::start(&[]).await.unwrap();
    // Interleaved, in one batch, before any worker runs: they are submitted together.
    let jobs: Vec<Value> = (0..40)
        .map(|i| {
            let p = if i % 2 == 0 { "low" } else { "urgent" };
            json!({"kind": "echo", "priority": p, "input": {"message": i}})
        })
        .collect();
    let ids = cluster.submit_all(&jobs).await.unwrap();
    let _w = cluster.spawn_worker(&[("TERN_BATCH_SIZE", "1"), ("TERN_CONCURRENCY", "1")]).unwrap();
    cluster.wait_terminal(&ids, Duration::from_secs(60)).await.unwrap();
    let (last_urgent_end, first_low_start): (chrono::DateTime<chrono::Utc>, chrono::DateTime<chrono::Utc>) =
        sqlx::query_as(
            "SELECT (SELECT max(finished_at) FROM jobs WHERE priority = 'urgent'),
                    (SELECT min(started_at) FROM jobs WHERE priority = 'low')",
        )
        .fetch_one(&cluster.pg)
        .await
        .unwrap();
    assert!(last_urgent_end <= first_low_start, "an urgent job finished at {last_urgent_end} after a low one started at {first_low_start}");
    // And within a priority, first in first out.
    let low_order: Vec<Uuid> = sqlx::query_scalar("SELECT id FROM jobs WHERE priority = 'low' ORDER BY started_at")
        .fetch_all(&cluster.pg)
        .await
        .unwrap();
    let mut submitted_low: Vec<Uuid> = ids.iter().step_by(2).copied().collect();
    assert_eq!(low_order, std::mem::take(&mut submitted_low));
}

#[tokio::test]
async fn a_low_job_is_not_starved_by_a_steady_stream_of_normal_jobs() {
    // One aging step of 400 ms: a low job outranks new normal jobs after waiting 400 ms.
    let mut cluster = Cluster::start(&[("TERN_AGING_STEP_MS", "400")]).await.unwrap();
    // The worker runs about 20 jobs/s; normal jobs arrive at about 40/s, so a backlog of normal
    // jobs is always waiting and, without aging, the low job would wait until the stream ends.
    let _w = cluster
        .spawn_worker(&[("TERN_BATCH_SIZE", "1"), ("TERN_CONCURRENCY", "1"), ("TERN_AGING_STEP_MS", "400")])
        .unwrap();
    let normal = |i: usize| json!({"kind": "echo", "priority": "normal", "input": {"message": i, "sleep_ms": 50}});
    let mut low: Option<Uuid> = None;
    let mut normal_ids = Vec::new();
    let mut low_done_during_stream = false;
    for tick in 0..120 {
        let batch: Vec<Value> = (0..2).map(|i| normal(tick * 2 + i)).collect();
        normal_ids.extend(cluster.submit_all(&batch).await.unwrap());
        if tick == 20 {
            let (status, job) =
                cluster.post("/v1/jobs", &json!({"kind": "echo", "priority": "low", "input": {"message": "low"}})).await.unwrap();
            assert_eq!(status, 201);
            low = Some(job["id"].as_str().unwrap().parse().unwrap());
        }
        if let Some(id) = low {
            if cluster.state_of(id).await.unwrap() == "succeeded" {
                low_done_during_stream = true;
                break;
            }
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let waiting: i64 = sqlx::query_scalar("SELECT count(*) FROM jobs WHERE priority = 'normal' AND state = 'queued'")
        .fetch_one(&cluster.pg)
        .await
        .unwrap();
    assert!(low_done_during_stream, "the low job did not run while normal jobs kept arriving");
    assert!(waiting > 0, "the stream never built a backlog, so the test proved nothing");
}

#[tokio::test]
async fn failing_attempts_retry_with_backoff_and_the_last_failure_is_kept() {
    let mut cluster = Cluster::start(&[]).await.unwrap();
    let _w = cluster.spawn_worker(&[("TERN_RETRY_BASE_MS", "200"), ("TERN_RETRY_CAP_MS", "1000")]).unwrap();
    let jobs = vec![
        // Fails twice, then succeeds on attempt 3.
        json!({"kind": "echo", "input": {"fail_attempts": 2}}),
        // Always fails: uses its 3 attempts and ends failed.
        json!({"kind": "echo", "max_attempts": 3, "input": {"fail_attempts": 100}}),
        // Bad input: fails at once without retry.
        json!({"kind": "echo", "input": {"fail_permanently": true}}),
    ];
    let ids = cluster.submit_all(&jobs).await.unwrap();
    cluster.wait_terminal(&ids, Duration::from_secs(30)).await.unwrap();

    let (_, recovered) = cluster.get(&format!("/v1/jobs/{}", ids[0])).await.unwrap();
    assert_eq!(recovered["state"], "succeeded");
    assert_eq!(recovered["attempts"], 3);
    assert_eq!(recovered["error"], Value::Null);

    let (_, dead) = cluster.get(&format!("/v1/jobs/{}", ids[1])).await.unwrap();
    assert_eq!(dead["state"], "failed");
    assert_eq!(dead["attempts"], 3);
    assert_eq!(dead["error"]["code"], "echo_failure");

    let (_, permanent) = cluster.get(&format!("/v1/jobs/{}", ids[2])).await.unwrap();
    assert_eq!(permanent["state"], "failed");
    assert_eq!(permanent["attempts"], 1);

    // The timeline shows the backoff: each retry ran no sooner than half its backoff.
    let (_, timeline) = cluster.get(&format!("/v1/jobs/{}/events", ids[0])).await.unwrap();
    let states: Vec<&str> = timeline["events"].as_array().unwrap().iter().map(|e| e["state"].as_str().unwrap()).collect();
    assert_eq!(states, ["queued", "running", "retrying", "running", "retrying", "running", "succeeded"]);
    let at = |i: usize| chrono::DateTime::parse_from_rfc3339(timeline["events"][i]["at"].as_str().unwrap()).unwrap();
    assert!(at(3) - at(2) >= chrono::Duration::milliseconds(100), "first retry came too soon");
    assert!(at(5) - at(4) >= chrono::Duration::milliseconds(200), "second retry came too soon");
}

#[tokio::test]
async fn a_delayed_job_waits_for_its_time() {
    let mut cluster = Cluster::start(&[]).await.unwrap();
    let _w = cluster.spawn_worker(&[]).unwrap();
    let (status, job) = cluster.post("/v1/jobs", &json!({"kind": "echo", "delay_ms": 1500, "input": {}})).await.unwrap();
    assert_eq!(status, 201);
    assert_eq!(job["state"], "scheduled");
    let id: Uuid = job["id"].as_str().unwrap().parse().unwrap();
    tokio::time::sleep(Duration::from_millis(700)).await;
    assert_eq!(cluster.state_of(id).await.unwrap(), "scheduled");
    cluster.wait_terminal(&[id], Duration::from_secs(10)).await.unwrap();
    let (started, run_at): (chrono::DateTime<chrono::Utc>, chrono::DateTime<chrono::Utc>) = sqlx::query_as(
        "SELECT started_at, (SELECT at FROM job_events WHERE job_id = $1 ORDER BY id LIMIT 1) + interval '1500 ms'
         FROM jobs WHERE id = $1",
    )
    .bind(id)
    .fetch_one(&cluster.pg)
    .await
    .unwrap();
    assert!(started >= run_at - chrono::Duration::milliseconds(50), "started {started}, due {run_at}");
}

#[tokio::test]
async fn an_idle_worker_takes_a_new_job_at_once_on_the_wake_up_hint_not_at_its_next_poll() {
    let mut cluster = Cluster::start(&[]).await.unwrap();
    // Polls back off 1, 2, 4 … ms up to a minute while the queue is empty.
    let _w = cluster.spawn_worker(&[("TERN_CONCURRENCY", "1"), ("TERN_IDLE_POLL_MAX_MS", "60000")]).unwrap();
    let first = cluster.submit_all(&[json!({"kind": "echo", "input": {"message": "first"}})]).await.unwrap();
    cluster.wait_terminal(&first, Duration::from_secs(60)).await.unwrap();
    // 9 s idle: the loop has slept 1 + 2 + … + 4096 ms and is in its 8,192 ms sleep, which ends
    // about 7 s after the next submit.
    tokio::time::sleep(Duration::from_secs(9)).await;
    let second = cluster.submit_all(&[json!({"kind": "echo", "input": {"message": "second"}})]).await.unwrap();
    cluster.wait_terminal(&second, Duration::from_secs(60)).await.unwrap();
    let waited: f64 = sqlx::query_scalar("SELECT extract(epoch FROM started_at - created_at)::float8 FROM jobs WHERE id = $1")
        .bind(second[0])
        .fetch_one(&cluster.pg)
        .await
        .unwrap();
    assert!(waited < 4.0, "the job waited {waited:.2} s for the idle worker: the wake-up hint did not reach it");
}
