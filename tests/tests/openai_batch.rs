//! OpenAI's Batch API over jobs (`/v1/files`, `/v1/batches`): a batch of 1,000 mixed lines
//! (embeddings, chat and text completions, transcriptions and translations by upload key,
//! lines refused before they run, NULs among them, and answers refused after) ends with every line answered
//! once; a batch goes on through its API restarting mid-file and a full queue, without a
//! line made a job twice; canceled and expired batches wind down with every line answered.

use anyhow::Result;
use serde_json::{json, Value};
use std::collections::HashMap;
use std::time::{Duration, Instant};
use tern_e2e::batch::{create_batch, line, lines_of, upload, wait_for};
use tern_e2e::Cluster;

/// A LibriVox clip stored as an upload; returns its key.
async fn upload_clip(cluster: &Cluster) -> Result<String> {
    let (_, upload) = cluster.post("/v1/uploads", &json!({})).await?;
    let wav = std::fs::read(tern_e2e::models_dir().join("testdata/librivox/sense_and_sensibility_01_austen_64kb-0870.wav"))?;
    let put = reqwest::Client::new().put(upload["url"].as_str().unwrap()).body(wav).send().await?;
    assert!(put.status().is_success());
    Ok(upload["upload_key"].as_str().unwrap().to_string())
}

#[tokio::test]
async fn a_batch_of_1000_mixed_lines_answers_every_line_once() {
    let mut cluster = Cluster::start(&[]).await.unwrap();
    let _worker = cluster.spawn_worker(&[]).unwrap();
    let clip = upload_clip(&cluster).await.unwrap();

    // What each line should come to: the answer's check, or the error code.
    let mut lines = Vec::new();
    let mut expect: HashMap<String, &str> = HashMap::new();
    let mut add = |id: String, url: &str, body: Value, outcome: &'static str, lines: &mut Vec<Value>| {
        lines.push(line(&id, url, body));
        expect.insert(id, outcome);
    };
    for i in 0..890 {
        let body = if i % 3 == 0 {
            json!({ "model": "m", "input": [format!("sentence {i}"), "and another"], "encoding_format": "base64" })
        } else {
            json!({ "model": "m", "input": format!("The tide came in at {i} past nine.") })
        };
        add(format!("embed-{i}"), "/v1/embeddings", body, "embedding", &mut lines);
    }
    for i in 0..40 {
        let body = json!({ "model": "m", "max_tokens": 3, "temperature": 0, "messages": [{ "role": "user", "content": format!("Count to {i}.") }] });
        add(format!("chat-{i}"), "/v1/chat/completions", body, "chat", &mut lines);
    }
    for i in 0..10 {
        add(format!("text-{i}"), "/v1/completions", json!({ "model": "m", "max_tokens": 2, "prompt": format!("{i} and") }), "text", &mut lines);
    }
    for (i, format) in ["json", "srt", "verbose_json", "text"].iter().enumerate() {
        let body = json!({ "model": "whisper-1", "file": clip, "response_format": format });
        add(format!("audio-{i}"), "/v1/audio/transcriptions", body, "transcript", &mut lines);
    }
    add("translate-0".into(), "/v1/audio/translations", json!({ "model": "whisper-1", "file": clip }), "transcript", &mut lines);
    // Refused before they run: bad bodies, what tern cannot honour, a missing upload.
    for i in 0..15 {
        add(format!("bad-input-{i}"), "/v1/embeddings", json!({ "input": 5 }), "invalid_request", &mut lines);
    }
    for i in 0..10 {
        add(format!("n2-{i}"), "/v1/chat/completions", json!({ "n": 2, "messages": [{ "role": "user", "content": "hi" }] }), "unsupported_parameter", &mut lines);
    }
    for i in 0..5 {
        add(format!("stream-{i}"), "/v1/completions", json!({ "prompt": "a", "stream": true }), "unsupported_parameter", &mut lines);
    }
    // A NUL, which Postgres cannot store: that line refused as POST /v1/jobs refuses it, the
    // rest run (it once failed the runner's insert as an outage, and stalled the batch).
    for i in 0..10 {
        add(format!("nul-{i}"), "/v1/embeddings", json!({ "input": format!("tide\u{0} {i}") }), "invalid_character", &mut lines);
    }
    for i in 0..5 {
        add(format!("no-upload-{i}"), "/v1/audio/transcriptions", json!({ "file": "uploads/default/none" }), "upload_not_found", &mut lines);
    }
    // Refused after its job ran: the model cannot give 7 dimensions.
    for i in 0..10 {
        add(format!("dims-{i}"), "/v1/embeddings", json!({ "input": "hello", "dimensions": 7 }), "dimensions_unsupported", &mut lines);
    }
    assert_eq!(lines.len(), 1000);

    let file = upload(&cluster, &lines).await.unwrap();
    let (_, meta) = cluster.get(&format!("/v1/files/{file}")).await.unwrap();
    assert_eq!(meta["purpose"], "batch");
    let batch = create_batch(&cluster, &file, "/v1/embeddings").await.unwrap();
    let id = batch["id"].as_str().unwrap().to_string();
    let started = Instant::now();
    let done = wait_for(&cluster, &id, "completed", Duration::from_secs(600)).await.unwrap();
    println!("1,000 lines in {:.1}s: {}", started.elapsed().as_secs_f64(), done["request_counts"]);
    let refused = expect.values().filter(|o| !["embedding", "chat", "text", "transcript"].contains(o)).count() as i64;
    assert_eq!(done["request_counts"], json!({ "total": 1000, "completed": 1000 - refused, "failed": refused }), "{done}");
    for field in ["in_progress_at", "finalizing_at", "completed_at"] {
        assert!(done[field].as_i64().is_some(), "{field}: {done}");
    }

    let outputs = lines_of(&cluster, &done["output_file_id"]).await.unwrap();
    let errors = lines_of(&cluster, &done["error_file_id"]).await.unwrap();
    assert_eq!(outputs.len() + errors.len(), 1000, "every line answered once");
    for (custom_id, outcome) in &expect {
        let (answer, in_errors) = match (outputs.get(custom_id), errors.get(custom_id)) {
            (Some(a), None) => (a, false),
            (None, Some(e)) => (e, true),
            other => panic!("{custom_id}: {other:?}"),
        };
        let body = &answer["response"]["body"];
        match *outcome {
            "embedding" => {
                assert!(!in_errors, "{answer}");
                assert_eq!(answer["response"]["status_code"], 200);
                let first = &body["data"][0]["embedding"];
                assert!(first.as_array().is_some_and(|v| v.len() == 384) || first.as_str().is_some_and(|b| b.len() == 2048), "{answer}");
            }
            "chat" => assert!(body["choices"][0]["message"]["content"].is_string() && body["object"] == "chat.completion", "{answer}"),
            "text" => assert!(body["choices"][0]["text"].is_string() && body["object"] == "text_completion", "{answer}"),
            "transcript" => {
                let text = body.as_str().map(str::to_string).unwrap_or_else(|| body["text"].as_str().unwrap_or_default().to_string());
                assert!(text.to_lowercase().contains("consider"), "{custom_id}: {answer}");
                if custom_id == "audio-1" {
                    assert!(text.contains("-->"), "srt: {answer}");
                }
                if custom_id == "audio-2" {
                    assert!(body["segments"].as_array().is_some_and(|s| !s.is_empty()), "verbose_json: {answer}");
                }
            }
            code => {
                assert!(in_errors, "{custom_id} should have failed: {answer}");
                assert_eq!(body["error"]["code"], code, "{custom_id}: {answer}");
                assert!(answer["response"]["status_code"].as_u64().is_some_and(|s| (400..500).contains(&s)), "{answer}");
            }
        }
    }

    // Each line that became a job did once, at the batch's priority, keyed by its custom id.
    let jobs: Vec<(String, String, String)> = sqlx::query_as(
        "SELECT idempotency_key, priority, state FROM jobs WHERE metadata->>'batch_id' = $1",
    )
    .bind(&id)
    .fetch_all(&cluster.pg)
    .await
    .unwrap();
    assert_eq!(jobs.len(), 1000 - 45, "lines refused before they ran made no job");
    assert!(jobs.iter().all(|(key, priority, state)| key.starts_with(&format!("{id}/")) && priority == "low" && state == "succeeded"));

    // The files and batches list; the input file cannot go while a batch reads it, can after.
    let (_, listed) = cluster.get("/v1/batches?limit=5").await.unwrap();
    assert_eq!(listed["data"][0]["id"], id.as_str());
    let (_, files) = cluster.get("/v1/files?purpose=batch_output").await.unwrap();
    assert_eq!(files["data"].as_array().unwrap().len(), 2, "{files}");
    let deleted: Value = cluster.http.delete(cluster.url(&format!("/v1/files/{file}"))).send().await.unwrap().json().await.unwrap();
    assert_eq!(deleted["deleted"], true, "{deleted}");
    let (status, _) = cluster.get(&format!("/v1/files/{file}")).await.unwrap();
    assert_eq!(status, 404);
}

#[tokio::test]
async fn a_batch_goes_on_through_a_restart_and_a_full_queue_and_cancels_and_expires() {
    // A queue of 60 embed jobs at most, and claims that lapse quickly after a crash.
    let mut cluster = Cluster::start(&[("TERN_MAX_QUEUED", "60"), ("TERN_BATCH_CLAIM_MS", "2000")]).await.unwrap();
    let lines: Vec<Value> =
        (0..300).map(|i| line(&format!("r{i}"), "/v1/embeddings", json!({ "input": format!("line {i}") }))).collect();
    let file = upload(&cluster, &lines).await.unwrap();
    let batch = create_batch(&cluster, &file, "/v1/embeddings").await.unwrap();
    let id = batch["id"].as_str().unwrap().to_string();

    // No worker yet: the batch fills the queue and waits.
    let queued = |cluster: &Cluster| {
        let pg = cluster.pg.clone();
        let id = id.clone();
        async move {
            let n: i64 = sqlx::query_scalar("SELECT count(*) FROM jobs WHERE metadata->>'batch_id' = $1").bind(&id).fetch_one(&pg).await?;
            Ok::<_, anyhow::Error>(n)
        }
    };
    cluster.wait_until("the queue to fill", Duration::from_secs(30), || async { Ok(queued(&cluster).await? >= 60) }).await.unwrap();
    tokio::time::sleep(Duration::from_secs(1)).await;
    assert_eq!(queued(&cluster).await.unwrap(), 60, "the batch waits while the queue is full");
    let (_, waiting) = cluster.get(&format!("/v1/batches/{id}")).await.unwrap();
    assert_eq!(waiting["status"], "in_progress");
    assert_eq!(waiting["request_counts"]["completed"], 0);

    // The API dies mid-file and comes back; a worker drains the queue.
    cluster.api.as_mut().unwrap().kill9();
    cluster.start_api().await.unwrap();
    let _worker = cluster.spawn_worker(&[]).unwrap();
    let done = wait_for(&cluster, &id, "completed", Duration::from_secs(300)).await.unwrap();
    assert_eq!(done["request_counts"], json!({ "total": 300, "completed": 300, "failed": 0 }), "{done}");
    let outputs = lines_of(&cluster, &done["output_file_id"]).await.unwrap();
    assert_eq!(outputs.len(), 300);
    assert!(done["error_file_id"].is_null());
    assert_eq!(queued(&cluster).await.unwrap(), 300, "no line was made a job twice");

    // Canceled: a batch whose jobs cannot run (the embed queue is paused) winds down.
    let (status, _) = cluster.post("/v1/admin/queues/embed/pause", &json!({})).await.unwrap();
    assert_eq!(status, 200);
    let file = upload(&cluster, &lines[..50]).await.unwrap();
    let canceled = create_batch(&cluster, &file, "/v1/embeddings").await.unwrap();
    let cid = canceled["id"].as_str().unwrap().to_string();
    wait_for(&cluster, &cid, "in_progress", Duration::from_secs(30)).await.unwrap();
    let (status, cancelling) = cluster.post(&format!("/v1/batches/{cid}/cancel"), &json!({})).await.unwrap();
    assert_eq!(status, 200, "{cancelling}");
    assert!(cancelling["status"] == "cancelling" || cancelling["status"] == "cancelled", "{cancelling}");
    let ended = wait_for(&cluster, &cid, "cancelled", Duration::from_secs(60)).await.unwrap();
    assert_eq!(ended["request_counts"], json!({ "total": 50, "completed": 0, "failed": 50 }), "{ended}");
    let errors = lines_of(&cluster, &ended["error_file_id"]).await.unwrap();
    assert_eq!(errors.len(), 50);
    assert!(errors.values().all(|e| e["error"]["code"] == "batch_cancelled"), "{errors:?}");
    let (status, again) = cluster.post(&format!("/v1/batches/{cid}/cancel"), &json!({})).await.unwrap();
    assert_eq!((status, again["error"]["code"].as_str()), (409, Some("batch_finished")));

    // Expired: its window passes (set in the past here) with its jobs waiting.
    let expiring = create_batch(&cluster, &file, "/v1/embeddings").await.unwrap();
    let eid = expiring["id"].as_str().unwrap().to_string();
    wait_for(&cluster, &eid, "in_progress", Duration::from_secs(30)).await.unwrap();
    sqlx::query("UPDATE batches SET expires_at = now() WHERE id = $1").bind(&eid).execute(&cluster.pg).await.unwrap();
    let ended = wait_for(&cluster, &eid, "expired", Duration::from_secs(60)).await.unwrap();
    let errors = lines_of(&cluster, &ended["error_file_id"]).await.unwrap();
    assert_eq!(errors.len(), 50);
    assert!(errors.values().all(|e| e["error"]["code"] == "batch_expired"), "{errors:?}");
    let left: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM jobs WHERE metadata->>'batch_id' IN ($1, $2) AND state <> 'canceled'",
    )
    .bind(&cid)
    .bind(&eid)
    .fetch_one(&cluster.pg)
    .await
    .unwrap();
    assert_eq!(left, 0, "the canceled and expired batches' jobs are canceled");
}

#[tokio::test]
async fn bad_files_and_requests_get_clear_errors() {
    let cluster = Cluster::start(&[]).await.unwrap();
    // A file whose lines are wrong fails validation, each error with its line.
    let file = {
        let body = "{\"custom_id\": \"a\", \"method\": \"POST\", \"url\": \"/v1/embeddings\", \"body\": {\"input\": \"x\"}}\nnot json\n";
        let form = reqwest::multipart::Form::new()
            .text("purpose", "batch")
            .part("file", reqwest::multipart::Part::bytes(body.as_bytes().to_vec()).file_name("bad.jsonl"));
        let v: Value = cluster.http.post(cluster.url("/v1/files")).multipart(form).send().await.unwrap().json().await.unwrap();
        v["id"].as_str().unwrap().to_string()
    };
    let batch = create_batch(&cluster, &file, "/v1/embeddings").await.unwrap();
    let failed = wait_for(&cluster, batch["id"].as_str().unwrap(), "failed", Duration::from_secs(30)).await.unwrap();
    assert_eq!(failed["errors"]["data"][0]["code"], "invalid_json_line", "{failed}");
    assert_eq!(failed["errors"]["data"][0]["line"], 2, "{failed}");

    let refusals = [
        (json!({ "input_file_id": file, "endpoint": "/v1/moderations", "completion_window": "24h" }), 400, "invalid_endpoint"),
        (json!({ "input_file_id": file, "endpoint": "/v1/embeddings", "completion_window": "2d" }), 400, "invalid_completion_window"),
        (json!({ "input_file_id": "file-nope", "endpoint": "/v1/embeddings", "completion_window": "24h" }), 404, "file_not_found"),
        (json!({ "endpoint": "/v1/embeddings", "completion_window": "24h" }), 400, "missing_required_parameter"),
    ];
    for (body, status, code) in refusals {
        let (got, answer) = cluster.post("/v1/batches", &body).await.unwrap();
        assert_eq!((got, answer["error"]["code"].as_str()), (status, Some(code)), "{body}: {answer}");
        assert!(answer["error"]["message"].is_string() && answer["error"]["type"] == "invalid_request_error", "{answer}");
    }
    let form = reqwest::multipart::Form::new().text("purpose", "fine-tune").part("file", reqwest::multipart::Part::bytes(b"{}".to_vec()));
    let resp = cluster.http.post(cluster.url("/v1/files")).multipart(form).send().await.unwrap();
    assert_eq!(resp.status(), 400);
    assert_eq!(resp.json::<Value>().await.unwrap()["error"]["code"], "invalid_purpose");
    // Another tenant sees none of it.
    let other = cluster.client_for(&cluster.create_key("other", "jobs:write,jobs:read").unwrap()).unwrap();
    let resp = other.get(cluster.url(&format!("/v1/files/{file}/content"))).send().await.unwrap();
    assert_eq!(resp.status(), 404);
    let resp = other.get(cluster.url(&format!("/v1/batches/{}", batch["id"].as_str().unwrap()))).send().await.unwrap();
    assert_eq!(resp.status(), 404);
}

/// The API's peak resident memory so far (`VmHWM`), in bytes.
fn peak_rss(pid: u32) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    let kb: u64 = status.lines().find_map(|l| l.strip_prefix("VmHWM:")).and_then(|v| v.trim().trim_end_matches(" kB").trim().parse().ok()).unwrap();
    kb * 1024
}

/// A batch whose answers are large (96 lines of 256 embeddings each, ~190 MB of output) is
/// finalized as a stream: the API holds a few outputs at a time, not the page's, so its peak
/// memory stays under a bound (160 MB) that does not grow with the batch, below the output
/// file's size.
#[tokio::test]
async fn a_batch_of_large_outputs_is_finalized_a_few_outputs_at_a_time() {
    const LINES: usize = 96;
    const TEXTS: usize = 256;
    let mut cluster = Cluster::start(&[]).await.unwrap();
    let _worker = cluster.spawn_worker(&[("TERN_WORKER_KINDS", "embed")]).unwrap();
    let pid = cluster.api.as_ref().unwrap().pid();
    let lines: Vec<Value> = (0..LINES)
        .map(|l| {
            let input: Vec<String> = (0..TEXTS).map(|t| format!("line {l}, text {t}: the tide came in")).collect();
            line(&format!("big-{l}"), "/v1/embeddings", json!({ "model": "m", "input": input }))
        })
        .collect();
    let file = upload(&cluster, &lines).await.unwrap();
    let before = peak_rss(pid);
    let batch = create_batch(&cluster, &file, "/v1/embeddings").await.unwrap();
    let done = wait_for(&cluster, batch["id"].as_str().unwrap(), "completed", Duration::from_secs(900)).await.unwrap();
    assert_eq!(done["request_counts"], json!({ "total": LINES, "completed": LINES, "failed": 0 }), "{done}");
    let grown = peak_rss(pid).saturating_sub(before);

    let resp = cluster.http.get(cluster.url(&format!("/v1/files/{}/content", done["output_file_id"].as_str().unwrap()))).send().await.unwrap();
    let text = resp.text().await.unwrap();
    let answers: Vec<Value> = text.lines().map(|l| serde_json::from_str(l).unwrap()).collect();
    assert_eq!(answers.len(), LINES);
    assert!(answers.iter().all(|a| a["response"]["body"]["data"].as_array().map(Vec::len) == Some(TEXTS)), "every line answered whole");
    println!("output file {} MB; the API's peak memory grew {} MB over the batch", text.len() >> 20, grown >> 20);
    // A bound that does not grow with the batch: the page's outputs held whole, parsed, would
    // take several times the file's 190 MB; seen here: 92 MB (112 MB with 48 lines of 512).
    assert!(grown < 160 << 20, "peak memory grew {} MB for an output file of {} MB", grown >> 20, text.len() >> 20);
}
