//! `GET /v1/jobs/{id}/stream`: a job's life as server-sent events, for clients that would
//! rather watch than poll.
//!
//! - `state`: each state the job enters, as its timeline records it (`{state, at, attempt,
//!   worker_id, detail}`); the event's id is the timeline entry's.
//! - `progress`: `{done, total}` as the worker reports it while the job runs.
//! - `text`: generated text as it comes, `{delta, offset}` (generate jobs).
//! - `job`: the finished job, as `GET /v1/jobs/{id}` shows it; the stream ends after it.
//!
//! Every event carries an id (`{timeline id}` or `{timeline id}.{text bytes}`), so a client
//! that reconnects with `Last-Event-ID`, to this replica or another after a restart, gets
//! what it missed and nothing twice: the state changes after that one, then the progress and
//! the text past what it had. The stream reads Postgres and Redis only, so any replica serves it.
//!
//! The stream reads the job from Postgres only when the job's timeline grew
//! ([`crate::job_watch`]), and its progress from Redis every [`POLL`] while it runs: an open
//! stream on a waiting job costs nothing. Streams count against the caller's and the process's
//! open streams (429 `too_many_streams` over them), and each ends after
//! `TERN_STREAM_MAX_SECONDS` (default 600): the client resumes with `Last-Event-ID`, as
//! EventSource does by itself.

use super::jobs::{job_view, own_job, parse_id};
use crate::auth::Caller;
use crate::error::ApiError;
use crate::openapi;
use crate::state::AppState;
use axum::extract::{Path, State};
use axum::http::HeaderMap;
use axum::response::sse::{Event, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use futures::StreamExt;
use serde_json::json;
use std::time::Duration;
use tern_jobs::JobState;
use uuid::Uuid;

/// How often the stream reads a running job's progress.
const POLL: Duration = Duration::from_millis(150);

/// Where a client is: the last timeline entry and the bytes of text it has.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Cursor {
    pub event: i64,
    pub text: usize,
}

impl Cursor {
    /// A `Last-Event-ID`, as this stream writes them; anything else starts from the beginning.
    pub fn parse(id: &str) -> Cursor {
        let (event, text) = id.split_once('.').unwrap_or((id, "0"));
        match (event.trim().parse(), text.trim().parse()) {
            (Ok(event), Ok(text)) => Cursor { event, text },
            _ => Cursor::default(),
        }
    }

    fn id(self) -> String {
        if self.text == 0 {
            self.event.to_string()
        } else {
            format!("{}.{}", self.event, self.text)
        }
    }
}

/// Watch a job.
///
/// `GET /v1/jobs/{id}/stream`: server-sent events `state` (every state the job enters),
/// `progress` and `text` (while it runs), then `job` (the finished job), after which the
/// stream ends. Reconnect with `Last-Event-ID` to resume without repeats.
#[utoipa::path(
    get,
    path = "/v1/jobs/{id}/stream",
    operation_id = "stream_job",
    tag = "jobs",
    params(
        ("id" = uuid::Uuid, Path, description = "The job's id"),
        ("Last-Event-ID" = Option<String>, Header, description = "The id of the last event received: the stream resumes after it"),
    ),
    responses(
        (status = 200, description = "`text/event-stream`: events `state`, `progress`, `text`, then `job`", content_type = "text/event-stream", body = openapi::JobStreamEvent),
        (status = 404, description = "`not_found`: no such job of this tenant", body = openapi::Error),
        (status = 429, description = "`too_many_streams`: this API key or this server has as many streams and waits open as allowed (`TERN_MAX_STREAMS_PER_KEY`, `TERN_MAX_STREAMS`)", body = openapi::Error,
            headers(("Retry-After" = u64, description = "Seconds to wait before trying again"))),
    ),
    security(("bearer" = ["jobs:read"]), ("api_key" = ["jobs:read"])),
)]
pub async fn stream(State(state): State<AppState>, caller: Caller, headers: HeaderMap, Path(id): Path<String>) -> Result<Response, ApiError> {
    let principal = caller.require("jobs:read")?;
    let id = parse_id(&id)?;
    own_job(&state, &principal.tenant, id).await?;
    let cursor = headers.get("last-event-id").and_then(|v| v.to_str().ok()).map(Cursor::parse).unwrap_or_default();
    let changes = state.watches.watch(principal.key_id, id)?;
    let ends = tokio::time::Instant::now() + state.stream_lifetime;
    let watch = Watch { state, id, cursor, progress: None, done: false, changes, ends, running: None, stale: true };
    let events = futures::stream::unfold(watch, |mut w| async move {
        if w.done {
            return None;
        }
        let events = w.next_events().await;
        Some((futures::stream::iter(events.into_iter().map(Ok::<_, std::convert::Infallible>)), w))
    })
    .flatten();
    Ok(Sse::new(events).keep_alive(KeepAlive::default()).into_response())
}

/// One client's watch over a job.
struct Watch {
    state: AppState,
    id: Uuid,
    cursor: Cursor,
    /// The last `(done, total)` sent.
    progress: Option<(u64, u64)>,
    done: bool,
    /// Wakes the stream when the job's timeline grows.
    changes: crate::job_watch::JobWatch,
    /// When the stream ends (the client resumes with `Last-Event-ID`).
    ends: tokio::time::Instant,
    /// The job's kind while it runs, as last read.
    running: Option<tern_jobs::JobKind>,
    /// Whether the job may have changed since it was last read.
    stale: bool,
}

impl Watch {
    /// What happened since the last look; waits until something did.
    async fn next_events(&mut self) -> Vec<Event> {
        loop {
            match self.look().await {
                Ok(events) if events.is_empty() => {
                    let left = self.ends.saturating_duration_since(tokio::time::Instant::now());
                    if left.is_zero() {
                        // Its lifetime is over: the client resumes after its last event.
                        self.done = true;
                        return Vec::new();
                    }
                    if self.changes.pause(self.running.is_some(), POLL, left).await {
                        self.stale = true;
                    }
                }
                Ok(events) => return events,
                Err(e) => {
                    self.done = true;
                    return vec![Event::default().event("error").data(json!({ "code": e.code, "message": e.message }).to_string())];
                }
            }
        }
    }

    async fn look(&mut self) -> Result<Vec<Event>, ApiError> {
        let mut events = Vec::new();
        if !self.stale {
            if let Some(kind) = self.running {
                self.running_news(kind, &mut events).await?;
            }
            return Ok(events);
        }
        self.stale = false;
        // The job first, then its timeline: a job seen finished has every entry written.
        let job = self.state.store.get(self.id).await?.ok_or_else(ApiError::not_found)?;
        for (event_id, entry) in self.state.store.events_after(self.id, self.cursor.event).await? {
            // A new attempt generates its text anew.
            if entry.state == JobState::Running {
                self.cursor.text = 0;
                self.progress = None;
            }
            self.cursor.event = event_id;
            events.push(Event::default().event("state").id(self.cursor.id()).data(serde_json::to_string(&entry).expect("events serialise")));
        }
        if job.state.is_terminal() {
            let view = job_view(&self.state, &job, false).await?;
            events.push(Event::default().event("job").id(self.cursor.id()).data(view.to_string()));
            self.done = true;
            return Ok(events);
        }
        self.running = (job.state == JobState::Running).then_some(job.kind);
        if let Some(kind) = self.running {
            self.running_news(kind, &mut events).await?;
        }
        Ok(events)
    }

    /// Progress and text past what the client has.
    async fn running_news(&mut self, kind: tern_jobs::JobKind, events: &mut Vec<Event>) -> Result<(), ApiError> {
        let Some(progress) = self.state.queue.progress(kind, self.id).await? else { return Ok(()) };
        if let Some(text) = &progress.text {
            // Only whole characters: the worker's text is UTF-8 and grows at its end.
            if let Some(delta) = text.get(self.cursor.text..).filter(|d| !d.is_empty()) {
                let offset = self.cursor.text;
                self.cursor.text = text.len();
                events.push(Event::default().event("text").id(self.cursor.id()).data(json!({ "delta": delta, "offset": offset }).to_string()));
            }
        }
        if self.progress != Some((progress.done, progress.total)) {
            self.progress = Some((progress.done, progress.total));
            events.push(
                Event::default().event("progress").id(self.cursor.id()).data(json!({ "done": progress.done, "total": progress.total }).to_string()),
            );
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn event_ids_round_trip() {
        for cursor in [Cursor { event: 12, text: 0 }, Cursor { event: 12, text: 345 }] {
            assert_eq!(Cursor::parse(&cursor.id()), cursor);
        }
        assert_eq!(Cursor::parse("garbage"), Cursor::default());
        assert_eq!(Cursor::parse("3.x"), Cursor::default());
    }
}
