//! Webhooks through the whole service: signed per the Standard Webhooks spec, delivered from a
//! Postgres outbox with retries, never lost when the receiver or the API process goes down.
//! The receiver here verifies every delivery with the spec's algorithm, written independently
//! of tern's signer.

use axum::body::Bytes;
use axum::http::{HeaderMap, StatusCode};
use base64::Engine;
use hmac::{Hmac, Mac};
use serde_json::{json, Value};
use sha2::Sha256;
use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use tern_e2e::Cluster;
use uuid::Uuid;

const SECRET: &str = "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw";
/// Seconds a timestamp may be off before a receiver refuses it (the spec's suggestion).
const TOLERANCE: i64 = 300;

/// The spec's verification: HMAC-SHA256 over `id.timestamp.body` with the base64-decoded
/// secret, compared with each `v1,` signature of the header; the timestamp must be recent.
fn verify(secret: &str, id: &str, timestamp: &str, body: &[u8], signatures: &str, now: i64) -> bool {
    let Ok(ts) = timestamp.parse::<i64>() else { return false };
    if (now - ts).abs() > TOLERANCE {
        return false;
    }
    let key = base64::engine::general_purpose::STANDARD.decode(secret.trim_start_matches("whsec_")).unwrap();
    let mut mac = Hmac::<Sha256>::new_from_slice(&key).unwrap();
    mac.update(format!("{id}.{timestamp}.").as_bytes());
    mac.update(body);
    let expected = base64::engine::general_purpose::STANDARD.encode(mac.finalize().into_bytes());
    signatures.split(' ').filter_map(|s| s.strip_prefix("v1,")).any(|s| s == expected)
}

#[derive(Clone, Debug)]
struct Received {
    id: String,
    timestamp: String,
    signature: String,
    body: Bytes,
    answered: u16,
    at: Instant,
}

impl Received {
    fn verifies(&self) -> bool {
        verify(SECRET, &self.id, &self.timestamp, &self.body, &self.signature, chrono::Utc::now().timestamp())
    }
    fn json(&self) -> Value {
        serde_json::from_slice(&self.body).unwrap()
    }
}

/// An HTTP receiver answering from a plan (status, Retry-After), then 200.
#[derive(Clone, Default)]
struct Receiver {
    got: Arc<Mutex<Vec<Received>>>,
    plan: Arc<Mutex<VecDeque<(u16, Option<u64>)>>>,
    /// Answer this to everything, whatever the plan (e.g. 410).
    always: Option<u16>,
}

impl Receiver {
    async fn start(plan: Vec<(u16, Option<u64>)>, always: Option<u16>) -> (Receiver, String) {
        let r = Receiver { plan: Arc::new(Mutex::new(plan.into())), always, ..Default::default() };
        let state = r.clone();
        let app = axum::Router::new().route(
            "/hook",
            axum::routing::post(move |headers: HeaderMap, body: Bytes| {
                let r = state.clone();
                async move {
                    let (status, retry_after) =
                        r.always.map(|s| (s, None)).or_else(|| r.plan.lock().unwrap().pop_front()).unwrap_or((200, None));
                    let header = |n: &str| headers.get(n).and_then(|v| v.to_str().ok()).unwrap_or("").to_string();
                    r.got.lock().unwrap().push(Received {
                        id: header("webhook-id"),
                        timestamp: header("webhook-timestamp"),
                        signature: header("webhook-signature"),
                        body,
                        answered: status,
                        at: Instant::now(),
                    });
                    let mut response = axum::response::Response::new(axum::body::Body::empty());
                    *response.status_mut() = StatusCode::from_u16(status).unwrap();
                    if let Some(s) = retry_after {
                        response.headers_mut().insert("retry-after", s.to_string().parse().unwrap());
                    }
                    response
                }
            }),
        );
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let url = format!("http://{}/hook", listener.local_addr().unwrap());
        tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
        (r, url)
    }

    fn got(&self) -> Vec<Received> {
        self.got.lock().unwrap().clone()
    }
}

async fn deliveries(cluster: &Cluster, id: Uuid) -> Vec<Value> {
    let (status, v) = cluster.get(&format!("/v1/jobs/{id}/deliveries")).await.unwrap();
    assert_eq!(status, 200, "{v}");
    v["deliveries"].as_array().unwrap().clone()
}

async fn wait_deliveries_settled(cluster: &Cluster, ids: &[Uuid], expected: usize) {
    cluster
        .wait_until("every delivery settled", Duration::from_secs(60), || async {
            let mut settled = 0;
            for id in ids {
                settled += deliveries(cluster, *id).await.iter().filter(|d| d["state"] != "pending").count();
            }
            Ok(settled >= expected)
        })
        .await
        .unwrap();
}

fn api_env(schedule: &'static str) -> Vec<(&'static str, &'static str)> {
    vec![("TERN_WEBHOOK_SECRETS", SECRET), ("TERN_WEBHOOK_SCHEDULE_MS", schedule), ("TERN_WEBHOOK_POLL_MS", "50")]
}

/// Each event reached the receiver answered 200 exactly once, and every request verified.
fn assert_each_event_once(got: &[Received], events: usize) {
    assert!(got.iter().all(Received::verifies), "every delivery verifies");
    let mut ok: HashMap<&str, usize> = HashMap::new();
    for r in got.iter().filter(|r| r.answered == 200) {
        *ok.entry(r.id.as_str()).or_default() += 1;
    }
    assert_eq!(ok.len(), events, "events delivered: {ok:?}");
    assert!(ok.values().all(|n| *n == 1), "each event once as 200: {ok:?}");
}

#[tokio::test]
async fn signed_deliveries_survive_a_failing_receiver_and_arrive_once_each_in_order() {
    let (receiver, url) = Receiver::start(vec![(500, None), (500, None), (503, None)], None).await;
    let mut cluster = Cluster::start(&api_env("0,200,200,200,200,200")).await.unwrap();
    let jobs: Vec<Value> =
        (0..3).map(|i| json!({"kind": "echo", "input": {"message": i}, "webhook": {"url": url}})).collect();
    let ids = cluster.submit_all(&jobs).await.unwrap();
    let _w = cluster.spawn_worker(&[]).unwrap();
    cluster.wait_terminal(&ids, Duration::from_secs(30)).await.unwrap();
    wait_deliveries_settled(&cluster, &ids, 6).await;

    let got = receiver.got();
    assert_each_event_once(&got, 6);
    assert_eq!(got.iter().filter(|r| r.answered != 200).count(), 3, "the failures were retried");
    for id in &ids {
        let mine: Vec<Value> = got
            .iter()
            .filter(|r| r.answered == 200)
            .map(Received::json)
            .filter(|v| v["data"]["id"] == id.to_string())
            .collect();
        let types: Vec<&str> = mine.iter().map(|v| v["type"].as_str().unwrap()).collect();
        assert_eq!(types, ["job.started", "job.succeeded"], "a job's events in order");
        let done = &mine[1]["data"];
        assert_eq!(done["state"], "succeeded");
        assert!(done["output"]["url"].as_str().is_some_and(|u| u.starts_with("http")), "payload is the job as GET shows it");
        let history = deliveries(&cluster, *id).await;
        assert!(history.iter().all(|d| d["state"] == "delivered"), "{history:?}");
    }

    // A receiver refuses a tampered body or a stale timestamp.
    let sample = got.iter().find(|r| r.answered == 200).unwrap();
    let mut tampered = sample.body.to_vec();
    tampered[sample.body.len() / 2] ^= 1;
    let now = chrono::Utc::now().timestamp();
    assert!(!verify(SECRET, &sample.id, &sample.timestamp, &tampered, &sample.signature, now));
    assert!(!verify(SECRET, &sample.id, &sample.timestamp, &sample.body, &sample.signature, now + 2 * TOLERANCE));
    let other = "whsec_AAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAA";
    assert!(!verify(other, &sample.id, &sample.timestamp, &sample.body, &sample.signature, now));
}

#[tokio::test]
async fn gone_disables_the_endpoint_and_retry_after_is_honoured() {
    let (gone, gone_url) = Receiver::start(vec![], Some(410)).await;
    let (busy, busy_url) = Receiver::start(vec![(429, Some(2))], None).await;
    let mut cluster = Cluster::start(&api_env("0,100,100,100")).await.unwrap();
    let ids = cluster
        .submit_all(&[
            json!({"kind": "echo", "input": {}, "webhook": {"url": gone_url}}),
            json!({"kind": "echo", "input": {}, "webhook": {"url": busy_url, "events": ["job.succeeded"]}}),
        ])
        .await
        .unwrap();
    let _w = cluster.spawn_worker(&[]).unwrap();
    cluster.wait_terminal(&ids, Duration::from_secs(30)).await.unwrap();
    wait_deliveries_settled(&cluster, &ids[1..], 1).await;
    wait_deliveries_settled(&cluster, &ids[..1], 1).await;

    let gone_got = gone.got();
    assert_eq!(gone_got.len(), 1, "one 410, then nothing more to that endpoint");
    let history = deliveries(&cluster, ids[0]).await;
    assert!(history.iter().all(|d| d["state"] == "disabled"), "{history:?}");

    let busy_got = busy.got();
    assert_eq!(busy_got.len(), 2, "429, then the retry");
    assert_eq!(busy_got[0].json()["type"], "job.succeeded", "only the events asked for");
    let waited = busy_got[1].at - busy_got[0].at;
    assert!(waited >= Duration::from_millis(1900), "Retry-After: 2 honoured, retried after {waited:?}");
    let history = deliveries(&cluster, ids[1]).await;
    assert_eq!(history[0]["history"][0]["status"], 429);
    assert_eq!(history[0]["history"][1]["status"], 200);

    // Replay sends a delivery again.
    let delivery = history[0]["delivery_id"].as_str().unwrap();
    let (status, _) = cluster.post(&format!("/v1/deliveries/{delivery}/replay"), &json!({})).await.unwrap();
    assert_eq!(status, 202);
    cluster
        .wait_until("the replay arrives", Duration::from_secs(10), || async { Ok(busy.got().len() == 3) })
        .await
        .unwrap();
    assert_eq!(busy.got()[2].id, busy_got[1].id, "the same webhook-id");

    // Bad webhooks are refused at submit.
    for (hook, code) in [
        (json!({"url": "ftp://example.com/x"}), "url_forbidden"),
        (json!({"url": "example.com/x"}), "invalid_webhook"),
        (
            json!({"url": gone_url, "events": ["job.exploded"]}),
            "invalid_webhook",
        ),
        (json!("https://example.com"), "invalid_webhook"),
    ] {
        let (status, err) = cluster.post("/v1/jobs", &json!({"kind": "echo", "input": {}, "webhook": hook})).await.unwrap();
        assert_eq!((status, err["error"]["code"].as_str()), (422, Some(code)), "{err}");
    }
}

#[tokio::test]
async fn killing_the_api_mid_retry_loses_no_event() {
    let (receiver, url) = Receiver::start(vec![(500, None); 4], None).await;
    let mut cluster = Cluster::start(&api_env("0,400,400,400,400,400,400,400")).await.unwrap();
    let jobs: Vec<Value> = (0..2).map(|i| json!({"kind": "echo", "input": {"message": i}, "webhook": {"url": url}})).collect();
    let ids = cluster.submit_all(&jobs).await.unwrap();
    let _w = cluster.spawn_worker(&[]).unwrap();
    cluster
        .wait_until("the receiver refused twice", Duration::from_secs(30), || async { Ok(receiver.got().len() >= 2) })
        .await
        .unwrap();
    cluster.api.as_mut().unwrap().kill9();
    tokio::time::sleep(Duration::from_millis(500)).await;
    cluster.start_api().await.unwrap();
    cluster.wait_terminal(&ids, Duration::from_secs(30)).await.unwrap();
    wait_deliveries_settled(&cluster, &ids, 4).await;
    assert_each_event_once(&receiver.got(), 4);
}

#[tokio::test]
async fn without_a_secret_jobs_cannot_name_a_webhook() {
    let cluster = Cluster::start(&[]).await.unwrap();
    let (status, err) = cluster
        .post("/v1/jobs", &json!({"kind": "echo", "input": {}, "webhook": {"url": "https://example.com/hook"}}))
        .await
        .unwrap();
    assert_eq!((status, err["error"]["code"].as_str()), (422, Some("webhooks_not_configured")), "{err}");
}

#[tokio::test]
async fn progress_events_come_when_asked_for_at_most_one_a_second() {
    let (receiver, url) = Receiver::start(vec![], None).await;
    let mut cluster = Cluster::start(&api_env("0,200,200")).await.unwrap();
    let ids = cluster
        .submit_all(&[json!({
            "kind": "generate",
            "input": {"prompt": "Counting up by one: 1, 2, 3, 4, 5, 6, 7, 8, 9, 10,", "temperature": 0, "max_tokens": 200},
            "webhook": {"url": url, "events": ["job.progress", "job.succeeded"]}
        })])
        .await
        .unwrap();
    let _w = cluster.spawn_worker(&[("TERN_WORKER_KINDS", "generate")]).unwrap();
    cluster.wait_terminal(&ids, Duration::from_secs(120)).await.unwrap();
    let history = deliveries(&cluster, ids[0]).await;
    wait_deliveries_settled(&cluster, &ids, history.len()).await;
    let got = receiver.got();
    assert_each_event_once(&got, history.len());
    let types: Vec<String> = got.iter().map(|r| r.json()["type"].as_str().unwrap().to_string()).collect();
    assert!(types.iter().filter(|t| *t == "job.progress").count() >= 2, "{types:?}");
    assert_eq!(types.last().map(String::as_str), Some("job.succeeded"), "{types:?}");
    assert!(!types.iter().any(|t| t == "job.started"), "only the events asked for");
    let progress = got.iter().map(Received::json).find(|v| v["type"] == "job.progress").unwrap();
    assert!(progress["data"]["progress"]["done"].as_u64().is_some(), "{progress}");
    // At most one a second: the outbox rows are at least a second apart.
    let times: Vec<chrono::DateTime<chrono::Utc>> = history
        .iter()
        .filter(|d| d["event"] == "job.progress")
        .map(|d| d["created_at"].as_str().unwrap().parse().unwrap())
        .collect();
    for pair in times.windows(2) {
        assert!((pair[1] - pair[0]).num_milliseconds() >= 1000, "{times:?}");
    }
}

#[tokio::test]
async fn tenant_endpoints_get_their_tenants_events_only_with_their_own_rotating_secret() {
    let (a_receiver, a_url) = Receiver::start(vec![], None).await;
    let (b_receiver, b_url) = Receiver::start(vec![], None).await;
    // No server secret: endpoints sign with their own.
    let mut cluster = Cluster::start(&[("TERN_WEBHOOK_SCHEDULE_MS", "0,200,200"), ("TERN_WEBHOOK_POLL_MS", "50")]).await.unwrap();
    let a = cluster.client_for(&cluster.create_key("tenant-a", "jobs:write,jobs:read").unwrap()).unwrap();
    let b = cluster.client_for(&cluster.create_key("tenant-b", "jobs:write,jobs:read").unwrap()).unwrap();
    let base = cluster.url("");
    let endpoint = |client: reqwest::Client, url: String, body: Value| {
        let target = format!("{base}{url}");
        async move {
            let r = client.post(target).json(&body).send().await.unwrap();
            let status = r.status().as_u16();
            (status, r.json::<Value>().await.unwrap_or(Value::Null))
        }
    };
    let (status, a_end) = endpoint(a.clone(), "/v1/webhooks/endpoints".into(), json!({"url": a_url})).await;
    assert_eq!(status, 201, "{a_end}");
    let (status, _) = endpoint(b.clone(), "/v1/webhooks/endpoints".into(), json!({"url": b_url, "events": ["job.succeeded"]})).await;
    assert_eq!(status, 201);
    let a_secret = a_end["secret"].as_str().unwrap().to_string();
    let a_id = a_end["id"].as_str().unwrap().to_string();
    // A tenant holds at most 20: the 21st is a conflict with what it has (409), until it
    // deletes one.
    let mut extra = Vec::new();
    for _ in 1..20 {
        let (status, end) = endpoint(b.clone(), "/v1/webhooks/endpoints".into(), json!({"url": b_url, "events": ["job.failed"]})).await;
        assert_eq!(status, 201, "{end}");
        extra.push(end["id"].as_str().unwrap().to_string());
    }
    let (status, refused) = endpoint(b.clone(), "/v1/webhooks/endpoints".into(), json!({"url": b_url})).await;
    assert_eq!((status, refused["error"]["code"].as_str()), (409, Some("too_many_endpoints")), "{refused}");
    for id in &extra {
        let r = b.delete(cluster.url(&format!("/v1/webhooks/endpoints/{id}"))).send().await.unwrap();
        assert!(r.status().is_success(), "{}", r.status());
    }

    let resp = a.post(cluster.url("/v1/jobs")).json(&json!({"kind": "echo", "input": {"message": "a"}})).send().await.unwrap();
    assert_eq!(resp.status(), 201);
    let job: Value = resp.json().await.unwrap();
    let id: Uuid = job["id"].as_str().unwrap().parse().unwrap();
    let _w = cluster.spawn_worker(&[]).unwrap();
    cluster.wait_terminal(&[id], Duration::from_secs(30)).await.unwrap();
    cluster
        .wait_until("A's endpoint has both events", Duration::from_secs(20), || async { Ok(a_receiver.got().len() >= 2) })
        .await
        .unwrap();
    let got = a_receiver.got();
    let now = chrono::Utc::now().timestamp();
    for r in &got {
        assert!(verify(&a_secret, &r.id, &r.timestamp, &r.body, &r.signature, now), "signed with the endpoint's secret");
        assert!(!r.verifies(), "not with another secret");
    }
    let types: Vec<Value> = got.iter().map(|r| r.json()["type"].clone()).collect();
    assert_eq!(types, [json!("job.started"), json!("job.succeeded")]);
    assert!(b_receiver.got().is_empty(), "tenant B's endpoint hears nothing of A's jobs");
    // B cannot see or touch A's endpoint.
    let listed: Value = b.get(cluster.url("/v1/webhooks/endpoints")).send().await.unwrap().json().await.unwrap();
    assert!(!listed.to_string().contains(&a_id));
    let (status, _) = endpoint(b.clone(), format!("/v1/webhooks/endpoints/{a_id}/rotate"), json!({})).await;
    assert_eq!(status, 404);

    // Rotation: the next deliveries carry both signatures.
    let (status, rotated) = endpoint(a.clone(), format!("/v1/webhooks/endpoints/{a_id}/rotate"), json!({})).await;
    assert_eq!(status, 200);
    let new_secret = rotated["secret"].as_str().unwrap().to_string();
    let resp = a.post(cluster.url("/v1/jobs")).json(&json!({"kind": "echo", "input": {"message": "b"}})).send().await.unwrap();
    let id2: Uuid = resp.json::<Value>().await.unwrap()["id"].as_str().unwrap().parse().unwrap();
    cluster.wait_terminal(&[id2], Duration::from_secs(30)).await.unwrap();
    cluster
        .wait_until("two more events", Duration::from_secs(20), || async { Ok(a_receiver.got().len() >= 4) })
        .await
        .unwrap();
    let later = a_receiver.got()[2].clone();
    let now = chrono::Utc::now().timestamp();
    assert_eq!(later.signature.split(' ').count(), 2, "{}", later.signature);
    assert!(verify(&new_secret, &later.id, &later.timestamp, &later.body, &later.signature, now));
    assert!(verify(&a_secret, &later.id, &later.timestamp, &later.body, &later.signature, now), "the old secret still verifies");
}

/// A receiver that holds every request until `release` is set, then answers `status`; it
/// counts requests and how many are open now (a request the sender gave up on is closed).
#[derive(Clone, Default)]
struct HeldReceiver {
    requests: Arc<std::sync::atomic::AtomicUsize>,
    open: Arc<std::sync::atomic::AtomicUsize>,
    release: Arc<std::sync::atomic::AtomicBool>,
}

impl HeldReceiver {
    async fn start(status: u16) -> (HeldReceiver, String) {
        use std::sync::atomic::Ordering::SeqCst;
        struct Open(Arc<std::sync::atomic::AtomicUsize>);
        impl Drop for Open {
            fn drop(&mut self) {
                self.0.fetch_sub(1, SeqCst);
            }
        }
        let r = HeldReceiver::default();
        let state = r.clone();
        let app = axum::Router::new().route(
            "/hook",
            axum::routing::post(move || {
                let r = state.clone();
                async move {
                    r.requests.fetch_add(1, SeqCst);
                    r.open.fetch_add(1, SeqCst);
                    let _open = Open(r.open.clone());
                    while !r.release.load(SeqCst) {
                        tokio::time::sleep(Duration::from_millis(10)).await;
                    }
                    StatusCode::from_u16(status).unwrap()
                }
            }),
        );
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let url = format!("http://{}/hook", listener.local_addr().unwrap());
        tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
        (r, url)
    }
    fn requests(&self) -> usize {
        self.requests.load(std::sync::atomic::Ordering::SeqCst)
    }
    fn open(&self) -> usize {
        self.open.load(std::sync::atomic::Ordering::SeqCst)
    }
    fn release(&self) {
        self.release
            .store(true, std::sync::atomic::Ordering::SeqCst);
    }
}

/// Many deliveries to one tenant endpoint answered 410 at the same moment: each attempt is
/// recorded (no transaction is lost to a deadlock between them), every delivery ends
/// `disabled`, and the endpoint is disabled.
#[tokio::test]
async fn deliveries_answered_gone_together_are_each_recorded() {
    let (gone, url) = HeldReceiver::start(410).await;
    let mut cluster = Cluster::start(&api_env("0,100,100")).await.unwrap();
    let (status, endpoint) = cluster
        .post(
            "/v1/webhooks/endpoints",
            &json!({"url": url, "events": ["job.succeeded"]}),
        )
        .await
        .unwrap();
    assert_eq!(status, 201, "{endpoint}");
    let jobs: Vec<Value> = (0..64)
        .map(|i| json!({"kind": "echo", "input": {"message": i}}))
        .collect();
    let ids = cluster.submit_all(&jobs).await.unwrap();
    let _w = cluster.spawn_worker(&[]).unwrap();
    cluster
        .wait_terminal(&ids, Duration::from_secs(30))
        .await
        .unwrap();
    // Every delivery that can be in flight at once is: then all are answered together.
    cluster
        .wait_until("deliveries in flight", Duration::from_secs(10), || async {
            Ok(gone.open() >= 8)
        })
        .await
        .unwrap();
    tokio::time::sleep(Duration::from_millis(300)).await;
    gone.release();
    cluster
        .wait_until("no delivery pending", Duration::from_secs(120), || async {
            let pending: i64 = sqlx::query_scalar(
                "SELECT count(*) FROM webhook_deliveries WHERE state = 'pending'",
            )
            .fetch_one(&cluster.pg)
            .await?;
            Ok(pending == 0)
        })
        .await
        .unwrap();
    // The first 410 recorded disables the endpoint and ends every pending delivery, which can
    // happen while the other answers' attempts are still being written: wait for those.
    let recorded = || async {
        let n: i64 = sqlx::query_scalar("SELECT count(*) FROM webhook_attempts").fetch_one(&cluster.pg).await?;
        Ok::<_, anyhow::Error>(n as usize)
    };
    let _ = cluster
        .wait_until("every request sent recorded", Duration::from_secs(30), || async { Ok(recorded().await? == gone.requests()) })
        .await;
    assert_eq!(recorded().await.unwrap(), gone.requests(), "every request sent is recorded");
    let states: Vec<String> = sqlx::query_scalar("SELECT DISTINCT state FROM webhook_deliveries")
        .fetch_all(&cluster.pg)
        .await
        .unwrap();
    assert_eq!(states, ["disabled"]);
    let disabled: bool =
        sqlx::query_scalar("SELECT disabled_at IS NOT NULL FROM webhook_endpoints")
            .fetch_one(&cluster.pg)
            .await
            .unwrap();
    assert!(disabled, "the endpoint is disabled");
    assert!(
        !cluster
            .api
            .as_ref()
            .unwrap()
            .log_text()
            .contains("could not record"),
        "no attempt went unrecorded"
    );
}

/// A receiver that hangs holds up only its own deliveries: another receiver's webhooks
/// arrive while it hangs, though it has more deliveries due than the dispatcher sends at once.
#[tokio::test]
async fn a_hanging_receiver_holds_up_no_other_receiver() {
    use std::sync::atomic::Ordering::SeqCst;
    let (hanging, hanging_url) = HeldReceiver::start(200).await;
    let (quick, quick_url) = Receiver::start(vec![], None).await;
    let mut cluster = Cluster::start(&api_env("0,100,100")).await.unwrap();
    let _w = cluster.spawn_worker(&[]).unwrap();
    let held: Vec<Value> =
        (0..80).map(|i| json!({"kind": "echo", "input": {"message": i}, "webhook": {"url": hanging_url, "events": ["job.succeeded"]}})).collect();
    let held_ids = cluster.submit_all(&held).await.unwrap();
    cluster
        .wait_terminal(&held_ids, Duration::from_secs(30))
        .await
        .unwrap();
    cluster
        .wait_until("requests hanging", Duration::from_secs(10), || async {
            Ok(hanging.open() > 0)
        })
        .await
        .unwrap();

    let quick_jobs: Vec<Value> =
        (0..3).map(|i| json!({"kind": "echo", "input": {"message": i}, "webhook": {"url": quick_url, "events": ["job.succeeded"]}})).collect();
    let quick_ids = cluster.submit_all(&quick_jobs).await.unwrap();
    cluster
        .wait_terminal(&quick_ids, Duration::from_secs(30))
        .await
        .unwrap();
    let open_during = Arc::new(std::sync::atomic::AtomicUsize::new(usize::MAX));
    cluster
        // Within the dispatcher's 15 s timeout: the hanging requests are not given up on.
        .wait_until(
            "the other receiver's webhooks",
            Duration::from_secs(10),
            || async {
                let done = quick.got().len() >= 3;
                if done {
                    open_during.store(hanging.open(), SeqCst);
                }
                Ok(done)
            },
        )
        .await
        .unwrap();
    let open = open_during.load(SeqCst);
    assert!(
        open > 0,
        "they arrived while the hanging receiver still held its requests"
    );
    assert!(
        open < 80,
        "the hanging receiver does not take every slot: {open} requests open"
    );
    hanging.release();
    wait_deliveries_settled(&cluster, &held_ids, 80).await;
    assert_each_event_once(&quick.got(), 3);
    assert_eq!(hanging.requests(), 80, "each held delivery sent once");
}

/// A receiver that answers a redirect is a failed attempt, not a hop: the dispatcher follows no
/// redirect (one could point it at an internal address the URL check refused), and the place
/// the redirect names hears nothing.
#[tokio::test]
async fn a_redirect_is_a_failed_attempt_and_is_never_followed() {
    let (target, target_url) = Receiver::start(vec![], None).await;
    let hits = Arc::new(Mutex::new(0usize));
    let app = {
        let (hits, target_url) = (hits.clone(), target_url.clone());
        axum::Router::new().route(
            "/hook",
            axum::routing::post(move || {
                let (hits, target_url) = (hits.clone(), target_url.clone());
                async move {
                    *hits.lock().unwrap() += 1;
                    (StatusCode::TEMPORARY_REDIRECT, [("location", target_url)])
                }
            }),
        )
    };
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let redirecting = format!("http://{}/hook", listener.local_addr().unwrap());
    tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });

    let mut cluster = Cluster::start(&api_env("0,100,100")).await.unwrap();
    let ids = cluster.submit_all(&[json!({"kind": "echo", "input": {}, "webhook": {"url": redirecting, "events": ["job.succeeded"]}})]).await.unwrap();
    let _w = cluster.spawn_worker(&[]).unwrap();
    cluster.wait_terminal(&ids, Duration::from_secs(30)).await.unwrap();
    wait_deliveries_settled(&cluster, &ids, 1).await;

    let history = deliveries(&cluster, ids[0]).await;
    assert_ne!(history[0]["state"], "delivered", "{history:?}");
    let attempts = history[0]["history"].as_array().unwrap();
    assert!(!attempts.is_empty() && attempts.iter().all(|a| a["status"] == 307), "{attempts:?}");
    assert_eq!(*hits.lock().unwrap(), attempts.len(), "each attempt reached the redirecting receiver once");
    assert!(target.got().is_empty(), "the redirect's target heard nothing");
}
