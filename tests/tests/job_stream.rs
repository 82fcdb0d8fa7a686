//! Live job streams: `GET /v1/jobs/{id}/stream` sends every state change, progress and the
//! generated text as it comes, then the finished job; a client resumes with `Last-Event-ID`
//! through its API replica restarting, missing nothing and getting nothing twice. And
//! `GET /v1/jobs/{id}?wait=` long-polls.

use serde_json::{json, Value};
use std::time::{Duration, Instant};
use tern_e2e::Cluster;

/// One server-sent event.
#[derive(Debug, Clone)]
struct Event {
    event: String,
    id: String,
    data: Value,
}

/// Reads events from a stream until `stop` says so or the stream ends.
async fn read_events(response: &mut reqwest::Response, buffer: &mut String, mut stop: impl FnMut(&Event) -> bool) -> Vec<Event> {
    let mut events = Vec::new();
    loop {
        while let Some(end) = buffer.find("\n\n") {
            let block: String = buffer.drain(..end + 2).collect();
            let mut event = Event { event: "message".into(), id: String::new(), data: Value::Null };
            for line in block.lines() {
                if let Some(v) = line.strip_prefix("event:") {
                    event.event = v.trim().to_string();
                } else if let Some(v) = line.strip_prefix("id:") {
                    event.id = v.trim().to_string();
                } else if let Some(v) = line.strip_prefix("data:") {
                    event.data = serde_json::from_str(v.trim()).unwrap();
                }
            }
            if event.data.is_null() {
                continue; // a keep-alive comment
            }
            let done = stop(&event);
            events.push(event);
            if done {
                return events;
            }
        }
        match tokio::time::timeout(Duration::from_secs(120), response.chunk()).await.expect("the stream went quiet") {
            Ok(Some(chunk)) => buffer.push_str(&String::from_utf8_lossy(&chunk)),
            _ => return events,
        }
    }
}

async fn open(cluster: &Cluster, id: &str, last_event_id: Option<&str>) -> reqwest::Response {
    let mut request = cluster.http.get(cluster.url(&format!("/v1/jobs/{id}/stream")));
    if let Some(last) = last_event_id {
        request = request.header("Last-Event-ID", last);
    }
    let response = request.send().await.unwrap();
    assert_eq!(response.status(), 200);
    assert!(response.headers()["content-type"].to_str().unwrap().starts_with("text/event-stream"));
    response
}

#[tokio::test]
async fn a_stream_shows_a_job_live_and_resumes_through_a_restart() {
    let mut cluster = Cluster::start(&[]).await.unwrap();
    let (status, job) = cluster
        .post("/v1/jobs", &json!({ "kind": "generate", "input": { "prompt": "Once upon a time", "max_tokens": 96, "temperature": 0 } }))
        .await
        .unwrap();
    assert_eq!(status, 201, "{job}");
    let id = job["id"].as_str().unwrap().to_string();

    // Queued, no worker yet: the stream shows that much and waits.
    let mut first = open(&cluster, &id, None).await;
    let mut buffer = String::new();
    let before = read_events(&mut first, &mut buffer, |e| e.event == "state").await;
    assert_eq!(before[0].data["state"], "queued", "{before:?}");

    // A worker takes it; the stream follows the text until some has come.
    let _worker = cluster.spawn_worker(&[("TERN_WORKER_KINDS", "generate")]).unwrap();
    let mut seen = before;
    seen.extend(read_events(&mut first, &mut buffer, |e| e.event == "text" || e.event == "job").await);
    drop(first);
    let last = seen.last().unwrap().id.clone();

    // The API replica restarts; the client comes back with the last id it saw.
    cluster.api.as_mut().unwrap().kill9();
    cluster.start_api().await.unwrap();
    let mut second = open(&cluster, &id, Some(&last)).await;
    let mut buffer = String::new();
    let after = read_events(&mut second, &mut buffer, |e| e.event == "job").await;
    assert_eq!(after.last().unwrap().event, "job", "{after:?}");
    seen.extend(after);

    let finished = &seen.last().unwrap().data;
    assert_eq!(finished["state"], "succeeded", "{finished}");
    // Every state change once, in order: as the job's timeline has them.
    let states: Vec<&str> = seen.iter().filter(|e| e.event == "state").map(|e| e.data["state"].as_str().unwrap()).collect();
    let (_, timeline) = cluster.get(&format!("/v1/jobs/{id}/events")).await.unwrap();
    let recorded: Vec<&str> = timeline["events"].as_array().unwrap().iter().map(|e| e["state"].as_str().unwrap()).collect();
    assert_eq!(states, recorded, "{seen:?}");
    // The text in pieces that follow one another, none sent twice, adding up to a start of
    // the output's text (the rest may have come while the client was away).
    let mut text = String::new();
    for e in seen.iter().filter(|e| e.event == "text") {
        assert_eq!(e.data["offset"].as_u64().unwrap() as usize, text.len(), "{seen:?}");
        text.push_str(e.data["delta"].as_str().unwrap());
    }
    assert!(!text.is_empty(), "some text came live: {seen:?}");
    let output = finished["output"]["inline"]["text"].as_str().unwrap();
    assert!(output.starts_with(&text), "{text:?} vs {output:?}");
    assert!(seen.iter().any(|e| e.event == "progress" && e.data["total"] == 96), "{seen:?}");
    // Ids only grow.
    let ids: Vec<(i64, usize)> = seen
        .iter()
        .map(|e| {
            let (event, text) = e.id.split_once('.').unwrap_or((&e.id, "0"));
            (event.parse().unwrap(), text.parse().unwrap())
        })
        .collect();
    assert!(ids.windows(2).all(|w| w[0] <= w[1]), "{ids:?}");

    // A finished job's stream is its timeline and the job, at once.
    let mut again = open(&cluster, &id, None).await;
    let replay = read_events(&mut again, &mut String::new(), |e| e.event == "job").await;
    assert_eq!(replay.iter().filter(|e| e.event == "state").count(), recorded.len());
    let (status, _) = cluster.get(&format!("/v1/jobs/{}/stream", uuid::Uuid::now_v7())).await.unwrap();
    assert_eq!(status, 404);
}

#[tokio::test]
async fn a_get_can_wait_for_the_job_to_finish() {
    let mut cluster = Cluster::start(&[]).await.unwrap();
    let (_, job) = cluster.post("/v1/jobs", &json!({ "kind": "embed", "input": { "texts": ["wait for me"] } })).await.unwrap();
    let id = job["id"].as_str().unwrap().to_string();
    // No worker: the wait runs out and the job is shown as it is.
    let started = Instant::now();
    let (status, waited) = cluster.get(&format!("/v1/jobs/{id}?wait=1s")).await.unwrap();
    assert_eq!((status, waited["state"].as_str()), (200, Some("queued")));
    assert!(started.elapsed() >= Duration::from_secs(1), "it waited");
    // A worker comes: the same request answers once the job finished.
    let _worker = cluster.spawn_worker(&[("TERN_WORKER_KINDS", "embed")]).unwrap();
    let (status, done) = cluster.get(&format!("/v1/jobs/{id}?wait=60s")).await.unwrap();
    assert_eq!((status, done["state"].as_str()), (200, Some("succeeded")), "{done}");
    for bad in ["61s", "soon", "1.5s", "1500ms"] {
        let (status, error) = cluster.get(&format!("/v1/jobs/{id}?wait={bad}")).await.unwrap();
        assert_eq!((status, error["error"]["code"].as_str()), (400, Some("invalid_wait")), "{bad}");
    }
}

/// A transcription's text streams as its windows finish, not at the end: a worker that decodes
/// one window at a time reports the text of each, and the stream sends it before the job's
/// last state. The job asked for word timestamps and gave a prompt: every segment comes with
/// its words, and the output keeps to its schema.
#[tokio::test]
async fn a_transcription_streams_its_text_window_by_window() {
    let mut cluster = Cluster::start(&[]).await.unwrap();
    let librivox = tern_e2e::models_dir().join("testdata/librivox");
    let mut pcm = Vec::new();
    let mut names: Vec<_> = std::fs::read_dir(&librivox).unwrap().map(|e| e.unwrap().path()).filter(|p| p.extension().is_some_and(|x| x == "wav")).collect();
    names.sort();
    for path in names.iter().cycle() {
        pcm.extend(tern_models::audio::decode_mono_16k(&std::fs::read(path).unwrap()).unwrap());
        pcm.extend(std::iter::repeat_n(0.0f32, 16_000));
        if pcm.len() > 16_000 * 65 {
            break;
        }
    }
    use base64::Engine;
    let audio = base64::engine::general_purpose::STANDARD.encode(tern_e2e::wav_16k_mono(&pcm));
    let input = json!({ "audio": { "base64": audio }, "word_timestamps": true, "prompt": "Sense and Sensibility, by Jane Austen." });
    let (status, job) = cluster.post("/v1/jobs", &json!({ "kind": "transcribe", "input": input })).await.unwrap();
    assert_eq!(status, 201, "{job}");
    let windows = job["cost"].as_u64().unwrap();
    assert!(windows >= 3, "{job}");
    let id = job["id"].as_str().unwrap().to_string();
    let mut stream = open(&cluster, &id, None).await;
    let _worker = cluster.spawn_worker(&[("TERN_WORKER_KINDS", "transcribe"), ("TERN_TRANSCRIBE_BATCH_WINDOWS", "1")]).unwrap();
    let seen = read_events(&mut stream, &mut String::new(), |e| e.event == "job").await;
    let finished = &seen.last().unwrap().data;
    assert_eq!(finished["state"], "succeeded", "{finished}");
    let texts: Vec<usize> = seen.iter().enumerate().filter(|(_, e)| e.event == "text").map(|(i, _)| i).collect();
    let last_state = seen.iter().rposition(|e| e.event == "state").unwrap();
    assert!(texts.len() >= 2, "text came in pieces: {seen:?}");
    assert!(texts[0] < last_state, "text came before the job ended: {seen:?}");
    let mut text = String::new();
    for &i in &texts {
        assert_eq!(seen[i].data["offset"].as_u64().unwrap() as usize, text.len());
        text.push_str(seen[i].data["delta"].as_str().unwrap());
    }
    let body: Value = reqwest::get(finished["output"]["url"].as_str().unwrap()).await.unwrap().json().await.unwrap();
    tern_jobs::schemas::validate_output(tern_jobs::JobKind::Transcribe, &body).unwrap();
    // The last window's text may land as the job ends, after the stream's last look.
    assert!(body["text"].as_str().unwrap().starts_with(&text), "the streamed text starts the transcript: {text:?}");
    let segments = body["segments"].as_array().unwrap();
    let mut previous = 0.0;
    for s in segments {
        let words = s["words"].as_array().unwrap_or_else(|| panic!("words in {s}"));
        let spelled: String = words.iter().map(|w| w["word"].as_str().unwrap()).collect();
        assert_eq!(spelled.trim(), s["text"].as_str().unwrap());
        for w in words {
            let (start, end) = (w["start"].as_f64().unwrap(), w["end"].as_f64().unwrap());
            assert!(start >= previous - 0.01 && start <= end, "{w} after {previous}");
            previous = start;
        }
    }
    assert!(previous > 30.0, "words are timed across the windows: last at {previous}");
}

/// Postgres transactions committed in the cluster's database so far.
async fn commits(cluster: &Cluster) -> i64 {
    // Statistics reach the shared view within a second of a transaction's end.
    tokio::time::sleep(Duration::from_millis(1200)).await;
    sqlx::query_scalar("SELECT xact_commit FROM pg_stat_database WHERE datname = current_database()").fetch_one(&cluster.pg).await.unwrap()
}

/// Thousands of streams on a job scheduled a year ahead hold no database connection and send
/// Postgres nothing while the job waits: they are woken by its notifications, not a poll each.
/// Another tenant's reads stay quick meanwhile; one stream or wait past the key's limit gets
/// 429 `too_many_streams` while another key still gets its own; and when the job ends, every
/// stream gets the final `job` event.
#[tokio::test]
async fn thousands_of_open_streams_cost_the_database_nothing_and_the_cap_answers_429() {
    const STREAMS: usize = 2_000;
    let cluster = Cluster::start(&[("TERN_MAX_STREAMS_PER_KEY", "2000"), ("TERN_MAX_STREAMS", "3000"), ("TERN_RATE_LIMIT_PER_SEC", "0")]).await.unwrap();
    let run_at = (chrono::Utc::now() + chrono::Duration::days(365)).to_rfc3339();
    let (status, job) = cluster.post("/v1/jobs", &json!({ "kind": "embed", "input": { "texts": ["next year"] }, "run_at": run_at })).await.unwrap();
    assert_eq!((status, job["state"].as_str()), (201, Some("scheduled")), "{job}");
    let id = job["id"].as_str().unwrap().to_string();
    let other_key = cluster.create_key("other", "jobs:write,jobs:read").unwrap();
    let other = cluster.client_for(&other_key).unwrap();
    let other_url = {
        let r = other.post(cluster.url("/v1/jobs")).json(&json!({ "kind": "embed", "input": { "texts": ["mine"] } })).send().await.unwrap();
        let v: Value = r.json().await.unwrap();
        cluster.url(&format!("/v1/jobs/{}", v["id"].as_str().unwrap()))
    };
    let latencies = |n: usize| {
        let (other, url) = (other.clone(), other_url.clone());
        async move {
            let mut took = Vec::new();
            for _ in 0..n {
                let start = Instant::now();
                let r = other.get(&url).send().await.unwrap();
                assert_eq!(r.status(), 200);
                took.push(start.elapsed());
            }
            took.sort();
            took
        }
    };
    let quiet = latencies(20).await;
    let (before, at) = (commits(&cluster).await, Instant::now());
    tokio::time::sleep(Duration::from_secs(3)).await;
    let idle = (commits(&cluster).await - before) as f64 / at.elapsed().as_secs_f64();

    // One connection a stream (HTTP/1.1), as browsers open them; no client timeout.
    let streaming = reqwest::Client::new();
    let streams: Vec<reqwest::Response> = futures::future::join_all((0..STREAMS).map(|_| {
        let request = streaming.get(cluster.url(&format!("/v1/jobs/{id}/stream"))).bearer_auth(&cluster.api_key);
        async move { request.send().await.unwrap() }
    }))
    .await;
    assert!(streams.iter().all(|r| r.status() == 200), "every stream under the limit opens");
    // Each has read the job once: its first event, the state it is in.
    let mut streams: Vec<(reqwest::Response, String)> = futures::future::join_all(streams.into_iter().map(|mut r| async move {
        let mut buffer = String::new();
        let first = read_events(&mut r, &mut buffer, |e| e.event == "state").await;
        assert_eq!(first.last().map(|e| e.data["state"].clone()), Some(json!("scheduled")));
        (r, buffer)
    }))
    .await;

    // While they wait: the database hears almost nothing from them (a poll each would be
    // thousands of queries a second) and another tenant's reads stay quick. First the counts of
    // the streams' opening reads land (a connection reports them when next used, or within 10 s
    // idle): until a second passes with few new ones.
    let mut last = commits(&cluster).await;
    for _ in 0..20 {
        let now = commits(&cluster).await;
        if (now - last) as f64 <= idle * 1.2 + 20.0 {
            break;
        }
        last = now;
    }
    let (before, at) = (commits(&cluster).await, Instant::now());
    tokio::time::sleep(Duration::from_secs(3)).await;
    let per_second = (commits(&cluster).await - before) as f64 / at.elapsed().as_secs_f64();
    eprintln!("{idle:.0} transactions a second with no stream open, {per_second:.0} with {STREAMS}");
    assert!(per_second < idle + 50.0, "{per_second:.0} transactions a second with {STREAMS} streams open, {idle:.0} with none");
    let busy = latencies(50).await;
    eprintln!("another tenant's GET: median {:?} (max {:?}) before, {:?} (max {:?}) with {STREAMS} streams open", quiet[10], quiet[19], busy[25], busy[49]);
    assert!(busy[25] < Duration::from_millis(100) && busy[49] < Duration::from_secs(1), "median {:?}, slowest {:?}", busy[25], busy[49]);

    // The key's limit: one more stream, or a wait, is refused; another key is not.
    let refused = cluster.http.get(cluster.url(&format!("/v1/jobs/{id}/stream"))).send().await.unwrap();
    assert_eq!(refused.status(), 429);
    assert!(refused.headers().contains_key("retry-after"));
    assert_eq!(refused.json::<Value>().await.unwrap()["error"]["code"], "too_many_streams");
    let (status, error) = cluster.get(&format!("/v1/jobs/{id}?wait=5s")).await.unwrap();
    assert_eq!((status, error["error"]["code"].as_str()), (429, Some("too_many_streams")));
    let (status, _) = cluster.get(&format!("/v1/jobs/{id}")).await.unwrap();
    assert_eq!(status, 200, "a plain read is no stream");
    let mine = other.get(other_url.clone() + "/stream").send().await.unwrap();
    assert_eq!(mine.status(), 200, "another key's streams are its own");
    drop(mine);

    // The job ends: every stream gets the finished job and closes.
    let (status, canceled) = cluster.post(&format!("/v1/jobs/{id}/cancel"), &json!({})).await.unwrap();
    assert_eq!(status, 200, "{canceled}");
    let finished = futures::future::join_all(streams.iter_mut().map(|(r, buffer)| async move {
        let events = read_events(r, buffer, |e| e.event == "job").await;
        events.last().map(|e| (e.event.clone(), e.data["state"].as_str().unwrap_or_default().to_string()))
    }))
    .await;
    assert!(finished.iter().all(|e| e.as_ref().map(|(ev, st)| (ev.as_str(), st.as_str())) == Some(("job", "canceled"))), "every stream saw the end");
    // Closed streams no longer count: the key may stream again.
    let again = cluster.http.get(cluster.url(&format!("/v1/jobs/{id}/stream"))).send().await.unwrap();
    assert_eq!(again.status(), 200);
}

/// A stream lives at most `TERN_STREAM_MAX_SECONDS`; the client resumes it with
/// `Last-Event-ID` and gets what came after, nothing twice.
#[tokio::test]
async fn a_stream_ends_after_its_lifetime_and_resumes_where_it_left() {
    let mut cluster = Cluster::start(&[("TERN_STREAM_MAX_SECONDS", "2")]).await.unwrap();
    let (_, job) = cluster.post("/v1/jobs", &json!({ "kind": "embed", "input": { "texts": ["short lived"] } })).await.unwrap();
    let id = job["id"].as_str().unwrap().to_string();
    let started = Instant::now();
    let mut first = open(&cluster, &id, None).await;
    let mut buffer = String::new();
    let events = read_events(&mut first, &mut buffer, |_| false).await;
    assert!(started.elapsed() >= Duration::from_secs(2), "it lived its lifetime");
    assert_eq!(events.iter().map(|e| e.data["state"].as_str().unwrap_or_default()).collect::<Vec<_>>(), ["queued"], "{events:?}");
    let last = events.last().unwrap().id.clone();

    let _worker = cluster.spawn_worker(&[("TERN_WORKER_KINDS", "embed")]).unwrap();
    let mut second = open(&cluster, &id, Some(&last)).await;
    let mut buffer = String::new();
    let rest = read_events(&mut second, &mut buffer, |e| e.event == "job").await;
    let states: Vec<&str> = rest.iter().filter(|e| e.event == "state").map(|e| e.data["state"].as_str().unwrap()).collect();
    assert_eq!(states, ["running", "succeeded"], "after the last event seen, nothing twice: {rest:?}");
    assert_eq!(rest.last().unwrap().data["state"], "succeeded");
}

/// A streamed chat whose job is retried mid-stream (its worker killed, its lease run out, the
/// job run again elsewhere) ends with an error event `job_retried` rather than splicing the
/// second attempt's text onto the first's.
#[tokio::test]
async fn a_streamed_chat_whose_job_is_retried_ends_with_job_retried() {
    let lease = [("TERN_LEASE_MS", "2000"), ("TERN_WORKER_KINDS", "generate")];
    let mut cluster = Cluster::start(&lease[..1]).await.unwrap();
    let mut first_worker = cluster.spawn_worker(&lease).unwrap();
    let mut response = cluster
        .http
        .post(cluster.url("/v1/chat/completions"))
        .json(&json!({
            "model": "x", "stream": true, "max_tokens": 2048, "temperature": 1.0, "seed": 7,
            "messages": [{"role": "user", "content": "Write a very long story about the sea."}],
        }))
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), 200);
    let mut text = String::new();
    // Some of the first attempt's text, then its worker dies.
    while !text.contains("\"content\"") {
        let chunk = tokio::time::timeout(Duration::from_secs(120), response.chunk()).await.expect("text comes").unwrap().expect("the stream is open");
        text.push_str(&String::from_utf8_lossy(&chunk));
    }
    first_worker.kill9();
    let _second_worker = cluster.spawn_worker(&lease).unwrap();
    let mut rest = String::new();
    while let Some(chunk) = tokio::time::timeout(Duration::from_secs(120), response.chunk()).await.expect("the stream goes on").unwrap() {
        rest.push_str(&String::from_utf8_lossy(&chunk));
    }
    let last: Value = rest.lines().filter_map(|l| l.strip_prefix("data: ")).filter_map(|d| serde_json::from_str(d).ok()).last().expect("events after the kill");
    assert_eq!(last["error"]["code"], "job_retried", "{rest}");
    assert!(!rest.contains("[DONE]"), "the stream ends with the error");
}
