//! The worker's model cache: with a memory budget too small for two models at once, jobs of
//! both kinds still all finish, the cache swapping the models in and out.

use base64::Engine;
use serde_json::{json, Value};
use std::time::Duration;
use tern_e2e::Cluster;

#[tokio::test]
async fn a_budget_for_one_model_at_a_time_still_runs_every_kind() {
    let mut cluster = Cluster::start(&[]).await.unwrap();
    let clip = std::fs::read(tern_e2e::models_dir().join("testdata/librivox/man1_nb.wav"))
        .or_else(|_| {
            // Any clip of the set will do.
            let dir = tern_e2e::models_dir().join("testdata/librivox");
            let first = std::fs::read_dir(&dir)?
                .filter_map(Result::ok)
                .map(|e| e.path())
                .find(|p| p.extension().is_some_and(|x| x == "wav"))
                .expect("a LibriVox clip");
            std::fs::read(first)
        })
        .unwrap();
    let audio = base64::engine::general_purpose::STANDARD.encode(&clip);
    // Alternate the kinds so the worker keeps needing the other model.
    let jobs: Vec<Value> = (0..4)
        .flat_map(|i| {
            [
                json!({"kind": "transcribe", "input": {"audio": {"base64": audio}}}),
                json!({"kind": "embed", "input": {"texts": [format!("sentence {i}")]}}),
            ]
        })
        .collect();
    let ids = cluster.submit_all(&jobs).await.unwrap();
    // Whisper tiny.en takes ~111 MB on the CPU (F32, token embeddings in F16), MiniLM ~91 MB:
    // 170 MiB (178 MB) holds either, not both.
    let worker = cluster
        .spawn_worker(&[("TERN_MEMORY_BUDGET", "170MiB"), ("TERN_WORKER_KINDS", "transcribe,embed"), ("TERN_BATCH_SIZE", "1"), ("TERN_CONCURRENCY", "1")])
        .unwrap();
    let counts = cluster.wait_terminal(&ids, Duration::from_secs(300)).await.unwrap();
    assert_eq!(counts.get("succeeded"), Some(&(ids.len() as i64)), "{counts:?}\n{}", worker.log_text());
    let log = worker.log_text();
    let evictions = log.matches("model evicted").count();
    assert!(evictions >= 2, "the models were swapped ({evictions} evictions):\n{log}");
    let loads = log.matches("model loaded and warmed up").count();
    assert_eq!(loads, evictions + 1, "every load but the first evicted the other model");
}

#[tokio::test]
async fn a_model_over_the_budget_fails_its_jobs_with_a_clear_error() {
    let mut cluster = Cluster::start(&[]).await.unwrap();
    let ids = cluster.submit_all(&[json!({"kind": "embed", "input": {"texts": ["hello"]}})]).await.unwrap();
    let _w = cluster.spawn_worker(&[("TERN_MEMORY_BUDGET", "10MB"), ("TERN_WORKER_KINDS", "embed")]).unwrap();
    // model_unavailable is retried (another worker may have room): look at the first failure.
    cluster
        .wait_until("the attempt fails", Duration::from_secs(60), || async {
            let (_, job) = cluster.get(&format!("/v1/jobs/{}", ids[0])).await.unwrap();
            Ok(job["error"]["code"] == "model_unavailable")
        })
        .await
        .unwrap();
    let (_, job) = cluster.get(&format!("/v1/jobs/{}", ids[0])).await.unwrap();
    let message = job["error"]["message"].as_str().unwrap();
    assert!(message.contains("TERN_MEMORY_BUDGET"), "{message}");
}
