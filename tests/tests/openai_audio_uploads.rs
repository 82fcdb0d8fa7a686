//! The OpenAI audio routes' uploads (`/v1/audio/transcriptions`, `/translations`,
//! `/embeddings`): the file streams into storage as it arrives, so concurrent uploads of the
//! largest size allowed hold a part each in the API's memory, not the file; a refused upload
//! leaves no object behind; a retry with the same `Idempotency-Key` gets the first job; form
//! errors answer in JSON with stable codes. No worker runs: the jobs only need to exist.

use anyhow::Result;
use reqwest::multipart::{Form, Part};
use serde_json::Value;
use std::time::Duration;
use tern_e2e::Cluster;

/// The API's peak resident memory so far (`VmHWM`), in bytes.
fn peak_rss(pid: u32) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    let kb: u64 = status.lines().find_map(|l| l.strip_prefix("VmHWM:")).and_then(|v| v.trim().trim_end_matches(" kB").trim().parse().ok()).unwrap();
    kb * 1024
}

async fn uploads_left(cluster: &Cluster) -> Vec<String> {
    cluster.objects.keys("uploads/").await.unwrap()
}

fn form(file: Vec<u8>, fields: &[(&str, &str)]) -> Form {
    let mut form = Form::new();
    for (name, value) in fields {
        form = form.text(name.to_string(), value.to_string());
    }
    form.part("file", Part::bytes(file).file_name("clip.wav"))
}

async fn post_form(cluster: &Cluster, path: &str, form: Form, idempotency_key: Option<&str>) -> Result<(u16, Option<String>, String, Value)> {
    let mut request = cluster.http.post(cluster.url(path)).multipart(form);
    if let Some(key) = idempotency_key {
        request = request.header("idempotency-key", key);
    }
    let resp = request.send().await?;
    let status = resp.status().as_u16();
    let job = resp.headers().get("x-tern-job-id").and_then(|v| v.to_str().ok()).map(str::to_string);
    let content_type = resp.headers().get("content-type").and_then(|v| v.to_str().ok()).unwrap_or_default().to_string();
    // A stream's body is read no further: the job header is what the test needs.
    let body = if content_type.starts_with("text/event-stream") { Value::Null } else { resp.json().await.unwrap_or(Value::Null) };
    Ok((status, job, content_type, body))
}

/// Six uploads of 160 MiB at once (960 MiB), unreadable as audio so each is refused once
/// stored: every one answers 422 `audio_unreadable`, the API's peak memory grows by less than
/// 40 MiB an upload whatever its size (an 8 MiB part being filled while the last is sent, the
/// S3 client's and the allocator's buffers: ~28 MiB measured), and no object stays. Read
/// whole, as before, the uploads took the API past 960 MiB.
#[tokio::test]
async fn concurrent_maximum_size_uploads_stream_to_storage_and_refused_ones_leave_nothing() {
    const UPLOAD: usize = 160 << 20;
    const AT_ONCE: usize = 6;
    const PER_UPLOAD_BOUND: u64 = 40 << 20;
    let cluster = Cluster::start(&[("TERN_MAX_AUDIO_UPLOAD_BYTES", &(UPLOAD + (1 << 20)).to_string())]).await.unwrap();
    let pid = cluster.api.as_ref().unwrap().pid();
    let before = peak_rss(pid);
    // Bytes no decoder reads as audio.
    let noise: Vec<u8> = (0..UPLOAD).map(|i| (i as u32).wrapping_mul(2_654_435_761).to_le_bytes()[3]).collect();
    let answers = futures::future::join_all((0..AT_ONCE).map(|_| {
        let form = form(noise.clone(), &[("model", "whisper-1")]);
        let request = cluster.http.post(cluster.url("/v1/audio/transcriptions")).timeout(Duration::from_secs(300)).multipart(form);
        async move {
            let resp = request.send().await.unwrap();
            (resp.status().as_u16(), resp.json::<Value>().await.unwrap())
        }
    }))
    .await;
    for (status, body) in &answers {
        assert_eq!(*status, 422, "{body}");
        assert_eq!(body["error"]["code"], "audio_unreadable", "{body}");
    }
    let grown = peak_rss(pid).saturating_sub(before);
    println!("{AT_ONCE} uploads of {} MiB at once: the API's peak memory grew {} MiB", UPLOAD >> 20, grown >> 20);
    assert!(grown < AT_ONCE as u64 * PER_UPLOAD_BOUND, "peak memory grew {} MiB for {AT_ONCE} uploads", grown >> 20);
    assert_eq!(uploads_left(&cluster).await, Vec::<String>::new(), "refused uploads leave no object");
}

/// A retry of the same form with the same `Idempotency-Key` gets the first job (200, not 409)
/// and leaves one upload, the first job's; another file under that key is 409. NUL in a text
/// field is 400 `invalid_character`, and a body that is no multipart form a JSON 400, on every
/// audio route.
#[tokio::test]
async fn retries_replay_by_content_and_form_errors_answer_in_json() {
    let cluster = Cluster::start(&[]).await.unwrap();
    let clip = std::fs::read(tern_e2e::models_dir().join("testdata/phrases/goforward.wav")).unwrap();
    // A stream answers at once with its job; the job need not run.
    let fields = [("model", "whisper-1"), ("stream", "true")];
    let (status, first, _, body) = post_form(&cluster, "/v1/audio/transcriptions", form(clip.clone(), &fields), Some("retry-1")).await.unwrap();
    assert_eq!(status, 200, "{body}");
    let (status, again, _, body) = post_form(&cluster, "/v1/audio/transcriptions", form(clip.clone(), &fields), Some("retry-1")).await.unwrap();
    assert_eq!(status, 200, "a retry replays: {body}");
    assert_eq!(again, first, "the same job");
    let mut other = clip.clone();
    let last = other.len() - 1;
    other[last] ^= 1;
    let (status, _, _, body) = post_form(&cluster, "/v1/audio/transcriptions", form(other, &fields), Some("retry-1")).await.unwrap();
    assert_eq!(status, 409, "another file under the key: {body}");
    assert_eq!(body["error"]["code"], "idempotency_conflict", "{body}");
    let (status, _, _, body) = post_form(&cluster, "/v1/audio/embeddings", form(clip.clone(), &[]), Some("retry-1")).await.unwrap();
    assert_eq!(status, 409, "another request under the key: {body}");
    assert_eq!(uploads_left(&cluster).await.len(), 1, "the first job's upload alone stays");

    for path in ["/v1/audio/transcriptions", "/v1/audio/translations", "/v1/audio/embeddings"] {
        let (status, _, content_type, body) = post_form(&cluster, path, form(clip.clone(), &[("model", "whisper-1"), ("prompt", "Ann\0Bob")]), None).await.unwrap();
        assert_eq!((status, body["error"]["code"].as_str()), (400, Some("invalid_character")), "{path}: {body}");
        assert!(content_type.starts_with("application/json"), "{path}: {content_type}");
        let resp = cluster.http.post(cluster.url(path)).json(&serde_json::json!({ "file": "x" })).send().await.unwrap();
        let status = resp.status().as_u16();
        let content_type = resp.headers().get("content-type").and_then(|v| v.to_str().ok()).unwrap_or_default().to_string();
        let body: Value = resp.json().await.unwrap_or(Value::Null);
        assert!((400..500).contains(&status) && content_type.starts_with("application/json"), "{path}: {status} {content_type}");
        assert_eq!(body["error"]["code"], "invalid_multipart", "{path}: {body}");
    }
    assert_eq!(uploads_left(&cluster).await.len(), 1, "refused forms leave no upload");
}
