//! The HTTP routes.
//!
//! The public API is registered with `utoipa_axum`'s `routes!`, which takes each handler's
//! route from its `#[utoipa::path]` attribute along with its OpenAPI operation: the router and
//! `GET /openapi.json` come from the same registrations, so neither can lack a route of the
//! other. Handlers that share a path share one `routes!`.

pub mod admin;
pub mod dashboard;
pub mod endpoints;
pub mod health;
pub mod job_stream;
pub mod jobs;
pub mod metrics;
pub mod models;
pub mod outputs;
pub mod tenants;
pub mod uploads;

use crate::error::ApiError;
use crate::openapi;
use crate::state::AppState;
use axum::extract::DefaultBodyLimit;
use axum::routing::get;
use axum::Router;
use utoipa::OpenApi as _;
use utoipa_axum::router::OpenApiRouter;
use utoipa_axum::routes;

/// Every route of the public API with its operation. Building it needs no state, so the
/// document can be made without a server.
fn api() -> OpenApiRouter<AppState> {
    OpenApiRouter::with_openapi(openapi::ApiDoc::openapi())
        .routes(routes!(health::healthz))
        .routes(routes!(health::readyz))
        .routes(routes!(metrics::metrics))
        .routes(routes!(openapi::serve))
        .routes(routes!(jobs::submit, jobs::list))
        .routes(routes!(jobs::submit_batch))
        .routes(routes!(jobs::get))
        .routes(routes!(jobs::events))
        .routes(routes!(job_stream::stream))
        .routes(routes!(jobs::cancel))
        .routes(routes!(jobs::deliveries))
        .routes(routes!(jobs::replay))
        .routes(routes!(outputs::download))
        .routes(routes!(uploads::create))
        .routes(routes!(endpoints::create, endpoints::list))
        .routes(routes!(endpoints::delete))
        .routes(routes!(endpoints::rotate))
        .routes(routes!(admin::create_key, admin::list_keys))
        .routes(routes!(admin::revoke_key))
        .routes(routes!(admin::queues))
        .routes(routes!(admin::pause))
        .routes(routes!(admin::resume))
        .routes(routes!(admin::purge))
        .routes(routes!(admin::jobs))
        .routes(routes!(admin::retry))
        .routes(routes!(admin::job, admin::delete))
        .routes(routes!(admin::cancel))
        .routes(routes!(admin::workers))
        .routes(routes!(admin::system))
        .routes(routes!(admin::run_now))
        .routes(routes!(admin::history))
        .routes(routes!(admin::drain))
        .routes(routes!(admin::undrain))
        .routes(routes!(tenants::list))
        .routes(routes!(tenants::set, tenants::reset))
        .routes(routes!(models::register, models::list))
        .routes(routes!(models::rollback))
}

pub fn router(state: AppState, cors: crate::middleware::Cors) -> Router {
    let max_body = state.limits.max_body_bytes;
    let (documented, _) = api().split_for_parts();
    documented
        // OpenAI's routes, as its own API reference describes them: not in this document.
        .merge(crate::openai::router(state.limits.max_audio_upload_bytes, state.limits.max_batch_file_bytes))
        // The dashboard's static files are a page, not API: they stay out of the document.
        .route("/admin", get(dashboard::index))
        .route("/admin/app.js", get(dashboard::script))
        .route("/admin/app.css", get(dashboard::style))
        .route("/admin/favicon.svg", get(dashboard::icon))
        // Browsers ask for it whatever the page says.
        .route("/favicon.ico", get(dashboard::icon))
        .fallback(|| async { ApiError::new(axum::http::StatusCode::NOT_FOUND, "not_found", "no such route") })
        .method_not_allowed_fallback(|| async {
            ApiError::new(axum::http::StatusCode::METHOD_NOT_ALLOWED, "method_not_allowed", "this route does not take that method")
        })
        .layer(DefaultBodyLimit::max(max_body))
        .layer(axum::middleware::from_fn_with_state(std::sync::Arc::new(cors), crate::middleware::wrap))
        .with_state(state)
}

/// The OpenAPI document as utoipa builds it from the routes; [`openapi::document`] completes
/// it for serving.
pub fn openapi() -> utoipa::openapi::OpenApi {
    api().into_openapi()
}
