//! `/admin`: the operators' dashboard. Four static files built into the binary, no front-end
//! build: the page signs in with an admin key (kept in the tab's session storage) and polls the
//! admin API every 2 s.

use axum::http::header;
use axum::response::IntoResponse;

const INDEX: &str = include_str!("../dashboard/index.html");
const SCRIPT: &str = include_str!("../dashboard/app.js");
const STYLE: &str = include_str!("../dashboard/app.css");
const ICON: &str = include_str!("../dashboard/favicon.svg");

/// Own scripts, styles and API calls only; nothing inline, nothing from elsewhere.
const POLICY: &str =
    "default-src 'none'; script-src 'self'; style-src 'self'; connect-src 'self'; img-src 'self'; form-action 'self'; frame-ancestors 'none'";

fn file(content_type: &'static str, body: &'static str) -> impl IntoResponse {
    ([(header::CONTENT_TYPE, content_type), (header::CONTENT_SECURITY_POLICY, POLICY)], body)
}

pub async fn index() -> impl IntoResponse {
    file("text/html; charset=utf-8", INDEX)
}

pub async fn script() -> impl IntoResponse {
    file("text/javascript; charset=utf-8", SCRIPT)
}

pub async fn style() -> impl IntoResponse {
    file("text/css; charset=utf-8", STYLE)
}

pub async fn icon() -> impl IntoResponse {
    file("image/svg+xml", ICON)
}
