//! `GET /metrics`: Prometheus text format, without authentication (scrapers rarely carry
//! keys; keep the API's port internal or filter this path at the proxy if that matters).
//!
//! Counters and histograms are recorded where things happen (requests, submissions, webhook
//! attempts); the queue gauges are read from Postgres and Redis at each scrape, so any API
//! replica reports the whole queue.

use crate::state::AppState;
use axum::extract::State;
use axum::http::header;
use axum::response::IntoResponse;

/// Prometheus metrics.
///
/// Queue gauges from the store, then the rendered registry: requests by route and status with
/// latency histograms, submissions by kind and priority, webhook attempts by outcome, queue
/// gauges by kind, priority and state. No key needed.
#[utoipa::path(
    get,
    path = "/metrics",
    operation_id = "metrics",
    tag = "health",
    responses(
        (status = 200, description = "Prometheus text format 0.0.4", body = String, content_type = "text/plain"),
    ),
)]
pub async fn metrics(State(state): State<AppState>) -> impl IntoResponse {
    match state.store.queue_stats().await {
        Ok(stats) => {
            for s in stats {
                let kind = s.kind.as_str();
                for (priority, c) in &s.priorities {
                    for (st, n) in [
                        ("queued", c.queued),
                        ("scheduled", c.scheduled),
                        ("running", c.running),
                        ("retrying", c.retrying),
                        ("failed", c.failed),
                    ] {
                        metrics::gauge!("tern_queue_jobs", "kind" => kind, "priority" => priority.clone(), "state" => st)
                            .set(n as f64);
                    }
                }
                metrics::gauge!("tern_queue_oldest_queued_seconds", "kind" => kind).set(s.oldest_queued_seconds.unwrap_or(0.0));
                if let Ok(depth) = state.queue.depth(s.kind).await {
                    metrics::gauge!("tern_queue_redis_depth", "kind" => kind).set(depth as f64);
                }
                if let Ok(paused) = state.queue.is_paused(s.kind).await {
                    metrics::gauge!("tern_queue_paused", "kind" => kind).set(if paused { 1.0 } else { 0.0 });
                }
            }
        }
        Err(e) => tracing::warn!(error = %e, "queue gauges not refreshed"),
    }
    (
        [(header::CONTENT_TYPE, "text/plain; version=0.0.4; charset=utf-8")],
        tern_jobs::prometheus::install().render(),
    )
}
