//! OpenAI's official Python SDK (PyPI, `scripts/services.sh openai`) against tern's
//! OpenAI-compatible routes, unchanged: models, transcriptions in every `response_format` and
//! streamed, a recording over 30 minutes, translations, embeddings as floats and base64, chat
//! and text completions plain and streamed, and errors in OpenAI's shape
//! (`tests/openai/sdk_check.py` holds the checks); the Batch API through the SDK; LangChain's
//! OpenAI client (chat, streamed chat, embeddings); image generation as URLs and base64. Each
//! request is a job through the queue, and a client that hangs up cancels its job.

use serde_json::{json, Value};
use std::path::PathBuf;
use std::process::Command;
use std::time::{Duration, Instant};
use tern_e2e::Cluster;

/// The SDK's Python: `TERN_OPENAI_PYTHON`, else where `scripts/services.sh openai` installs it.
fn python() -> PathBuf {
    if let Some(path) = std::env::var_os("TERN_OPENAI_PYTHON") {
        return path.into();
    }
    tern_e2e::state_dir().join("openai/venv/bin/python")
}

fn run_checks(cluster: &Cluster, phase: &str) {
    let python = python();
    assert!(python.exists(), "{} is missing: run scripts/services.sh openai", python.display());
    let script = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("openai/sdk_check.py");
    let librivox = tern_e2e::models_dir().join("testdata/librivox");
    let output = Command::new(&python)
        .arg(&script)
        .args([phase, &cluster.url(""), &cluster.api_key])
        .arg(&librivox)
        .output()
        .unwrap();
    let text = format!("{}{}", String::from_utf8_lossy(&output.stdout), String::from_utf8_lossy(&output.stderr));
    println!("{text}");
    assert!(output.status.success(), "the SDK's {phase} checks failed:\n{text}");
    assert!(text.contains("all checks passed"), "{text}");
}

/// Tools through the SDK: SmolLM2 with Qwen2.5's published chat template beside its file
/// (`chat_template.jinja`; both speak ChatML), so the template shows the tools; a worker
/// whose template shows none fails such a job as `tools_unsupported`, a 400.
#[tokio::test]
async fn the_openai_sdk_calls_tools() {
    let mut cluster = Cluster::start(&[]).await.unwrap();
    let folder = tern_e2e::state_dir().join(format!("smollm2-with-tools-{}", std::process::id()));
    std::fs::create_dir_all(&folder).unwrap();
    let _ = std::fs::remove_file(folder.join("model.gguf"));
    std::os::unix::fs::symlink(tern_e2e::models_dir().join("smollm2-135m-instruct/model.gguf"), folder.join("model.gguf")).unwrap();
    let qwen = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../models/tests/fixtures/llm/templates/qwen2.5.jinja");
    std::fs::copy(qwen, folder.join("chat_template.jinja")).unwrap();
    let model = folder.display().to_string();
    let worker = cluster.spawn_worker(&[("TERN_WORKER_KINDS", "generate"), ("TERN_LLM_MODEL", model.as_str())]).unwrap();
    run_checks(&cluster, "tools");
    drop(worker);

    // SmolLM2's own template shows no tools.
    let _plain = cluster.spawn_worker(&[("TERN_WORKER_KINDS", "generate")]).unwrap();
    let body = json!({
        "model": "x", "max_tokens": 8,
        "messages": [{"role": "user", "content": "Weather in Paris?"}],
        "tools": [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}],
    });
    let (status, reply) = cluster.post("/v1/chat/completions", &body).await.unwrap();
    assert_eq!((status, reply["error"]["code"].as_str()), (400, Some("tools_unsupported")), "{reply}");
    std::fs::remove_dir_all(&folder).unwrap();
}

/// Images through the SDK, on the diffusion family's tiny random-weight pipeline.
#[tokio::test]
async fn the_openai_sdk_makes_images() {
    let mut cluster = Cluster::start(&[]).await.unwrap();
    let fixtures = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../models/tests/fixtures/diffusion");
    let models = fixtures.display().to_string();
    let _worker = cluster.spawn_worker(&[("TERN_WORKER_KINDS", "image"), ("TERN_MODELS_DIR", models.as_str()), ("TERN_IMAGE_MODEL", "sd-tiny")]).unwrap();
    run_checks(&cluster, "images");
    assert_eq!(jobs_by_kind(&cluster).await, json!({ "image": 2 }), "the refused requests made no job");
}

/// Jobs of each kind in this cluster's database.
async fn jobs_by_kind(cluster: &Cluster) -> Value {
    let rows: Vec<(String, i64)> =
        sqlx::query_as("SELECT kind, count(*) FROM jobs GROUP BY kind").fetch_all(&cluster.pg).await.unwrap();
    rows.into_iter().map(|(kind, n)| (kind, json!(n))).collect::<serde_json::Map<_, _>>().into()
}

#[tokio::test]
async fn the_openai_sdk_runs_against_tern_unchanged() {
    let mut cluster = Cluster::start(&[]).await.unwrap();
    // Greedy (the OpenAI routes take no beam size): the 31-minute recording below would take
    // several times longer with beams on 2 cores.
    let mut worker = cluster.spawn_worker(&[("TERN_WHISPER_BEAM_SIZE", "1")]).unwrap();
    run_checks(&cluster, "main");
    // Every request above was a job: 9 transcriptions (7 answered, 2 refused before any job),
    // 4 embeddings (one refused after its job ran), 4 chats and completions.
    let kinds = jobs_by_kind(&cluster).await;
    assert!(kinds["transcribe"].as_i64().unwrap() >= 7, "{kinds}");
    assert!(kinds["embed"].as_i64().unwrap() >= 4, "{kinds}");
    assert!(kinds["generate"].as_i64().unwrap() >= 4, "{kinds}");
    let failed: i64 = sqlx::query_scalar("SELECT count(*) FROM jobs WHERE state <> 'succeeded'").fetch_one(&cluster.pg).await.unwrap();
    assert_eq!(failed, 0, "every job the SDK's requests made succeeded");
    // The Batch API through the SDK: a batch run to its files, another canceled.
    run_checks(&cluster, "batch");
    // LangChain's OpenAI client, unchanged too.
    run_checks(&cluster, "langchain");

    // A client that hangs up cancels its job: a long streamed generation, dropped after its
    // first chunk.
    let response = cluster
        .http
        .post(cluster.url("/v1/chat/completions"))
        .json(&json!({
            "model": "x", "stream": true, "max_tokens": 2048, "temperature": 1.0, "seed": 1,
            "messages": [{"role": "user", "content": "Write a very long story about the sea."}],
        }))
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), 200);
    let id: uuid::Uuid = response.headers()["x-tern-job-id"].to_str().unwrap().parse().unwrap();
    let mut response = response;
    let first = response.chunk().await.unwrap().unwrap_or_default();
    assert!(String::from_utf8_lossy(&first).starts_with("data: "), "{first:?}");
    drop(response);
    let deadline = Instant::now() + Duration::from_secs(30);
    let state = loop {
        let (_, job) = cluster.get(&format!("/v1/jobs/{id}")).await.unwrap();
        if job["state"] != "running" && job["state"] != "queued" || Instant::now() > deadline {
            break job["state"].clone();
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    assert_eq!(state, "canceled", "the job of a client that left");

    // Translation needs a multilingual model.
    worker.kill9();
    let _base = cluster.spawn_worker(&[("TERN_WHISPER_MODEL", "whisper-base"), ("TERN_WORKER_KINDS", "transcribe"), ("TERN_WHISPER_BEAM_SIZE", "1")]).unwrap();
    run_checks(&cluster, "translate");
}
