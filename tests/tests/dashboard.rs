//! The `/admin` dashboard driven in headless Chromium (playwright-core, `tests/dashboard/`):
//! sign-in, a queue depth that follows submissions, Retry on a failed job, history charts and
//! run times from the server (kept through a reload), the jobs browser's bulk cancel and delete,
//! "run now" on a scheduled job, a job's page, a purge, and no console error. Screenshots are
//! kept as `tern-test-logs/dashboard*.png` beside the test binaries.
//!
//! Needs `/usr/bin/chromium` (Debian `chromium`) and `npm ci` in `tests/dashboard`; the test
//! script installs both. Without them the test says SKIPPED and passes, except under `CI=true`.

use serde_json::json;
use std::path::Path;
use std::process::Command;
use std::time::Duration;
use tern_e2e::Cluster;
use uuid::Uuid;

#[tokio::test]
async fn an_operator_signs_in_sees_the_queue_grow_and_retries_a_failed_job() {
    let script_dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("dashboard");
    let chromium = std::env::var("CHROMIUM").unwrap_or_else(|_| "/usr/bin/chromium".into());
    if !Path::new(&chromium).exists() || !script_dir.join("node_modules/playwright-core").exists() {
        assert!(std::env::var("CI").is_err(), "CI needs chromium and tests/dashboard/node_modules (scripts/test.sh installs them)");
        println!("SKIPPED: no chromium or playwright-core");
        return;
    }
    let mut cluster = Cluster::start(&[]).await.unwrap();
    // One job fails for good, then the worker stops, so the jobs the browser submits wait.
    let mut worker = cluster.spawn_worker(&[("TERN_WORKER_KINDS", "echo")]).unwrap();
    let (_, job) = cluster
        .post("/v1/jobs", &json!({"kind": "echo", "max_attempts": 1, "input": {"fail_permanently": true}}))
        .await
        .unwrap();
    let failed: Uuid = job["id"].as_str().unwrap().parse().unwrap();
    let (_, ok) = cluster.post("/v1/jobs", &json!({"kind": "echo", "input": {"message": "fine"}})).await.unwrap();
    let succeeded: Uuid = ok["id"].as_str().unwrap().parse().unwrap();
    cluster
        .wait_until("the jobs finish", Duration::from_secs(20), || async {
            Ok(cluster.state_of(failed).await? == "failed" && cluster.state_of(succeeded).await? == "succeeded")
        })
        .await
        .unwrap();
    let (_, later) = cluster.post("/v1/jobs", &json!({"kind": "echo", "delay_ms": 3_600_000, "input": {}})).await.unwrap();
    let scheduled = later["id"].as_str().unwrap().to_string();
    worker.terminate(Duration::from_secs(10)).unwrap();

    let screenshot = tern_e2e::bin_dir().join("tern-test-logs").join("dashboard.png");
    let _ = std::fs::remove_file(&screenshot);
    let out = Command::new("node")
        .current_dir(&script_dir)
        .env("CHROMIUM", &chromium)
        .args(["dashboard.mjs", &cluster.url(""), &cluster.api_key, &failed.to_string(), &scheduled])
        .arg(&screenshot)
        .output()
        .expect("running node");
    println!("{}", String::from_utf8_lossy(&out.stdout));
    assert!(out.status.success(), "dashboard script failed:\n{}\n{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    // Retried from the browser (queued again), then canceled by its purge.
    let (_, timeline) = cluster.get(&format!("/v1/jobs/{failed}/events")).await.unwrap();
    let states: Vec<&str> = timeline["events"].as_array().unwrap().iter().map(|e| e["state"].as_str().unwrap()).collect();
    assert!(states.ends_with(&["failed", "queued", "canceled"]), "{states:?}");
    assert_eq!(cluster.state_of(scheduled.parse().unwrap()).await.unwrap(), "canceled", "run now queued it; the purge canceled it");
    for page in ["dashboard-jobs.png", "dashboard-job.png"] {
        let png = std::fs::read(tern_e2e::bin_dir().join("tern-test-logs").join(page)).expect("screenshot saved");
        assert!(png.starts_with(b"\x89PNG"), "{page} is not a PNG");
    }
    let png = std::fs::read(&screenshot).expect("screenshot saved");
    assert!(png.starts_with(b"\x89PNG"), "not a PNG");
}
