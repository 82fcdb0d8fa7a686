//! OpenAI's Batch API from a test: upload a JSONL file, create a batch, wait for it, read its
//! files.

use crate::Cluster;
use anyhow::{bail, Result};
use serde_json::{json, Value};
use std::collections::HashMap;
use std::time::{Duration, Instant};

/// Uploads `lines` as a batch input file; returns its id.
pub async fn upload(cluster: &Cluster, lines: &[Value]) -> Result<String> {
    let body: String = lines.iter().map(|l| l.to_string() + "\n").collect();
    let form = reqwest::multipart::Form::new()
        .text("purpose", "batch")
        .part("file", reqwest::multipart::Part::bytes(body.into_bytes()).file_name("input.jsonl"));
    let resp = cluster.http.post(cluster.url("/v1/files")).multipart(form).send().await?;
    let status = resp.status();
    let file: Value = resp.json().await?;
    if status != 200 {
        bail!("upload answered {status}: {file}");
    }
    Ok(file["id"].as_str().unwrap().to_string())
}

/// Creates a batch of the uploaded `file` for `endpoint`, completion window 24h; it starts
/// `validating`.
pub async fn create_batch(cluster: &Cluster, file: &str, endpoint: &str) -> Result<Value> {
    let (status, batch) =
        cluster.post("/v1/batches", &json!({ "input_file_id": file, "endpoint": endpoint, "completion_window": "24h" })).await?;
    if status != 200 {
        bail!("create answered {status}: {batch}");
    }
    assert_eq!(batch["status"], "validating", "{batch}");
    Ok(batch)
}

/// Polls the batch until it reaches `status`.
pub async fn wait_for(cluster: &Cluster, id: &str, status: &str, timeout: Duration) -> Result<Value> {
    let deadline = Instant::now() + timeout;
    loop {
        let (code, batch) = cluster.get(&format!("/v1/batches/{id}")).await?;
        assert_eq!(code, 200, "{batch}");
        if batch["status"] == status {
            return Ok(batch);
        }
        if ["completed", "failed", "expired", "cancelled"].contains(&batch["status"].as_str().unwrap_or_default()) || Instant::now() > deadline {
            bail!("batch {id} is {} (waiting for {status}): {batch}", batch["status"]);
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// A file's lines, by custom id.
pub async fn lines_of(cluster: &Cluster, file: &Value) -> Result<HashMap<String, Value>> {
    let Some(id) = file.as_str() else { return Ok(HashMap::new()) };
    let resp = cluster.http.get(cluster.url(&format!("/v1/files/{id}/content"))).send().await?;
    assert_eq!(resp.status(), 200);
    let text = resp.text().await?;
    let mut out = HashMap::new();
    for line in text.lines() {
        let v: Value = serde_json::from_str(line)?;
        let custom_id = v["custom_id"].as_str().unwrap().to_string();
        assert!(out.insert(custom_id.clone(), v).is_none(), "{custom_id} is answered twice in {id}");
    }
    Ok(out)
}

/// One line of a batch input file.
pub fn line(custom_id: &str, url: &str, body: Value) -> Value {
    json!({ "custom_id": custom_id, "method": "POST", "url": url, "body": body })
}
