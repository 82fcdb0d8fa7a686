//! The HTTP API's contract: idempotency, stable error codes, cancel, files, listing, limits.

use base64::Engine;
use serde_json::{json, Value};
use sha2::{Digest, Sha256};
use std::time::Duration;
use tern_e2e::Cluster;
use uuid::Uuid;

async fn job_count(cluster: &Cluster) -> i64 {
    sqlx::query_scalar("SELECT count(*) FROM jobs").fetch_one(&cluster.pg).await.unwrap()
}

#[tokio::test]
async fn an_idempotency_key_replays_the_same_job_and_refuses_a_different_body() {
    let cluster = Cluster::start(&[]).await.unwrap();
    let body = json!({"kind": "echo", "input": {"message": "once"}});
    let send = |body: Value| {
        cluster.http.post(cluster.url("/v1/jobs")).header("Idempotency-Key", "order-42").json(&body).send()
    };
    let first = send(body.clone()).await.unwrap();
    assert_eq!(first.status(), 201);
    let first: Value = first.json().await.unwrap();
    let again = send(body.clone()).await.unwrap();
    assert_eq!(again.status(), 200);
    let again: Value = again.json().await.unwrap();
    assert_eq!(first["id"], again["id"]);
    let other = send(json!({"kind": "echo", "input": {"message": "twice"}})).await.unwrap();
    assert_eq!(other.status(), 409);
    let other: Value = other.json().await.unwrap();
    assert_eq!(other["error"]["code"], "idempotency_conflict");
    assert_eq!(job_count(&cluster).await, 1);
    assert_eq!(cluster.queue_len("echo", "ready").await.unwrap(), 1);
}

/// Issue 20, item 10: idempotency keys are scoped to the tenant (another tenant's use of a key
/// neither blocks nor reveals anything), and a batch whose jobs share a key with different
/// bodies commits none of its jobs.
#[tokio::test]
async fn idempotency_keys_are_per_tenant_and_a_conflicting_batch_commits_nothing() {
    let cluster = Cluster::start(&[]).await.unwrap();
    let a = cluster
        .client_for(
            &cluster
                .create_key("tenant-a", "jobs:write,jobs:read")
                .unwrap(),
        )
        .unwrap();
    let b = cluster
        .client_for(
            &cluster
                .create_key("tenant-b", "jobs:write,jobs:read")
                .unwrap(),
        )
        .unwrap();
    let submit = |client: &reqwest::Client, body: Value| {
        client
            .post(cluster.url("/v1/jobs"))
            .header("Idempotency-Key", "order-42")
            .json(&body)
            .send()
    };
    let from_a = submit(&a, json!({"kind": "echo", "input": {"message": "a"}}))
        .await
        .unwrap();
    assert_eq!(from_a.status(), 201);
    let from_a: Value = from_a.json().await.unwrap();
    let from_b = submit(&b, json!({"kind": "echo", "input": {"message": "b"}}))
        .await
        .unwrap();
    assert_eq!(from_b.status(), 201, "B's key is B's own");
    let from_b: Value = from_b.json().await.unwrap();
    assert_ne!(from_a["id"], from_b["id"]);
    let again = submit(&a, json!({"kind": "echo", "input": {"message": "a"}}))
        .await
        .unwrap();
    assert_eq!(again.status(), 200);
    assert_eq!(again.json::<Value>().await.unwrap()["id"], from_a["id"]);

    let before = job_count(&cluster).await;
    let batch = |jobs: Value| {
        a.post(cluster.url("/v1/jobs/batch"))
            .json(&json!({ "jobs": jobs }))
            .send()
    };
    let conflicting = batch(json!([
        {"kind": "echo", "input": {"message": "fresh"}},
        {"kind": "echo", "input": {"message": 1}, "idempotency_key": "dup"},
        {"kind": "echo", "input": {"message": 2}, "idempotency_key": "dup"},
    ]))
    .await
    .unwrap();
    assert_eq!(conflicting.status(), 409);
    assert_eq!(
        conflicting.json::<Value>().await.unwrap()["error"]["code"],
        "idempotency_conflict"
    );
    let reused = batch(json!([
        {"kind": "echo", "input": {"message": "fresh"}},
        {"kind": "echo", "input": {"message": "b"}, "idempotency_key": "order-42"},
    ]))
    .await
    .unwrap();
    assert_eq!(reused.status(), 409, "a key A used for another body");
    assert_eq!(
        job_count(&cluster).await,
        before,
        "neither batch committed a job"
    );

    let same = batch(json!([
        {"kind": "echo", "input": {"message": 1}, "idempotency_key": "twice"},
        {"kind": "echo", "input": {"message": 1}, "idempotency_key": "twice"},
    ]))
    .await
    .unwrap();
    assert_eq!(same.status(), 201);
    let same: Value = same.json().await.unwrap();
    assert_eq!(
        same["jobs"][0]["id"], same["jobs"][1]["id"],
        "the same request twice is one job"
    );
    assert_eq!(job_count(&cluster).await, before + 1);
}

#[tokio::test]
async fn bad_input_gets_a_4xx_with_a_stable_code_and_nothing_is_enqueued() {
    let cluster = Cluster::start(&[("TERN_MAX_BODY_BYTES", "65536")]).await.unwrap();
    let cases: Vec<(&str, Value, u16, &str)> = vec![
        ("unknown kind", json!({"kind": "paint", "input": {}}), 400, "unknown_kind"),
        ("missing kind", json!({"input": {}}), 400, "invalid_request"),
        ("invalid priority", json!({"kind": "echo", "priority": "asap", "input": {}}), 400, "invalid_priority"),
        ("priority not a string", json!({"kind": "echo", "priority": 1, "input": {}}), 400, "invalid_priority"),
        ("input failing its schema", json!({"kind": "echo", "input": {"sleep_ms": "long"}}), 422, "invalid_input"),
        ("unknown input field", json!({"kind": "echo", "input": {"colour": "red"}}), 422, "invalid_input"),
        ("missing input", json!({"kind": "echo"}), 422, "invalid_input"),
        ("bad base64", json!({"kind": "echo", "input": {"file": {"base64": "%%%not base64"}}}), 400, "invalid_base64"),
        ("non-http URL", json!({"kind": "echo", "input": {"file": {"url": "file:///etc/passwd"}}}), 422, "url_forbidden"),
        ("ftp URL", json!({"kind": "echo", "input": {"file": {"url": "ftp://example.com/a.wav"}}}), 422, "url_forbidden"),
        ("no scheme", json!({"kind": "echo", "input": {"file": {"url": "example.com/a.wav"}}}), 400, "invalid_url"),
        ("URL not in ASCII", json!({"kind": "echo", "input": {"file": {"url": "https://bücher.example/a.wav"}}}), 400, "invalid_url"),
        ("URL that does not parse", json!({"kind": "echo", "input": {"file": {"url": "http://a:99999/x"}}}), 400, "invalid_url"),
        ("webhook URL not in ASCII", json!({"kind": "echo", "input": {}, "webhook": {"url": "https://ü.example/"}}), 422, "invalid_webhook"),
        ("delay_ms not integral", json!({"kind": "echo", "input": {}, "delay_ms": 1.5}), 400, "invalid_request"),
        ("missing upload", json!({"kind": "echo", "input": {"file": {"upload_key": "uploads/nothing-here"}}}), 404, "upload_not_found"),
        ("unknown field", json!({"kind": "echo", "input": {}, "colour": "red"}), 400, "invalid_request"),
        ("bad max_attempts", json!({"kind": "echo", "input": {}, "max_attempts": 0}), 400, "invalid_request"),
        ("bad run_at", json!({"kind": "echo", "input": {}, "run_at": "tomorrow"}), 400, "invalid_request"),
        ("huge metadata", json!({"kind": "echo", "input": {}, "metadata": {"x": "y".repeat(17_000)}}), 400, "metadata_too_large"),
        ("oversized body", json!({"kind": "echo", "input": {"message": "z".repeat(70_000)}}), 413, "body_too_large"),
        ("not an object", json!([1, 2]), 400, "invalid_request"),
    ];
    for (what, body, status, code) in cases {
        let (got_status, got) = cluster.post("/v1/jobs", &body).await.unwrap();
        assert_eq!(got_status, status, "{what}: {got}");
        assert_eq!(got["error"]["code"], code, "{what}: {got}");
        assert!(got["error"]["message"].as_str().is_some_and(|m| !m.is_empty()), "{what}");
    }
    // Malformed JSON.
    let resp = cluster.http.post(cluster.url("/v1/jobs")).header("content-type", "application/json").body("{\"kind\": ").send().await.unwrap();
    assert_eq!(resp.status(), 400);
    let body: Value = resp.json().await.unwrap();
    assert_eq!(body["error"]["code"], "invalid_json");
    // A batch with one bad job is refused whole.
    let (status, body) = cluster
        .post("/v1/jobs/batch", &json!({"jobs": [{"kind": "echo", "input": {}}, {"kind": "echo", "priority": "soon", "input": {}}]}))
        .await
        .unwrap();
    assert_eq!(status, 400);
    assert_eq!(body["error"]["code"], "invalid_priority");
    assert!(body["error"]["message"].as_str().unwrap().starts_with("jobs[1]"));
    let (status, body) = cluster.post("/v1/jobs/batch", &json!({"jobs": []})).await.unwrap();
    assert_eq!((status, body["error"]["code"].as_str()), (400, Some("batch_too_large")));

    assert_eq!(job_count(&cluster).await, 0);
    assert_eq!(cluster.queue_len("echo", "ready").await.unwrap(), 0);
    // The API is still serving.
    let (status, _) = cluster.post("/v1/jobs", &json!({"kind": "echo", "input": {}})).await.unwrap();
    assert_eq!(status, 201);
    // JSON Schema counts 3.0 as an integer, and so does the API: options and input alike.
    let (status, job) = cluster
        .post("/v1/jobs", &json!({"kind": "echo", "input": {"sleep_ms": 5.0}, "max_attempts": 3.0, "delay_ms": 0.0}))
        .await
        .unwrap();
    assert_eq!(status, 201, "{job}");
    assert_eq!(job["max_attempts"], 3);
    assert_eq!(job["input"]["sleep_ms"], json!(5), "stored as an integer, for the worker's serde");
}

#[tokio::test]
async fn cancel_stops_a_queued_job_at_once_and_a_running_job_at_its_next_check() {
    let mut cluster = Cluster::start(&[]).await.unwrap();
    let (_, queued) = cluster.post("/v1/jobs", &json!({"kind": "echo", "input": {"message": "never"}})).await.unwrap();
    let queued_id = queued["id"].as_str().unwrap().to_string();
    let (status, canceled) = cluster.post(&format!("/v1/jobs/{queued_id}/cancel"), &json!({})).await.unwrap();
    assert_eq!(status, 200);
    assert_eq!(canceled["state"], "canceled");
    assert_eq!(cluster.queue_len("echo", "ready").await.unwrap(), 0);

    let (_, sleeper) = cluster.post("/v1/jobs", &json!({"kind": "echo", "input": {"sleep_ms": 60000}})).await.unwrap();
    let sleeper_id: Uuid = sleeper["id"].as_str().unwrap().parse().unwrap();
    let _w = cluster.spawn_worker(&[]).unwrap();
    cluster
        .wait_until("the sleeper to run", Duration::from_secs(20), || async { Ok(cluster.state_of(sleeper_id).await? == "running") })
        .await
        .unwrap();
    let (status, requested) = cluster.post(&format!("/v1/jobs/{sleeper_id}/cancel"), &json!({})).await.unwrap();
    assert_eq!(status, 202);
    assert_eq!(requested["cancel_requested"], true);
    cluster.wait_terminal(&[sleeper_id], Duration::from_secs(10)).await.unwrap();
    assert_eq!(cluster.state_of(sleeper_id).await.unwrap(), "canceled");

    // A finished job cannot be canceled, and the queued one never ran.
    let (status, body) = cluster.post(&format!("/v1/jobs/{sleeper_id}/cancel"), &json!({})).await.unwrap();
    assert_eq!((status, body["error"]["code"].as_str()), (409, Some("job_finished")));
    let (_, never) = cluster.get(&format!("/v1/jobs/{queued_id}")).await.unwrap();
    assert_eq!(never["attempts"], 0);
    let (status, _) = cluster.post(&format!("/v1/jobs/{}/cancel", Uuid::now_v7()), &json!({})).await.unwrap();
    assert_eq!(status, 404);
}

#[tokio::test]
async fn files_arrive_as_base64_as_a_presigned_upload_or_by_url() {
    let mut cluster = Cluster::start(&[]).await.unwrap();
    let content = b"RIFF....WAVEfmt pretend audio".repeat(100);
    let digest = hex::encode(Sha256::digest(&content));

    // 1. base64 in the body.
    let b64 = base64::engine::general_purpose::STANDARD.encode(&content);
    let (status, inline) = cluster.post("/v1/jobs", &json!({"kind": "echo", "input": {"file": {"base64": b64}}})).await.unwrap();
    assert_eq!(status, 201, "{inline}");
    assert!(inline["input"]["file"]["upload_key"].as_str().unwrap().starts_with("uploads/"), "base64 is moved to storage");

    // 2. a presigned PUT.
    let (status, upload) = cluster.post("/v1/uploads", &json!({})).await.unwrap();
    assert_eq!(status, 201);
    let put = cluster.http.put(upload["url"].as_str().unwrap()).body(content.clone()).send().await.unwrap();
    assert!(put.status().is_success(), "presigned PUT answered {}", put.status());
    let key = upload["upload_key"].as_str().unwrap();
    let (status, uploaded) = cluster.post("/v1/jobs", &json!({"kind": "echo", "input": {"file": {"upload_key": key}}})).await.unwrap();
    assert_eq!(status, 201, "{uploaded}");

    // 3. an http URL (a presigned GET of the same object serves it).
    let url = cluster.objects.presign_get(key).await.unwrap();
    let (status, by_url) = cluster.post("/v1/jobs", &json!({"kind": "echo", "input": {"file": {"url": url}}})).await.unwrap();
    assert_eq!(status, 201, "{by_url}");

    let ids: Vec<Uuid> = [&inline, &uploaded, &by_url].iter().map(|j| j["id"].as_str().unwrap().parse().unwrap()).collect();
    let _w = cluster.spawn_worker(&[]).unwrap();
    cluster.wait_terminal(&ids, Duration::from_secs(30)).await.unwrap();
    for id in ids {
        let (_, job) = cluster.get(&format!("/v1/jobs/{id}")).await.unwrap();
        assert_eq!(job["state"], "succeeded", "{job}");
        let output: Value = reqwest::get(job["output"]["url"].as_str().unwrap()).await.unwrap().json().await.unwrap();
        assert_eq!(output["file"]["sha256"], digest.as_str());
        assert_eq!(output["file"]["size"], content.len());
    }
}

/// Issue 20, item 1: an uploaded MP3 whose headers do not state its length is priced and
/// refused from its first MiB and its size (never read whole by the API): ten minutes of it
/// are refused under a five-minute limit, and cost 22 windows under the default one.
#[tokio::test]
async fn a_long_headerless_mp3_upload_is_measured_without_reading_it_whole() {
    // Silent MPEG-1 Layer III frames (128 kbit/s, 44.1 kHz, mono), no Xing header: 653 s.
    let mut frame = vec![0u8; 417];
    frame[..4].copy_from_slice(&[0xFF, 0xFB, 0x90, 0xC4]);
    let mp3 = frame.repeat(25_000);
    let mut cluster = Cluster::start(&[("TERN_MAX_AUDIO_SECONDS", "300")])
        .await
        .unwrap();
    let upload = |cluster: &Cluster| {
        let mp3 = mp3.clone();
        let http = cluster.http.clone();
        let presign = cluster.url("/v1/uploads");
        async move {
            let upload: Value = http
                .post(presign)
                .json(&json!({}))
                .send()
                .await
                .unwrap()
                .json()
                .await
                .unwrap();
            let put = http
                .put(upload["url"].as_str().unwrap())
                .body(mp3)
                .send()
                .await
                .unwrap();
            assert!(put.status().is_success());
            upload["upload_key"].as_str().unwrap().to_string()
        }
    };
    let key = upload(&cluster).await;
    let (status, err) = cluster
        .post(
            "/v1/jobs",
            &json!({"kind": "transcribe", "input": {"audio": {"upload_key": key}}}),
        )
        .await
        .unwrap();
    assert_eq!(
        (status, err["error"]["code"].as_str()),
        (413, Some("audio_too_long")),
        "{err}"
    );
    let message = err["error"]["message"].as_str().unwrap();
    assert!(message.contains("about 653 s"), "{message}");

    cluster.api.as_mut().unwrap().kill9();
    cluster.set_api_env("TERN_MAX_AUDIO_SECONDS", "7200");
    cluster.start_api().await.unwrap();
    let key = upload(&cluster).await;
    let (status, job) = cluster
        .post(
            "/v1/jobs",
            &json!({"kind": "transcribe", "input": {"audio": {"upload_key": key}}}),
        )
        .await
        .unwrap();
    assert_eq!(status, 201, "{job}");
    let id: Uuid = job["id"].as_str().unwrap().parse().unwrap();
    let cost: i32 = sqlx::query_scalar("SELECT cost FROM jobs WHERE id = $1")
        .bind(id)
        .fetch_one(&cluster.pg)
        .await
        .unwrap();
    assert_eq!(cost, 22, "653 s is 22 windows of 30 s");
}

#[tokio::test]
async fn listing_pages_newest_first_and_filters_by_state_and_kind() {
    let cluster = Cluster::start(&[]).await.unwrap();
    let jobs: Vec<Value> = (0..7).map(|i| json!({"kind": "echo", "input": {"message": i}})).collect();
    let ids = cluster.submit_all(&jobs).await.unwrap();
    let mut seen = Vec::new();
    let mut cursor: Option<String> = None;
    loop {
        let path = match &cursor {
            Some(c) => format!("/v1/jobs?limit=3&state=queued&kind=echo&cursor={c}"),
            None => "/v1/jobs?limit=3&state=queued&kind=echo".to_string(),
        };
        let (status, page) = cluster.get(&path).await.unwrap();
        assert_eq!(status, 200);
        for job in page["jobs"].as_array().unwrap() {
            seen.push(job["id"].as_str().unwrap().parse::<Uuid>().unwrap());
        }
        match page["next_cursor"].as_str() {
            Some(c) => cursor = Some(c.to_string()),
            None => break,
        }
    }
    let mut newest_first = ids.clone();
    newest_first.reverse();
    assert_eq!(seen, newest_first);
    let (_, none) = cluster.get("/v1/jobs?state=succeeded").await.unwrap();
    assert_eq!(none["jobs"].as_array().unwrap().len(), 0);
    let (status, bad) = cluster.get("/v1/jobs?state=sleeping").await.unwrap();
    assert_eq!((status, bad["error"]["code"].as_str()), (400, Some("invalid_state")));
    // A queued job shows where it stands.
    let (_, first) = cluster.get(&format!("/v1/jobs/{}", ids[0])).await.unwrap();
    assert_eq!(first["queue_position"], 0);
    let (_, last) = cluster.get(&format!("/v1/jobs/{}", ids[6])).await.unwrap();
    assert_eq!(last["queue_position"], 6);
    let (status, _) = cluster.get(&format!("/v1/jobs/{}", Uuid::now_v7())).await.unwrap();
    assert_eq!(status, 404);
}

#[tokio::test]
async fn a_full_queue_answers_503_queue_full_with_retry_after() {
    let cluster = Cluster::start(&[("TERN_MAX_QUEUED", "5")]).await.unwrap();
    let jobs: Vec<Value> = (0..5).map(|_| json!({"kind": "echo", "input": {}})).collect();
    cluster.submit_all(&jobs).await.unwrap();
    let resp = cluster.http.post(cluster.url("/v1/jobs")).json(&json!({"kind": "echo", "input": {}})).send().await.unwrap();
    assert_eq!(resp.status(), 503);
    assert!(resp.headers().get("retry-after").is_some());
    let body: Value = resp.json().await.unwrap();
    assert_eq!(body["error"]["code"], "queue_full");
    assert_eq!(job_count(&cluster).await, 5);
}

#[tokio::test]
async fn health_and_readiness_report_the_backing_services() {
    let cluster = Cluster::start(&[]).await.unwrap();
    let (status, health) = cluster.get("/healthz").await.unwrap();
    assert_eq!((status, health["status"].as_str()), (200, Some("ok")));
    let (status, ready) = cluster.get("/readyz").await.unwrap();
    assert_eq!(status, 200);
    assert_eq!(ready["checks"], json!({"postgres": "ok", "redis": "ok", "s3": "ok"}));
}

#[test]
fn both_binaries_explain_their_flags_and_environment_variables() {
    for binary in ["tern-api", "tern-worker"] {
        let out = std::process::Command::new(tern_e2e::bin_dir().join(binary)).arg("--help").output().unwrap();
        assert!(out.status.success(), "{binary} --help failed");
        let help = String::from_utf8(out.stdout).unwrap();
        for expected in ["TERN_DATABASE_URL", "TERN_REDIS_URL", "TERN_S3_ENDPOINT", "TERN_LEASE_MS", "TERN_LOG_FORMAT"] {
            assert!(help.contains(expected), "{binary} --help does not mention {expected}");
        }
        assert!(!help.contains("tern-dev-secret"), "{binary} --help shows the secret key");
    }
}

#[tokio::test]
async fn every_response_carries_a_request_id_and_security_headers_and_cors_is_opt_in() {
    let cluster = Cluster::start(&[]).await.unwrap();
    let check = |resp: &reqwest::Response| {
        let h = resp.headers();
        assert!(h.get("x-request-id").is_some_and(|v| !v.is_empty()), "{h:?}");
        assert_eq!(h["x-content-type-options"], "nosniff");
        assert_eq!(h["x-frame-options"], "DENY");
        assert_eq!(h["referrer-policy"], "no-referrer");
        assert!(h.contains_key("content-security-policy"));
    };
    for path in ["/healthz", "/v1/jobs", "/v1/nothing-here", &format!("/v1/jobs/{}", uuid::Uuid::now_v7())] {
        let resp = cluster.http.get(cluster.url(path)).send().await.unwrap();
        check(&resp);
    }
    // A client's id is passed through, and errors carry it.
    let resp = cluster
        .http
        .post(cluster.url("/v1/jobs"))
        .header("x-request-id", "client-abc-123")
        .json(&json!({"kind": "nope", "input": {}}))
        .send()
        .await
        .unwrap();
    check(&resp);
    assert_eq!(resp.headers()["x-request-id"], "client-abc-123");
    let body: Value = resp.json().await.unwrap();
    assert_eq!(body["error"]["request_id"], "client-abc-123", "{body}");
    // No CORS unless configured.
    let resp = cluster.http.get(cluster.url("/healthz")).header("origin", "https://app.example").send().await.unwrap();
    assert!(resp.headers().get("access-control-allow-origin").is_none());

    let cors = Cluster::start(&[("TERN_CORS_ORIGINS", "https://app.example")]).await.unwrap();
    let preflight = cors
        .http
        .request(reqwest::Method::OPTIONS, cors.url("/v1/jobs"))
        .header("origin", "https://app.example")
        .header("access-control-request-method", "POST")
        .send()
        .await
        .unwrap();
    assert_eq!(preflight.status(), 204);
    assert_eq!(preflight.headers()["access-control-allow-origin"], "https://app.example");
    let other = cors.http.get(cors.url("/healthz")).header("origin", "https://evil.example").send().await.unwrap();
    assert!(other.headers().get("access-control-allow-origin").is_none());
}

/// Issue 20, items 5 and 7: a NUL anywhere in a request is refused at the edge (it answered 503
/// `database_unavailable` with Retry-After, so clients retried forever), and every way a body,
/// query or method can be wrong answers in the error shape with a stable code.
#[tokio::test]
async fn a_nul_is_refused_at_the_edge_and_every_refusal_is_a_json_error() {
    let cluster = Cluster::start(&[]).await.unwrap();
    let nul = "a\u{0}b";
    let cases = [
        ("/v1/jobs", json!({"kind": "echo", "input": {"message": nul}})),
        ("/v1/jobs", json!({"kind": "echo", "input": {"message": 1}, "metadata": {"note": nul}})),
        ("/v1/jobs", json!({"kind": "echo", "input": {"message": 1}, "idempotency_key": nul})),
        ("/v1/jobs", json!({"kind": "generate", "input": {"prompt": "hi", "stop": [nul]}})),
        ("/v1/jobs/batch", json!({"jobs": [{"kind": "echo", "input": {}}, {"kind": "echo", "input": {"message": nul}}]})),
        ("/v1/admin/keys", json!({"tenant": "acme", "scopes": ["jobs:read"], "name": nul})),
        ("/v1/webhooks/endpoints", json!({"url": format!("http://127.0.0.1:9/{nul}")})),
    ];
    for (path, body) in cases {
        let (status, err) = cluster.post(path, &body).await.unwrap();
        assert_eq!((status, err["error"]["code"].as_str()), (400, Some("invalid_character")), "{path} {body}: {err}");
    }
    let jobs: i64 = sqlx::query_scalar("SELECT count(*) FROM jobs").fetch_one(&cluster.pg).await.unwrap();
    assert_eq!(jobs, 0, "nothing was accepted");

    // Bodies of the routes that take a fixed shape.
    let send = |path: &str, content_type: &str, body: &str| {
        cluster.http.post(cluster.url(path)).header("content-type", content_type).body(body.to_string()).send()
    };
    for (path, content_type, body, status, code) in [
        ("/v1/webhooks/endpoints", "application/json", "{\"url\": ", 400, "invalid_json"),
        ("/v1/webhooks/endpoints", "text/plain", "{\"url\": \"http://127.0.0.1:9/\"}", 415, "unsupported_media_type"),
        ("/v1/webhooks/endpoints", "application/json", "{\"url\": 5}", 422, "invalid_request"),
        ("/v1/admin/keys", "application/json", "[]", 422, "invalid_request"),
        ("/v1/admin/models", "application/json", "{\"kind\": ", 400, "invalid_json"),
    ] {
        let resp = send(path, content_type, body).await.unwrap();
        assert_eq!(resp.status().as_u16(), status, "{path} {content_type} {body}");
        let err: Value = resp.json().await.expect("a JSON body");
        assert_eq!(err["error"]["code"], code, "{path} {body}: {err}");
    }
    // Query strings and methods.
    for (path, status, code) in [
        ("/v1/jobs?state=queued&state=running", 400, "invalid_query"),
        ("/v1/jobs?limit=many", 400, "invalid_limit"),
        ("/v1/jobs?cursor=%00", 400, "invalid_character"),
        ("/v1/admin/jobs?tenant=a%00", 400, "invalid_character"),
    ] {
        let (got, err) = cluster.get(path).await.unwrap();
        assert_eq!((got, err["error"]["code"].as_str()), (status, Some(code)), "{path}: {err}");
    }
    let resp = cluster.http.delete(cluster.url("/v1/jobs")).send().await.unwrap();
    assert_eq!(resp.status(), 405);
    let err: Value = resp.json().await.expect("a JSON body");
    assert_eq!(err["error"]["code"], "method_not_allowed");
}
