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
