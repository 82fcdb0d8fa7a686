//! Text generation through the whole service: API, queue, worker (SmolLM2 GGUF on candle), S3.

use serde_json::{json, Value};
use std::time::{Duration, Instant};
use tern_e2e::Cluster;
use uuid::Uuid;

async fn finished(cluster: &Cluster, id: Uuid) -> Value {
    let (_, job) = cluster.get(&format!("/v1/jobs/{id}")).await.unwrap();
    assert_eq!(job["state"], "succeeded", "{job}");
    let stored: Value = reqwest::get(job["output"]["url"].as_str().unwrap()).await.unwrap().json().await.unwrap();
    tern_jobs::schemas::validate_output(tern_jobs::JobKind::Generate, &stored).unwrap();
    assert_eq!(job["output"]["inline"], stored, "the inline copy is the stored output");
    stored
}

fn chat(question: &str) -> Value {
    json!([{"role": "user", "content": question}])
}

#[tokio::test]
async fn generation_is_deterministic_and_stops_where_asked() {
    let mut cluster = Cluster::start(&[]).await.unwrap();
    let story = chat("Write a short story about a lighthouse keeper.");
    let jobs = vec![
        // 0, 1: same seed, sampled: the same text.
        json!({"kind": "generate", "input": {"messages": story, "temperature": 0.8, "seed": 7, "max_tokens": 40}}),
        json!({"kind": "generate", "input": {"messages": story, "temperature": 0.8, "seed": 7, "max_tokens": 40}}),
        // 2: greedy answer that ends at <|im_end|>.
        json!({"kind": "generate", "input": {"messages": chat("What is the capital of France? Answer with one word."), "temperature": 0, "max_tokens": 64}}),
        // 3: max_tokens.
        json!({"kind": "generate", "input": {"messages": story, "temperature": 0, "max_tokens": 5}}),
        // 4: the greedy answer of 2, cut at a stop sequence.
        json!({"kind": "generate", "input": {"messages": chat("What is the capital of France? Answer with one word."), "temperature": 0, "max_tokens": 64, "stop": ["Paris"]}}),
        // 5: a raw prompt.
        json!({"kind": "generate", "input": {"prompt": "1, 2, 3, 4,", "temperature": 0, "max_tokens": 8}}),
    ];
    let ids = cluster.submit_all(&jobs).await.unwrap();
    let _w = cluster.spawn_worker(&[]).unwrap();
    let counts = cluster.wait_terminal(&ids, Duration::from_secs(180)).await.unwrap();
    assert_eq!(counts.get("succeeded"), Some(&(ids.len() as i64)), "{counts:?}");
    let mut out = Vec::new();
    for id in &ids {
        out.push(finished(&cluster, *id).await);
    }
    println!("{out:#?}");
    assert_eq!(out[0]["text"], out[1]["text"], "same seed, same text");
    assert!(!out[0]["text"].as_str().unwrap().is_empty());

    let answer = out[2]["text"].as_str().unwrap();
    assert!(answer.contains("Paris"), "{answer}");
    assert_eq!(out[2]["finish_reason"], "stop", "ends at <|im_end|>");
    assert!(out[2]["usage"]["completion_tokens"].as_u64().unwrap() < 64);
    assert!(out[2]["usage"]["prompt_tokens"].as_u64().unwrap() > 5);

    assert_eq!(out[3]["finish_reason"], "length");
    assert_eq!(out[3]["usage"]["completion_tokens"], 5);

    let cut = out[4]["text"].as_str().unwrap();
    assert_eq!(out[4]["finish_reason"], "stop");
    assert!(!cut.contains("Paris"), "the stop sequence is not in the text: {cut}");
    assert!(answer.starts_with(cut), "the text before the stop sequence: {cut:?} vs {answer:?}");

    assert!(out[5]["text"].as_str().unwrap().contains('5'), "{}", out[5]["text"]);

    // The six were pulled as one batch and decoded together (on the CPU); the same request
    // alone, in a batch of its own, gives the same text.
    let alone = cluster.submit_all(&jobs[..1]).await.unwrap();
    let counts = cluster.wait_terminal(&alone, Duration::from_secs(120)).await.unwrap();
    assert_eq!(counts.get("succeeded"), Some(&1), "{counts:?}");
    let alone = finished(&cluster, alone[0]).await;
    assert_eq!(alone["text"], out[0]["text"], "decoded alone and in a batch of six");
}

#[tokio::test]
async fn partial_text_shows_while_generating_and_oversized_requests_fail_cleanly() {
    let mut cluster = Cluster::start(&[]).await.unwrap();
    let (status, job) = cluster
        .post(
            "/v1/jobs",
            &json!({"kind": "generate", "input": {"prompt": "Here is a long list of fruits, one per line:\n", "temperature": 0, "max_tokens": 300}}),
        )
        .await
        .unwrap();
    assert_eq!(status, 201, "{job}");
    assert_eq!(job["cost"].as_i64().unwrap(), 300 + 12, "prompt tokens (estimated) + max_tokens");
    let id: Uuid = job["id"].as_str().unwrap().parse().unwrap();
    // The prompt alone overflows the context (digits are one token each).
    let (status, job) = cluster
        .post("/v1/jobs", &json!({"kind": "generate", "input": {"prompt": "7".repeat(30_000), "max_tokens": 2048}}))
        .await
        .unwrap();
    assert_eq!(status, 201, "{job}");
    let too_big: Uuid = job["id"].as_str().unwrap().parse().unwrap();
    let (status, err) = cluster.post("/v1/jobs", &json!({"kind": "generate", "input": {"max_tokens": 5}})).await.unwrap();
    assert_eq!((status, err["error"]["code"].as_str()), (422, Some("invalid_input")), "{err}");

    let _w = cluster.spawn_worker(&[]).unwrap();
    let started = Instant::now();
    let mut partial = None;
    while started.elapsed() < Duration::from_secs(120) {
        let (_, job) = cluster.get(&format!("/v1/jobs/{id}")).await.unwrap();
        if job["state"] == "running" {
            if let Some(text) = job["progress"]["text"].as_str().filter(|t| !t.is_empty()) {
                partial = Some((text.to_string(), job["progress"]["done"].as_u64().unwrap()));
                break;
            }
        }
        assert_ne!(job["state"], "succeeded", "finished before any partial text was seen");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let (partial, done) = partial.expect("partial text while running");
    assert!(done > 0 && done < 300, "{done}");
    cluster.wait_terminal(&[id, too_big], Duration::from_secs(180)).await.unwrap();
    let out = finished(&cluster, id).await;
    assert!(out["text"].as_str().unwrap().starts_with(&partial), "the partial text is a prefix of the result");

    let (_, job) = cluster.get(&format!("/v1/jobs/{too_big}")).await.unwrap();
    assert_eq!(job["state"], "failed", "{job}");
    assert_eq!(job["error"]["code"], "context_length_exceeded", "{job}");
    assert_eq!(job["attempts"], 1, "not retried: {job}");
}

#[tokio::test]
async fn a_short_job_submitted_while_a_long_one_decodes_joins_it_and_finishes_first() {
    let mut cluster = Cluster::start(&[]).await.unwrap();
    let worker = cluster.spawn_worker(&[("TERN_WORKER_KINDS", "generate"), ("TERN_LOG", "info")]).unwrap();
    let long = json!({"kind": "generate", "input": {"prompt": "Counting up by one: 1, 2, 3, 4, 5, 6, 7, 8, 9, 10,", "temperature": 0, "max_tokens": 300}});
    let long_id = cluster.submit_all(&[long]).await.unwrap()[0];
    // Wait until it decodes.
    let started = Instant::now();
    loop {
        let (_, job) = cluster.get(&format!("/v1/jobs/{long_id}")).await.unwrap();
        if job["progress"]["done"].as_u64().unwrap_or(0) >= 5 {
            break;
        }
        assert!(started.elapsed() < Duration::from_secs(120), "the long job never started: {job}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let short = json!({"kind": "generate", "input": {"messages": chat("What is the capital of France? Answer with one word."), "temperature": 0, "max_tokens": 8}});
    let short_id = cluster.submit_all(&[short]).await.unwrap()[0];
    cluster.wait_terminal(&[long_id, short_id], Duration::from_secs(180)).await.unwrap();
    let long_out = finished(&cluster, long_id).await;
    assert_eq!(long_out["finish_reason"], "length", "the long job must outlast the short one: {long_out}");
    finished(&cluster, short_id).await;
    let (long_end, short_end): (chrono::DateTime<chrono::Utc>, chrono::DateTime<chrono::Utc>) = sqlx::query_as(
        "SELECT (SELECT finished_at FROM jobs WHERE id = $1), (SELECT finished_at FROM jobs WHERE id = $2)",
    )
    .bind(long_id)
    .bind(short_id)
    .fetch_one(&cluster.pg)
    .await
    .unwrap();
    // With static batches the short job would wait for the long one's batch to end.
    assert!(short_end < long_end, "the short job finished at {short_end}, after the long one at {long_end}");
    assert!(worker.log_text().contains("joined_late=1"), "the worker's log shows the late join");
}

/// Gemma 3 270M (another architecture, a SentencePiece vocabulary, its own chat template)
/// through the whole service: a generate job, a chat completion rendered with Gemma's
/// template, and a conversation the template refuses, failed with its code and not retried.
#[tokio::test]
async fn gemma_serves_generate_jobs_and_chat_completions() {
    let mut cluster = Cluster::start(&[]).await.unwrap();
    let _worker = cluster.spawn_worker(&[("TERN_WORKER_KINDS", "generate"), ("TERN_LLM_MODEL", "gemma-3-270m")]).unwrap();
    let jobs = [
        json!({"kind": "generate", "input": {"prompt": "Question: What is the capital of France?\nAnswer:", "temperature": 0, "max_tokens": 4}}),
        // Gemma's template wants user and assistant turns in turn.
        json!({"kind": "generate", "input": {"messages": [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}], "max_tokens": 4}}),
    ];
    let ids = cluster.submit_all(&jobs).await.unwrap();
    cluster.wait_terminal(&ids, Duration::from_secs(180)).await.unwrap();
    let out = finished(&cluster, ids[0]).await;
    assert!(out["text"].as_str().unwrap().contains("Paris"), "{out}");
    assert_eq!(out["model"], "gemma-3-270m", "{out}");
    let (_, refused) = cluster.get(&format!("/v1/jobs/{}", ids[1])).await.unwrap();
    assert_eq!(refused["state"], "failed", "{refused}");
    assert_eq!(refused["error"]["code"], "invalid_messages", "{refused}");
    assert_eq!(refused["attempts"], 1, "not retried: {refused}");

    let body = json!({
        "model": "gemma-3-270m", "max_tokens": 6, "temperature": 0,
        "messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2 + 2?"}],
    });
    let (status, reply) = cluster.post("/v1/chat/completions", &body).await.unwrap();
    assert_eq!(status, 200, "{reply}");
    assert!(reply["choices"][0]["message"]["content"].is_string(), "{reply}");
    // <bos><start_of_turn>user\nBe brief.\n\nWhat is 2 + 2?<end_of_turn>\n<start_of_turn>model\n
    let prompt_tokens = reply["usage"]["prompt_tokens"].as_u64().unwrap();
    assert!((18..=24).contains(&prompt_tokens), "{reply}");
}
