//! Hot model swaps under load: a new embedding model version is loaded beside the running one
//! and switched in between batches with no failed job; a broken version fails its health check
//! and the active one stays; rollback brings the previous version back at once. A transcription
//! model swaps in the same way under a steady stream of clips.

use base64::Engine;
use serde_json::{json, Value};
use std::future::Future;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};
use tern_e2e::{models_dir, Cluster, Process};
use uuid::Uuid;

const DEFAULT: &str = "all-MiniLM-L6-v2";
const WHISPER: &str = "whisper-tiny.en";

/// A models directory with the real models, two more names for the embedder's weights, and a
/// broken copy whose tensors are all zero: it loads, but every text gets the same vector.
fn models_with_versions(root: &Path) -> PathBuf {
    let dir = root.join("models");
    std::fs::create_dir_all(&dir).unwrap();
    for entry in std::fs::read_dir(models_dir()).unwrap() {
        let entry = entry.unwrap();
        std::os::unix::fs::symlink(entry.path(), dir.join(entry.file_name())).unwrap();
    }
    let real = models_dir().join(DEFAULT);
    for name in ["minilm-v2", "minilm-v3"] {
        std::os::unix::fs::symlink(&real, dir.join(name)).unwrap();
    }
    std::os::unix::fs::symlink(models_dir().join(WHISPER), dir.join("whisper-v2")).unwrap();
    let broken = dir.join("minilm-broken");
    std::fs::create_dir_all(&broken).unwrap();
    for entry in std::fs::read_dir(&real).unwrap() {
        let entry = entry.unwrap();
        if entry.file_name() != "model.safetensors" {
            std::os::unix::fs::symlink(entry.path(), broken.join(entry.file_name())).unwrap();
        }
    }
    let mut weights = std::fs::read(real.join("model.safetensors")).unwrap();
    let header = 8 + u64::from_le_bytes(weights[..8].try_into().unwrap()) as usize;
    weights[header..].fill(0);
    std::fs::write(broken.join("model.safetensors"), weights).unwrap();
    dir
}

/// A deployment with one worker for `kind` over [`models_with_versions`] (kept in the returned
/// folder, which must outlive the worker).
async fn start_with_versions(kind: &str, worker_env: &[(&str, &str)]) -> (tempfile::TempDir, Cluster, Process) {
    let root = tempfile::tempdir().unwrap();
    let models = models_with_versions(root.path()).display().to_string();
    let mut cluster = Cluster::start(&[]).await.unwrap();
    let mut env = vec![("TERN_MODELS_DIR", models.as_str()), ("TERN_WORKER_KINDS", kind)];
    env.extend_from_slice(worker_env);
    let worker = cluster.spawn_worker(&env).unwrap();
    (root, cluster, worker)
}

/// Submits an embedding job every 40 ms until `check` holds (asked every 200 ms).
async fn load_until<F, Fut>(cluster: &Cluster, ids: &mut Vec<Uuid>, what: &str, timeout: Duration, check: F)
where
    F: FnMut() -> Fut,
    Fut: Future<Output = bool>,
{
    submit_until(cluster, embed_job, ids, what, timeout, check).await
}

fn embed_job(n: usize) -> Value {
    json!({"kind": "embed", "input": {"texts": [format!("steady load, job {n}")]}})
}

/// Submits `job(n)` every 40 ms until `check` holds (asked every 200 ms).
async fn submit_until<F, Fut>(cluster: &Cluster, job: impl Fn(usize) -> Value, ids: &mut Vec<Uuid>, what: &str, timeout: Duration, mut check: F)
where
    F: FnMut() -> Fut,
    Fut: Future<Output = bool>,
{
    let started = Instant::now();
    let mut n = 0;
    loop {
        let (status, job) = cluster.post("/v1/jobs", &job(ids.len())).await.unwrap();
        assert_eq!(status, 201, "{job}");
        ids.push(job["id"].as_str().unwrap().parse().unwrap());
        n += 1;
        if n % 5 == 0 && check().await {
            return;
        }
        assert!(started.elapsed() < timeout, "timed out waiting for {what}");
        tokio::time::sleep(Duration::from_millis(40)).await;
    }
}

async fn versions(cluster: &Cluster) -> Vec<Value> {
    let (status, body) = cluster.get("/v1/admin/models").await.unwrap();
    assert_eq!(status, 200, "{body}");
    body["versions"].as_array().unwrap().clone()
}

async fn version(cluster: &Cluster, id: &str) -> Value {
    versions(cluster).await.into_iter().find(|v| v["id"] == id).unwrap()
}

/// The swap state worker1 reports for version `id`.
fn on_worker1(version: &Value) -> Option<&str> {
    version["workers"].as_array()?.iter().find(|w| w["worker_id"] == "worker1")?["state"].as_str()
}

async fn register(cluster: &Cluster, model: &str) -> String {
    register_kind(cluster, "embed", model).await
}

async fn register_kind(cluster: &Cluster, kind: &str, model: &str) -> String {
    let (status, v) = cluster.post("/v1/admin/models", &json!({"kind": kind, "model": model})).await.unwrap();
    assert_eq!(status, 201, "{v}");
    assert_eq!(v["state"], "candidate");
    v["id"].as_str().unwrap().to_string()
}

/// The model that served the last job that succeeded.
async fn model_of_last(cluster: &Cluster, ids: &[Uuid]) -> String {
    let counts = cluster.wait_terminal(ids, Duration::from_secs(30)).await.unwrap();
    assert_eq!(counts.get("succeeded").copied(), Some(ids.len() as i64), "every job succeeds: {counts:?}");
    let (_, job) = cluster.get(&format!("/v1/jobs/{}", ids.last().unwrap())).await.unwrap();
    let output: Value = reqwest::get(job["output"]["url"].as_str().unwrap()).await.unwrap().json().await.unwrap();
    output["model"].as_str().unwrap().to_string()
}

/// Under a stream of `job`s: waits until `default` serves them, registers `model` for `kind`,
/// waits until it is active on worker1, and checks that the jobs after it ran on it. Returns the version's id and the jobs submitted by the
/// time it was active.
async fn warm_then_swap_in(cluster: &Cluster, job: impl Fn(usize) -> Value + Copy, ids: &mut Vec<Uuid>, default: &str, kind: &str, model: &str) -> (String, usize) {
    submit_until(cluster, job, ids, "one job", Duration::from_secs(10), || async { true }).await;
    let first = ids[0];
    submit_until(cluster, job, ids, "the first jobs", Duration::from_secs(60), || async {
        cluster.state_of(first).await.unwrap() == "succeeded"
    })
    .await;
    assert_eq!(model_of_last(cluster, ids).await, default);

    let id = register_kind(cluster, kind, model).await;
    submit_until(cluster, job, ids, &format!("{model} to be active on worker1"), Duration::from_secs(60), || async {
        let v = version(cluster, &id).await;
        v["state"] == "active" && on_worker1(&v) == Some("active")
    })
    .await;
    let swapped_at = ids.len();
    submit_until(cluster, job, ids, "a few more jobs", Duration::from_secs(10), || async { true }).await;
    assert_eq!(model_of_last(cluster, ids).await, model, "jobs after the swap run the new version");
    (id, swapped_at)
}

#[tokio::test]
async fn a_new_version_swaps_in_under_load_a_broken_one_is_refused_and_rollback_restores_the_previous() {
    let (_root, cluster, _worker) = start_with_versions("embed", &[]).await;
    let mut ids = Vec::new();

    // Warm on the configured model, then a new version swaps in while jobs keep coming.
    let (v2, swapped_at) = warm_then_swap_in(&cluster, embed_job, &mut ids, DEFAULT, "embed", "minilm-v2").await;
    let v = version(&cluster, &v2).await;
    // Embedding batches are short, so several start during the load. (A continuous
    // transcription batch may span the whole load, so the transcription test cannot ask this.)
    assert!(v["workers"][0]["batches_during_load"].as_i64().unwrap() > 0, "batches kept running on the old model during the load: {v}");
    assert!(v["workers"][0]["load_ms"].as_i64().unwrap() > 0, "{v}");

    // A broken version fails its health check; minilm-v2 stays active and serving.
    let broken = register(&cluster, "minilm-broken").await;
    load_until(&cluster, &mut ids, "the broken version to fail", Duration::from_secs(60), || async {
        version(&cluster, &broken).await["state"] == "failed"
    })
    .await;
    let v = version(&cluster, &broken).await;
    assert!(v["error"].as_str().unwrap().contains("health check failed"), "{v}");
    assert_eq!(on_worker1(&v), Some("failed"), "{v}");
    assert_eq!(version(&cluster, &v2).await["state"], "active");
    assert_eq!(model_of_last(&cluster, &ids).await, "minilm-v2");

    // v3 replaces v2, which becomes the previous version; rollback makes it active again,
    // without a load: it is still in memory.
    let v3 = register(&cluster, "minilm-v3").await;
    load_until(&cluster, &mut ids, "minilm-v3 to be active", Duration::from_secs(60), || async {
        let v = version(&cluster, &v3).await;
        v["state"] == "active" && on_worker1(&v) == Some("active")
    })
    .await;
    let v = version(&cluster, &v2).await;
    assert_eq!((v["state"].as_str(), on_worker1(&v)), (Some("previous"), Some("deprecated")), "{v}");
    let (status, body) = cluster.post("/v1/admin/models/embed/rollback", &json!({})).await.unwrap();
    assert_eq!(status, 200, "{body}");
    assert_eq!(body["active"], v2.as_str());
    load_until(&cluster, &mut ids, "minilm-v2 to be active again", Duration::from_secs(30), || async {
        on_worker1(&version(&cluster, &v2).await) == Some("active")
    })
    .await;
    load_until(&cluster, &mut ids, "a few more jobs", Duration::from_secs(10), || async { true }).await;
    assert_eq!(model_of_last(&cluster, &ids).await, "minilm-v2");
    let v = version(&cluster, &v3).await;
    assert_eq!((v["state"].as_str(), on_worker1(&v)), (Some("retired"), Some("deprecated")), "{v}");

    // Not one job failed through three swaps, and jobs kept finishing across each of them.
    let counts = cluster.wait_terminal(&ids, Duration::from_secs(30)).await.unwrap();
    assert_eq!(counts.get("succeeded").copied(), Some(ids.len() as i64), "{counts:?}");
    assert!(ids.len() > swapped_at + 5);
}

#[tokio::test]
async fn registering_checks_the_kind_and_the_name_and_rollback_needs_an_active_version() {
    let cluster = Cluster::start(&[]).await.unwrap();
    for (body, code) in [
        (json!({"kind": "echo", "model": "x"}), "invalid_kind"),
        (json!({"kind": "paint", "model": "x"}), "invalid_kind"),
        (json!({"kind": "embed", "model": "../../etc"}), "invalid_model"),
        (json!({"kind": "embed", "model": "/abs"}), "invalid_model"),
        (json!({"kind": "embed", "model": ""}), "invalid_model"),
    ] {
        let (status, err) = cluster.post("/v1/admin/models", &body).await.unwrap();
        assert_eq!((status, err["error"]["code"].as_str()), (422, Some(code)), "{body} -> {err}");
    }
    let (status, err) = cluster.post("/v1/admin/models/embed/rollback", &json!({})).await.unwrap();
    assert_eq!((status, err["error"]["code"].as_str()), (409, Some("nothing_to_roll_back")), "{err}");
    assert!(versions(&cluster).await.is_empty());

    let key = cluster.create_key("t1", "jobs:write,jobs:read").unwrap();
    let (status, _) = {
        let r = cluster.client_for(&key).unwrap().get(cluster.url("/v1/admin/models")).send().await.unwrap();
        (r.status().as_u16(), ())
    };
    assert_eq!(status, 403);
}

/// A new transcription model swaps in while clips keep arriving, and no clip fails. (That a
/// batch kept busy without end still lets a swap in is the engine's own test, where a closed
/// loop of requests can keep one batch running.)
#[tokio::test]
async fn a_transcription_model_swaps_in_under_a_steady_stream_of_clips() {
    // Greedy, with trimmed padding: the test is about the swap, and a steady stream of clips
    // must keep pace on 2 cores (at the default full padding a clip costs a 30 s encoder pass).
    let (_root, cluster, _worker) = start_with_versions("transcribe", &[("TERN_WHISPER_PADDING", "2")]).await;
    // The shortest LibriVox clip: a few seconds of speech, a fraction of a second to transcribe.
    let clip = std::fs::read_dir(models_dir().join("testdata/librivox"))
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|e| e == "wav"))
        .min_by_key(|p| std::fs::metadata(p).unwrap().len())
        .unwrap();
    let audio = base64::engine::general_purpose::STANDARD.encode(std::fs::read(clip).unwrap());
    let job = |_: usize| json!({"kind": "transcribe", "input": {"audio": {"base64": audio}, "beam_size": 1}});
    let mut ids = Vec::new();

    let (_, swapped_at) = warm_then_swap_in(&cluster, job, &mut ids, WHISPER, "transcribe", "whisper-v2").await;
    let counts = cluster.wait_terminal(&ids, Duration::from_secs(60)).await.unwrap();
    assert_eq!(counts.get("succeeded").copied(), Some(ids.len() as i64), "{counts:?}");
    assert!(ids.len() > swapped_at);
}
