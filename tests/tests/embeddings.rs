//! Sentence embeddings through the whole service: API, queue, worker (MiniLM on candle), S3.

use serde_json::{json, Value};
use std::time::Duration;
use tern_e2e::Cluster;
use uuid::Uuid;

fn dot(a: &[f64], b: &[f64]) -> f64 {
    a.iter().zip(b).map(|(x, y)| x * y).sum()
}

fn vectors(out: &Value) -> Vec<Vec<f64>> {
    out["embeddings"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v.as_array().unwrap().iter().map(|x| x.as_f64().unwrap()).collect())
        .collect()
}

/// The job's output: inline in the record when present (checked against the S3 copy).
async fn output(cluster: &Cluster, id: Uuid) -> Value {
    let (_, job) = cluster.get(&format!("/v1/jobs/{id}")).await.unwrap();
    assert_eq!(job["state"], "succeeded", "{job}");
    let stored: Value = reqwest::get(job["output"]["url"].as_str().unwrap()).await.unwrap().json().await.unwrap();
    tern_jobs::schemas::validate_output(tern_jobs::JobKind::Embed, &stored).unwrap();
    if let Some(inline) = job["output"].get("inline") {
        assert_eq!(inline, &stored, "the inline copy is the stored output");
    }
    stored
}

#[tokio::test]
async fn embeddings_match_the_reference_and_batched_equals_single() {
    let mut cluster = Cluster::start(&[]).await.unwrap();
    let long = "The committee postponed its decision on the new bridge until the spring. ".repeat(12);
    let texts = [
        "A man is eating food.",
        "A man is eating a piece of bread.",
        "short",
        long.as_str(),
        "Ein Mann isst Brot.",
    ];
    let mut jobs = vec![json!({"kind": "embed", "input": {"texts": texts}})];
    jobs.extend(texts.iter().map(|t| json!({"kind": "embed", "input": {"texts": [t]}})));
    let ids = cluster.submit_all(&jobs).await.unwrap();
    let (_, first) = cluster.get(&format!("/v1/jobs/{}", ids[0])).await.unwrap();
    assert!(first["cost"].as_i64().unwrap() >= texts.len() as i64 * 20, "cost is padded tokens: {first}");
    let _w = cluster.spawn_worker(&[]).unwrap();
    let counts = cluster.wait_terminal(&ids, Duration::from_secs(120)).await.unwrap();
    assert_eq!(counts.get("succeeded"), Some(&(ids.len() as i64)), "{counts:?}");

    let batched = output(&cluster, ids[0]).await;
    assert_eq!(batched["dimensions"], 384);
    let (_, job) = cluster.get(&format!("/v1/jobs/{}", ids[0])).await.unwrap();
    assert!(job["output"]["inline"].is_object(), "a small output is inlined: {}", job["output"]);
    let batched = vectors(&batched);
    assert_eq!(batched.len(), texts.len());
    for v in &batched {
        assert!((dot(v, v).sqrt() - 1.0).abs() < 1e-4, "unit length");
    }
    let cosine = dot(&batched[0], &batched[1]);
    assert!((cosine - 0.755).abs() <= 0.005, "cosine {cosine}, reference 0.755");
    for (i, id) in ids[1..].iter().enumerate() {
        let single = vectors(&output(&cluster, *id).await).remove(0);
        let diff = single.iter().zip(&batched[i]).map(|(a, b)| (a - b).abs()).fold(0.0, f64::max);
        assert!(diff <= 1e-4, "text {i}: batched differs from single by {diff}");
    }
}

#[tokio::test]
async fn large_outputs_stay_in_s3_and_bad_input_is_refused() {
    let mut cluster = Cluster::start(&[]).await.unwrap();
    // 200 vectors of 384 floats are far over 64 KiB of JSON.
    let texts: Vec<String> = (0..200).map(|i| format!("sentence number {i}")).collect();
    let (status, job) = cluster.post("/v1/jobs", &json!({"kind": "embed", "input": {"texts": texts}})).await.unwrap();
    assert_eq!(status, 201, "{job}");
    let id: Uuid = job["id"].as_str().unwrap().parse().unwrap();
    for bad in [json!({"texts": []}), json!({"texts": vec!["x"; 2049]}), json!({"texts": [1, 2]}), json!({})] {
        let (status, err) = cluster.post("/v1/jobs", &json!({"kind": "embed", "input": bad})).await.unwrap();
        assert_eq!((status, err["error"]["code"].as_str()), (422, Some("invalid_input")), "{err}");
    }
    let _w = cluster.spawn_worker(&[]).unwrap();
    cluster.wait_terminal(&[id], Duration::from_secs(120)).await.unwrap();
    let out = output(&cluster, id).await;
    assert_eq!(vectors(&out).len(), 200);
    let (_, job) = cluster.get(&format!("/v1/jobs/{id}")).await.unwrap();
    assert!(job["output"].get("inline").is_none(), "large outputs are not inlined");
}
