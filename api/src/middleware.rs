//! What wraps every request: a request id (the client's `x-request-id` when it sends a sane
//! one, else a new UUID) in the response, in every log line of the request and in error bodies;
//! an access log line with status and latency; security headers; and CORS, off unless origins
//! are configured.

use axum::extract::{Request, State};
use axum::http::{header, HeaderMap, HeaderValue, Method, StatusCode};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use std::sync::Arc;
use std::time::Instant;
use tracing::Instrument;

tokio::task_local! {
    /// The id of the request being handled, for error bodies.
    pub static REQUEST_ID: String;
}

/// Longest client-supplied request id kept; longer or odd ones are replaced.
const REQUEST_ID_MAX: usize = 128;

/// Cross-origin policy. Empty: no CORS headers at all (browsers then refuse cross-origin calls).
#[derive(Debug, Clone, Default)]
pub struct Cors {
    /// Allowed origins (`https://app.example.com`), or `*` for any.
    pub origins: Vec<String>,
}

impl Cors {
    fn allows(&self, origin: &str) -> bool {
        self.origins.iter().any(|o| o == "*" || o.eq_ignore_ascii_case(origin))
    }
}

fn request_id(headers: &HeaderMap) -> String {
    headers
        .get("x-request-id")
        .and_then(|v| v.to_str().ok())
        .filter(|v| !v.is_empty() && v.len() <= REQUEST_ID_MAX && v.bytes().all(|b| b.is_ascii_graphic()))
        .map(str::to_string)
        .unwrap_or_else(|| uuid::Uuid::now_v7().to_string())
}

pub async fn wrap(State(cors): State<Arc<Cors>>, req: Request, next: Next) -> Response {
    let started = Instant::now();
    let id = request_id(req.headers());
    let method = req.method().clone();
    let path = req.uri().path().to_string();
    // The route's pattern, not the path: ids would make a series per job. `{id}` is written
    // `:id`, which every Prometheus tool reads (some text parsers split labels at `}`).
    let route = req
        .extensions()
        .get::<axum::extract::MatchedPath>()
        .map_or_else(|| "unmatched".to_string(), |p| p.as_str().replace('{', ":").replace('}', ""));
    let origin = req
        .headers()
        .get(header::ORIGIN)
        .and_then(|o| o.to_str().ok())
        .filter(|o| cors.allows(o))
        .map(str::to_string);
    let preflight = method == Method::OPTIONS && req.headers().contains_key(header::ACCESS_CONTROL_REQUEST_METHOD);
    let span = tracing::info_span!("request", request_id = %id);
    let mut resp = if preflight && origin.is_some() {
        let mut r = StatusCode::NO_CONTENT.into_response();
        let h = r.headers_mut();
        h.insert(header::ACCESS_CONTROL_ALLOW_METHODS, HeaderValue::from_static("GET, POST, PUT, DELETE, OPTIONS"));
        h.insert(
            header::ACCESS_CONTROL_ALLOW_HEADERS,
            HeaderValue::from_static("authorization, content-type, idempotency-key, x-request-id"),
        );
        h.insert(header::ACCESS_CONTROL_MAX_AGE, HeaderValue::from_static("600"));
        r
    } else {
        REQUEST_ID.scope(id.clone(), next.run(req).instrument(span.clone())).await
    };
    let h = resp.headers_mut();
    if let Ok(v) = HeaderValue::from_str(&id) {
        h.insert("x-request-id", v);
    }
    h.insert(header::X_CONTENT_TYPE_OPTIONS, HeaderValue::from_static("nosniff"));
    h.insert(header::X_FRAME_OPTIONS, HeaderValue::from_static("DENY"));
    h.insert(header::REFERRER_POLICY, HeaderValue::from_static("no-referrer"));
    // The dashboard's pages set their own (self-hosted scripts and styles).
    if !h.contains_key(header::CONTENT_SECURITY_POLICY) {
        h.insert(header::CONTENT_SECURITY_POLICY, HeaderValue::from_static("default-src 'none'; frame-ancestors 'none'"));
    }
    if !h.contains_key(header::CACHE_CONTROL) {
        h.insert(header::CACHE_CONTROL, HeaderValue::from_static("no-store"));
    }
    if let Some(origin) = origin.and_then(|o| HeaderValue::from_str(&o).ok()) {
        h.insert(header::ACCESS_CONTROL_ALLOW_ORIGIN, origin);
        h.insert(header::VARY, HeaderValue::from_static("origin"));
        h.insert(header::ACCESS_CONTROL_EXPOSE_HEADERS, HeaderValue::from_static("x-request-id, retry-after"));
    }
    let status = resp.status().as_u16();
    let latency = started.elapsed().as_secs_f64();
    metrics::counter!("tern_http_requests_total", "method" => method.to_string(), "route" => route.clone(), "status" => status.to_string())
        .increment(1);
    metrics::histogram!("tern_http_request_duration_seconds", "route" => route).record(latency);
    span.in_scope(|| {
        tracing::info!(%method, path, status, latency_ms = latency * 1000.0, "request")
    });
    resp
}
