//! The HTTP routes.

pub mod admin;
pub mod dashboard;
pub mod endpoints;
pub mod health;
pub mod jobs;
pub mod metrics;
pub mod models;
pub mod uploads;

use crate::error::ApiError;
use crate::state::AppState;
use axum::extract::DefaultBodyLimit;
use axum::routing::{get, post};
use axum::Router;

pub fn router(state: AppState, cors: crate::middleware::Cors) -> Router {
    let max_body = state.limits.max_body_bytes;
    Router::new()
        .route("/healthz", get(health::healthz))
        .route("/readyz", get(health::readyz))
        .route("/metrics", get(metrics::metrics))
        .route("/admin", get(dashboard::index))
        .route("/admin/app.js", get(dashboard::script))
        .route("/admin/app.css", get(dashboard::style))
        .route("/v1/jobs", post(jobs::submit).get(jobs::list))
        .route("/v1/jobs/batch", post(jobs::submit_batch))
        .route("/v1/jobs/{id}", get(jobs::get))
        .route("/v1/jobs/{id}/events", get(jobs::events))
        .route("/v1/jobs/{id}/cancel", post(jobs::cancel))
        .route("/v1/jobs/{id}/deliveries", get(jobs::deliveries))
        .route("/v1/deliveries/{id}/replay", post(jobs::replay))
        .route("/v1/uploads", post(uploads::create))
        .route("/v1/webhooks/endpoints", post(endpoints::create).get(endpoints::list))
        .route("/v1/webhooks/endpoints/{id}", axum::routing::delete(endpoints::delete))
        .route("/v1/webhooks/endpoints/{id}/rotate", post(endpoints::rotate))
        .route("/v1/admin/keys", post(admin::create_key).get(admin::list_keys))
        .route("/v1/admin/keys/{id}/revoke", post(admin::revoke_key))
        .route("/v1/admin/queues", get(admin::queues))
        .route("/v1/admin/queues/{kind}/pause", post(admin::pause))
        .route("/v1/admin/queues/{kind}/resume", post(admin::resume))
        .route("/v1/admin/queues/{kind}/purge", post(admin::purge))
        .route("/v1/admin/jobs", get(admin::jobs))
        .route("/v1/admin/jobs/retry", post(admin::retry))
        .route("/v1/admin/jobs/{id}", get(admin::job).delete(admin::delete))
        .route("/v1/admin/jobs/{id}/cancel", post(admin::cancel))
        .route("/v1/admin/workers", get(admin::workers))
        .route("/v1/admin/system", get(admin::system))
        .route("/v1/admin/workers/{id}/drain", post(admin::drain))
        .route("/v1/admin/workers/{id}/undrain", post(admin::undrain))
        .route("/v1/admin/models", post(models::register).get(models::list))
        .route("/v1/admin/models/{kind}/rollback", post(models::rollback))
        .fallback(|| async { ApiError::new(axum::http::StatusCode::NOT_FOUND, "not_found", "no such route") })
        .layer(DefaultBodyLimit::max(max_body))
        .layer(axum::middleware::from_fn_with_state(std::sync::Arc::new(cors), crate::middleware::wrap))
        .with_state(state)
}
