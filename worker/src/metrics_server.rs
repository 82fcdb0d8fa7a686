//! The worker's `GET /metrics` (Prometheus text format) on a port of its own
//! (`TERN_METRICS_ADDR`). Job, batch and model counters are recorded where they happen; the
//! model cache's state is copied into gauges at each scrape.

use crate::engine::Engine;
use axum::extract::State;
use axum::http::header;
use axum::response::IntoResponse;
use axum::routing::get;
use axum::Router;
use std::net::SocketAddr;
use std::sync::Arc;

async fn metrics(State(engine): State<Option<Arc<Engine>>>) -> impl IntoResponse {
    if let Some(engine) = engine {
        let r = engine.report.lock().expect("not poisoned").clone();
        metrics::gauge!("tern_worker_memory_budget_bytes").set(r.budget_bytes as f64);
        metrics::gauge!("tern_worker_models_resident_bytes").set(r.resident_bytes as f64);
        metrics::counter!("tern_model_cache_hits_total").absolute(r.hits);
        metrics::counter!("tern_model_cache_misses_total").absolute(r.misses);
        metrics::counter!("tern_model_cache_evictions_total").absolute(r.evictions);
        metrics::counter!("tern_model_load_failures_total").absolute(r.load_failures);
        for m in &r.models {
            metrics::gauge!("tern_model_resident_bytes", "model" => m.name.clone()).set(m.bytes as f64);
            metrics::gauge!("tern_model_unit_bytes", "model" => m.name.clone()).set(m.unit_bytes as f64);
        }
        let b = engine.batching();
        for (family, budget) in b.budgets.as_object().into_iter().flatten() {
            metrics::gauge!("tern_engine_batch_budget", "budget" => family.clone()).set(budget.as_f64().unwrap_or(0.0));
        }
        if let Some(free) = b.free_bytes {
            metrics::gauge!("tern_engine_device_free_bytes").set(free as f64);
        }
        // Only grows: the busy fraction over an interval is its rise over the interval's length.
        metrics::gauge!("tern_engine_busy_seconds").set(b.busy_seconds);
    }
    (
        [(header::CONTENT_TYPE, "text/plain; version=0.0.4; charset=utf-8")],
        tern_jobs::prometheus::install().render(),
    )
}

/// Binds `addr` for [`serve`]. A port already in use is logged, not fatal: a worker without
/// metrics still runs jobs.
pub async fn bind(addr: SocketAddr) -> Option<tokio::net::TcpListener> {
    match tokio::net::TcpListener::bind(addr).await {
        Ok(listener) => {
            tracing::info!(%addr, "metrics at /metrics");
            Some(listener)
        }
        Err(e) => {
            tracing::warn!(%addr, error = %e, "metrics port unavailable; running without /metrics");
            None
        }
    }
}

/// Serves `/metrics` on `listener` until the process ends.
pub async fn serve(listener: tokio::net::TcpListener, engine: Option<Arc<Engine>>) {
    let app = Router::new().route("/metrics", get(metrics)).with_state(engine);
    if let Err(e) = axum::serve(listener, app).await {
        tracing::warn!(error = %e, "metrics server stopped");
    }
}
